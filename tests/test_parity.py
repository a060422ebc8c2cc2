"""Parity with DeepSeek's reference inference code (goldens in tests/fixtures/reference-v41-tiny).

Layer by layer, teacher-forced, at the strict bar: every backbone block is fed the
reference's own input for that call (prefill, then each of the 12 decode steps), keeps
its own caches across calls, and its outputs are compared with the reference's, within 2%
of the golden std (most bit-identical). This checks every sub-layer, the caches, the
compressor's pending groups, the indexer's top-k and the engram hashing at every step
without letting a one-ulp difference upstream cascade. It runs twice: against the
reference as published (skipping the (layer, step) pairs where its indexer reads another
layer's index keys, an upstream quirk we do not reproduce) and against the reference with
that quirk removed (the pinned-index-keys run, the semantics implemented here), where
every layer at every step is compared.

End to end, such one-ulp differences do cascade in this random-weight model, in the
reference too: the end-to-end logits are held to the reference's own spread under a
change of summation order (tests/parity_bar.py, docs/parity.md).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from dsv41_mlx.models.attention import SharedAttention
from dsv41_mlx.models.hyper import hc_post, hc_pre

from . import parity_bar, parity_ties

TOLERANCE = 0.02  # max abs error / std of the golden tensor
N_CALLS, N_LAYERS = 13, 8  # prefill + 12 decode steps; backbone blocks


def _err(got: mx.array, ref: np.ndarray) -> float:
    got = np.array(got.astype(mx.float32))
    return float(np.abs(got - ref).max() / max(ref.std(), 1e-6))


def _calls(prompt_ids: np.ndarray, decode: dict[str, np.ndarray]):
    """(call name, its token ids, its start position) for the prefill and each decode step."""
    yield "prefill", prompt_ids[0].tolist(), 0
    for t in range(decode["decode.input_ids"].shape[0]):
        yield f"decode.{t:02d}", decode["decode.input_ids"][t, 0].tolist(), int(decode["decode.start_pos"][t])


def _reference_index_key_quirk(layer_id: int, start: int, n: int, args) -> bool:
    """True where the published reference's indexer reads another layer's index keys.

    Upstream, a ratio>1 KV source republishes its index keys only on the step that
    completes a group; on other decode steps its indexer (and the layers using its top-k)
    score against the last published cache, which belongs to a different layer. We
    implement each indexer reading its own source's keys (the pinned variant), so against
    the published reference those (layer, step) pairs are not comparable; against the
    pinned run they are, and are compared.
    """
    source = args.kv_source_of(layer_id) if args.compress_ratios[layer_id] else None
    ratio = args.compress_ratios[source] if source is not None else 0
    return n == 1 and ratio > 1 and (start + 1) % ratio != 0


def _teacher_force(model, prompt_ids, decode, intermediates, skip_quirk: bool):
    """Every block of every call fed the reference's input, our caches carried across calls.
    -> (errors [(call, layer, what, error)], top-k mismatches, {(call, layer): MoE input})."""
    args = model.args
    cache = model.make_cache()
    errors = []
    topk_mismatch = []
    moe_inputs = {}  # (call, layer) -> (stream entering the MoE sub-layer, its pre-mix)
    for call, ids, start in _calls(prompt_ids, decode):
        S = len(ids)
        positions = mx.arange(start, start + S)
        hashes = model.hasher(cache.tokens, ids)
        assert np.array_equal(hashes, intermediates[f"{call}.engram_hash_ids"][0]), call
        cache.tokens.extend(ids)
        shared = SharedAttention()
        for i, layer in enumerate(model.layers):
            key = f"{call}.layers.{i}"
            h = mx.array(intermediates[f"{key}.block_in"][0]).astype(mx.bfloat16)
            pre = mx.array(intermediates[f"{key}.pre_mix_in"][0])
            attn_mix = layer.hc_attn(h)
            x = layer.attn(layer.attn_norm(hc_pre(h, pre)), positions, cache.layers[i], cache.layers, shared)
            h2 = hc_post(x, h, attn_mix)
            ffn_mix = layer.hc_ffn(h2)
            y = layer.ffn(layer.ffn_norm(hc_pre(h2, attn_mix.pre)))
            out = hc_post(y, h2, ffn_mix)
            mx.eval(out, cache.state())
            if skip_quirk and _reference_index_key_quirk(i, start, S, args):
                continue
            moe_inputs[call, i] = (h2, attn_mix.pre)
            errors += [(call, i, "attn_out", _err(x, intermediates[f"{key}.attn_out"][0])),
                       (call, i, "ffn_out", _err(y, intermediates[f"{key}.ffn_out"][0])),
                       (call, i, "block_out", _err(out, intermediates[f"{key}.block_out"][0])),
                       (call, i, "pre_mix_out", _err(ffn_mix.pre, intermediates[f"{key}.pre_mix_out"][0]))]
            if layer.attn.is_index_source and f"{key}.topk_idxs" in intermediates:
                ids_, valid = shared.topk
                offset = S if start == 0 else args.sliding_window
                ours = np.where(np.array(valid), np.array(ids_).astype(np.int64) + offset, -1)
                ref = intermediates[f"{key}.topk_idxs"][0]
                for row, (a, b) in enumerate(zip(ours, ref)):
                    if set(a.tolist()) != set(b.tolist()):
                        topk_mismatch.append((call, i, row, sorted(a.tolist()), sorted(b.tolist())))
    return errors, topk_mismatch, moe_inputs


@pytest.fixture(scope="module")
def pinned_golden(fixture_dir):
    """The reference's outputs with the index-key quirk removed (same prefill, same decode inputs)."""
    return load_file(fixture_dir / "golden_variant_pinned_index_keys.safetensors")


