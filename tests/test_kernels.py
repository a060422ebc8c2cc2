"""The custom kernels: the pure-MLX spec against numpy float64, the FP8 head
builder against the release quantiser, the Metal text type-checked by clang and
the CUDA text compiled by NVRTC (no GPU needed for either).

The CUDA twins run against the same spec on the H200 in
scripts/check_kernels.py (through the device tool).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx import kernels
from dsv41_mlx.cache import DraftCache
from dsv41_mlx.kernels import (ACT_QUANT, FP4_QUANT, FP8_ROWS, HC_INPUT, HC_MIX, HEAD_LOGITS, MARKOV_DRAFTS, ROWS_GATE,
                               HC_POST_MIX, HC_SPLIT, MOE_GATE_SCORES, MOE_GATE_TOPK, RING_WRITE, RMS_NORM, RMS_NORM_PAIR,
                               SPARSE_ATTENTION, TOP_K,
                               fp8_rows_top64, moe_gate, moe_gate_reference, ring_write, ring_write_reference, tuning)
from dsv41_mlx.quant import e4m3_decode, e8m0_decode, quantize_fp8_tiles, quantize_fp8_tiles_mx

from scripts.kernel_checks import nvrtc
from scripts.kernel_checks.cases import experts_case, gemv_case, mma_case, mma_hc_case, x_prep_case

from .kernel_emulation import EMULATION
from .metal_check import clang, syntax_check, syntax_check_all, wrap
from .scripts import load_script


def _random_head(rng, n, k):
    w = rng.normal(0, 0.05, (n, k)).astype(np.float32)
    w[:32, :32] = 0  # an all-zero tile
    w[32:64, :32] *= 1e-3  # a tile with small scale
    return mx.array(w).astype(mx.bfloat16)


def test_fp8_head_builder_equals_the_release_quantiser():
    rng = np.random.default_rng(0)
    w = _random_head(rng, 256, 192)
    head = quantize_fp8_tiles_mx(w)
    codes, scales = quantize_fp8_tiles(np.array(w.astype(mx.float32)))
    assert np.array_equal(np.array(head.codes), codes)
    assert np.array_equal(np.array(head.scales)[1:], scales[1:])  # the zero tile's scale is floored, not 2**-127
    assert np.array(head.scales).min() >= 1
    dense = e4m3_decode(codes).reshape(8, 32, 6, 32) * e8m0_decode(np.array(head.scales))[:, None, :, None]
    assert np.array_equal(np.array(head.dequantize()), dense.reshape(256, 192))


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_fp8_rows_spec_matches_numpy_float64(rows):
    rng = np.random.default_rng(rows)
    head = quantize_fp8_tiles_mx(_random_head(rng, 1024, 512))
    x = mx.array(rng.normal(0, 1, (rows, 512)).astype(np.float32))
    vals, ids = fp8_rows_top64(x, head, impl="mlx")
    assert vals.shape == ids.shape == (rows, TOP_K) and ids.dtype == mx.int32
    weights = np.array(head.dequantize()).astype(np.float64)
    logits = np.array(x).astype(np.float64) @ weights.T
    vals, ids = np.array(vals), np.array(ids)
    assert np.all(np.diff(vals, axis=1) <= 0)  # best first
    assert np.abs(vals - np.take_along_axis(logits, ids, axis=1)).max() <= 1e-5 * np.abs(logits).max()
    kth = np.sort(logits, axis=1)[:, -TOP_K][:, None]
    assert np.all(np.take_along_axis(logits, ids, axis=1) >= kth - 1e-5)  # the 64 best (up to float32 ties)
    assert all(len(set(r)) == TOP_K for r in ids.tolist())


def test_fp8_rows_rejects_shapes_it_cannot_take():
    head = quantize_fp8_tiles_mx(mx.zeros((128, 64), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="1..16 rows"):
        fp8_rows_top64(mx.zeros((17, 64)), head)


def test_ring_write_spec_puts_position_p_in_slot_p_mod_window():
    rings = mx.arange(2 * 8 * 16).reshape(2, 8, 16).astype(mx.bfloat16)
    rows = -mx.arange(2 * 3 * 16).reshape(2, 3, 16).astype(mx.bfloat16) - 1
    out = np.array(ring_write_reference(rings, rows, first=14).astype(mx.float32))  # positions 14, 15, 16
    expected = np.array(rings.astype(mx.float32))
    for j, slot in enumerate([6, 7, 0]):
        expected[:, slot] = np.array(rows[:, j].astype(mx.float32))
    assert np.array_equal(out, expected)
    assert np.array_equal(np.array(ring_write(rings, rows, 14).astype(mx.float32)), expected)


def _gate_float64(x, w, bias, k, temp, route_scale, normalize):
    logits = x.astype(np.float64) @ w.astype(np.float64).T / temp
    scores = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20)))))
    ids = np.sort(np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :k], axis=-1)
    weights = np.take_along_axis(scores, ids, axis=-1)
    if normalize and k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * route_scale, ids


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_gate_spec_matches_numpy_float64(normalize):
    """The router spec the gate kernel is checked against: the experts of largest biased
    score, in ascending id order, weighted by their unbiased sqrt-softplus scores."""
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (9, 256)).astype(np.float32)
    w = rng.normal(0, 0.5, (24, 256)).astype(np.float32)
    w[3] *= 40  # large logits: the softplus's linear branch
    bias = rng.normal(0, 0.3, 24).astype(np.float32)
    got_w, got_ids = moe_gate_reference(mx.array(x), mx.array(w), mx.array(bias), 6, 1.5, 2.5, normalize)
    want_w, want_ids = _gate_float64(x, w, bias, 6, 1.5, 2.5, normalize)
    assert np.array_equal(np.array(got_ids), want_ids)
    assert np.allclose(np.array(got_w), want_w, rtol=1e-5, atol=0)
    assert (np.array(got_ids)[:, 1:] > np.array(got_ids)[:, :-1]).all()


def test_moe_gate_takes_the_spec_where_the_kernel_cannot_run():
    """On the CPU, and for more rows than a decode or verify forward has, the router is the spec."""
    rng = np.random.default_rng(5)
    x = mx.array(rng.normal(0, 1, (40, 64)).astype(np.float32)).astype(mx.bfloat16)
    w, bias = mx.array(rng.normal(0, 1, (16, 64)).astype(np.float32)), mx.zeros((16,))
    for impl in ("mlx", "cuda"):  # 40 rows: the spec even where a GPU kernel is asked for
        got = moe_gate(x, w, bias, 3, 1.0, 1.5, True, impl=impl)
        want = moe_gate_reference(x, w, bias, 3, 1.0, 1.5, True)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def test_draft_cache_writes_through_the_ring_kernel():
    cache = DraftCache(n_stages=3, window=4, head_dim=8)
    rows = mx.random.normal((3, 4, 8)).astype(mx.bfloat16)
    cache.write(rows, 6)  # positions 2..5: slots 2, 3, 0, 1
    assert mx.array_equal(cache.rings[:, mx.array([2, 3, 0, 1])], rows).item()


# ------------------------------------------------------------ Metal text check

NO_ROPE = {"rope_cos": "float32", "rope_sin": "float32"}  # the placeholders a norm without RoPE gets
MOE_GATE_SCORES_IO = ({"x": "bfloat16", "w": "float32", "params": "float32", "sizes": "int32"},
                      {"scores": "float32"})
HC_POST_MIX_IO = ({"y": "bfloat16", "residual": "bfloat16", "post": "float32", "comb": "float32", "fn": "float32",
                   "rows": "int32"}, {"parts": "float32", "h": "bfloat16"})
HC_INPUT_IO = ({"h": "bfloat16", "pre_in": "float32", "parts": "float32", "scale": "float32", "base": "float32",
                "norm_w": "float32", "params": "float32", "rows": "int32"},
               {"x": "bfloat16", "xq": "bfloat16", "pre": "float32", "post": "float32", "comb": "float32"})
ATTENTION_IO = ({"q": "bfloat16", "ring": "bfloat16", "index": "int32", "wmask": "bool", "kv": "bfloat16",
                 "ids": "uint32", "pmask": "bool", "sink": "float32", "rope_cos": "float32", "rope_sin": "float32",
                 "params": "float32", "rows": "int32"}, {"out": "bfloat16"})  # sparse_attention's inputs, output


CASES = {
    "fp8_rows": (FP8_ROWS, {"x": "uint16", "w": "uint8", "scales": "uint8"},
                 {"top_vals": "float32", "top_ids": "int32"}, {"R": 5, "K": 5120, "N": 129280, "TILES": 505}),
    "ring_write": (RING_WRITE, {"rings": "uint16", "rows": "uint16", "span": "int32"}, {"out": "uint16"},
                   {"S": 3, "W": 128, "D": 512}),
    "markov_drafts": (MARKOV_DRAFTS, {"base": "float32", "cand": "int32", "head": "uint16", "embed": "uint16",
                                      "anchor": "int32", "temp": "float32", "noise": "float32"},
                      {"drafts": "int32", "logits": "float32", "embeds": "uint16"}, {"B": 5, "C": 64, "R": 16, "NOISE": 1}),
    "hc_split": (HC_SPLIT, {"mixes": "float32", "scale": "float32", "base": "float32", "eps": "float32",
                            "rows": "int32"}, {"pre": "float32", "post": "float32", "comb": "float32"},
                 {"HC": 4, "ITERS": 20}),
    "act_quant": (ACT_QUANT, {"x": "bfloat16", "n": "int32"}, {"y": "bfloat16"}, {"T": "bfloat16", "O": "bfloat16"}),
    "act_quant_to_f32": (ACT_QUANT, {"x": "bfloat16", "n": "int32"}, {"y": "float32"},
                         {"T": "bfloat16", "O": "float32"}),
    "hc_mix": (HC_MIX, {"h": "bfloat16", "fn": "float32", "rows": "int32"}, {"parts": "float32"},
               {"D": 5120, "HC": 4, "CH": 16}),
    "hc_post_mix": (HC_POST_MIX, *HC_POST_MIX_IO, {"D": 5120, "HC": 4, "CH": 16}),
    "hc_input": (HC_INPUT, *HC_INPUT_IO, {"D": 5120, "HC": 4, "ITERS": 20, "O": "bfloat16", "CH": 16}),
    # the tiny checkpoint's width: a row's features and a chunk's values not a whole number of passes
    "hc_input_tiny": (HC_INPUT, *HC_INPUT_IO, {"D": 64, "HC": 4, "ITERS": 20, "O": "bfloat16", "CH": 16}),
    # after fp8_mma_hc: the mixes' parts from its 160 tiles of 32 features
    "hc_input_from_tiles": (HC_INPUT, *HC_INPUT_IO, {"D": 5120, "HC": 4, "ITERS": 20, "O": "bfloat16", "CH": 160}),
    "hc_post_mix_tiny": (HC_POST_MIX, *HC_POST_MIX_IO, {"D": 64, "HC": 4, "CH": 16}),
    # (the simdgroups: 16 on CUDA, 8 on Metal; both forms in both languages)
    "sparse_attention": (SPARSE_ATTENTION, *ATTENTION_IO,
                         {"D": 512, "H": 64, "G": 2, "W": 128, "K": 512, "RD": 64, "WARPS": 16}),
    # CUDA's one-row layout (Layout.attention_one_row): one head, 32 warps a threadgroup
    "sparse_attention_one_row": (SPARSE_ATTENTION, *ATTENTION_IO,
                                 {"D": 512, "H": 64, "G": 1, "W": 128, "K": 512, "RD": 64, "WARPS": 32}),
    "sparse_attention_window_only": (SPARSE_ATTENTION, *ATTENTION_IO,
                                     {"D": 512, "H": 64, "G": 2, "W": 128, "K": 0, "RD": 64, "WARPS": 8}),
    # the tiny checkpoint's attention: 8 chunks a key row (most lanes idle in the scores), 32 key subsets
    "sparse_attention_tiny": (SPARSE_ATTENTION, *ATTENTION_IO,
                              {"D": 64, "H": 4, "G": 2, "W": 8, "K": 4, "RD": 16, "WARPS": 8}),
    "rms_norm": (RMS_NORM, {"x": "bfloat16", "w": "float32", "eps": "float32", "sizes": "int32", **NO_ROPE},
                 {"y": "bfloat16"}, {"T": "bfloat16", "O": "bfloat16", "QUANT": 0, "ROPE": 0}),
    "rms_norm_f32": (RMS_NORM, {"x": "float32", "w": "float32", "eps": "float32", "sizes": "int32", **NO_ROPE},
                     {"y": "float32"}, {"T": "float32", "O": "float32", "QUANT": 0, "ROPE": 0}),
    "rms_norm_quantised": (RMS_NORM, {"x": "bfloat16", "w": "float32", "eps": "float32", "sizes": "int32",
                                      **NO_ROPE}, {"y": "float32"}, {"T": "bfloat16", "O": "float32", "QUANT": 1,
                                                                     "ROPE": 0}),
    "rms_norm_rope_quantised": (RMS_NORM, {"x": "bfloat16", "w": "float32", "eps": "float32", "sizes": "int32",
                                           "rope_cos": "float32", "rope_sin": "float32"}, {"y": "bfloat16"},
                                {"T": "bfloat16", "O": "bfloat16", "QUANT": 1, "ROPE": 64}),
    # attention's q_norm (fp32 out: Metal's GEMM input) and rotated kv_norm in one launch
    "rms_norm_pair": (RMS_NORM_PAIR, {"x": "bfloat16", "w": "float32", "x2": "bfloat16", "w2": "float32",
                                      "eps": "float32", "sizes": "int32", "rope_cos": "float32",
                                      "rope_sin": "float32"}, {"y": "float32", "y2": "bfloat16"},
                      {"T": "bfloat16", "O": "float32", "O2": "bfloat16", "QUANT": 1, "ROPE": 64}),
    "fp4_quant_kv": (FP4_QUANT, {"x": "bfloat16", "n": "int32"}, {"y": "bfloat16"},
                     {"T": "bfloat16", "BLOCK": 16, "SCALE_E4M3": 1}),
    "fp4_quant_index": (FP4_QUANT, {"x": "float32", "n": "int32"}, {"y": "float32"},
                        {"T": "float32", "BLOCK": 32, "SCALE_E4M3": 0}),
    "moe_gate_scores": (MOE_GATE_SCORES, *MOE_GATE_SCORES_IO, {"T": "bfloat16", "RB": 8, "D": 5120}),
    "moe_gate_scores_one_row": (MOE_GATE_SCORES, *MOE_GATE_SCORES_IO, {"T": "bfloat16", "RB": 1, "D": 5120}),
    "moe_gate_scores_tiny": (MOE_GATE_SCORES, *MOE_GATE_SCORES_IO, {"T": "float32", "RB": 16, "D": 64}),
    "fp8_gemv": gemv_case(RB=8, T=4, C=32),
    "fp8_gemv_16_rows": gemv_case(RB=16, T=4, C=256),
    "fp8_gemv_quantizing": gemv_case(RB=16, T=4, C=64, QX=1),
    "fp8_gemv_swiglu": gemv_case(RB=1, T=4, C=64, QX=1, SW=1),
    "fp8_gemv_swiglu_8_rows": gemv_case(RB=8, T=2, C=32, SW=1),
    "fp8_gemv_parts": gemv_case(RB=1, T=4, C=64, QX=1, AP=6),
    "fp8_gemv_parts_8_rows": gemv_case(RB=8, T=2, C=64, AP=6),
    "fp8_gemv_pair": gemv_case(RB=1, T=4, C=256, SPLIT=1280),
    "fp4_experts": experts_case(NH=1),
    "fp4_experts_16_rows": experts_case(NH=2),
    "fp4_experts_quantizing": experts_case(NH=1, QX=1, ONE=1),
    "fp4_experts_one_row_two_ahead": experts_case(NH=1, SW=2, ONE=1, U=2),  # w13's (Layout.experts_loads_ahead)
    "fp4_experts_swiglu": experts_case(NH=1, SW=2),
    "fp4_experts_swiglu_16_rows": experts_case(NH=2, QX=1, SW=1),
    "fp4_experts_prepared": experts_case(NH=1, SW=2, PX=1),
    "fp4_experts_prepared_16_rows": experts_case(NH=2, QX=1, PX=1),
    "fp4_experts_prepared_one_row": experts_case(NH=1, QX=1, ONE=1, PX=1),
    "mma_x_prep": x_prep_case(QX=0),
    "mma_x_prep_quantizing": x_prep_case(QX=1),
    "fp8_mma": mma_case(NH=1),
    "fp8_mma_16_rows": mma_case(NH=2),
    "fp8_mma_quantizing": mma_case(NH=1, QX=1, ONE=1),
    "fp8_mma_one_row_short": mma_case(NH=1, QX=1, ONE=1, U=2),  # wq_b's (Layout.mma_loads_ahead)
    "fp8_mma_swiglu": mma_case(NH=1, QX=1, SW=1),
    "fp8_mma_parts_16_rows": mma_case(NH=2, AP=6),
    # 16-row tiles (Layout.mma_tile_rows): one m group a tile, two lanes a weight row on Metal
    "fp8_mma_16_row_tiles_one_row": mma_case(NH=1, QX=1, SW=1, ONE=1, TR=16),
    "fp8_mma_16_row_tiles": mma_case(NH=2, AP=6, TR=16),
    # wo_b of a decode step and the shared expert's w2 of a verify step, their output put into the stream
    "fp8_mma_hc": mma_hc_case(NH=1, QX=1, ONE=1),
    "fp8_mma_hc_parts_16_rows": mma_hc_case(NH=2, AP=6),
    "head_logits": (HEAD_LOGITS, {"x": "bfloat16", "w": "bfloat16", "sizes": "int32"}, {"y": "float32"}, {"R": 8}),
    "moe_gate_topk": (MOE_GATE_TOPK, {"scores": "float32", "bias": "float32", "params": "float32", "rows": "int32"},
                      {"weights": "float32", "ids": "uint32"}, {"E": 384, "K": 6, "NORMALIZE": 1}),
    "rows_gate": (ROWS_GATE, {"flag": "uint32", "rows": "uint8"}, {"status": "uint32", "out": "uint8"},
                  {"SPINS": 1 << 24, "N": 4224}),
}
METAL_CASES = sorted(case for case, (spec, *_) in CASES.items() if spec.metal is not None)  # rows_gate: CUDA only


@pytest.fixture(autouse=True)
def _compilers_present(request):
    if "metal" in request.node.name:
        assert clang() is not None, "clang++ is needed for the Metal check: the `ziglang` test extra has one"
    if "cuda" in request.node.name:
        assert nvrtc.nvrtc() is not None, "the CUDA check needs the test extras' NVRTC wheels"


def _wrapped(case: str, body: str | None = None) -> str:
    spec, inputs, outputs, template = CASES[case]
    return wrap(spec.name, body or spec.source("metal"), spec.header("metal"), inputs, outputs, template)


def _metal_source(case: str, rows: int) -> str:
    spec, inputs, outputs, template = CASES[case]
    if "R" in template:
        template = {**template, "R": rows}
    return wrap(spec.name, spec.source("metal"), spec.header("metal"), inputs, outputs, template)


@pytest.fixture(scope="module")
def every_metal_source_checked(tmp_path_factory):
    """All the cases below type-checked in one clang run (syntax_check_all)."""
    assert clang() is not None, "clang++ is needed for the Metal check: the `ziglang` test extra has one"
    return syntax_check_all([_metal_source(case, rows) for case in METAL_CASES for rows in (1, 16)],
                            tmp_path_factory.mktemp("metal"))


@pytest.mark.parametrize("case", METAL_CASES)
@pytest.mark.parametrize("rows", [1, 16])
def test_metal_source_type_checks(case, rows, every_metal_source_checked, tmp_path):
    out = every_metal_source_checked  # where not all passed, this case's own check says whether it did
    if out.returncode:
        out = syntax_check(_metal_source(case, rows), tmp_path)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("case, breakage", [
    ("fp8_rows", ("simdgroup_store(", "simdgroup_stor(")),  # misspelt builtin
    ("head_logits", ("bf16x8_floats(wv[u][o], wf);", "bf16x8_floats(wv[u], wf);")),  # array of words for a word
    ("fp8_rows", ("const uint odd = E4M3_ODD(words[c]);", "const uint odd = E4M3_ODD(words[c])")),  # no semicolon
    ("fp8_rows", ("simdgroup_half8x8 a;", "simdgroup_float8x8 a;")),  # type error: float tile from half memory
    ("ring_write", ("src[chunk];", "src[chunck];")),  # misspelt variable
    ("hc_split", ("hc_split_row<HC, ITERS>(mix, scale, base, eps[0],", "hc_split_row<HC, ITERS>(mix, scale, eps[0],")),
    ("act_quant", ("const float v = static_cast<float>(x[idx]);", "const float v = static_cast<float>(x[idx])")),
    ("act_quant", ("fp8_fake_quant_lane(v)", "fp8_fake_quant_lane(v, 1)")),  # bad call
    ("moe_gate_scores", ("a += simd_shuffle_xor(a, offset);", "a += simd_shuffle_xor(a);")),  # bad call
    ("moe_gate_scores", ("threadgroup float partial[WARPS][RB];", "threadgroup float partial[WARPS][RB]")),
    ("moe_gate_topk", ("threadgroup float choice[E];", "threadgroup float choice[E]")),  # no semicolon
    ("hc_input", ("cb[k] = float(bfloat16_t(c));", "cb[k] = float(bfloat16_t(c))")),  # no semicolon
    ("hc_input", ("(mix, scale, base, params[1], pre", "(mix, scale, params[1], pre")),  # hc_split_lanes' arguments
    ("hc_input", ("bfloat16_t(c)", "bfloat16_t(c, 1)")),  # bad conversion
    ("hc_mix", ("acc[m] += v * fc[m * HD + j];", "acc[m] += v * fc;")),  # pointer into a float
    ("hc_post_mix", ("(acc, &partial[0][0], lane,", "(acc, partial, lane,")),  # 2-d array for a pointer
    ("hc_post_mix", ("h[row * HD + chunk * CHUNK + j] = hb[k];", "h[row * HD + chunk * CHUNK + j] = hv[k];")),  # misspelt
    ("hc_input", ("c < uint(CH) ? parts[", "c < uint(CH) ? part[")),  # misspelt
    ("fp4_quant_kv", ("simd_shuffle_xor(amax, offset)", "simd_shuffle_xor(amax)")),  # bad call
    ("rms_norm", ("w, D, eps[0], rope_cos", "w, D, eps, rope_cos")),  # a pointer for a float
    ("rms_norm_quantised", ("threadgroup float partial[8];", "threadgroup float partial[8]")),  # no semicolon
    ("rms_norm_rope_quantised", ("y + ulong(row) * D, partial,", "y + ulong(row) * D, partial[0],")),  # a float for a pointer
    ("rms_norm_pair", ("(x2 + start2 + ulong(row) * D2, w2, D2,", "(x2 + start2 + ulong(row) * D2, D2,")),  # an argument short
    ("sparse_attention", ("threadgroup float denom[G];", "threadgroup float denom[G]")),  # no semicolon
    ("fp8_gemv", ("gemv_warp_totals<T, RB>(&acc[0][0], partial,", "gemv_warp_totals<T, RB>(acc, partial,")),  # wrong type
    ("fp4_experts", ("E2M1_HALF(codes >> 4)", "E2M1_HALF(codes >> 4, 1)")),  # bad macro call
    ("fp4_experts", ("threadgroup int picks[16];", "threadgroup int picks[16]")),  # no semicolon
    ("fp4_experts_16_rows", ("simdgroup_store(d[mg][h], dbuf", "simdgroup_store(d[mg][h], wbuf")),  # float tile, half memory
    ("fp8_gemv", ("q[i] = *((const device uint4*)", "q[i] = *((const device uint2*)")),  # type error
    ("fp4_experts_quantizing", ("mma_x_column<QX>(float(", "mma_x_columns<QX>(float(")),  # misspelt
    ("fp8_gemv_swiglu", ("o / RB * RB + RB), swiglu[0]);", "o / RB * RB + RB), swiglu);")),
    ("fp4_experts_swiglu", ("own_weight : weights[pr]);", "own_weight : weight[pr]);")),  # misspelt
    ("fp8_gemv_parts", ("o / RB, NY, v);", "o / RB, v);")),  # an argument short
    ("sparse_attention", ("ulong(key_row[j]) * D;", "ulong(key_rows[j]) * D;")),  # misspelt variable
    ("sparse_attention", ("qs[i / D][d ^ 1] * -rope_sin[s * D + d]", "qs[i / D][d ^ 1] * -rope_sine[s * D + d]")),
    ("sparse_attention_window_only", ("float(q[q0 + (i ^ 1)])", "float(q + (i ^ 1))")),  # pointer to float
    ("fp8_mma", ("const uint odd = E4M3_ODD(qw[c]);", "const uint odd = E4M3_ODD(qw[c])")),  # no semicolon
    ("fp8_mma_parts_16_rows", ("mma_warps_total<COLS, TR>(red, SW ? 2 * out + j : out, r)",
                               "mma_warps_total<COLS, TR>(red, SW ? 2 * out + j : out)")),  # an argument short
    ("fp8_mma_16_row_tiles", ("const uint4 q1 = TR == 32 ? wp[1] : q0;", "const uint4 q1 = TR == 32 ? wp : q0;")),
    ("fp8_mma_hc", ("h[(ulong(r) * HC + c) * N + d] = b;", "h[(ulong(r) * HC + c) * N + d] = hv;")),  # array stored
    ("fp8_mma_hc_parts_16_rows", ("acc[j] += simd_shuffle_xor(acc[j], offset);",
                                  "acc[j] += simd_shuffle_xor(acc, offset);")),  # array for a float
])
def test_a_broken_metal_source_fails_the_check(case, breakage, tmp_path):
    spec = CASES[case][0]
    old, new = breakage
    body = spec.source("metal")
    assert old in body
    out = syntax_check(_wrapped(case, body.replace(old, new, 1)), tmp_path)
    assert out.returncode != 0
    assert "error" in out.stderr


# ------------------------------------------------------------- CUDA text check

on_linux = pytest.mark.skipif(sys.platform != "linux", reason="NVRTC wheels are published for Linux only")


def _cuda_wrapped(case: str, body: str | None = None) -> str:
    spec, inputs, outputs, template = CASES[case]
    return nvrtc.wrap(spec.name, body or spec.source("cuda"), spec.header("cuda"), inputs, outputs, template)


@on_linux
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_source_compiles(case):
    ok, log = nvrtc.compile_cuda(_cuda_wrapped(case))
    assert ok, log


@on_linux
@pytest.mark.parametrize("case, breakage", [
    ("fp8_rows", ("__byte_perm(wq[mg][0][j], 0, 0x3120)", "__byte_perm(wq[mg][0][j], 0x3120)")),  # bad call
    ("ring_write", ("src[chunk];", "src[chunck];")),  # misspelt variable
    ("head_logits", ("acc[o][r] = fmaf(wf[e], xf[e], acc[o][r]);", "acc[o][r] = fmaf(wf, xf[e], acc[o][r]);")),
    ("hc_split", ("mix[k] = mixes[row * (2 + HC) * HC + k];", "mix[k] = mixes[row * (2 + HC) * HC + k]")),
    ("act_quant", ("fp8_fake_quant_lane(v)", "fp8_fake_quant_lane()")),  # bad call
    ("moe_gate_topk", ("choice[i] = neg_inf;", "choice[i] = neg_infinity;")),  # misspelt variable
    ("rows_gate", ("__nanosleep(256);", "__nanosleep();")),  # bad call
    ("moe_gate_scores", ("acc[r] += static_cast<float>(x[min(r, rows - 1) * D + d]) * wd[k];",
                         "acc[r] += static_cast<float>(x[min(r, rows - 1) * D + d]) * wd;")),  # array for a float
    ("hc_input", ("__float2bfloat16(c)", "__float2bfloat16(c, 1)")),  # bad call
    ("hc_input", ("(mix, scale, base, params[1], pre", "(mix, scale, params[1], pre")),  # hc_split_lanes' arguments
    ("hc_input", ("w[k] = EVEN || d < (unsigned int)D ? norm_w[d] : 0.0f;", "w = norm_w[d];")),
    ("hc_mix", ("acc[m] += v * fc[m * HD + j];", "acc[m] += v * fc;")),  # pointer into a float
    ("hc_post_mix", ("(acc, &partial[0][0], lane,", "(acc, partial, lane,")),  # 2-d array for a pointer
    ("hc_post_mix", ("post[row * HC + c], comb + row * HC * HC,", "posts[row * HC + c], comb + row * HC * HC,")),
    ("fp4_quant_kv", ("const float mag = fabsf(q);", "const float mag = fabsf(q)")),  # no semicolon
    ("rms_norm", ("w, D, eps[0], rope_cos", "w, D, eps, rope_cos")),  # a pointer for a float
    ("rms_norm_rope_quantised", ("y + (size_t)row * D, partial);", "y + (size_t)row * D, partial[0]);")),  # float for pointer
    ("rms_norm_pair", ("(x2 + start2 + (size_t)row * D2, w2, D2,", "(x2 + start2 + (size_t)row * D2, D2,")),  # an argument short
    ("sparse_attention", ("denom[g] = total + expf(sink[h0 + g] - row_max);",
                          "denom[g] = total + expf(sinks[h0 + g]);")),  # misspelt variable
    ("sparse_attention", ("v * rope_cos[s * D + d] +", "v * rope_cos +")),  # float times a pointer
    ("sparse_attention", ("bf16x8_floats(__ldg(reinterpret_cast<const uint4*>(key + 8 * ch)), kf);",
                          "bf16x8_floats(__ldg(reinterpret_cast<const uint4*>(key + 8 * ch)), kf[0]);")),
    ("sparse_attention_window_only", ("float v = qs[i / D][d];", "float v = qs[i / D];")),  # array into a float
    ("fp8_gemv", ("gemv_lane_accumulate<T, RB>(p, &wf[0][0], &acc[0][0], r);",
                  "gemv_lane_accumulate<T, RB>(p, &wf[0][0], &acc[0][0]);")),
    ("fp4_experts", ("if (ids[q] == expert) {", "if (id[q] == expert) {")),  # misspelt variable
    ("fp4_experts", ("nb, xrow, b0, per_warp, lane, acc, xsrow);", "nb, xrow[0], b0, per_warp, lane, acc, xsrow);")),  # a row for rows
    ("fp4_experts_quantizing", ("mma_warp_sums<E2m1Codes,", "mma_warp_sums<E2m1Code,")),  # misspelt code format
    ("fp8_gemv_quantizing", ("p = gemv_fake_quant8(p, xs[r]);", "p = gemv_fake_quant8(p, xs);")),  # array for float
    ("fp8_gemv_swiglu", ("o / RB * RB + RB), swiglu[0]);", "o / RB * RB + RB), swiglu);")),
    ("fp4_experts_swiglu", ("own_weight : weights[pr]);", "own_weight : weight[pr]);")),  # misspelt
    ("fp8_gemv_parts", ("o / RB, NY, v);", "o / RB, v);")),  # an argument short
    ("fp8_mma_quantizing", ("mma_warps_total<NH, TR>(red, n, r)", "mma_warps_total<NH, TR>(red, n)")),  # short
    ("fp8_mma_16_rows", ("mma_warp_sums_to<NH>(red, acc, lane);", "mma_warp_sums_to<NH>(red, acc[0], lane);")),  # wrong shape
    ("fp8_mma_hc", ("acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], offset);",
                    "acc[j] += __shfl_xor_sync(0xffffffffu, acc, offset);")),  # array for a float
    ("fp8_mma_hc_parts_16_rows", ("v = mma_warps_total<NH>(red, lane, r);", "v = mma_warps_total<NH>(red, r);")),
])
def test_a_broken_cuda_source_fails_the_compile(case, breakage):
    old, new = breakage
    body = CASES[case][0].source("cuda")
    assert old in body
    ok, log = nvrtc.compile_cuda(_cuda_wrapped(case, body.replace(old, new, 1)))
    assert not ok and "error" in log


# hc_split_lanes.cuh run on the host: 32 fibers (tests/emulation/fibers.h) stand in for a
# warp's lanes (a shuffle is a store, a barrier, a load, a barrier), beside hc_split_row.cuh on
# one thread
LANES_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include "fibers.h"
#define __device__
static emu::Barrier lockstep{32};
static float exchange[32];
unsigned int my_lane;
float __shfl_sync(unsigned int, float v, int src) {
  exchange[my_lane] = v;
  emu::wait(lockstep);
  const float got = exchange[src];
  emu::wait(lockstep);
  return got;
}
#include "hc_split_row.cuh"
#include "hc_split_lanes.cuh"
int main() {
  constexpr int HC = 4, ITERS = 20, M = (2 + HC) * HC;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  int differ = 0;
  for (int trial = 0; trial < 300; trial++) {
    float mix[M], scale[3], base[M];
    for (float& v : mix) v = normal(rng);
    for (float& v : base) v = 0.5f * normal(rng);
    for (float& v : scale) v = std::fabs(normal(rng));
    float pre0[HC], post0[HC], comb0[HC * HC], pre1[HC], post1[HC], comb1[HC * HC];
    hc_split_row<HC, ITERS>(mix, scale, base, 1e-6f, pre0, post0, comb0);
    auto lane = [&] { hc_split_lanes<HC, ITERS>(mix, scale, base, 1e-6f, pre1, post1, comb1, my_lane); };
    emu::run_group(32, lane, [](unsigned l) { my_lane = l; });
    differ += std::memcmp(pre0, pre1, sizeof pre0) || std::memcmp(post0, post1, sizeof post0) ||
              std::memcmp(comb0, comb1, sizeof comb0);
  }
  std::printf("%d differ\n", differ);
  return differ != 0;
}
"""


