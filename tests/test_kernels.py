"""The custom kernels: the pure-MLX spec against numpy float64, the FP8 head
builder against the release quantiser, the Metal text type-checked by clang and
the CUDA text compiled by NVRTC (no GPU needed for either).

The CUDA twins run against the same spec on the H200 in
scripts/check_kernels.py (through the device tool).
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx.cache import DraftCache
from dsv41_mlx.kernels import (ACT_QUANT, FP8_ROWS, HC_SPLIT, RING_WRITE, TOP_K, fp8_rows_top64, ring_write,
                               ring_write_reference)
from dsv41_mlx.quant import e4m3_decode, e8m0_decode, quantize_fp8_tiles, quantize_fp8_tiles_mx

from . import cuda_check
from .metal_check import clang, syntax_check, wrap


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


def test_draft_cache_writes_through_the_ring_kernel():
    cache = DraftCache(n_stages=3, window=4, head_dim=8)
    rows = mx.random.normal((3, 4, 8)).astype(mx.bfloat16)
    cache.write(rows, 6)  # positions 2..5: slots 2, 3, 0, 1
    assert mx.array_equal(cache.rings[:, mx.array([2, 3, 0, 1])], rows).item()


# ------------------------------------------------------------ Metal text check

CASES = {
    "fp8_rows": (FP8_ROWS, {"x": "uint16", "w": "uint8", "scales": "uint8"},
                 {"top_vals": "float32", "top_ids": "int32"}, {"R": 5, "K": 5120, "N": 129280, "TILES": 505}),
    "ring_write": (RING_WRITE, {"rings": "uint16", "rows": "uint16", "span": "int32"}, {"out": "uint16"},
                   {"S": 3, "W": 128, "D": 512}),
    "hc_split": (HC_SPLIT, {"mixes": "float32", "scale": "float32", "base": "float32", "eps": "float32",
                            "rows": "int32"}, {"pre": "float32", "post": "float32", "comb": "float32"},
                 {"HC": 4, "ITERS": 20}),
    "act_quant": (ACT_QUANT, {"x": "bfloat16", "n": "int32"}, {"y": "bfloat16"}, {"T": "bfloat16", "O": "bfloat16"}),
    "act_quant_to_f32": (ACT_QUANT, {"x": "bfloat16", "n": "int32"}, {"y": "float32"},
                         {"T": "bfloat16", "O": "float32"}),
}

@pytest.fixture(autouse=True)
def _compilers_present(request):
    if "metal" in request.node.name:
        assert clang() is not None, "clang++ is needed for the Metal check (.ci/run installs it)"
    if "cuda" in request.node.name:
        assert cuda_check.nvrtc() is not None, "the CUDA check needs the test extras' NVRTC wheels"


def _wrapped(case: str, body: str | None = None) -> str:
    spec, inputs, outputs, template = CASES[case]
    return wrap(spec.name, body or spec.source("metal"), spec.header("metal"), inputs, outputs, template)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rows", [1, 16])
def test_metal_source_type_checks(case, rows, tmp_path):
    spec, inputs, outputs, template = CASES[case]
    if "R" in template:
        template = {**template, "R": rows}
    out = syntax_check(wrap(spec.name, spec.source("metal"), spec.header("metal"), inputs, outputs, template),
                       tmp_path)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("case, breakage", [
    ("fp8_rows", ("simdgroup_store(", "simdgroup_stor(")),  # misspelt builtin
    ("fp8_rows", ("const uint odd = E4M3_ODD(words[c]);", "const uint odd = E4M3_ODD(words[c])")),  # no semicolon
    ("fp8_rows", ("simdgroup_half8x8 a;", "simdgroup_float8x8 a;")),  # type error: float tile from half memory
    ("ring_write", ("src[chunk];", "src[chunck];")),  # misspelt variable
    ("hc_split", ("metal::exp(c[i * HC + j] - row_max)", "metal::exp(c[i * HC + j] - row_max, 1)")),  # bad call
    ("act_quant", ("const float q = v / scale;", "const float q = v / scal;")),  # misspelt variable
    ("act_quant", ("simd_max(metal::abs(v))", "simd_max(metal::abs(v), 1)")),  # bad call
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
    return cuda_check.wrap(spec.name, body or spec.source("cuda"), spec.header("cuda"), inputs, outputs, template)


@on_linux
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_source_compiles(case):
    ok, log = cuda_check.compile_cuda(_cuda_wrapped(case))
    assert ok, log


@on_linux
@pytest.mark.parametrize("case, breakage", [
    ("fp8_rows", ("__byte_perm(wq[mg][0][j], 0, 0x3120)", "__byte_perm(wq[mg][0][j], 0x3120)")),  # bad call
    ("ring_write", ("src[chunk];", "src[chunck];")),  # misspelt variable
    ("hc_split", ("expf(c[i * HC + j] - row_max)", "expf(c[i * HC + j] - row_max, 1)")),  # bad call
    ("act_quant", ("__shfl_xor_sync(0xffffffffu, amax, offset)", "__shfl_xor_sync(amax, offset)")),  # bad call
])
def test_a_broken_cuda_source_fails_the_compile(case, breakage):
    old, new = breakage
    body = CASES[case][0].source("cuda")
    assert old in body
    ok, log = cuda_check.compile_cuda(_cuda_wrapped(case, body.replace(old, new, 1)))
    assert not ok and "error" in log


def test_gemm_check_flags_a_kernel_that_rounds_along_the_way(monkeypatch):
    """scripts/check_kernels.py's bf16-vs-fp32 GEMM check, here on the CPU, whose bf16-fed
    GEMMs do round along the way: it must report them (on CUDA they pass)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "check_kernels.py"
    spec = importlib.util.spec_from_file_location("check_kernels", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "quantised_gemm_shapes", lambda: ({(1024, 4096)}, {(2, 2048, 256)}, {(4, 2048, 256)}))
    problems, _ = check.check_gemms_bf16(seed=1, rows_list=(8,))
    assert any(p.startswith("mxfp8 1024->4096") for p in problems)
    assert not any("alone differs" in p for p in problems)  # the CPU's expert rows are independent