@pytest.fixture(scope="module")
def pinned_intermediates(fixture_dir):
    return load_file(fixture_dir / "golden_intermediates_pinned_index_keys.safetensors")


@pytest.fixture(scope="module")
def forced_reference(fixture_model, golden, intermediates):
    """Teacher-forced against the published reference, the quirk's pairs skipped."""
    return (*_teacher_force(fixture_model, golden["prompt_ids"], golden, intermediates, skip_quirk=True),
            intermediates)


@pytest.fixture(scope="module")
def forced_pinned(fixture_model, golden, pinned_golden, pinned_intermediates):
    """Teacher-forced against the pinned-index-keys run, every layer at every step."""
    return (*_teacher_force(fixture_model, golden["prompt_ids"], pinned_golden, pinned_intermediates,
                            skip_quirk=False), pinned_intermediates)


@pytest.fixture(params=["reference", "pinned"])
def teacher_forced(request):
    """(errors, top-k mismatches, MoE inputs, the intermediates compared against), for each run."""
    return request.getfixturevalue(f"forced_{request.param}")


def test_pinned_run_is_compared_at_every_layer_and_step(fixture_model, golden, pinned_golden, forced_pinned):
    """The pinned comparison covers the quirk's (layer, step) pairs too: none skipped."""
    assert np.array_equal(pinned_golden["decode.input_ids"], golden["decode.input_ids"])
    args = fixture_model.args
    quirk = {(call, i) for call, ids, start in _calls(golden["prompt_ids"], pinned_golden)
             for i in range(N_LAYERS) if _reference_index_key_quirk(i, start, len(ids), args)}
    assert len(quirk) >= 12, quirk  # the pairs the published reference cannot be compared at
    errors, *_ = forced_pinned
    for what in ("attn_out", "ffn_out", "block_out", "pre_mix_out"):
        compared = {(call, i) for call, i, w, _ in errors if w == what}
        assert len(compared) == N_CALLS * N_LAYERS, what
        assert quirk <= compared, what


def test_every_attention_matches_reference_at_every_step(teacher_forced):
    errors, *_ = teacher_forced
    attn = [e for e in errors if e[2] == "attn_out"]
    assert len(attn) > N_CALLS * N_LAYERS - 20  # all but (for the published run) the quirk's pairs
    bad = [e for e in attn if e[3] > TOLERANCE]
    assert not bad, f"{len(bad)} attention outputs beyond {TOLERANCE:.0%} of the golden std: {bad[:5]}"


def test_every_block_matches_reference_at_every_step(teacher_forced):
    errors, *_ = teacher_forced
    bad = [e for e in errors if e[2] in ("block_out", "pre_mix_out") and e[3] > TOLERANCE]
    assert not bad, f"{len(bad)} outputs beyond {TOLERANCE:.0%} of the golden std: {bad[:5]}"


def _one_ulp_neighbours(h: mx.array):
    """Every copy of h [S, hc, dim] bf16 with one element moved by one bf16 ulp, either way."""
    bits = np.array(h.view(mx.uint16)).astype(np.int32)
    for index in np.ndindex(bits.shape):
        for step in (-1, 1):
            moved = bits.copy()
            moved[index] += step
            yield index, step, mx.array(moved.astype(np.uint16)).view(mx.bfloat16)