def test_hc_split_lanes_gives_hc_split_rows_bits(tmp_path):
    """hc_input's split on a simdgroup (hc_split_lanes, a lane for each comb entry) does the
    one-thread split's operations (hc_split_row) in its order, so the same bits: run on the
    host with 32 fibers as lanes, 300 random rows agree bit for bit; summing a column in
    the other order (a lane version that only matches to float noise) fails."""
    assert clang() is not None, "clang++ is needed to build the host harness: the `ziglang` test extra has one"

    def build(kernel_dir, name):
        (tmp_path / f"{name}.cpp").write_text(LANES_HARNESS)
        return subprocess.Popen([clang(), "-std=c++20", "-O1", "-I", str(kernel_dir), "-I", str(kernels.kernel_dir()),
                                 "-I", str(EMULATION), str(tmp_path / f"{name}.cpp"), "-o", str(tmp_path / name)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(name):
        return subprocess.run([str(tmp_path / name)], capture_output=True, text=True, timeout=120)

    text = kernels.kernel_text("hc_split_lanes.cuh")
    column = "for (int i = 0; i < HC; i++) {\n      total += __shfl_sync(ALL, c, i * HC + col);"
    assert column in text
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "hc_split_lanes.cuh").write_text(
        text.replace(column, column.replace("int i = 0; i < HC; i++", "int i = HC - 1; i >= 0; i--")))
    builds = [build(kernels.kernel_dir(), "same"), build(broken, "other_order")]  # both at once
    for b in builds:
        errors = b.communicate(timeout=300)[1]
        assert b.returncode == 0, errors
    same = run("same")
    assert same.returncode == 0 and same.stdout.strip() == "0 differ", same.stdout
    assert run("other_order").returncode != 0


@on_linux
def test_cuda_text_by_include_compiles_the_same_text(tmp_path):
    """On CUDA the kernels' texts reach NVRTC as #include lines of copies (kernels.included_texts,
    so that MLX hashes two lines a launch, not the text): the copies hold the texts, NVRTC
    builds the include form, and a broken copy fails it (NVRTC read the file)."""
    spec, inputs, outputs, template = CASES["hc_input"]
    header, body = spec.header("cuda"), spec.source("cuda")
    inc_header, inc_body = kernels.included_texts(spec.name, header, body, root=tmp_path)
    assert inc_header.startswith("#include") and inc_body.startswith("#include")
    assert len(inc_header) + len(inc_body) < 2 * len(str(tmp_path)) + 200 < len(header) + len(body)
    (copy,) = tmp_path.glob("*/hc_input.cu")
    assert copy.read_text() == body and copy.with_suffix(".cuh").read_text() == header
    ok, log = nvrtc.compile_cuda(nvrtc.wrap(spec.name, inc_body, inc_header, inputs, outputs, template))
    assert ok, log
    copy.write_text(body.replace("__float2bfloat16(c)", "__float2bfloat16(c, 1)", 1))
    ok, log = nvrtc.compile_cuda(nvrtc.wrap(spec.name, inc_body, inc_header, inputs, outputs, template))
    assert not ok and "error" in log


def test_included_texts_follow_their_content(tmp_path):
    """Another text is another folder (a new name for MLX's build cache, never a stale build);
    the same text again is the same lines, and a copy that no longer matches is rewritten;
    a folder that cannot be written gives the texts themselves."""
    first = kernels.included_texts("k", "// header\n", "y[0] = 1;\n", root=tmp_path)
    assert kernels.included_texts("k", "// header\n", "y[0] = 1;\n", root=tmp_path) == first
    other = kernels.included_texts("k", "// header\n", "y[0] = 2;\n", root=tmp_path)
    assert other[1] != first[1] and len(list(tmp_path.iterdir())) == 2
    (copy,) = [p for p in tmp_path.glob("*/k.cu") if p.read_text() == "y[0] = 1;\n"]
    copy.write_text("edited")
    assert kernels.included_texts("k", "// header\n", "y[0] = 1;\n", root=tmp_path) == first
    assert copy.read_text() == "y[0] = 1;\n"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert kernels.included_texts("k", "// h\n", "y[0] = 3;\n", root=blocked) == ("// h\n", "y[0] = 3;\n")


def test_included_texts_go_to_the_package_cache(tmp_path, monkeypatch):
    """The copies live in the package's cache directory ($DSV41_MLX_CACHE, else
    ~/.cache/dsv41_mlx), not a temporary directory other users share."""
    monkeypatch.setenv("DSV41_MLX_CACHE", str(tmp_path))
    header, source = kernels.included_texts("k", "// header\n", "y[0] = 1;\n")
    assert str(tmp_path / "cuda-kernels") in source
    monkeypatch.delenv("DSV41_MLX_CACHE")
    assert kernels.kernel_text_cache() == Path.home() / ".cache" / "dsv41_mlx" / "cuda-kernels"

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    assert kernels.included_texts("k", "// h\n", "y[0] = 2;\n") == ("// h\n", "y[0] = 2;\n")


@on_linux
def test_gemv_registers_reports_each_variant():
    """scripts/gemv_registers.py: NVRTC's register count for each GEMV kernel variant of a
    layout, and the threadgroups of 256 threads a core then holds. fp8_mma_hc's end (the
    stream and the mix parts) keeps fp8_mma's two threadgroups a core (a form holding every
    mix's loads at once took 255 registers, one threadgroup a core, and ran slower)."""
    script = load_script("gemv_registers")
    rows = script.table("sm_90", layouts=((1, 4, 32),), experts_layouts=(1,))
    assert [(r["kernel"], r["variant"]) for r in rows] == (
        [("fp8_gemv", v) for v in script.GEMV_VARIANTS] + [("fp4_experts", v) for v in script.EXPERTS_VARIANTS]
        + [("fp8_mma", v) for v in script.MMA_VARIANTS] + [("fp8_mma_hc", v) for v in script.MMA_HC_VARIANTS])
    for r in rows:
        assert 16 <= r["registers"] <= 255 and r["threadgroups_per_core"] == 65536 // (256 * r["registers"])
    assert all(r["threadgroups_per_core"] >= 2 for r in rows if r["kernel"].startswith("fp8_mma"))


def act_quant_spec(x: mx.array, impl: str, dtype: mx.Dtype | None = None) -> mx.array:
    """A stand-in for kernels.act_quant_fp8 in tests that take the GPU path on the CPU: its
    spec, quant.fp8_fake_quant_reference, with the kernel's signature."""
    from dsv41_mlx.quant import fp8_fake_quant_reference

    return fp8_fake_quant_reference(x).astype(dtype or x.dtype)


def test_check_kernels_runs_the_checks_named_at_the_rows_asked(monkeypatch, capsys):
    """scripts/check_kernels.py: on the CPU nothing to check; on a GPU the checks whose names
    start with a NAME given, at the --rows given (kernel_checks.harness.CHECK_ROWS while they
    run), each check's problems printed and counted, the exit status 1 where any."""
    from scripts.kernel_checks import harness as checks_harness

    script = load_script("check_kernels")
    monkeypatch.setattr(sys, "argv", ["check_kernels.py", "--rows=1,6", "rms_norm"])
    assert script.main() == 1 and "nothing to check" in capsys.readouterr().out
    ran = []

    def check(name, problems):
        return lambda impl, seed: ran.append((name, impl, checks_harness.CHECK_ROWS)) or problems

    monkeypatch.setattr(checks_harness, "CHECK_ROWS", checks_harness.CHECK_ROWS)  # (restored after)
    monkeypatch.setattr(script, "backend", lambda: "metal")
    monkeypatch.setattr(script, "CHECKS", [("rms_norm", check("rms_norm", []), 1),
                                           ("rms_norm_pair", check("rms_norm_pair", ["2 values off"]), 2),
                                           ("moe_gate", check("moe_gate", []), 3)])
    assert script.main() == 1
    assert ran == [("rms_norm", "metal", (1, 6)), ("rms_norm_pair", "metal", (1, 6))]
    out = capsys.readouterr().out
    assert "rms_norm: ok" in out and "rms_norm_pair: 2 values off" in out and out.endswith("1 FAILED\n")


def test_gemm_check_flags_a_kernel_that_rounds_along_the_way(monkeypatch):
    """scripts/check_kernels.py's bf16-vs-fp32 GEMM check, here on the CPU, whose bf16-fed
    GEMMs do round along the way: it must report them (on CUDA they pass)."""
    from scripts.kernel_checks import mlx_gemms as check
    monkeypatch.setattr(check, "quantised_gemm_shapes", lambda: ({(1024, 4096)}, {(2, 2048, 256)}, {(4, 2048, 256)}))
    problems, _ = check.check_gemms_bf16(seed=1, rows_list=(8,))
    assert any(p.startswith("mxfp8 1024->4096") for p in problems)
    assert not any("alone differs" in p for p in problems)  # the CPU's expert rows are independent


def test_gemm_agreement_allows_only_summation_order_differences():
    """The bf16-vs-fp32 GEMM comparison: a near-cancelling sum may land a few bf16 steps
    away within the fp32 summation-order bound; a value off by more than that bound, or
    many values one step off, are problems."""
    from scripts.kernel_checks import harness as check
    k = 1024
    wide = mx.array(np.linspace(-40, 40, 20_000).astype(np.float32))
    magnitude = mx.full(wide.shape, 800.0)  # k products of ~0.8 in absolute value
    narrow = wide.astype(mx.bfloat16)
    assert check.gemm_agreement("same", wide, narrow, magnitude, k) == (None, None)

    def moved(index, value):
        return mx.array(np.where(np.arange(wide.size) == index, np.float32(value), np.array(wide))).astype(mx.bfloat16)

    # A sum that cancels to 1e-3: 3 bf16 steps apart is 2e-5, inside 2k * 2**-24 * 800 ~ 1e-1.
    near_zero = mx.array(np.where(np.arange(wide.size) == 7, np.float32(1e-3), np.array(wide)))
    problem, note = check.gemm_agreement("cancel", near_zero, moved(7, 1e-3 * (1 + 3 * 2**-7)), magnitude, k)
    assert problem is None and "within the summation-order bound" in note
    problem, _ = check.gemm_agreement("wrong", wide, moved(7, float(wide[7].item()) + 1.0), magnitude, k)
    assert problem is not None and "beyond the fp32 summation-order bound" in problem
    one_step = (wide * (1 + 2**-7)).astype(mx.bfloat16)
    problem, _ = check.gemm_agreement("rounded", wide, one_step, magnitude, k)
    assert problem is not None and "values differ" in problem


def _wrong_gemm_kernels(reference):
    """Stand-ins for a GEMM kernel (x first; impl=, init_value=, quantize_input= and, for
    fp8_gemv, real_rows= keywords) that a check must flag, each with the words its problem
    carries: values off, an output left as poisoned, rows that depend on each other, an input
    not quantised when asked."""
    def off(*args, impl=None, init_value=None, **kw):
        return (reference(*args, **kw).astype(mx.float32) * 1.01).astype(mx.bfloat16)

    def unwritten(*args, impl=None, init_value=None, **kw):
        y = reference(*args, **kw)
        if init_value is None:
            return y
        flat = y.flatten()
        return mx.concatenate([flat[:-1], mx.array([init_value], dtype=y.dtype)]).reshape(y.shape)

    def coupled_rows(x, *args, impl=None, init_value=None, **kw):
        return reference(x + x[:1] * (x.shape[0] > 1) * 1e-2, *args, **kw)

    def unquantised(*args, impl=None, init_value=None, quantize_input=False, **kw):
        return reference(*args, **kw)

    return ((off, "values differ"), (unwritten, "beyond the fp32 summation-order bound"),
            (coupled_rows, "alone differs"), (unquantised, "quantising its input"))


@pytest.mark.parametrize("kernel, shapes", [
    ("fp8_gemv", ({(256, 64)}, {(2, 256, 32)}, set())),
    ("fp4_experts", (set(), set(), {(4, 256, 64)})),
])
def test_gemm_kernel_checks_pass_the_spec_and_flag_wrong_kernels(monkeypatch, kernel, shapes):
    """scripts/check_kernels.py's fp8_gemv and fp4_experts checks: the spec itself passes; a
    kernel whose values are off, that leaves an output unwritten, whose rows depend on each
    other, or that does not quantise its input when asked, fails; so does an fp8_gemv whose
    2-D form or stacked grouped form differs, or that computes a padded forward's padding rows,
    and an fp4_experts that computes every row of longer inputs than its rows=."""
    from dsv41_mlx import kernels

    check = importlib.import_module(f"scripts.kernel_checks.{kernel}")
    run = getattr(check, f"check_{kernel}")
    reference = getattr(kernels, f"{kernel}_reference")
    monkeypatch.setattr(check, "quantised_gemm_shapes", lambda: shapes)
    monkeypatch.setattr(check, kernel, lambda *args, impl=None, init_value=None, **kw: reference(*args, **kw))
    assert run("mlx", seed=1) == []
    wrong = _wrong_gemm_kernels(reference)
    if kernel == "fp8_gemv":
        def dense_off(x, w, s, impl=None, init_value=None, **kw):
            y = reference(x, w, s, **kw)
            return (y.astype(mx.float32) * 1.01).astype(mx.bfloat16) if w.ndim == 2 else y

        def padding_computed(*args, impl=None, init_value=None, real_rows=None, **kw):
            return reference(*args, **kw)

        def stacked_off(x, w, s, impl=None, init_value=None, groups=0, **kw):
            y = reference(x, w, s, groups=groups, **kw)
            return (y.astype(mx.float32) * 1.01).astype(mx.bfloat16) if groups else y

        wrong += ((dense_off, "the dense form"), (padding_computed, "zeros after them"),
                  (stacked_off, "the stacked form"))
    else:
        def rows_ignored(*args, impl=None, init_value=None, rows=None, **kw):  # every row of its inputs
            return reference(*args, **kw)

        wrong += ((rows_ignored, "differ from those rows alone"),)
    for broken, message in wrong:
        monkeypatch.setattr(check, kernel, broken)
        assert any(message in p for p in run("mlx", seed=1)), message


def test_pair_check_passes_two_launches_and_flags_a_wrong_pair(monkeypatch, fixture_dir):
    """scripts/check_kernels.py's fp8_gemv_pair check: a pair that is fp8_gemv on each matrix
    passes; one whose second part reads the first matrix's rows, or that computes a padded
    forward's padding rows, fails."""
    from dsv41_mlx import kernels

    import json

    from dsv41_mlx.config import ModelArgs

    from scripts.kernel_checks import fp8_gemv as check
    tiny = ModelArgs.from_dict(json.loads((fixture_dir / "config.json").read_text()))
    monkeypatch.setattr(check, "flash_args", lambda: tiny)
    monkeypatch.setattr(check, "fp8_gemv_pair_fits", lambda *args: True)
    monkeypatch.setattr(check, "fp8_gemv", lambda x, w, s, impl=None, **kw: kernels.fp8_gemv_reference(x, w, s, **kw))

    def pair(x, w, s, split, impl=None, init_value=None, real_rows=None, shift=0, padding=False):
        rows = slice(split - shift, w.shape[0] - shift)
        real = None if padding else real_rows
        return mx.concatenate([kernels.fp8_gemv_reference(x, w[:split], s[:split], real_rows=real).reshape(-1),
                               kernels.fp8_gemv_reference(x, w[rows], s[rows], real_rows=real).reshape(-1)])

    monkeypatch.setattr(check, "fp8_gemv_pair", pair)
    assert check.check_fp8_gemv_pair("mlx", seed=1) == []
    monkeypatch.setattr(check, "fp8_gemv_pair", lambda *a, **kw: pair(*a, **kw, shift=32))
    assert any("not the bits of fp8_gemv" in p for p in check.check_fp8_gemv_pair("mlx", seed=1))
    monkeypatch.setattr(check, "fp8_gemv_pair", lambda *a, **kw: pair(*a, **kw, padding=True))
    assert any("zeros after them" in p for p in check.check_fp8_gemv_pair("mlx", seed=1))


def test_rms_norm_pair_check_passes_two_norms_and_flags_a_wrong_pair(monkeypatch):
    """scripts/check_kernels.py's rms_norm_pair check: a pair that is rms_norm on each input
    passes; one that rotates neither, or scales the second input's weights, fails; and
    rms_norm_halves taking its second input from the wrong place in the array fails."""
    from dsv41_mlx.models.layers import rotate
    from dsv41_mlx.quant import fp8_fake_quant_reference

    from scripts.kernel_checks import rms_norm as check

    def norm(x, w, eps, impl=None, quantize_to=None, rope=None):  # the quantised (rotated) kernel's spec
        y = kernels.rms_norm_reference(x, w, eps)
        if rope is not None:
            cos, sin, dims = rope
            S, D = y.shape
            pairs = (S, D // 2, 2)
            y = rotate(y, cos.reshape(pairs), sin.reshape(pairs), (mx.arange(D) >= D - dims).reshape(pairs[1:]))
        return fp8_fake_quant_reference(y).astype(quantize_to)

    def pair(x, w, x2, w2, eps, q1, q2, rope2, impl=None, unrotated=False, weights=None):
        return norm(x, w, eps, quantize_to=q1), norm(x2, w2 * 1.01 if weights else w2, eps, quantize_to=q2,
                                                      rope=None if unrotated else rope2)

    def halves(both, rows, split, w, w2, eps, q1, q2, rope2, impl=None, start2=None):
        x, x2 = kernels.pair_halves(both, rows, split)
        if start2 is not None:  # the second input read from the wrong place in `both`
            x2 = both[start2: start2 + x2.size].reshape(x2.shape)
        return pair(x, w, x2, w2, eps, q1, q2, rope2)

    monkeypatch.setattr(check, "rms_norm", norm)
    monkeypatch.setattr(check, "rms_norm_pair", pair)
    monkeypatch.setattr(check, "rms_norm_halves", halves)
    assert check.check_rms_norm_pair("mlx", seed=2) == []
    for broken in ({"unrotated": True}, {"weights": "scaled"}):
        monkeypatch.setattr(check, "rms_norm_pair", lambda *a, kw=broken, **k: pair(*a, **k, **kw))
        assert any("second output" in p for p in check.check_rms_norm_pair("mlx", seed=2)), broken
    monkeypatch.setattr(check, "rms_norm_pair", pair)
    monkeypatch.setattr(check, "rms_norm_halves", lambda *a, **k: halves(*a, **k, start2=0))
    assert any("rms_norm_halves" in p for p in check.check_rms_norm_pair("mlx", seed=2))


def test_epilogue_check_passes_the_spec_and_flags_a_wrong_epilogue(monkeypatch):
    """scripts/check_kernels.py's gemv_epilogues check: the specs themselves pass; a SwiGLU that
    ignores its limit, drops the pairs' weights, or reads a pair's gate and up the other way round fails;
    so do parts added in another order, or to the padding rows too."""
    from dsv41_mlx import kernels

    from scripts.kernel_checks import epilogues as check
    monkeypatch.setattr(check, "quantised_gemm_shapes", lambda: ({(256, 64), (32, 256)}, set(), {(4, 256, 64)}))
    monkeypatch.setattr(check, "flash_args", lambda: type("Args", (), {"moe_intermediate_size": 32}))

    def spec(name, swiglu_change=None, parts_change=None):
        """The kernel's spec, its epilogue's arguments changed as a broken kernel would."""
        reference = getattr(kernels, f"{name}_reference")

        def kernel(*args, impl=None, init_value=None, swiglu=None, parts=None, **kw):
            if swiglu is not None and swiglu_change:
                if swiglu_change == "swapped":  # each pair's up row read as its gate row
                    y = reference(*args, **kw)
                    swapped = mx.stack([y[..., 1::2], y[..., 0::2]], axis=-1).reshape(y.shape)
                    return kernels.swiglu_pairs(swapped, swiglu)
                swiglu = swiglu_change(swiglu)
            if parts is not None and parts_change:
                if parts_change == "padding":  # every row's: the padding rows get the parts too
                    y = reference(*args, **kw)
                    return kernels.parts_added(y, mx.broadcast_to(parts[:1], (y.shape[0], *parts.shape[1:])))
                parts = parts[:, ::-1]
            return reference(*args, **({"swiglu": swiglu} if swiglu is not None else {}),
                             **({"parts": parts} if parts is not None else {}), **kw)

        return kernel

    for name in ("fp8_gemv", "fp4_experts"):
        monkeypatch.setattr(check, name, spec(name))
    assert check.check_gemv_epilogues("mlx", seed=3) == []
    broken = [("fp8_gemv", "SwiGLU", {"swiglu_change": lambda act: kernels.SwiGLU(0.0, act.weights)}),
              ("fp8_gemv", "SwiGLU", {"swiglu_change": "swapped"}),
              ("fp4_experts", "SwiGLU", {"swiglu_change": lambda act: kernels.SwiGLU(0.0, act.weights)}),
              ("fp4_experts", "SwiGLU", {"swiglu_change": lambda act: kernels.SwiGLU(act.limit)}),
              ("fp4_experts", "SwiGLU", {"swiglu_change": "swapped"}),
              ("fp8_gemv", "parts added", {"parts_change": "reversed"}),
              ("fp8_gemv", "parts added, 2 real rows", {"parts_change": "padding"})]
    for name, words, change in broken:
        monkeypatch.setattr(check, name, spec(name, **change))
        problems = check.check_gemv_epilogues("mlx", seed=3)
        assert any(p.startswith(name) and words in p for p in problems), (name, change)
        monkeypatch.setattr(check, name, spec(name))


def test_gate_check_passes_the_spec_and_flags_a_wrong_router(monkeypatch):
    """scripts/check_kernels.py's router check: the spec itself passes; a router whose
    weights are off, or that picks another expert, or whose rows depend on each other, fails."""
    from scripts.kernel_checks import moe_gate as check
    assert check.check_moe_gate("mlx", seed=2) == []

    def off_weights(x, *args, impl=None):
        w, ids = moe_gate_reference(x, *args)
        return w * 1.001, ids

    def other_expert(x, *args, impl=None):
        w, ids = moe_gate_reference(x, *args)
        return w, mx.sort(mx.concatenate([ids[:, :-1], (ids[:, -1:] + 1) % args[0].shape[0]], axis=1), axis=1)

    def coupled_rows(x, *args, impl=None):
        w, ids = moe_gate_reference(x, *args)
        return w * (1 + 1e-3 * (x.shape[0] > 1)), ids

    for broken, message in ((off_weights, "weights off"), (other_expert, "other experts"),
                            (coupled_rows, "alone differs")):
        monkeypatch.setattr(check, "moe_gate", broken)
        assert any(message in p for p in check.check_moe_gate("mlx", seed=2)), message


def test_hc_input_runs_only_where_it_fits():
    """The sub-layer input kernel takes a GPU, a bfloat16 stream and at most 16 rows (decode
    and verify); elsewhere the model composes its spec, and a direct call says why not."""
    from dsv41_mlx.kernels import hc_input, hc_input_fits, hc_post_input

    h = mx.zeros((8, 4, 512), dtype=mx.bfloat16)
    assert not hc_input_fits(h)  # the CPU
    assert hc_input_fits(h, impl="cuda") and hc_input_fits(h, impl="metal")
    assert not hc_input_fits(mx.zeros((17, 4, 512), dtype=mx.bfloat16), impl="cuda")
    assert not hc_input_fits(h.astype(mx.float32), impl="cuda")
    assert not hc_input_fits(mx.zeros((1, 4, 8192 + 32), dtype=mx.bfloat16), impl="cuda")  # registers
    assert not hc_input_fits(mx.zeros((1, 5, 512), dtype=mx.bfloat16), impl="metal")  # 35 mixes, 32 lanes
    with pytest.raises(ValueError, match="hc_input takes"):
        hc_input(h, mx.zeros((8, 4)), mx.zeros((24, 2048)), mx.zeros((3,)), mx.zeros((24,)), mx.ones((512,)),
                 20, 1e-6, 1e-6, 1e-6, mx.bfloat16)
    with pytest.raises(ValueError, match="hc_input takes"):
        hc_post_input(h[:, 0], h, mx.zeros((8, 4)), mx.zeros((8, 4, 4)), mx.zeros((8, 4)), mx.zeros((24, 2048)),
                      mx.zeros((3,)), mx.zeros((24,)), mx.ones((512,)), 20, 1e-6, 1e-6, 1e-6, mx.bfloat16)


def test_hc_input_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """scripts/check_kernels.py's sub-layer input check: the spec itself passes; a kernel
    whose x is off by a bf16 step in many values, whose quantised x is not its x's, whose
    mixes are off, or whose rows depend on each other, fails."""
    from dsv41_mlx.quant import fp8_fake_quant_reference

    from scripts.kernel_checks import hc as check
    spec = check.hc_input_spec

    def exact(h, pre_in, *args, impl=None):
        return spec(h, pre_in, *args)

    def x_off(h, pre_in, *args, impl=None):
        x, xq, *mixes = spec(h, pre_in, *args)
        x = (x.astype(mx.float32) * (1 + 2.0**-6)).astype(mx.bfloat16)
        return (x, fp8_fake_quant_reference(x).astype(args[-1]), *mixes)

    def xq_of_unrounded(h, pre_in, *args, impl=None):
        x, xq, *mixes = spec(h, pre_in, *args)
        return (x, (xq.astype(mx.float32) * (1 + 2.0**-4)).astype(xq.dtype), *mixes)

    def comb_off(h, pre_in, *args, impl=None):
        x, xq, pre, post, comb = spec(h, pre_in, *args)
        return x, xq, pre, post, comb + 1e-4

    def coupled_rows(h, pre_in, *args, impl=None):
        x, xq, pre, post, comb = spec(h, pre_in, *args)
        return x, xq, pre + 1e-3 * (h.shape[0] > 1), post, comb

    monkeypatch.setattr(check, "hc_input", exact)
    assert check.check_hc_input("mlx", seed=3) == []
    for broken, message in ((x_off, "x:"), (xq_of_unrounded, "xq:"), (comb_off, "comb off"),
                            (coupled_rows, "alone differs")):
        monkeypatch.setattr(check, "hc_input", broken)
        assert any(message in p for p in check.check_hc_input("mlx", seed=3)), message


def test_rms_norm_rope_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """check_kernels.py's check of the rotated RMSNorm (the window keys' norm, RoPE and
    FP8 fake-quant in one launch): the spec passes; a kernel that skips the rotation, rotates
    the first features instead of the last, or whose rows depend on each other, fails."""
    from dsv41_mlx.kernels import rms_norm_reference
    from dsv41_mlx.quant import fp8_fake_quant_reference

    from scripts.kernel_checks import rms_norm as check

    def spec(x, w, eps, impl=None, quantize_to=None, rope=None, first=False, coupled=False):
        y = rms_norm_reference(x, w * (1 + 1e-2 * (coupled and x.shape[0] > 1)), eps)
        if rope is not None:
            cos, sin, dims = rope
            if first:  # the first dims features: the mirror image of the last
                y = check.rotated_spec(y[:, ::-1], cos[:, ::-1], sin[:, ::-1], dims)[:, ::-1]
            else:
                y = check.rotated_spec(y, cos, sin, dims)
        return y if quantize_to is None else fp8_fake_quant_reference(y).astype(quantize_to)

    monkeypatch.setattr(check, "rms_norm", spec)
    assert check.check_rms_norm_rope("mlx", seed=5) == []
    for broken, message in (
            (lambda *a, rope=None, **kw: spec(*a, **kw), "differ"),
            (lambda *a, **kw: spec(*a, first=True, **kw), "differ"),
            (lambda *a, **kw: spec(*a, coupled=True, **kw), "alone differs")):
        monkeypatch.setattr(check, "rms_norm", broken)
        assert any(message in p for p in check.check_rms_norm_rope("mlx", seed=5)), message


def test_hc_post_input_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """check_kernels.py's check of the sub-layer input that expands the stream itself: the
    spec (hyper.hc_post, then hc_input's spec) passes; a kernel whose stream is off by a bf16
    step in many values, or whose rows depend on each other, fails."""
    from dsv41_mlx.models.hyper import HcMixes, hc_post

    from scripts.kernel_checks import hc as check

    def spec(y, residual, post, comb, pre_in, *args, impl=None):
        h = hc_post(y, residual, HcMixes(pre_in, post, comb))
        return (h, *check.hc_input_spec(h, pre_in, *args))

    def h_off(*a, impl=None):
        h, *rest = spec(*a)
        return ((h.astype(mx.float32) * (1 + 2.0**-6)).astype(mx.bfloat16), *rest)

    def coupled_rows(y, *a, impl=None):
        h, x, xq, pre, post, comb = spec(y, *a)
        return h, x, xq, pre, post + 1e-3 * (y.shape[0] > 1), comb

    monkeypatch.setattr(check, "hc_post_input", spec)
    assert check.check_hc_post_input("mlx", seed=3) == []
    for broken, message in ((h_off, "h:"), (coupled_rows, "alone differs")):
        monkeypatch.setattr(check, "hc_post_input", broken)
        assert any(message in p for p in check.check_hc_post_input("mlx", seed=3)), message



def test_fp8_into_stream_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """check_kernels.py's check of the GEMM that puts its output into the stream: specs of the
    kernels it runs (the GEMM's output by fp8_gemv_reference, the stream by hyper._hc_post,
    its mix parts the whole projection in one part, the next sub-layer's input completing
    them) pass; a stream off by a bf16 step, parts that miss a share of the projection, or
    rows that depend on each other fail."""
    from dsv41_mlx.kernels import hc_split_reference, rms_norm_reference
    from dsv41_mlx.models.hyper import _hc_post, hc_pre
    from dsv41_mlx.quant import fp8_fake_quant_reference

    from scripts.kernel_checks import harness as checks_harness, hc as check
    monkeypatch.setattr(checks_harness, "CHECK_ROWS", (1, 5))

    def gemv(x, w, s, impl=None, **kw):
        return kernels.fp8_gemv_reference(x, w, s, **kw)

    def hc_post_input(y, residual, post, comb, pre_in, *args, impl=None):
        h = _hc_post(y, residual, post, comb)
        return (h, *check.hc_input_spec(h, pre_in, *args))

    def into_stream(x, w, s, onto, impl=None, h_scale=1.0, share=1.0, coupled=False, **kw):
        residual, post, comb, fn = onto
        y = gemv(x, w, s, **kw)
        h = (_hc_post(y, residual, post + 1e-2 * (coupled and x.shape[0] > 1), comb).astype(mx.float32)
             * h_scale).astype(mx.bfloat16)
        flat = h.reshape(h.shape[0], -1).astype(mx.float32)
        return h, mx.concatenate([flat @ fn.T * share, (flat * flat).sum(axis=1, keepdims=True)], axis=1)[:, None]

    def from_parts(h, parts, pre_in, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to, impl=None):
        total = parts.sum(axis=1)
        mixes = total[:, :-1] * mx.rsqrt(total[:, -1:] / (h.shape[1] * h.shape[2]) + hc_norm_eps)
        x = rms_norm_reference(hc_pre(h, pre_in), norm_w, norm_eps)
        return (x, fp8_fake_quant_reference(x).astype(quantize_to),
                *hc_split_reference(mixes, scale, base, h.shape[1], iters, eps))

    monkeypatch.setattr(check, "fp8_gemv", gemv)
    monkeypatch.setattr(kernels, "hc_post_input", hc_post_input)
    monkeypatch.setattr(kernels, "hc_input_from_parts", from_parts)
    monkeypatch.setattr(kernels, "fp8_into_stream", into_stream)
    assert check.check_fp8_into_stream("mlx", seed=3) == []
    for broken, message in (({"h_scale": 1 + 2.0**-6}, "values of h differ"), ({"share": 0.99}, "off by"),
                            ({"coupled": True}, "alone differs")):
        monkeypatch.setattr(kernels, "fp8_into_stream", lambda *a, b=broken, **kw: into_stream(*a, **b, **kw))
        assert any(message in p for p in check.check_fp8_into_stream("mlx", seed=3)), message


def test_fp8_into_stream_runs_only_where_it_fits():
    """The GEMM that puts its output into the stream takes a GPU, a stream hc_input fits (bf16,
    at most 16 rows) as wide as the GEMM's outputs, and a matrix on the matrix unit (4096
    outputs or more); elsewhere it says what it got. hc_input's second launch names parts of
    the wrong shape."""
    from dsv41_mlx.kernels import StreamOnto, fp8_into_stream, fp8_into_stream_fits, hc_input_from_parts

    w = mx.zeros((5120, 2048), dtype=mx.uint32)  # wo_b: 8192 inputs, 5120 outputs
    stream = mx.zeros((1, 4, 5120), dtype=mx.bfloat16)
    assert fp8_into_stream_fits(w, stream, impl="cuda") and fp8_into_stream_fits(w, stream, impl="metal")
    assert not fp8_into_stream_fits(w, stream, impl="mlx")
    assert not fp8_into_stream_fits(w, mx.zeros((17, 4, 5120), dtype=mx.bfloat16), impl="cuda")  # prefill's rows
    assert not fp8_into_stream_fits(w, stream.astype(mx.float32), impl="cuda")
    assert not fp8_into_stream_fits(mx.zeros((1024, 2048), dtype=mx.uint32), mx.zeros((1, 4, 1024), dtype=mx.bfloat16),
                                    impl="cuda")  # off the matrix unit
    assert not fp8_into_stream_fits(w, mx.zeros((1, 4, 4096), dtype=mx.bfloat16), impl="cuda")  # another width
    onto = StreamOnto(stream, mx.zeros((1, 4)), mx.zeros((1, 4, 4)), mx.zeros((24, 4 * 5120)))
    with pytest.raises(ValueError, match="fp8_into_stream takes"):
        fp8_into_stream(mx.zeros((1, 8192), dtype=mx.bfloat16), w, mx.zeros((5120, 256), dtype=mx.uint8), onto,
                        impl="mlx")
    with pytest.raises(ValueError, match="parts are"):
        hc_input_from_parts(stream, mx.zeros((1, 160, 24)), mx.zeros((1, 4)), mx.zeros(3), mx.zeros(24),
                            mx.zeros(5120), 20, 1e-6, 1e-6, 1e-6, mx.bfloat16, impl="cuda")


def test_matrix_unit_kernels_take_k_up_to_their_scale_buffer():
    """fp8_mma and fp4_experts stage a tile's weight scales (K bytes) in a fixed buffer of
    MMA_MAX_K, the same bound in the CUDA text as in kernels: a wider K stays off the matrix unit
    (fp8_gemv's other kernel, or the spec), the release's widest, wo_b's 8192, on it."""
    from dsv41_mlx.kernels import (MMA_MAX_K, fp4_experts_fits, fp8_gemv_on_matrix_unit, fp8_into_stream_fits,
                                   kernel_text)

    assert f"constexpr unsigned int MMA_MAX_K = {MMA_MAX_K};" in kernel_text("mma_x.cuh")
    assert MMA_MAX_K == 8192
    assert fp8_gemv_on_matrix_unit(5120, 8192) and not fp8_gemv_on_matrix_unit(5120, 8192 + 256)
    stream = mx.zeros((1, 4, 5120), dtype=mx.bfloat16)
    assert fp8_into_stream_fits(mx.zeros((5120, 8192 // 4), dtype=mx.uint32), stream, impl="cuda")
    assert not fp8_into_stream_fits(mx.zeros((5120, (8192 + 256) // 4), dtype=mx.uint32), stream, impl="cuda")
    ids = mx.zeros((1, 6), dtype=mx.uint32)
    for k, fits in ((8192, True), (8192 + 256, False)):
        x, w = mx.zeros((1, 1, k), dtype=mx.bfloat16), mx.zeros((24, 4608, k // 8), dtype=mx.uint32)
        assert fp4_experts_fits(x, w, ids, impl="cuda") is fits


def test_attention_kernel_runs_only_where_it_fits():
    """The attention kernel takes a GPU, bfloat16 queries, at most 16 rows, heads in groups of
    two, a width of 16-byte chunks that divide 256 and its threadgroup memory; elsewhere the
    model gathers the keys and runs the spec. It decides on the queries' shape alone (the
    model asks before it makes them), and takes its rows' RoPE tables."""
    from dsv41_mlx.kernels import attention_fits, sparse_attention_rows
    from dsv41_mlx.models.layers import shared_rope

    bf16 = mx.bfloat16
    assert not attention_fits((8, 64, 512), bf16, 128, 512)  # the CPU
    assert attention_fits((8, 64, 512), bf16, 128, 512, impl="cuda")
    assert attention_fits((8, 64, 512), bf16, 128, 0, impl="metal")
    assert not attention_fits((17, 64, 512), bf16, 128, 512, impl="cuda")
    assert not attention_fits((8, 5, 512), bf16, 128, 512, impl="cuda")
    assert attention_fits((8, 4, 64), bf16, 128, 512, impl="cuda")  # the tiny checkpoint's heads
    assert not attention_fits((8, 64, 520), bf16, 128, 512, impl="cuda")  # 65 chunks
    assert not attention_fits((8, 64, 512), mx.float32, 128, 512, impl="cuda")
    assert not attention_fits((8, 64, 512), bf16, 128, 2048, impl="cuda")  # scores beyond the threadgroup memory
    q = mx.zeros((8, 64, 512), dtype=bf16)
    keys = (mx.zeros((130, 512), dtype=bf16), mx.zeros((8, 128), dtype=mx.int32), mx.ones((8, 128), dtype=mx.bool_))
    rope = shared_rope(64, 10000)
    with pytest.raises(ValueError, match="sparse_attention_rows takes bfloat16"):
        sparse_attention_rows(q, *keys, None, None, None, mx.zeros((64,)), 0.04, rope.tables(mx.arange(8), 512), 64)
    with pytest.raises(ValueError, match="sparse_attention_rows takes Rope.tables"):  # another row count's
        sparse_attention_rows(q, *keys, None, None, None, mx.zeros((64,)), 0.04, rope.tables(mx.arange(4), 512), 64,
                              impl="cuda")


def test_attention_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """scripts/check_kernels.py's attention check: the spec itself passes; a kernel that
    drops the sink, reads the wrong window slot, forgets the RoPE (of q and of the output,
    or only the inverse), couples rows, computes a padded forward's padding rows, reads q
    given as [S, H * D] in another layout, or gives other bits at 8 simdgroups a threadgroup,
    fails."""
    from dsv41_mlx.models.layers import Rope
    from dsv41_mlx.models.attention import sparse_attention

    from scripts.kernel_checks import harness as checks_harness, sparse_attention as check
    spec = check.sparse_attention_spec

    def no_sink(q, ring, index, wmask, kv, ids, pmask, sink, *rest, impl=None):
        return spec(q, ring, index, wmask, kv, ids, pmask, sink - 30, *rest)

    def shifted_slot(q, ring, index, *rest, impl=None):
        return spec(q, ring, (index + 1) % ring.shape[0], *rest)

    def no_rope(q, ring, index, wmask, kv, ids, pmask, sink, scale, rope, rope_dims, real_rows=None, impl=None):
        q = q.reshape(q.shape[0], sink.shape[0], -1)
        return sparse_attention(q, ring[index], wmask, None if ids is None else kv[ids], pmask, sink, scale)

    def no_inverse_rope(q, ring, index, wmask, kv, ids, pmask, sink, scale, rope, rope_dims, real_rows=None,
                        impl=None):
        q = q.reshape(q.shape[0], sink.shape[0], -1)
        return sparse_attention(Rope.apply(q, rope), ring[index], wmask, None if ids is None else kv[ids], pmask,
                                sink, scale)

    def flat_q_misread(q, *rest, impl=None):  # [S, H * D] read with the features outermost
        S, H = q.shape[0], rest[6].shape[0]
        return spec(q.reshape(S, -1, H).swapaxes(1, 2) if q.ndim == 2 else q, *rest)

    def coupled_rows(q, *rest, impl=None):
        out = spec(q, *rest)
        return (out.astype(mx.float32) * (1 + 0.01 * (q.shape[0] > 1))).astype(mx.bfloat16)

    def padding_computed(*args, impl=None):  # ignores real_rows
        return spec(*args[:11])

    def warps_dependent(*args, impl=None):  # sums in another order at another simdgroup count
        out = spec(*args)
        eight = tuning.current().attention_warps.get(impl) == 8
        return (out.astype(mx.float32) * 1.05).astype(mx.bfloat16) if eight else out

    monkeypatch.setattr(check, "sparse_attention_rows", lambda *a, impl=None: spec(*a))
    assert check.check_sparse_attention("mlx", seed=4) == []
    monkeypatch.setattr(checks_harness, "CHECK_ROWS", (8,))  # a padded forward's rows: every fault shows there
    for broken, message in ((no_sink, "off by"), (shifted_slot, "off by"), (no_rope, "off by"),
                            (no_inverse_rope, "off by"), (coupled_rows, "alone differs"),
                            (padding_computed, "zeros after them"), (flat_q_misread, "q as [S, H * D]"),
                            (warps_dependent, "8 simdgroups")):
        monkeypatch.setattr(check, "sparse_attention_rows", broken)
        assert any(message in p for p in check.check_sparse_attention("mlx", seed=4)), broken.__name__


def test_rms_norm_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """scripts/check_kernels.py's RMSNorm check: the spec itself passes; a kernel that rounds
    twice (bf16 before the weight), couples rows, or quantises other values than its own
    norm, fails."""
    from dsv41_mlx.kernels import rms_norm_reference
    from dsv41_mlx.quant import fp8_fake_quant_reference

    from scripts.kernel_checks import rms_norm as check

    def kernel_like(norm):  # a norm as the kernel computes it, with the quantised form on top
        def run(x, w, eps, impl=None, quantize_to=None):
            y = norm(x, w, eps)
            return y if quantize_to is None else fp8_fake_quant_reference(y).astype(quantize_to)
        return run

    def rounds_twice(x, w, eps):
        normed = mx.fast.rms_norm(x.astype(mx.float32), mx.ones_like(w), eps).astype(x.dtype)
        return (normed.astype(mx.float32) * w).astype(x.dtype)

    def coupled_rows(x, w, eps):
        return rms_norm_reference(x, w * (1 + 1e-3 * (x.shape[0] > 1)), eps)

    def quantises_unrounded(x, w, eps, impl=None, quantize_to=None):
        y = rms_norm_reference(x.astype(mx.float32), w, eps)  # skips the rounding to x's dtype
        return (y if quantize_to is None else fp8_fake_quant_reference(y)).astype(quantize_to or x.dtype)

    monkeypatch.setattr(check, "rms_norm", kernel_like(rms_norm_reference))
    assert check.check_rms_norm("mlx", seed=6) == []
    for broken, message in ((kernel_like(rounds_twice), "differ"), (kernel_like(coupled_rows), "alone differs"),
                            (quantises_unrounded, "differ from act_quant")):
        monkeypatch.setattr(check, "rms_norm", broken)
        assert any(message in p for p in check.check_rms_norm("mlx", seed=6)), broken


def test_custom_kernels_can_be_switched_off_on_a_gpu(monkeypatch):
    """DSV41_MLX_KERNELS=0 runs the pure-MLX specs on a GPU (to compare or time the two);
    what the device is, and so the GEMMs' input dtype, stays."""
    from dsv41_mlx import kernels, quant

    monkeypatch.delenv("DSV41_MLX_KERNELS", raising=False)
    kernels.kernels_switched_off.cache_clear()  # (read once a process: as a new process reads it)
    with kernels.dispatching(device="cuda"):
        assert kernels.backend() == "cuda"
        monkeypatch.setenv("DSV41_MLX_KERNELS", "0")
        assert kernels.backend() == "cuda"  # the process read it already
        kernels.kernels_switched_off.cache_clear()
        try:
            assert kernels.backend() == "mlx"
            assert quant.gemm_input_dtype() == mx.bfloat16
        finally:
            kernels.kernels_switched_off.cache_clear()  # the next reader reads the restored environment


def test_fp4_check_passes_the_spec_and_flags_a_wrong_kernel(monkeypatch):
    """scripts/check_kernels.py's FP4 check: the spec itself passes bit for bit; a kernel that
    breaks the E2M1 ties the other way, or drops the E4M3 scale's rounding, fails."""
    from dsv41_mlx.quant import fp4_fake_quant_reference

    from scripts.kernel_checks import fake_quant as check

    def spec(x, block, e4m3, impl=None):
        return fp4_fake_quant_reference(x, block, "e4m3" if e4m3 else "e8m0")

    def ties_down(x, block, e4m3, impl=None):
        y = spec(x, block, e4m3)
        return mx.where(mx.abs(x.astype(mx.float32)) == 1.75, mx.sign(x) * 1.5, y).astype(x.dtype)

    def raw_scale(x, block, e4m3, impl=None):
        y = spec(x, block, e4m3)
        return (y.astype(mx.float32) * (1 + 2.0**-10 * e4m3)).astype(x.dtype)

    monkeypatch.setattr(check, "fp4_quant", spec)
    assert check.check_fp4_quant("mlx", seed=2) == []
    for broken in (ties_down, raw_scale):
        monkeypatch.setattr(check, "fp4_quant", broken)
        assert any("values differ" in p for p in check.check_fp4_quant("mlx", seed=2)), broken.__name__


def test_metal_hc_split_row_takes_scale_from_constant_memory(tmp_path):
    """MLX's metal_kernel passes an input of fewer than 8 values in `constant` memory (the
    mixes' scale has 3) and larger ones in `device` memory, and Metal does not convert
    pointers between the two: hc_split_row.h must take either. Checked with clang's address
    spaces (the shim's `device` and `constant` are plain C++, so the kernel checks cannot)."""
    import subprocess

    from dsv41_mlx.kernels import kernel_text

    prelude = """
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2))) const
#define thread
namespace metal { float exp(float x); float max(float a, float b); }
"""
    caller = """
void split(constant float* scale, const device float* base, device float* pre, device float* post,
           device float* comb) {
  float mix[24] = {};
  hc_split_row<4, 20>(mix, scale, base, 1e-6f, pre, post, comb);
}
"""
    for header, ok in ((kernel_text("hc_split_row.h"), True),
                       (kernel_text("hc_split_row.h").replace("ScalePtr scale", "const device float* scale"), False)):
        src = tmp_path / "split.cpp"
        src.write_text(prelude + header + caller)
        out = subprocess.run([clang(), "-std=c++17", "-fsyntax-only", str(src)], capture_output=True, text=True)
        assert (out.returncode == 0) == ok, out.stderr


def test_kernel_arguments_are_made_once_per_value():
    """A kernel's small arguments (sizes, epsilons) are made once per value and passed again
    on every later call, so that a forward allocates none on the host."""
    from dsv41_mlx import kernels

    seen = []

    def compiled(spec, language):
        def run(inputs, output_shapes, output_dtypes, **_):
            seen.append(inputs[2:])
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    with kernels.dispatching(build=compiled):
        x, w = mx.ones((3, 64), dtype=mx.bfloat16), mx.ones((64,))
        for _ in range(2):
            kernels.rms_norm(x, w, 1e-6, impl="cuda")
        (eps_a, sizes_a, *rope_a), (eps_b, sizes_b, *rope_b) = seen  # rope: the placeholders, made once too
        assert eps_a is eps_b and sizes_a is sizes_b and all(a is b for a, b in zip(rope_a, rope_b))
        assert sizes_a.tolist() == [3, 64] and sizes_a.dtype == mx.int32 and eps_a.dtype == mx.float32
        kernels.rms_norm(x[:2], w, 1e-6, impl="cuda")
        assert seen[-1][1].tolist() == [2, 64]


def test_gemv_threads_per_output_default_by_shape_and_can_be_set_for_benchmarks():
    """fp8_gemv launches with C = gemv_threads_per_output(K, N * G) unless told otherwise (bench.py
    gemms --threads), its grid sized for C; a C other than 32, 64, 128 or 256 is refused. The rule:
    the fewest threads that leave each at most 10 steps of 16 inputs and, given the matrix's outputs,
    fill 256 threadgroups."""
    from dsv41_mlx import kernels

    threads = kernels.gemv_threads_per_output
    # outputs enough to fill the GPU at any C: the steps alone decide
    assert [threads(5120, 32768), threads(8192, 32768), threads(15360, 32768)] == [32, 64, 128]
    assert [threads(5120, 512), threads(5120, 1280), threads(5120, 4608)] == [256, 256, 64]  # wkv, wq_a, w13
    assert [threads(1280, 32768), threads(4096, 8 * 1024), threads(15360, 5120)] == [32, 32, 128]
    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            seen.append((dict(template)["C"], grid[0]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    with kernels.dispatching(build=compiled):
        x, w, s = mx.zeros((8, 5120), dtype=mx.bfloat16), mx.zeros((512, 1280), dtype=mx.uint32), mx.zeros((512, 160))
        kernels.fp8_gemv(x, w, s, impl="cuda")
        kernels.fp8_gemv(x, w, s, impl="cuda", threads=128)
        assert seen == [(256, 512 // (256 // 256 * 2) * 256), (128, 512 // (256 // 128 * 2) * 256)]  # 8 rows: T = 2
        for bad in (48, 512):
            with pytest.raises(ValueError, match="threads per output"):
                kernels.fp8_gemv(x, w, s, impl="cuda", threads=bad)


def test_gemv_layout_bounds_the_computed_rows_by_a_power_of_two():
    """The GEMV kernels' row bound RB is the least power of two holding the rows they compute
    (a padded forward's real rows: a 1-row decode runs RB = 1), T outputs per thread group 4
    at RB 1 and 2 above; the grid follows T. fp4_experts runs 8 pairs a pass on the matrix
    unit up to 8 rows (NH 1) and 16 above, a threadgroup per (pair, 32 outputs), its x prepared
    by mma_x_prep (a warp per row and block of 32 columns) where it computes more than one row."""
    from dsv41_mlx import kernels

    layout = tuning.Layout()
    assert [layout.gemv_layout(r) for r in (1, 2, 3, 5, 8, 9, 16)] == [
        (1, 4), (2, 2), (4, 2), (8, 2), (8, 2), (16, 2), (16, 2)]
    assert [layout.mma_column_groups(r) for r in (1, 6, 8, 9, 16)] == [1, 1, 1, 2, 2]
    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            t = dict(template)
            layout = (t["RB"], t["T"]) if "RB" in t else (t["NH"], t["PX"]) if "NH" in t else ()
            seen.append((spec.name, *layout, grid[0], output_shapes[0]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    x, w, s = mx.zeros((8, 4096), dtype=mx.bfloat16), mx.zeros((2048, 1024), dtype=mx.uint32), mx.zeros((2048, 128))
    we, se = mx.zeros((4, 64, 64), dtype=mx.uint32), mx.zeros((4, 64, 16))
    with kernels.dispatching(build=compiled):
        kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=1)
        kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=6)
        for x_shape, ids_shape, rows in (((3, 1, 512), (3, 2), None), ((9, 1, 512), (9, 2), None),
                                         ((8, 2, 512), (8, 2), 1), ((8, 2, 512), (8, 2), 3)):
            kernels.fp4_experts(mx.zeros(x_shape, dtype=mx.bfloat16), we, se, mx.zeros(ids_shape, dtype=mx.uint32),
                                impl="cuda", rows=rows)
        per_tg = 256 // kernels.gemv_threads_per_output(4096, 2048)  # thread groups a threadgroup
        assert seen == [("fp8_gemv", 1, 4, 2048 // (per_tg * 4) * 256, (8, 2048)),  # all 8 rows out, padding zeros
                        ("fp8_gemv", 8, 2, 2048 // (per_tg * 2) * 256, (8, 2048)),
                        ("mma_x_prep", 3 * 512, (3, 512)),  # x [3, 1, K]: its 3 rows
                        ("fp4_experts", 1, 1, 3 * 2 * 64 // 32 * 256, (3, 2, 64)),
                        ("mma_x_prep", 9 * 512, (9, 512)),
                        ("fp4_experts", 2, 1, 9 * 2 * 64 // 32 * 256, (9, 2, 64)),
                        ("fp4_experts", 1, 0, 1 * 2 * 64 // 32 * 256, (1, 2, 64)),  # one row: x as it is
                        ("mma_x_prep", 3 * 2 * 512, (6, 512)),  # x [8, 2, K], 3 rows computed: its first 3 x 2
                        ("fp4_experts", 1, 1, 3 * 2 * 64 // 32 * 256, (3, 2, 64))]


def test_one_computed_row_takes_its_own_layouts():
    """Where a launch computes one row (a decode step: a padded forward of one real row), CUDA
    runs the package's layouts for it, which change no bit (scripts/check_kernels.py compares
    them): the attention at one head and 32 warps a threadgroup (Layout.attention_one_row),
    fp8_mma with 2 blocks loaded ahead for a short K (Layout.mma_loads_ahead); more computed
    rows, a long K and Metal keep the general ones. Keyed on the computed rows, not the padded
    forward's."""
    from dsv41_mlx import kernels

    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            t = dict(template)
            seen.append((spec.name, t.get("G"), t.get("WARPS"), t.get("U"), grid[0]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    S, H, D, W, K = 8, 4, 64, 8, 4
    q, ring = mx.zeros((S, H, D), dtype=mx.bfloat16), mx.zeros((16, D), dtype=mx.bfloat16)
    index, wmask = mx.zeros((S, W), dtype=mx.int32), mx.ones((S, W), dtype=mx.bool_)
    kv, ids, pmask = mx.zeros((16, D), dtype=mx.bfloat16), mx.zeros((S, K), dtype=mx.uint32), mx.ones((S, K), dtype=mx.bool_)
    rope = (mx.zeros((S, D // 2, 2)), mx.zeros((S, D // 2, 2)))
    with kernels.dispatching(build=compiled):
        for impl, real in (("cuda", 1), ("cuda", 6), ("metal", 1)):
            kernels.sparse_attention_rows(q, ring, index, wmask, kv, ids, pmask, mx.zeros((H,)), 0.125, rope, 16,
                                          real_rows=real, impl=impl)
        assert seen == [("sparse_attention", 1, 32, None, S * H * 32 * 32),
                        ("sparse_attention", 2, 16, None, S * H // 2 * 16 * 32),
                        ("sparse_attention", 2, 8, None, S * H // 2 * 8 * 32)]
        seen.clear()
        x = mx.zeros((S, 1280), dtype=mx.bfloat16)
        w, s = mx.zeros((4096, 1280 // 4), dtype=mx.uint32), mx.zeros((4096, 1280 // 32), dtype=mx.uint8)
        for real in (1, 6):
            kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=real)
        x = mx.zeros((S, 2304), dtype=mx.bfloat16)
        w, s = mx.zeros((4096, 2304 // 4), dtype=mx.uint32), mx.zeros((4096, 2304 // 32), dtype=mx.uint8)
        kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=1)
        assert [(name, u) for name, _, _, u, _ in seen] == [("fp8_mma", 2), ("fp8_mma", 6), ("fp8_mma", 6)]


def test_fp8_mma_takes_the_array_it_waits_for_and_its_tile_rows():
    """fp8_gemv on the matrix unit takes `after` as its last input (unread: a CUDA graph runs the
    launch once it is written), else an input it has anyway, and its grid holds N / TR tiles
    (Layout.mma_tile_rows): TR 16 doubles the threadgroups."""
    from dsv41_mlx import kernels

    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            seen.append((spec.name, inputs, dict(template)["TR"], grid[0]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    with kernels.dispatching(build=compiled):
        x = mx.zeros((8, 1280), dtype=mx.bfloat16)
        w, s = mx.zeros((4096, 1280 // 4), dtype=mx.uint32), mx.zeros((4096, 1280 // 32), dtype=mx.uint8)
        picks = mx.zeros((8, 6), dtype=mx.uint32)
        kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=1, swiglu=kernels.SwiGLU(7.0), after=picks)
        kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=1)
        with tuning.using(tuning.Layout(mma_tile_rows=lambda n, k: 16)):
            kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=6)
        (name, waits, tr, grid), (_, plain, _, _), (_, _, tr16, grid16) = seen
        assert name == "fp8_mma" and waits[-1] is picks and len(waits) == len(kernels.FP8_MMA.inputs)
        assert plain[-1] is not picks and any(plain[-1] is a for a in plain[:-1])
        assert (tr, grid, tr16, grid16) == (32, 4096 // 32 * 256, 16, 4096 // 16 * 256)


def test_wq_a_and_wkv_run_as_one_launch_that_writes_them_apart():
    """fp8_gemv_pair fits the release's stacked wq_a + wkv (5120 -> 1280 + 512) on a GPU: one
    fp8_gemv launch with SPLIT at wq_a's rows, each part (pair_halves) a [rows, outputs] view of its output,
    with the C each matrix gets alone (256). Not on the CPU, not for a matrix on the matrix
    unit, not where a part alone would take another C (another summation order), not for a
    split inside a thread group's outputs."""
    from dsv41_mlx import kernels

    x = mx.zeros((8, 5120), dtype=mx.bfloat16)

    def stack(n):
        return mx.zeros((n, 1280), dtype=mx.uint32), mx.zeros((n, 160), dtype=mx.uint8)

    w, s = stack(1792)
    assert kernels.fp8_gemv_pair_fits(x, w, 1280, impl="cuda") and kernels.fp8_gemv_pair_fits(x, w, 1280, impl="metal")
    assert not kernels.fp8_gemv_pair_fits(x, w, 1280, impl="mlx")
    assert not kernels.fp8_gemv_pair_fits(x, w, 1282, impl="cuda")  # a part of 1282 outputs: not whole groups
    assert not kernels.fp8_gemv_pair_fits(x, stack(4608)[0], 4096, impl="cuda")  # 4096 outputs: the matrix unit
    assert kernels.gemv_threads_per_output(5120, 2560) != kernels.gemv_threads_per_output(5120, 512)
    assert not kernels.fp8_gemv_pair_fits(x, stack(2560)[0], 2048, impl="cuda")  # C 128 for the pair, 256 for 512
    assert not kernels.fp8_gemv_pair_fits(x[None], w, 1280, impl="cuda")  # a dense x [S, K] only
    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            seen.append((spec.name, dict(template), grid[0], output_shapes[0]))
            return [mx.arange(shape[0]).astype(dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    with kernels.dispatching(build=compiled):
        a, kv = kernels.pair_halves(kernels.fp8_gemv_pair(x, w, s, 1280, impl="cuda", real_rows=1), 8, 1280)
        (name, template, grid, shape), = seen
        assert name == "fp8_gemv" and shape == (8 * 1792,) and grid == 1792 // 4 * 256
        assert {k: template[k] for k in ("RB", "T", "C", "QX", "SW", "AP", "SPLIT")} == {
            "RB": 1, "T": 4, "C": 256, "QX": 0, "SW": 0, "AP": 0, "SPLIT": 1280}
        assert a.shape == (8, 1280) and kv.shape == (8, 512)
        assert a[1, 0].item() == 1280 and kv[0, 0].item() == 8 * 1280  # the first part's rows, then the second's
        with pytest.raises(ValueError, match="fp8_gemv_pair takes"):
            kernels.fp8_gemv_pair(x, w, s, 1282, impl="cuda")


def test_large_dense_fp8_gemms_run_on_the_matrix_unit_at_every_row_count():
    """fp8_gemv picks fp8_mma by the matrix's shape alone (a dense matrix of at least
    Layout.mma_min_outputs outputs), so a matrix sums in one order at every row count: one row
    and eight alike; smaller or grouped matrices keep the scalar kernel, and `threads` (bench's
    layout comparisons) asks for the scalar kernel."""
    from dsv41_mlx import kernels

    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            seen.append((spec.name, dict(template).get("NH"), grid[0], output_shapes[0]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    with kernels.dispatching(build=compiled):
        n = tuning.current().mma_min_outputs
        x, w, s = mx.zeros((16, 1024), dtype=mx.bfloat16), mx.zeros((n, 256), dtype=mx.uint32), mx.zeros((n, 32))
        for rows in (1, 8, 9):
            kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=rows)
        kernels.fp8_gemv(x, w[: n - 32], s[: n - 32], impl="cuda", real_rows=1)
        kernels.fp8_gemv(x, w, s, impl="cuda", real_rows=1, threads=64)
        kernels.fp8_gemv(mx.repeat(x[:, None], 2, axis=1), mx.repeat(w[None], 2, axis=0), mx.repeat(s[None], 2, axis=0),
                         impl="cuda")
        assert [(name, nh) for name, nh, _, _ in seen] == [("fp8_mma", 1), ("fp8_mma", 1), ("fp8_mma", 2),
                                                           ("fp8_gemv", None), ("fp8_gemv", None), ("fp8_gemv", None)]
        assert seen[0][2:] == (n // 32 * 256, (16, n))  # a threadgroup per 32 outputs; every row out


def test_the_model_head_runs_head_logits_for_a_decode_or_verify_forward():
    """model.Head keeps the release's bf16 weight and on a GPU runs head_logits (one launch,
    its row bound R from the computed rows, a padded forward's real rows passed on) for bf16 x
    of up to DECODE_MAX_ROWS rows; more rows (or no GPU) take the spec."""
    from dsv41_mlx import kernels
    from dsv41_mlx.models.deepseek_v41 import Head

    seen = []

    def compiled(spec, language):
        def run(inputs, template, grid, output_shapes, output_dtypes, **_):
            seen.append((spec.name, dict(template)["R"], grid[0], output_shapes[0], inputs[2].tolist()))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return run

    head = Head(64, 256)
    assert head.weight.dtype == mx.bfloat16
    head.weight = (mx.random.normal((64, 256)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((17, 256)).astype(mx.bfloat16)
    want = x.astype(mx.float32) @ head.weight.astype(mx.float32).T
    with kernels.dispatching("cuda", compiled):
        assert head(x[:1]).shape == (1, 64) and head(x[:8], real_rows=6).shape == (8, 64)
        assert seen == [("head_logits", 1, 2 * 256, (1, 64), [1, 64, 256, 1]),
                        ("head_logits", 8, 2 * 256, (8, 64), [6, 64, 256, 8])]
        assert mx.array_equal(head(x), want).item() and len(seen) == 2  # 17 rows: the spec
        assert mx.array_equal(head(x[:2].astype(mx.float32)), want[:2]).item() and len(seen) == 2  # not bf16
    with kernels.dispatching("mlx", compiled):
        assert mx.array_equal(head(x[:2]), want[:2]).item() and len(seen) == 2


def test_gemv_kernels_quantise_bf16_input_only():
    """Asked to FP8 fake-quantise its input, a GEMV kernel takes bfloat16 only: float32 input
    would be rounded to bf16 first, and rounded twice could land elsewhere than the spec."""
    from dsv41_mlx.kernels import fp4_experts, fp8_gemv

    w, s = mx.zeros((1, 32, 64), dtype=mx.uint32), mx.zeros((1, 32, 8), dtype=mx.uint8)
    with pytest.raises(ValueError, match="bfloat16 input only"):
        fp8_gemv(mx.zeros((2, 1, 256)), w, s, impl="cuda", quantize_input=True)
    with pytest.raises(ValueError, match="bfloat16 input only"):
        fp4_experts(mx.zeros((2, 1, 256)), mx.zeros((3, 32, 32), dtype=mx.uint32), mx.zeros((3, 32, 8), dtype=mx.uint8),
                    mx.array([[0, 1], [1, 2]]), impl="cuda", quantize_input=True)
