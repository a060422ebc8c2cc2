"""The DSpark drafter against DeepSeek's reference `forward_spec` (tests/fixtures/reference-v41-tiny).

The reference call sequence, replayed with the reference's own inputs: the
prompt's features seed the rings; at decode step t the features of position
p_t are ingested and a block is proposed from the anchor decode.output_ids[t].
Inputs come from the pinned-index-keys variant (the target semantics we
implement); the drafter itself has no index keys, so the variant only changes
what the drafter is fed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from dsv41_mlx.cache import DraftCache
from dsv41_mlx.runtime.drafter import Drafter

TOLERANCE = 0.02  # max abs error / std of the golden tensor, as for the target


@pytest.fixture(scope="module")
def pinned(fixture_dir):
    return load_file(fixture_dir / "golden_variant_pinned_index_keys.safetensors")


def _replay(model, prefill_features, golden):
    """Yield (step, proposal) for the 12 reference decode steps, with the reference's BF16 head."""
    drafter = Drafter(model, head="bf16")
    cache = drafter.make_cache()
    drafter.ingest(cache, mx.array(prefill_features[0]))
    for t in range(golden["decode.start_pos"].shape[0]):
        drafter.ingest(cache, mx.array(golden["decode.main_hidden"][t, 0]))
        assert cache.end == golden["decode.start_pos"][t] + 1
        proposal = drafter.propose(cache, int(golden["decode.output_ids"][t, 0]))
        mx.eval(proposal.drafts, proposal.logits, proposal.confidence)
        yield t, proposal


@pytest.fixture(scope="module")
def replayed(fixture_model, golden, pinned):
    return list(_replay(fixture_model, golden["prefill.main_hidden"], pinned))


def test_draft_logits_match_reference_at_every_step(replayed, pinned):
    for t, proposal in replayed:
        ref = pinned["spec.logits"][t, 0]
        err = np.abs(np.array(proposal.logits) - ref).max() / ref.std()
        assert err <= TOLERANCE, f"decode step {t}: draft logits off by {err:.2%} of the golden std"


def test_drafts_match_reference_where_the_margin_exceeds_our_error(replayed, pinned):
    for t, proposal in replayed:
        ref_logits = pinned["spec.logits"][t, 0]
        ours = np.array(proposal.drafts)
        ref = pinned["spec.output_ids"][t, 0, 1:]
        err = np.abs(np.array(proposal.logits) - ref_logits).max()
        for k in range(len(ref)):
            if ours[k] != ref[k]:
                top2 = np.sort(ref_logits[k])[-2:]
                assert top2[1] - top2[0] <= 2 * err, f"step {t} draft {k}: {ours[k]} != {ref[k]}"
                break  # later drafts follow a different Markov chain: not comparable


def test_confidence_matches_reference_at_every_step(replayed, pinned):
    ref = pinned["spec.confidence"][:, 0]
    ours = np.stack([np.array(p.confidence) for _, p in replayed])
    err = np.abs(ours - ref).max() / ref.std()
    assert err <= TOLERANCE, f"confidence off by {err:.2%} of the golden std"


def test_main_x_matches_reference(fixture_model, golden, intermediates):
    first = fixture_model.mtp[0]
    for t in range(golden["decode.start_pos"].shape[0]):
        feats = mx.array(golden["decode.main_hidden"][t, 0]).astype(mx.bfloat16)
        main_x = np.array(first.main_norm(first.main_proj(feats)).astype(mx.float32))
        ref = intermediates[f"decode.{t:02d}.spec.dspark_main_x"][0]
        assert np.array_equal(main_x, ref), f"decode step {t}"


def test_fp8_head_drafts_follow_the_markov_chain_over_their_candidates(golden, drafter, monkeypatch):
    """With the FP8 head, draft k is the best of its 64 candidates under the head's logits plus
    the Markov bias of the draft before it (the anchor for the first): MarkovHead.bias at those
    candidates, every position's row exactly."""
    from dsv41_mlx.runtime import drafter as drafter_module

    heads = []
    top64 = drafter_module.fp8_rows_top64
    monkeypatch.setattr(drafter_module, "fp8_rows_top64", lambda *a: heads.append(top64(*a)) or heads[-1])
    cache = drafter.make_cache()
    drafter.ingest(cache, mx.array(golden["prefill.main_hidden"][0]))
    anchor = int(golden["decode.output_ids"][0, 0])
    proposal = drafter.propose(cache, anchor)
    (base, candidates), = heads
    markov = drafter.stages[-1].markov_head
    prev = [anchor] + proposal.drafts.tolist()[:-1]
    for k in range(drafter.block):
        bias = markov.bias(markov.embed(mx.array([prev[k]])), candidates[k][None])[0]
        assert mx.array_equal(proposal.logits[k], base[k] + bias).item(), k
        assert proposal.drafts[k].item() == candidates[k][mx.argmax(proposal.logits[k])].item(), k


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_markov_pass_in_one_launch_drafts_what_the_step_by_step_pass_does(golden, drafter, temperature):
    """With the FP8 head and a pick rule markov_drafts runs (the greedy picker's; a coupled
    picker's without top-k or top-p: logits / T plus the position's Gumbel noise), a proposal is
    the step-by-step Markov pass's (the same picker without its rule): drafts, logits and
    confidences. A picker that filters (top-p) has no such rule."""
    import types

    from dsv41_mlx.runtime.drafter import argmax_picker
    from dsv41_mlx.sampling import SamplingParams
    from dsv41_mlx.speculative import SpeculativeDecoder

    cache = drafter.make_cache()
    drafter.ingest(cache, mx.array(golden["prefill.main_hidden"][0]))
    anchor = int(golden["decode.output_ids"][0, 0])

    def picker(**params):
        decoder = types.SimpleNamespace(params=SamplingParams(**params), verify="coupled" if params else "greedy",
                                        runner=types.SimpleNamespace(args=drafter.model.args))
        return SpeculativeDecoder.pick(decoder, cache.end + 1)

    pick = picker(temperature=temperature, seed=5) if temperature else picker()
    assert pick is argmax_picker or pick.rule.temperature == temperature
    one = drafter.propose(cache, anchor, pick)
    steps = drafter.propose(cache, anchor, lambda *args: pick(*args))  # no rule: one step at a time
    for a, b in ((one.drafts, steps.drafts), (one.logits, steps.logits), (one.confidence, steps.confidence)):
        assert mx.array_equal(a, b).item()
    assert not hasattr(picker(temperature=0.8, top_p=0.9), "rule")