def test_every_moe_matches_reference_or_differs_by_one_input_ulp(fixture_model, teacher_forced):
    """MoE outputs bit-identical to the reference's, except where our stream entering the MoE
    sub-layer differs from the reference's by a single bf16 rounding: there, moving one
    element of that stream by one ulp must make the MoE output the reference's bit for bit.

    (The stream is the hyper-connection expansion, an fp32 sum rounded to bf16; a value on
    a rounding boundary goes either way with last-ulp differences in the mixes, and the FP8
    quantisation in front of the expert GEMMs turns one bf16 ulp into a whole FP8 step.
    On this fixture that happens once, in the published run: decode step 9, layer 5, 4.1%
    off as computed.)
    """
    errors, _, moe_inputs, intermediates = teacher_forced
    outliers = [e for e in errors if e[2] == "ffn_out" and e[3] != 0]
    assert len(outliers) < 5, outliers  # rare, or it is not rounding
    for call, i, _, err in outliers:
        layer = fixture_model.layers[i]
        h2, pre = moe_inputs[call, i]
        ref = intermediates[f"{call}.layers.{i}.ffn_out"][0]
        exact = [(index, step) for index, step, h in _one_ulp_neighbours(h2)
                 if _err(layer.ffn(layer.ffn_norm(hc_pre(h, pre))), ref) == 0]
        assert exact, f"{call} layer {i}: MoE {err:.1%} off and no one-ulp change of its input explains it"


def test_every_attention_is_bit_identical(teacher_forced):
    """Not a tolerance story: fed the reference's input, the attention (window, compressed
    groups, indexer, sink) reproduces the reference's bf16 output exactly, at every step."""
    errors, *_ = teacher_forced
    off = [e for e in errors if e[2] == "attn_out" and e[3] != 0]
    assert not off, off


def test_indexer_selects_the_reference_positions(teacher_forced):
    _, mismatches, *_ = teacher_forced
    assert not mismatches, f"top-k differs: {mismatches[:3]}"


def test_head_and_features_match_reference(fixture_model, golden, intermediates):
    model = fixture_model
    for t in range(golden["decode.input_ids"].shape[0]):
        x = mx.array(intermediates[f"decode.{t:02d}.final_norm_out"][0]).astype(mx.bfloat16)
        logits = np.array(model.head(x))
        ref = golden["decode.logits"][t]
        assert np.abs(logits - ref).max() <= 1e-4 * ref.std()
        feats = []
        for layer in model.args.dspark_target_layer_ids:
            h = intermediates[f"decode.{t:02d}.layers.{layer}.block_in"][0]
            feats.append(h.astype(np.float64).mean(axis=1))
        ours = np.concatenate(feats, axis=-1)
        ref = golden["decode.main_hidden"][t, 0]
        assert np.abs(ours - ref).max() <= 2 ** -8 * np.abs(ref).max()


# End to end: prefill, then the 12 decode steps fed the golden decode inputs, nothing else
# from the reference, against the pinned run's logits (prefill is the same in both).

def _end_to_end_logits(model, golden, decode) -> dict[str, np.ndarray]:
    """call name (as in the ensemble's file) -> our logits."""
    cache = model.make_cache()
    logits, _ = model(mx.array(golden["prompt_ids"].astype(np.int32)), cache)
    prefill = np.array(logits[0])
    out = {"prefill.all": prefill, "prefill.last": prefill[-1]}
    for t in range(decode["decode.input_ids"].shape[0]):
        logits, _ = model(mx.array(decode["decode.input_ids"][t].astype(np.int32)), cache)
        out[f"decode.{t:02d}"] = np.array(logits[0, -1])
    return out


def _golden_logits(golden, decode) -> dict[str, np.ndarray]:
    out = {"prefill.all": golden["prefill.logits"][0], "prefill.last": golden["prefill.last_logits"][0]}
    for t in range(decode["decode.logits"].shape[0]):
        out[f"decode.{t:02d}"] = decode["decode.logits"][t, 0]
    return out


def _judge_all(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray], ensemble) -> list[parity_bar.CallResult]:
    assert set(ours) == set(ref) == set(ensemble), (sorted(ours), sorted(ensemble))
    return [parity_bar.judge(call, ours[call], ref[call], ensemble[call]) for call in ensemble]


@pytest.fixture(scope="module")
def ensemble(fixture_dir):
    return parity_bar.load_ensemble(fixture_dir)


@pytest.fixture(scope="module")
def end_to_end_logits(fixture_model, golden, pinned_golden):
    return _end_to_end_logits(fixture_model, golden, pinned_golden)


@pytest.fixture(scope="module")
def end_to_end(end_to_end_logits, golden, pinned_golden, ensemble):
    return _judge_all(end_to_end_logits, _golden_logits(golden, pinned_golden), ensemble)


