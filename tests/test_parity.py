"""Parity with DeepSeek's reference inference code (goldens in tests/fixtures/reference-v41-tiny).

Layer by layer, teacher-forced: every backbone block is fed the reference's own
input for that call (prefill, then each of the 12 decode steps), keeps its own
caches across calls, and its outputs are compared with the reference's. This
checks every sub-layer, the caches, the compressor's pending groups, the
indexer's top-k and the engram hashing at every step without letting a one-ulp
difference upstream cascade. (End to end, such differences do cascade in this
random-weight model: see docs/parity.md.)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx.models.attention import SharedAttention
from dsv41_mlx.models.hyper import hc_post, hc_pre

TOLERANCE = 0.02  # max abs error / std of the golden tensor


def _err(got: mx.array, ref: np.ndarray) -> float:
    got = np.array(got.astype(mx.float32))
    return float(np.abs(got - ref).max() / max(ref.std(), 1e-6))


def _calls(golden):
    yield "prefill", golden["prompt_ids"][0].tolist(), 0
    for t in range(golden["decode.input_ids"].shape[0]):
        yield f"decode.{t:02d}", golden["decode.input_ids"][t, 0].tolist(), int(golden["decode.start_pos"][t])


def _reference_index_key_quirk(layer_id: int, start: int, n: int, args) -> bool:
    """True where the reference's indexer reads another layer's index keys.

    Upstream, a ratio>1 KV source republishes its index keys only on the step
    that completes a group; on other decode steps its indexer (and the layers
    using its top-k) score against the last published cache, which belongs to
    a different layer. We implement each indexer reading its own source's keys
    (the pinned variant), so those (layer, step) pairs are not comparable.
    """
    source = args.kv_source_of(layer_id) if args.compress_ratios[layer_id] else None
    ratio = args.compress_ratios[source] if source is not None else 0
    return n == 1 and ratio > 1 and (start + 1) % ratio != 0


@pytest.fixture(scope="module")
def teacher_forced(fixture_model, golden, intermediates):
    model = fixture_model
    args = model.args
    cache = model.make_cache()
    errors = []  # (call, layer, what, error)
    topk_mismatch = []
    moe_inputs = {}  # (call, layer) -> (stream entering the MoE sub-layer, its pre-mix)
    for call, ids, start in _calls(golden):
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
            if _reference_index_key_quirk(i, start, S, args):
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


def test_every_attention_matches_reference_at_every_step(teacher_forced):
    errors, *_ = teacher_forced
    attn = [e for e in errors if e[2] == "attn_out"]
    assert len(attn) > 13 * 8 - 20  # prefill + 12 decode steps, all but the quirk's pairs
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


def test_every_moe_matches_reference_or_differs_by_one_input_ulp(fixture_model, teacher_forced, intermediates):
    """MoE outputs within 2% of the golden std, except where our stream entering the MoE
    sub-layer differs from the reference's by a single bf16 rounding: there, moving one
    element of that stream by one ulp must make the MoE output the reference's bit for bit.

    (The stream is the hyper-connection expansion, an fp32 sum rounded to bf16; a value on
    a rounding boundary goes either way with last-ulp differences in the mixes, and the FP8
    quantisation in front of the expert GEMMs turns one bf16 ulp into a whole FP8 step.
    On this fixture that happens once: decode step 9, layer 5, 4.1% off as computed.)
    """
    errors, _, moe_inputs = teacher_forced
    outliers = [e for e in errors if e[2] == "ffn_out" and e[3] > TOLERANCE]
    assert len(outliers) < 5, outliers  # rare, or it is not rounding
    for call, i, _, err in outliers:
        layer = fixture_model.layers[i]
        h2, pre = moe_inputs[call, i]
        ref = intermediates[f"{call}.layers.{i}.ffn_out"][0]
        exact = [(index, step) for index, step, h in _one_ulp_neighbours(h2)
                 if _err(layer.ffn(layer.ffn_norm(hc_pre(h, pre))), ref) == 0]
        assert exact, f"{call} layer {i}: MoE {err:.1%} off and no one-ulp change of its input explains it"


def test_attention_and_moe_are_bit_exact_at_most_layers(teacher_forced):
    """Not a tolerance story: the sub-layers reproduce the reference's bf16 values exactly."""
    errors, *_ = teacher_forced
    sub = [e for e in errors if e[2] in ("attn_out", "ffn_out")]
    exact = sum(e[3] == 0 for e in sub)
    assert exact / len(sub) > 0.9, f"only {exact} of {len(sub)} sub-layer outputs are bit-exact"


def test_indexer_selects_the_reference_positions(teacher_forced):
    _, mismatches, _ = teacher_forced
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


def test_end_to_end_prefill_picks_the_reference_token(fixture_model, golden):
    model = fixture_model
    logits, _ = model(mx.array(golden["prompt_ids"].astype(np.int32)), model.make_cache())
    assert int(np.array(logits[0, -1]).argmax()) == int(golden["prefill.output_ids"][0])