def test_stage_attention_through_the_kernel_proposes_what_the_cpu_path_does(fixture_model, golden, drafter,
                                                                          monkeypatch):
    """On a GPU a stage's attention runs the target's attention kernel, each row's window every key
    (the ring's and the block's), q unrotated and the output rotated back inside it. With that
    kernel replaced by its spec (scripts/check_kernels.py), a proposal is the CPU path's: drafts,
    logits and confidences, the same bits."""
    from dsv41_mlx.models.dspark import every_key
    from scripts.kernel_checks.sparse_attention import sparse_attention_spec as spec
    from tests.test_model import _gpu_dispatch_with_specs

    cache = drafter.make_cache()
    drafter.ingest(cache, mx.array(golden["prefill.main_hidden"][0]))
    anchor = int(golden["decode.output_ids"][0, 0])
    want = drafter.propose(cache, anchor)
    mx.eval(want.drafts, want.logits, want.confidence)
    windows = []

    def attention(*args, impl=None):
        windows.append(args[2].shape)  # each row's window (traced: its shape, its rows below)
        return spec(*args)

    _gpu_dispatch_with_specs(monkeypatch, fixture_model, attention)
    got = drafter.propose(cache, anchor)
    keys = drafter.window + drafter.block
    assert windows == [(drafter.block, keys)] * len(drafter.stages)
    assert every_key(drafter.block, keys).tolist() == [list(range(keys))] * drafter.block  # the ring's, the block's
    for a, b in ((got.drafts, want.drafts), (got.logits, want.logits), (got.confidence, want.confidence)):
        assert mx.array_equal(a, b).item()


def test_ring_slot_holds_position_modulo_window(fixture_model, golden, drafter):
    """Ingesting in pieces or at once gives the same rings: slot p % window holds position p."""
    drafter = drafter
    feats = mx.array(golden["prefill.main_hidden"][0])  # 41 positions, window 8
    whole = drafter.make_cache()
    drafter.ingest(whole, feats)
    pieces = drafter.make_cache()
    for s in range(0, feats.shape[0], 3):
        drafter.ingest(pieces, feats[s: s + 3])
    assert whole.end == pieces.end == feats.shape[0]
    assert mx.array_equal(whole.rings, pieces.rings).item()
    window = drafter.window
    positions = mx.arange(feats.shape[0] - window, feats.shape[0])
    expected = drafter.ring_rows(feats[-window:], positions)
    slots = np.array(positions) % window
    assert mx.array_equal(whole.rings[:, mx.array(slots)], expected).item()


def test_ingest_begun_ahead_commits_what_an_ingest_of_those_positions_writes(fixture_model, golden, drafter):
    """A round begins the ingest of its verify rows before it knows how many it commits
    (Drafter.ingest_ahead): committing the first m gives the rings an ingest of those m gives;
    more than were begun, none, or part of more than a window are refused."""
    drafter = drafter
    feats = mx.array(golden["prefill.main_hidden"][0])  # 41 positions, window 8
    for m in (1, 3, 6):
        begun, plain = drafter.make_cache(), drafter.make_cache()
        drafter.ingest(begun, feats[:20])
        drafter.ingest(plain, feats[:20])
        drafter.ingest_ahead(begun, feats[20:26]).commit(m)
        drafter.ingest(plain, feats[20: 20 + m])
        assert begun.end == plain.end == 20 + m
        assert mx.array_equal(begun.rings, plain.rings).item(), m
    cache = drafter.make_cache()
    ahead = drafter.ingest_ahead(cache, feats[:6])
    for m in (0, 7):
        with pytest.raises(ValueError, match=f"cannot commit {m} of 6 positions"):
            ahead.commit(m)
    with pytest.raises(ValueError, match="cannot commit 5 of 20 positions"):  # only the newest 8 were computed
        drafter.ingest_ahead(cache, feats[:20]).commit(5)
    assert cache.end == 0


def test_draft_cache_marks_only_written_slots_valid():
    cache = DraftCache(n_stages=2, window=4, head_dim=3)
    assert not cache.valid().any().item()
    cache.write(mx.ones((2, 2, 3), dtype=mx.bfloat16), 2)
    assert cache.valid().tolist() == [True, True, False, False]
    cache.write(mx.ones((2, 4, 3), dtype=mx.bfloat16), 9)
    assert cache.valid().all().item() and cache.end == 11
    with pytest.raises(ValueError, match="expected 3 ring rows"):
        cache.write(mx.ones((2, 2, 3), dtype=mx.bfloat16), 3)