def test_end_to_end_error_within_the_reference_noise_at_every_call(end_to_end):
    assert len(end_to_end) == 14  # prefill (every position, last position) and 12 decode steps
    bad = [r for r in end_to_end if r.error > r.bound]
    assert not bad, parity_bar.violations(bad)


def test_end_to_end_error_is_typically_the_reference_noise(end_to_end):
    median = float(np.median([r.ratio for r in end_to_end]))
    assert median <= parity_bar.MEDIAN_RATIO, [f"{r.call}: {r.ratio:.2f}" for r in end_to_end]


def test_end_to_end_argmax_where_the_margin_clears_the_noise(end_to_end):
    """Argmax equal wherever the golden top-2 margin exceeds 2 x the call's abs_err_p90.
    (On this fixture no margin does: the reference's own noise is larger than every margin,
    and the ensemble's argmax moves too. The rule is checked as stated; see
    test_bar_flags_an_argmax_flip_beyond_the_noise for it catching one.)"""
    flips = [(r.call, r.argmax_flips) for r in end_to_end if r.argmax_flips]
    assert not flips, flips


def test_bar_flags_an_argmax_flip_beyond_the_noise():
    stats = {"median": 0.2, "max": 0.3, "abs_err_p90": 0.25}
    golden = np.array([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 2.2]])  # margins 1.0 (checked) and 0.2 (not)
    flipped = golden[:, [0, 1, 3, 2]]
    result = parity_bar.judge("decode.00", flipped, golden, stats)
    assert (result.rows_checked, result.argmax_flips, result.argmax_differs) == (1, [0], 2)
    assert any("argmax" in v for v in parity_bar.violations([result]))


def test_end_to_end_bar_rejects_the_upstream_index_key_quirk(golden, pinned_golden, ensemble):
    """The bar separates semantics from noise: the published reference, whose indexers read
    another layer's index keys on some decode steps, judged as a port of the pinned run
    misses it (its prefill is the pinned run's, bit for bit)."""
    quirk = _golden_logits(golden, golden)
    results = _judge_all(quirk, _golden_logits(golden, pinned_golden), ensemble)
    assert results[0].error == results[1].error == 0
    assert [r.call for r in results if r.error > r.bound]  # some decode steps beyond the noise
    assert np.median([r.ratio for r in results]) > parity_bar.MEDIAN_RATIO


TIE_FP32_ULPS = 8  # a bf16 rounding this close to its midpoint goes either way with the fp32 arithmetic's last bits
MAX_TIES = 32  # rare, or it is not rounding


def test_end_to_end_departures_are_bf16_rounding_ties(fixture_model, golden, pinned_golden, pinned_intermediates,
                                                      end_to_end_logits):
    """Where the end-to-end run departs from the pinned reference (first at prefill layer 2,
    and from then on everywhere, decode step 2 worst), it is bf16 rounding ties: taking the
    reference's rounding at the few values whose fp32 value lies within 8 fp32 ulps of a
    bf16 midpoint, the same run matches the reference at the teacher-forced bar, every block
    at every call and every call's logits."""
    prompt = golden["prompt_ids"][0].tolist()
    decode = pinned_golden["decode.input_ids"][:, 0, 0].tolist()
    plain = parity_ties.run(fixture_model, prompt, decode, pinned_intermediates)
    # the run is the model's own forward, bit for bit
    assert np.array_equal(plain.logits["prefill"], end_to_end_logits["prefill.all"])
    for t in range(len(decode)):
        assert np.array_equal(plain.logits[f"decode.{t:02d}"], end_to_end_logits[f"decode.{t:02d}"]), t

    tied = parity_ties.run(fixture_model, prompt, decode, pinned_intermediates, TIE_FP32_ULPS)
    assert len(tied.ties) <= MAX_TIES, tied.ties
    assert all(t.fp32_ulps <= TIE_FP32_ULPS for t in tied.ties)
    bad_blocks = {key: err for key, err in tied.block_error.items() if err > TOLERANCE}
    assert not bad_blocks, bad_blocks
    reference = _golden_logits(golden, pinned_golden)
    reference["prefill"] = reference.pop("prefill.all")
    del reference["prefill.last"]
    errors = {call: parity_bar.logit_error(tied.logits[call], reference[call]) for call in reference}
    bad = {call: err for call, err in errors.items() if err > TOLERANCE}
    assert not bad, bad


def test_end_to_end_prefill_picks_the_reference_token(fixture_model, golden):
    model = fixture_model
    logits, _ = model(mx.array(golden["prompt_ids"].astype(np.int32)), model.make_cache())
    assert int(np.array(logits[0, -1]).argmax()) == int(golden["prefill.output_ids"][0])
