"""GPU kernels run on the host (tests/kernel_emulation.py) against their pure-MLX specs, both
twins: fp4_experts (Metal: simdgroup matrices and threadgroup staging; CUDA: mma.sync
fragments in registers) with its pair bookkeeping, at several row counts, x per row and per
slot, quantised in the kernel or before, with and without its SwiGLU epilogue; the scalar
fp8_gemv with its epilogues and its pair form (two stacked matrices written apart), and
fp8_mma (its matrix-unit form for large matrices); the drafter head's fp8_rows (the matrix
unit, then a bitonic sort); the model's head_logits; rms_norm_pair against two rms_norm
launches; act_quant and ring_write bit for bit; sparse_attention with and without picks.
There is neither a Mac nor a GPU here: beside the type-check and the NVRTC compile, this is
the check that each twin computes its spec (the CUDA twins' emulated fragment layout is the
one that gave the spec's numbers on an H200)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

import mlx.core as mx
from dsv41_mlx import kernels
from dsv41_mlx.kernels.tuning import Layout
from tests.metal_check import clang
from tests.kernel_emulation import run, start


@pytest.fixture(autouse=True)
def _clang_present():
    assert clang() is not None, "clang++ is needed to build the host emulation: the `ziglang` test extra has one"


E, KS, N, K = 5, 3, 64, 512
LAYOUT = Layout()  # the package's launch layout, as a forward takes it


def _inputs(rows: int, per_slot: bool, quantise_first: bool, seed: int, k: int = K):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << 32, (E, N, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.integers(118, 124, (E, N, k // 32)).astype(np.uint8)
    ids = np.sort(np.stack([rng.choice(E, KS, replace=False) for _ in range(rows)]), axis=1).astype(np.uint32)
    x = mx.array(rng.standard_normal((rows, KS if per_slot else 1, k)).astype(np.float32)).astype(mx.bfloat16)
    if quantise_first:  # as the model feeds it: FP8 fake-quantised over blocks of 32
        from dsv41_mlx.quant import fp8_fake_quant_reference
        x = fp8_fake_quant_reference(x).astype(mx.bfloat16)
    weights = np.abs(rng.standard_normal((rows, KS))).astype(np.float32) * 0.3
    return codes, scales, ids, x, weights


def _bf16_bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.bfloat16).view(mx.uint16)).reshape(-1)


def _floats(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _assert_within_rounding(got_bits: np.ndarray, want: mx.array) -> np.ndarray:
    """A GEMM kernel's bf16 output against its spec's: both sum exact products in float32 (in
    other orders) and round to bf16, so an output may land one bf16 step apart, and a SwiGLU
    rounds its gate and up first (three roundings). Returns the outputs as floats."""
    got, want = _floats(got_bits), np.array(want.astype(mx.float32)).reshape(-1)
    bound = 2.0 ** -6 * np.abs(want) + 2.0 ** -10 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
    return got


def _fp4_experts_start(spec, language, x, codes, scales, ids, weights, template, n_out, tmp_path,
                       rows: int | None = None):
    """spec's body (fp4_experts' inputs) started on the host (kernel_emulation.start) over the
    (row, expert) pairs of the first `rows` rows (default all): its run gives y's bits. With
    template PX = 1, x is first run through mma_x_prep on the host (its first rows x slots
    rows), and fp4_experts reads that."""
    rows = ids.shape[0] if rows is None else rows
    k = x.shape[-1]
    x_in, xs = ("bfloat16", _bf16_bits(x)), ("float32", np.zeros(1, dtype=np.float32))
    if template.get("PX"):
        n = rows * x.shape[1]
        prep = run(kernels.MMA_X_PREP, language, {"x": x_in, "sizes": ("int32", np.array([n, k]))},
                   {"xh": ("uint16", n * k), "xs": ("float32", n * k // 32)}, {"QX": template["QX"]},
                   n * k // 256, tmp_path)
        x_in, xs = ("uint16", prep["xh"]), ("float32", prep["xs"])
    return start(spec, language, {
        "x": x_in, "xs": xs, "w": ("uint32", codes), "scales": ("uint8", scales),
        "ids": ("uint32", ids), "sizes": ("int32", np.array([rows, KS, N, k, x.shape[1]])),
        "swiglu": ("float32", np.array([7.0])), "weights": ("float32", weights)},
        {"y": ("bfloat16", rows * KS * n_out)}, template, rows * KS * (N // 32), tmp_path)


def _fp4_experts_on_the_host(*args, **kwargs) -> np.ndarray:
    """_fp4_experts_start's launch run: y's bits."""
    return _fp4_experts_start(*args, **kwargs)()["y"]


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, per_slot, qx, sw", [
    (1, False, 1, 2),   # a decode step's gate and up projection: x quantised in the kernel, weighted SwiGLU
    (1, True, 1, 0),    # its down projection
    (5, False, 0, 2),   # a verify forward's gate and up projection: x quantised before
    (6, True, 1, 0),    # its down projection, x quantised in the kernel (up to 8 rows)
    (9, False, 0, 1),   # past 8 rows: two column groups (NH 2)
    (16, True, 0, 0),
])
def test_fp4_experts_runs_its_spec_on_the_host(language, rows, per_slot, qx, sw, tmp_path):
    codes, scales, ids, x, weights = _inputs(rows, per_slot, quantise_first=not qx, seed=rows)
    act = None if not sw else kernels.SwiGLU(7.0, mx.array(weights) if sw == 2 else None)
    want = kernels.fp4_experts_reference(x, mx.array(codes), mx.array(scales), mx.array(ids),
                                         quantize_input=bool(qx), swiglu=act)
    got = _fp4_experts_on_the_host(kernels.FP4_EXPERTS, language, x, codes, scales, ids, weights,
                                   {"NH": LAYOUT.mma_column_groups(rows), "QX": qx, "SW": sw, "ONE": int(rows == 1),
                                    "U": LAYOUT.experts_loads_ahead(rows, K), "PX": 0}, N // 2 if sw else N, tmp_path)
    _assert_within_rounding(got, want)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, per_slot, qx, sw", [
    (1, False, 1, 2),   # one row (the package keeps x as it is there; the path exists all the same)
    (5, False, 0, 2),   # a verify forward's gate and up projection
    (6, True, 1, 0),    # its down projection, x quantised by mma_x_prep
    (9, False, 1, 1),   # two column groups (NH 2)
])
def test_fp4_experts_on_prepared_x_gives_the_same_bits(language, rows, per_slot, qx, sw, tmp_path):
    """x through mma_x_prep first (PX = 1: x / s and s a block, made once) gives fp4_experts the
    very bits it computes from x itself (PX = 0), so Layout.experts_prepare_x may choose either."""
    codes, scales, ids, x, weights = _inputs(rows, per_slot, quantise_first=not qx, seed=rows + 20)
    template = {"NH": LAYOUT.mma_column_groups(rows), "QX": qx, "SW": sw, "ONE": int(rows == 1),
                "U": LAYOUT.experts_loads_ahead(rows, K)}
    n_out = N // 2 if sw else N
    launches = [_fp4_experts_start(kernels.FP4_EXPERTS, language, x, codes, scales, ids, weights,
                                   {**template, "PX": px}, n_out, tmp_path) for px in (0, 1)]
    plain, prepared = (launch()["y"] for launch in launches)
    assert np.array_equal(plain, prepared)
    assert np.any(plain != 0)


@pytest.mark.parametrize("rows, per_slot, qx, sw, px", [
    (1, False, 1, 2, 0),  # a decode step's gate and up projection (a warp of 9 blocks: K 2304)
    (6, True, 1, 0, 1),   # a verify forward's down projection
    (9, False, 0, 1, 0),  # two column groups
])
def test_fp4_experts_gives_the_same_bits_whatever_its_loads_ahead(rows, per_slot, qx, sw, px, tmp_path):
    """The CUDA walk's U (the blocks whose loads a warp issues before it uses the first:
    Layout.experts_loads_ahead: 1 for one row of a short K, else 2) moves no bit: each block's sums
    are added in the same order. A decode step's row and the same row in a verify forward
    launch with different U, and drafts on must give the bits of drafts off."""
    # K 2304 (w2's): 9 blocks a warp, not a multiple of U
    codes, scales, ids, x, weights = _inputs(rows, per_slot, quantise_first=not qx, seed=rows + 40, k=2304)
    template = {"NH": LAYOUT.mma_column_groups(rows), "QX": qx, "SW": sw, "ONE": int(rows == 1), "PX": px}
    n_out = N // 2 if sw else N
    launches = [_fp4_experts_start(kernels.FP4_EXPERTS, "cuda", x, codes, scales, ids, weights,
                                   {**template, "U": u}, n_out, tmp_path) for u in (1, 2, 4)]
    bits = [launch()["y"] for launch in launches]
    assert np.any(bits[0] != 0)
    for other in bits[1:]:
        assert np.array_equal(bits[0], other)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("per_slot, sw", [(False, 2), (True, 0)])
def test_fp4_experts_computes_the_first_rows_of_longer_inputs(language, per_slot, sw, tmp_path):
    """A padded decode step hands the kernel x, ids and the pairs' weights of all 8 rows as they
    are (model.Fp4Stack.pairs: no views) with its real rows as R: the kernel's first R rows are
    the spec's of those rows alone, whatever the other rows hold."""
    rows, real = 8, 2
    codes, scales, ids, x, weights = _inputs(rows, per_slot, quantise_first=True, seed=11)
    act = None if not sw else kernels.SwiGLU(7.0, mx.array(weights[:real]) if sw == 2 else None)
    want = kernels.fp4_experts_reference(x[:real], mx.array(codes), mx.array(scales), mx.array(ids[:real]),
                                         swiglu=act)
    got = _fp4_experts_on_the_host(kernels.FP4_EXPERTS, language, x, codes, scales, ids, weights,
                                   {"NH": 1, "QX": 0, "SW": sw, "ONE": 0, "U": 2, "PX": 1}, N // 2 if sw else N,
                                   tmp_path, rows=real)
    assert got.size == real * KS * (N // 2 if sw else N)
    _assert_within_rounding(got, want)


@pytest.mark.parametrize("language, right, wrong", [
    ("metal", "ulong2(0, 0), true);", "ulong2(0, 0), false);"),  # x tiles loaded untransposed
    ("cuda", "bx[h][2 * ks], bx[h][2 * ks + 1]);", "bx[h][2 * ks + 1], bx[h][2 * ks]);"),  # B halves swapped
])
def test_the_host_run_catches_a_wrong_layout(language, right, wrong, tmp_path):
    """The check can fail: the same kernel with one operand's layout wrong gives other numbers."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Broken(kernels.KernelSpec):  # `right` in the body (Metal) or a header (CUDA's mma_x.cuh)
        def source(self, language):
            return super().source(language).replace(right, wrong)

        def header(self, language):
            return super().header(language).replace(right, wrong)

    spec = kernels.FP4_EXPERTS
    assert right in spec.source(language) + spec.header(language)
    broken = Broken(spec.name, spec.inputs, spec.outputs, spec.metal, spec.cuda, spec.header_files, spec.twin_headers)
    rows = 2
    codes, scales, ids, x, weights = _inputs(rows, False, quantise_first=True, seed=0)
    want = np.array(kernels.fp4_experts_reference(x, mx.array(codes), mx.array(scales), mx.array(ids))
                    .astype(mx.float32)).reshape(-1)
    got = _floats(_fp4_experts_on_the_host(broken, language, x, codes, scales, ids, weights,
                                           {"NH": 1, "QX": 0, "SW": 0, "ONE": 0, "U": 2, "PX": 0}, N, tmp_path))
    assert np.abs(got - want).max() > 2.0 ** -6 * np.abs(want).max()


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_fp8_rows_runs_its_spec_on_the_host(language, rows, tmp_path):
    """The drafter head's kernel (the matrix unit, then a bitonic sort in threadgroup memory):
    each row's 64 best outputs of each tile of 256, merged as fp8_rows_top64 merges them,
    against fp8_rows_reference: the same best values, and each id's logit its value."""
    from dsv41_mlx.quant import Fp8Matrix
    from scripts.benchmarks.harness import random_scales, random_words

    mx.random.seed(rows)
    n, k, tiles = 768, 256, 3
    codes = np.array(random_words((n, k // 4))).view(np.uint8)  # E4M3 codes without NaNs, [n, k]
    w = Fp8Matrix(mx.array(codes), random_scales((n // 32, k // 32)))
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    out = run(kernels.FP8_ROWS, language, {"x": ("uint16", _bf16_bits(x)), "w": ("uint8", codes),
                                          "scales": ("uint8", np.array(w.scales))},
              {"top_vals": ("float32", rows * tiles * 64), "top_ids": ("int32", rows * tiles * 64)},
              {"R": rows, "K": k, "N": n, "TILES": tiles}, tiles, tmp_path)
    vals, ids = kernels.top_k_best(mx.array(out["top_vals"].reshape(rows, -1)),
                                   mx.array(out["top_ids"].reshape(rows, -1)))
    want_vals, _ = kernels.fp8_rows_reference(x, w)
    logits = np.array(x.astype(mx.float32) @ w.dequantize().T)
    vals, ids, want_vals = np.array(vals), np.array(ids), np.array(want_vals)
    tol = 1e-3 * np.abs(logits).max()  # fp16 x and another order of the float32 sums
    assert np.all(np.abs(vals - want_vals) <= tol)
    assert np.all(np.abs(np.take_along_axis(logits, ids, axis=1) - vals) <= tol)
    assert all(len(set(row)) == kernels.TOP_K for row in ids.tolist())


@pytest.mark.parametrize("language", ["metal", "cuda"])
def test_act_quant_and_ring_write_give_their_specs_bits_on_the_host(language, tmp_path):
    """Two element-wise kernels whose spec is exact: act_quant's FP8 fake-quantisation (a
    SIMD-group maximum per block of 32) and ring_write's slot arithmetic, bit for bit."""
    from dsv41_mlx.quant import fp8_fake_quant_reference

    rng = np.random.default_rng(3)
    x = mx.array((rng.standard_normal((3, 96)) * np.exp(rng.uniform(-6, 6, (3, 96)))).astype(np.float32))
    want = _bf16_bits(fp8_fake_quant_reference(x.astype(mx.bfloat16)).astype(mx.bfloat16))
    got = run(kernels.ACT_QUANT, language, {"x": ("bfloat16", _bf16_bits(x)), "n": ("int32", np.array([x.size]))},
              {"y": ("bfloat16", x.size)}, {"T": "bfloat16", "O": "bfloat16"}, -(-x.size // 256), tmp_path)["y"]
    assert np.array_equal(got, want)

    S, W, D, first, M = 3, 8, 64, 13, 5  # positions 13..17 wrap around a ring of 8
    rings = mx.array(rng.standard_normal((S, W, D)).astype(np.float32)).astype(mx.bfloat16)
    rows = mx.array(rng.standard_normal((S, M, D)).astype(np.float32)).astype(mx.bfloat16)
    want = _bf16_bits(kernels.ring_write_reference(rings, rows, first))
    got = run(kernels.RING_WRITE, language, {"rings": ("uint16", _bf16_bits(rings)), "rows": ("uint16", _bf16_bits(rows)),
                                             "span": ("int32", np.array([first, M]))},
              {"out": ("uint16", S * W * D)}, {"S": S, "W": W, "D": D}, -(-S * W * (D // 8) // 256), tmp_path)["out"]
    assert np.array_equal(got, want)


def _fp8_gemm_on_the_host(spec, language, rows, out_rows, qx, sw, ap, template, groups, tmp_path):
    """An FP8 GEMM kernel of fp8_gemv's inputs (fp8_gemv, fp8_mma) run on the host against
    fp8_gemv_reference: 64 outputs, 512 inputs, `rows` computed of `out_rows`."""
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.benchmarks.harness import random_scales, random_words

    mx.random.seed(rows + 2 * sw + ap)
    n, k = 64, 512
    w, s = random_words((n, k // 4)), random_scales((n, k // 32))
    x = mx.random.normal((out_rows, k)).astype(mx.bfloat16)
    if not qx:
        x = fp8_fake_quant_reference(x).astype(mx.bfloat16)
    n_out = n // 2 if sw else n
    parts = (mx.random.normal((rows, ap, n_out)) * 0.5).astype(mx.bfloat16) if ap else None
    act = kernels.SwiGLU(7.0) if sw else None
    want = kernels.fp8_gemv_reference(x, w, s, quantize_input=bool(qx), real_rows=rows, swiglu=act, parts=parts)
    got = run(spec, language, {
        "x": ("bfloat16", _bf16_bits(x)), "w": ("uint32", np.array(w)), "scales": ("uint8", np.array(s)),
        "sizes": ("int32", np.array([rows, n, k, 1, out_rows])), "swiglu": ("float32", np.array([7.0])),
        "parts": ("bfloat16", _bf16_bits(parts) if ap else np.zeros(1, np.uint16))},
        {"y": ("bfloat16", out_rows * n_out)}, template, groups, tmp_path)["y"]
    got = _assert_within_rounding(got, want)
    assert np.all(got.reshape(out_rows, n_out)[rows:] == 0)  # the padding rows: zeros


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, qx, sw, ap", [(1, 1, 0, 0), (1, 1, 1, 0), (6, 0, 0, 6), (6, 0, 1, 0)])
def test_fp8_gemv_runs_its_spec_on_the_host(language, rows, qx, sw, ap, tmp_path):
    """The scalar FP8 GEMV (a thread group of C threads per T outputs, the simdgroups' sums
    added in order) with its QX / SW / AP epilogues and a padded forward's zero rows."""
    rb, t = LAYOUT.gemv_layout(rows)
    c = kernels.gemv_threads_per_output(512, 64)
    _fp8_gemm_on_the_host(kernels.FP8_GEMV, language, rows, 8, qx, sw, ap,
                          {"RB": rb, "T": t, "C": c, "QX": qx, "SW": sw, "AP": ap, "SPLIT": 0}, 64 // (256 // c * t),
                          tmp_path)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, out_rows", [(1, 8), (6, 8)])
def test_fp8_gemv_pair_writes_each_matrix_apart_on_the_host(language, rows, out_rows, tmp_path):
    """fp8_gemv with SPLIT (kernels.fp8_gemv_pair): two stacked matrices of 32 outputs each, one
    input, the first's [out_rows, 32] then the second's [out_rows, 32] in y; each output the
    bits of the same kernel without SPLIT (y's columns apart), the padding rows zeros. A
    launch that split nowhere would interleave the two."""
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.benchmarks.harness import random_scales, random_words

    mx.random.seed(11 + rows)
    n, k, split = 64, 512, 32
    w, s = random_words((n, k // 4)), random_scales((n, k // 32))
    x = fp8_fake_quant_reference(mx.random.normal((out_rows, k))).astype(mx.bfloat16)
    rb, t = LAYOUT.gemv_layout(rows)
    c = kernels.gemv_threads_per_output(k, n)
    inputs = {"x": ("bfloat16", _bf16_bits(x)), "w": ("uint32", np.array(w)), "scales": ("uint8", np.array(s)),
              "sizes": ("int32", np.array([rows, n, k, 1, out_rows])), "swiglu": ("float32", np.array([0.0])),
              "parts": ("bfloat16", np.zeros(1, np.uint16))}

    def launch(splits, workdir):
        workdir.mkdir()
        template = {"RB": rb, "T": t, "C": c, "QX": 0, "SW": 0, "AP": 0, "SPLIT": splits}
        return start(kernels.FP8_GEMV, language, inputs, {"y": ("bfloat16", out_rows * n)}, template,
                     n // (256 // c * t), workdir)

    whole, pair = launch(0, tmp_path / "whole"), launch(split, tmp_path / "pair")
    whole, pair = whole()["y"].reshape(out_rows, n), pair()["y"]
    first, second = pair[: out_rows * split].reshape(out_rows, split), pair[out_rows * split:].reshape(out_rows, -1)
    assert np.array_equal(first, whole[:, :split]) and np.array_equal(second, whole[:, split:])
    assert np.all(whole[rows:] == 0) and not np.all(whole[:rows] == 0)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, out_rows, qx, sw, ap", [
    (1, 8, 1, 0, 0),    # a decode step's wq_b: one computed row of a padded forward, x quantised in the kernel
    (1, 8, 1, 1, 0),    # the shared expert's gate and up projection with its SwiGLU
    (6, 8, 0, 0, 6),    # a verify forward's shared-expert down projection, the routed experts' parts added
    (6, 8, 1, 0, 0),    # a verify forward's wo_b: x quantised in the kernel (up to 8 rows)
    (9, 16, 0, 1, 0),   # past 8 rows: two column groups (NH 2)
    (16, 16, 0, 0, 0),
])
def test_fp8_mma_runs_its_spec_on_the_host(language, rows, out_rows, qx, sw, ap, tmp_path):
    """fp8_gemv's large matrices on the matrix unit (fp8_mma), the one-row path included."""
    _fp8_gemm_on_the_host(kernels.FP8_MMA, language, rows, out_rows, qx, sw, ap,
                          {"NH": LAYOUT.mma_column_groups(rows), "QX": qx, "SW": sw, "AP": ap, "ONE": int(rows == 1),
                           "U": LAYOUT.mma_loads_ahead(512, rows), "TR": 32}, 64 // 32, tmp_path)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, out_rows, qx, sw, ap", [
    (1, 8, 1, 1, 0),    # the shared expert's gate and up projection with its SwiGLU, one row
    (1, 8, 1, 0, 0),
    (6, 8, 0, 0, 6),    # the routed experts' parts added
    (9, 16, 0, 1, 0),   # two column groups (NH 2)
])
def test_fp8_mma_tiles_of_16_rows_give_the_same_bits(language, rows, out_rows, qx, sw, ap, tmp_path):
    """fp8_mma's tiles of 16 weight rows (TR 16, Layout.mma_tile_rows: twice the threadgroups)
    give every output the bits of 32-row tiles: the same products summed in the same order
    (the padding rows zeros both ways), and so the spec's values."""
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.benchmarks.harness import random_scales, random_words

    mx.random.seed(70 + rows + sw)
    n, k = 64, 512
    w, s = random_words((n, k // 4)), random_scales((n, k // 32))
    x = mx.random.normal((out_rows, k)).astype(mx.bfloat16)
    x = x if qx else fp8_fake_quant_reference(x).astype(mx.bfloat16)
    n_out = n // 2 if sw else n
    parts = (mx.random.normal((rows, ap, n_out)) * 0.5).astype(mx.bfloat16) if ap else None
    inputs = {"x": ("bfloat16", _bf16_bits(x)), "w": ("uint32", np.array(w)), "scales": ("uint8", np.array(s)),
              "sizes": ("int32", np.array([rows, n, k, 1, out_rows])), "swiglu": ("float32", np.array([7.0])),
              "parts": ("bfloat16", _bf16_bits(parts) if ap else np.zeros(1, np.uint16))}
    launches = {}
    for tr in (32, 16):
        (tmp_path / str(tr)).mkdir()
        template = {"NH": LAYOUT.mma_column_groups(rows), "QX": qx, "SW": sw, "AP": ap, "ONE": int(rows == 1),
                    "U": LAYOUT.mma_loads_ahead(k, rows), "TR": tr}
        launches[tr] = start(kernels.FP8_MMA, language, inputs, {"y": ("bfloat16", out_rows * n_out)}, template,
                             n // tr, tmp_path / str(tr))
    got = {tr: launch()["y"] for tr, launch in launches.items()}
    assert np.array_equal(got[16], got[32])
    want = kernels.fp8_gemv_reference(x, w, s, quantize_input=bool(qx), real_rows=rows,
                                      swiglu=kernels.SwiGLU(7.0) if sw else None, parts=parts)
    _assert_within_rounding(got[16], want)
    assert np.all(got[16].reshape(out_rows, n_out)[rows:] == 0) and not np.all(got[16] == 0)



@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, out_rows, qx, ap", [
    (1, 8, 1, 0),   # a decode step's wo_b: one computed row of a padded forward, x quantised in the kernel
    (6, 8, 0, 6),   # a verify forward's shared-expert down projection, the routed experts' parts added
    (9, 16, 0, 0),  # past 8 rows: two column groups (NH 2)
])
def test_fp8_mma_into_the_stream_runs_its_spec_on_the_host(language, rows, out_rows, qx, ap, tmp_path):
    """fp8_mma_hc (kernels.fp8_into_stream): fp8_mma's output y put into the stream in the same
    launch. The new stream h is model._hc_post of fp8_mma's own y (run beside it on the same
    inputs) within a bfloat16 step, every row (the padding's y zeros); each row's mix parts, its
    tiles' sums, add up to h's projection by fn and its sum of squares (within a float32 sum's
    bound, against float64)."""
    from dsv41_mlx.models.hyper import _hc_post
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.benchmarks.harness import random_scales, random_words
    from scripts.kernel_checks.harness import bf16_step_problem

    mx.random.seed(40 + rows)
    n, k, hc = 64, 512, 4
    m = (2 + hc) * hc
    w, s = random_words((n, k // 4)), random_scales((n, k // 32))
    x = mx.random.normal((out_rows, k)).astype(mx.bfloat16)
    x = x if qx else fp8_fake_quant_reference(x).astype(mx.bfloat16)
    parts = (mx.random.normal((rows, ap, n)) * 0.5).astype(mx.bfloat16) if ap else None
    residual = mx.random.normal((out_rows, hc, n)).astype(mx.bfloat16)
    post, comb = mx.random.uniform(0, 2, (out_rows, hc)), mx.softmax(mx.random.normal((out_rows, hc, hc)), axis=-1)
    fn = mx.random.normal((m, hc * n)) * 0.1
    common = {"x": ("bfloat16", _bf16_bits(x)), "w": ("uint32", np.array(w)), "scales": ("uint8", np.array(s)),
              "sizes": ("int32", np.array([rows, n, k, 1, out_rows])),
              "parts": ("bfloat16", _bf16_bits(parts) if ap else np.zeros(1, np.uint16))}
    template = {"NH": LAYOUT.mma_column_groups(rows), "QX": qx, "AP": ap, "ONE": int(rows == 1),
                "U": LAYOUT.mma_loads_ahead(k, rows), "TR": 32}
    (tmp_path / "y").mkdir()
    y = start(kernels.FP8_MMA, language, {**common, "swiglu": ("float32", np.array([0.0]))},
              {"y": ("bfloat16", out_rows * n)}, {**template, "SW": 0}, n // 32, tmp_path / "y")
    got = start(kernels.FP8_MMA_HC, language, {
        **common, "residual": ("bfloat16", _bf16_bits(residual)), "post": ("float32", np.array(post)),
        "comb": ("float32", np.array(comb)), "fn": ("float32", np.array(fn))},
        {"h": ("bfloat16", out_rows * hc * n), "mix_parts": ("float32", out_rows * n // 32 * (m + 1))},
        {**template, "HC": hc}, n // 32, tmp_path)
    y, got = y()["y"], got()
    y = mx.array(_floats(y).reshape(out_rows, n)).astype(mx.bfloat16)
    h = mx.array(_floats(got["h"]).reshape(out_rows, hc, n)).astype(mx.bfloat16)
    assert bf16_step_problem(h, _hc_post(y, residual, post, comb)) is None
    flat = np.array(h.astype(mx.float32), np.float64).reshape(out_rows, hc * n)
    sums = got["mix_parts"].reshape(out_rows, n // 32, m + 1).astype(np.float64).sum(axis=1)
    f = np.array(fn, np.float64)
    exact = np.concatenate([flat @ f.T, (flat * flat).sum(axis=1, keepdims=True)], axis=1)
    size = np.concatenate([np.abs(flat) @ np.abs(f).T, (flat * flat).sum(axis=1, keepdims=True)], axis=1)
    assert np.all(np.abs(sums - exact) <= hc * n * 2.0 ** -24 * size)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("chunks", [2, 16, 20])
def test_hc_input_completes_its_parts_on_the_host(language, chunks, tmp_path):
    """hc_input's second launch (kernels.hc_input_from_parts) from parts of any chunk count:
    hc_mix's 16, fp8_mma_hc's one a tile (2 here), and a count that leaves some simdgroups
    fewer chunks. x within a bfloat16 step of the collapse's RMSNorm, xq act_quant's bits of
    x, and the mixes those hc_split makes of the parts' totals (float64 here), within 2e-5;
    the padding of the last row (rows past `rows`) untouched."""
    from dsv41_mlx.kernels import hc_split_reference, rms_norm_reference
    from dsv41_mlx.models.hyper import hc_pre
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.kernel_checks.harness import bf16_step_problem

    rng = np.random.default_rng(chunks)
    S, hc, d, iters = 3, 4, 64, 20
    m = (2 + hc) * hc
    h = mx.array(rng.standard_normal((S, hc, d)).astype(np.float32)).astype(mx.bfloat16)
    parts = rng.normal(0, 1, (S, chunks, m + 1)).astype(np.float32)
    parts[:, :, m] = rng.uniform(0, 40, (S, chunks))  # each chunk's sum of squares
    pre_in = rng.uniform(0, 1, (S, hc)).astype(np.float32)
    scale, base = np.array([0.5, 0.7, 0.9], np.float32), rng.normal(0, 0.5, m).astype(np.float32)
    norm_w, params = rng.uniform(0.5, 1.5, d).astype(np.float32), np.array([1e-6, 1e-6, 1e-6], np.float32)
    got = run(kernels.HC_INPUT, language, {
        "h": ("bfloat16", _bf16_bits(h)), "pre_in": ("float32", pre_in), "parts": ("float32", parts),
        "scale": ("float32", scale), "base": ("float32", base), "norm_w": ("float32", norm_w),
        "params": ("float32", params), "rows": ("int32", np.array([S]))},
        {"x": ("bfloat16", S * d), "xq": ("bfloat16", S * d), "pre": ("float32", S * hc),
         "post": ("float32", S * hc), "comb": ("float32", S * hc * hc)},
        {"D": d, "HC": hc, "ITERS": iters, "O": "bfloat16", "CH": chunks}, S, tmp_path)
    x = mx.array(_floats(got["x"]).reshape(S, d)).astype(mx.bfloat16)
    assert bf16_step_problem(x, rms_norm_reference(hc_pre(h, mx.array(pre_in)), mx.array(norm_w), 1e-6)) is None
    assert np.array_equal(got["xq"], _bf16_bits(fp8_fake_quant_reference(x).astype(mx.bfloat16)))
    totals = parts.astype(np.float64).sum(axis=1)
    mixes = totals[:, :m] / np.sqrt(totals[:, m:] / (hc * d) + 1e-6)
    want = hc_split_reference(mx.array(mixes.astype(np.float32)), mx.array(scale), mx.array(base), hc, iters, 1e-6)
    for name, w in zip(("pre", "post", "comb"), want):
        assert np.abs(got[name] - np.array(w).reshape(-1)).max() <= 2e-5, name

def _head_start(language, x, w, rows, workdir):
    """head_logits started on the host: x [S, D] and w [V, D] bf16; its run gives fp32 logits [S, V]."""
    workdir.mkdir()
    (S, D), V = x.shape, w.shape[0]
    launch = start(kernels.HEAD_LOGITS, language, {
        "x": ("bfloat16", _bf16_bits(x)), "w": ("bfloat16", _bf16_bits(w)), "sizes": ("int32", np.array([rows, V, D, S]))},
        {"y": ("float32", S * V)}, {"R": LAYOUT.head_row_bound(rows)}, V // 32, workdir)
    return lambda: launch()["y"].reshape(S, V)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows, out_rows", [(1, 1), (6, 8), (16, 16)])
def test_head_logits_runs_its_spec_on_the_host(language, rows, out_rows, tmp_path):
    """The model's head from its bf16 weight (the vocabulary's logits in fp32): each logit within
    the bound of a float32 sum of the exact products in any order (against float64 here), a
    padded forward's padding rows zeros, and row 0 alone the same bits as among the others."""
    mx.random.seed(rows)
    V, D = 64, 768  # 3 steps a lane: the last pair of steps half past the end
    x = mx.random.normal((out_rows, D)).astype(mx.bfloat16)
    w = (mx.random.normal((V, D)) * 0.05).astype(mx.bfloat16)
    batch = _head_start(language, x, w, rows, tmp_path / "batch")
    alone = _head_start(language, x[:1], w, 1, tmp_path / "alone") if rows > 1 else None
    got = batch()
    xs, ws = np.array(x.astype(mx.float32), np.float64), np.array(w.astype(mx.float32), np.float64)
    exact, size = xs[:rows] @ ws.T, np.abs(xs[:rows]) @ np.abs(ws).T
    assert np.all(np.abs(got[:rows] - exact) <= D * 2.0 ** -24 * size)
    assert not np.any(got[rows:])
    if rows > 1:
        assert np.array_equal(alone()[0].view(np.uint32), got[0].view(np.uint32))


def _gate_scores_start(language, x, w, temp, rb, workdir):
    """moe_gate_scores started on the host with RB = rb: x [S, D] bf16, w [E, D] fp32; its run
    gives scores [S, E]."""
    workdir.mkdir()
    (S, D), E = x.shape, w.shape[0]
    launch = start(kernels.MOE_GATE_SCORES, language, {
        "x": ("bfloat16", _bf16_bits(x)), "w": ("float32", np.array(w).reshape(-1)),
        "params": ("float32", np.array([temp])), "sizes": ("int32", np.array([S, E, D]))},
        {"scores": ("float32", S * E)}, {"T": "bfloat16", "RB": rb, "D": D}, E, workdir)
    return lambda: launch()["scores"].reshape(S, E)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("rows", [1, 6, 9])
def test_moe_gate_scores_runs_its_spec_on_the_host(language, rows, tmp_path):
    """The router's scores at Layout.gate_row_bound's RB: sqrt(softplus(x . w / temp)) with the
    dot within the bound of a float32 sum of exact products (against float64), and a row the
    same bits when it is summed alone (RB 1, a decode step) as among others (RB 8 or 16)."""
    rng = np.random.default_rng(rows)
    E, D, temp = 7, 600, 1.5  # D: three features a thread, the last pass partly past the end
    x = mx.array(rng.standard_normal((rows, D)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array((rng.standard_normal((E, D)) * 0.05).astype(np.float32))
    rb = LAYOUT.gate_row_bound(rows)
    batch = _gate_scores_start(language, x, w, temp, rb, tmp_path / "batch")
    alone = _gate_scores_start(language, x[:1], w, temp, LAYOUT.gate_row_bound(1), tmp_path / "alone")
    got = batch()
    xs, ws = np.array(x.astype(mx.float32), np.float64), np.array(w, np.float64)
    dots, size = xs @ ws.T, np.abs(xs) @ np.abs(ws).T
    # the score's inverse: softplus^-1(s^2) = log(expm1(s^2)), the dot over temp (all under 20 here)
    assert np.all(np.abs(dots / temp) < 20)
    back = np.log(np.expm1(got.astype(np.float64) ** 2)) * temp
    assert np.all(np.abs(back - dots) <= D * 2.0 ** -24 * size + 1e-5 * np.maximum(1.0, np.abs(dots)))
    assert LAYOUT.gate_row_bound(1) == 1 and (rows == 1 or rb > 1)
    assert np.array_equal(alone()[0].view(np.uint32), got[0].view(np.uint32))


@pytest.mark.parametrize("language", ["metal", "cuda"])
def test_rms_norm_pair_gives_two_rms_norms_bits_on_the_host(language, tmp_path):
    """rms_norm_pair (q_norm and the rotated kv_norm in one launch) on the host: each output the
    bits of rms_norm's kernel run on that input alone (quantised; the second rotated), also
    with both inputs in one array (x2's rows from an offset into it), the
    shared row code (rms_norm_row) reached through both bodies; and rms_norm's rotated,
    quantised rows against the spec: model.rotate of the spec's norm, then act_quant."""
    from dsv41_mlx.models.layers import rotate
    from dsv41_mlx.quant import fp8_fake_quant_reference

    rng = np.random.default_rng(3)
    S, D, D2, R = 3, 64, 32, 16
    x = mx.array(rng.normal(0, 3, (S, D)).astype(np.float32)).astype(mx.bfloat16)
    x2 = mx.array(rng.normal(0, 3, (S, D2)).astype(np.float32)).astype(mx.bfloat16)
    w, w2 = (mx.array(rng.normal(1, 0.3, n).astype(np.float32)) for n in (D, D2))
    angles = rng.uniform(0, 6.3, (S, R // 2)).astype(np.float32)
    cos = np.ones((S, D2), np.float32)
    sin = np.zeros((S, D2), np.float32)
    cos[:, D2 - R:] = np.repeat(np.cos(angles), 2, axis=1)
    sin[:, D2 - R::2], sin[:, D2 - R + 1::2] = -np.sin(angles), np.sin(angles)  # the sin table carries the signs
    eps = np.array([1e-6], np.float32)

    def single_start(v, weight, rope, name):
        workdir = tmp_path / name
        workdir.mkdir()
        n = v.shape[1]
        tables = (cos, sin) if rope else (np.zeros(1, np.float32), np.zeros(1, np.float32))
        return start(kernels.RMS_NORM, language, {
            "x": ("bfloat16", _bf16_bits(v)), "w": ("float32", np.array(weight)), "eps": ("float32", eps),
            "sizes": ("int32", np.array([S, n])), "rope_cos": ("float32", tables[0]), "rope_sin": ("float32", tables[1])},
            {"y": ("bfloat16", S * n)}, {"T": "bfloat16", "O": "bfloat16", "QUANT": 1, "ROPE": rope}, S, workdir)

    def pair_start(x_bits, x2_bits, start2, name):  # rms_norm_pair, x2's rows from element start2 of x2
        workdir = tmp_path / name
        workdir.mkdir()
        return start(kernels.RMS_NORM_PAIR, language, {
            "x": ("bfloat16", x_bits), "w": ("float32", np.array(w)), "x2": ("bfloat16", x2_bits),
            "w2": ("float32", np.array(w2)), "eps": ("float32", eps), "sizes": ("int32", np.array([S, D, D2, start2])),
            "rope_cos": ("float32", cos), "rope_sin": ("float32", sin)},
            {"y": ("bfloat16", S * D), "y2": ("bfloat16", S * D2)},
            {"T": "bfloat16", "O": "bfloat16", "O2": "bfloat16", "QUANT": 1, "ROPE": R}, 2 * S, workdir)

    # halves: both inputs in one array, x2's rows after x's (fp8_gemv_pair's output; kernels.rms_norm_halves)
    both = np.concatenate([_bf16_bits(x), _bf16_bits(x2)])
    launches = (single_start(x, w, 0, "q"), single_start(x2, w2, R, "kv"),
                pair_start(_bf16_bits(x), _bf16_bits(x2), 0, "pair"), pair_start(both, both, S * D, "halves"))
    q, kv, pair, halves = (launch() for launch in launches)
    q, kv = q["y"], kv["y"]
    assert np.array_equal(pair["y"], q) and np.array_equal(pair["y2"], kv)
    assert np.array_equal(halves["y"], q) and np.array_equal(halves["y2"], kv)
    normed = kernels.rms_norm_reference(x2, w2, 1e-6)
    pairs = (S, D2 // 2, 2)
    rotated = rotate(normed, mx.array(cos).reshape(pairs), mx.array(sin).reshape(pairs),
                     mx.array(np.arange(D2) >= D2 - R).reshape(pairs[1:]))
    want = _bf16_bits(fp8_fake_quant_reference(rotated))
    assert np.mean(kv == want) > 0.9 and np.count_nonzero(kv) > 0.5 * kv.size


def test_rows_gate_takes_a_release_and_reports_giving_up(tmp_path):
    """rows_gate (CUDA only) passes a release the host made (flag[0] != flag[1]), takes it
    (flag[1] = flag[0]) and copies the rows; with none to take it gives up after SPINS reads,
    counts that in flag[2] and says so (and copies the rows all the same)."""
    rows = np.random.default_rng(5).integers(0, 256, 600).astype(np.uint8)
    for flag, spins, status, after in [([7, 6, 0], 1 << 24, [0, 7], [7, 7, 0]), ([7, 7, 2], 64, [1, 7], [7, 7, 3])]:
        got = run(kernels.ROWS_GATE, "cuda", {"flag": ("uint32", np.array(flag)), "rows": ("uint8", rows)},
                  {"status": ("uint32", 2), "out": ("uint8", rows.size)}, {"SPINS": spins, "N": rows.size}, 1,
                  tmp_path, read_back=("flag",))
        assert got["status"].tolist() == status and got["flag"].tolist() == after
        assert np.array_equal(got["out"], rows)


def _emulated(language: str, workdir) -> Callable:
    """A kernel builder for kernels.dispatching that runs each launch's body on the host
    (kernel_emulation.run): its inputs as the wrapper hands them, its outputs back as MLX
    arrays of the shapes asked, each launch in a folder of its own under workdir."""
    names = {mx.bfloat16: "bfloat16", mx.float32: "float32", mx.uint32: "uint32", mx.uint16: "uint16",
             mx.uint8: "uint8", mx.int32: "int32"}
    count = itertools.count()

    def build(spec, impl):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
            assert threadgroup == (256, 1, 1) and init_value is None  # (what the emulation runs)
            folder = workdir / f"{spec.name}-{next(count)}"
            folder.mkdir()
            arrays = {n: (names[a.dtype], np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))
                      for n, a in zip(spec.inputs, inputs)}
            constants = {k: names[v] if isinstance(v, mx.Dtype) else int(v) for k, v in template}
            outputs = {n: (names[d], math.prod(shape))
                       for n, shape, d in zip(spec.outputs, output_shapes, output_dtypes)}
            got = run(spec, language, arrays, outputs, constants, grid[0] // 256, folder)
            return [(mx.array(got[n]).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(got[n])).reshape(shape)
                    for n, shape, d in zip(spec.outputs, output_shapes, output_dtypes)]

        return launch

    return build


@pytest.mark.parametrize("language", ["metal", "cuda"])
def test_the_gemm_wrappers_give_the_same_bits_under_another_launch_layout(language, tmp_path):
    """kernels.fp8_gemv on the matrix unit and kernels.fp4_experts, their launches run on the
    host (kernels.dispatching), give every output the same bits under the package's Layout and
    under one of other tile rows, blocks loaded ahead and x preparation: a decode step's one
    computed row and a verify forward's six, of a padded forward of 8."""
    from dsv41_mlx.kernels import tuning
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.benchmarks.harness import random_scales, random_words

    mx.random.seed(90)
    w, s = random_words((N, K // 4)), random_scales((N, K // 32))
    x = mx.random.normal((8, K)).astype(mx.bfloat16)
    codes, scales, ids, xe, _ = _inputs(8, False, quantise_first=True, seed=91)
    experts = (mx.array(codes), mx.array(scales), mx.array(ids))
    package = replace(tuning.current(), mma_min_outputs=N)  # (N outputs: the matrix unit under both)
    other = replace(package, mma_tile_rows=lambda n, k: 16, mma_loads_ahead=lambda k, rows: 4,
                    experts_loads_ahead=lambda rows, k: 3, experts_prepare_x=lambda rows: rows == 1)
    got = []
    with kernels.dispatching(language, _emulated(language, tmp_path)):
        for layout in (package, other):
            with tuning.using(layout):
                got.append([kernels.fp8_gemv(x, w, s, quantize_input=True, real_rows=rows) for rows in (1, 6)]
                           + [kernels.fp4_experts(xe, *experts, rows=rows) for rows in (1, 6)])
    want = [kernels.fp8_gemv_reference(fp8_fake_quant_reference(x), w, s, real_rows=rows) for rows in (1, 6)]
    want += [kernels.fp4_experts_reference(xe, *experts, rows=rows) for rows in (1, 6)]
    for a, b, spec in zip(*got, want):
        assert mx.array_equal(a, b).item()
        _assert_within_rounding(np.array(a.view(mx.uint16)).reshape(-1), spec)


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("picks", [6, 0])
def test_sparse_attention_runs_its_spec_on_the_host(language, picks, tmp_path):
    """sparse_attention (a decode or verify forward's attention, each row over its own window and
    picks) on the host against its spec: q rotated, attention.sparse_attention over each row's
    gathered keys, the output rotated back (scripts/kernel_checks/sparse_attention.py). Masked
    window slots and picks, a row that sees no window key, a row that sees no key at all (zeros)
    and a padding row (zeros); within the tolerances check_kernels.py holds the GPU to."""
    from dsv41_mlx.models.layers import Rope
    from scripts.kernel_checks.sparse_attention import off_by, sparse_attention_spec

    rng = np.random.default_rng(11 + picks)
    S, H, G, D, W, R, T, RD, real = 4, 4, 2, 64, 8, 12, 20, 16, 3  # the last row: padding
    q, ring, kv = (mx.array(rng.normal(0, 1, shape).astype(np.float32)).astype(mx.bfloat16)
                   for shape in ((S, H, D), (R, D), (T, D)))
    sink = mx.array(rng.normal(0, 1, H).astype(np.float32))
    index = rng.integers(0, R, (S, W)).astype(np.int32)
    wmask = rng.random((S, W)) < 0.8
    ids = rng.integers(0, T, (S, picks)).astype(np.uint32)
    pmask = rng.random((S, picks)) < 0.7
    wmask[1] = False  # sees picks only (or, without picks, nothing)
    wmask[2], pmask[2] = False, False  # sees no key at all
    rope = Rope(RD, 10000.0).tables(mx.array(rng.integers(0, 1000, S).astype(np.int32)), D)
    scale = D ** -0.5
    placeholder = {"kv": ("bfloat16", np.zeros(1, np.uint16)), "ids": ("uint32", np.zeros(1, np.uint32)),
                   "pmask": ("bool", np.zeros(1, np.bool_))}
    got = run(kernels.SPARSE_ATTENTION, language, {
        "q": ("bfloat16", _bf16_bits(q)), "ring": ("bfloat16", _bf16_bits(ring)), "index": ("int32", index),
        "wmask": ("bool", wmask), **({"kv": ("bfloat16", _bf16_bits(kv)), "ids": ("uint32", ids),
                                      "pmask": ("bool", pmask)} if picks else placeholder),
        "sink": ("float32", np.array(sink)), "rope_cos": ("float32", np.array(rope[0])),
        "rope_sin": ("float32", np.array(rope[1])), "params": ("float32", np.array([scale], np.float32)),
        "rows": ("int32", np.array([real], np.int32))},
        {"out": ("bfloat16", S * H * D)}, {"D": D, "H": H, "G": G, "W": W, "K": picks, "RD": RD, "WARPS": 8},
        S * (H // G), tmp_path)["out"]
    want = sparse_attention_spec(q, ring, mx.array(index), mx.array(wmask), kv if picks else None,
                                 mx.array(ids) if picks else None, mx.array(pmask) if picks else None,
                                 sink, scale, rope, RD, real)
    got, want = _floats(got).reshape(S, H, D), np.array(want.astype(mx.float32))
    zeros = ~(wmask.any(axis=1) | pmask.any(axis=1)) | (np.arange(S) >= real)  # no key seen, or padding
    assert zeros.tolist() == [False, not picks, True, True]
    assert not got[zeros].any() and not want[zeros].any()
    assert all(np.abs(want[r]).max() > 0 for r in np.flatnonzero(~zeros))
    assert off_by(got, want) is None


@pytest.mark.parametrize("language", ["metal", "cuda"])
@pytest.mark.parametrize("noisy", [False, True], ids=["greedy", "temperature and noise"])
def test_markov_drafts_picks_its_specs_drafts_on_the_host(language, noisy, tmp_path):
    """The Markov pass over a block (5 positions, 64 candidates each, rank 16): each position's
    draft and the embeddings exactly the spec's, the candidates' logits within float32 rounding
    (the R products summed in another order); with a temperature and noise, the picks move
    where they say."""
    B, C, V, R, anchor, temperature = 5, 64, 600, 16, 77, 0.7
    rng = np.random.default_rng(11 + noisy)
    base = mx.array(rng.standard_normal((B, C)).astype(np.float32) * 3)
    candidates = mx.array(np.stack([rng.choice(V, C, replace=False) for _ in range(B)]).astype(np.int32))
    head, embed = (mx.array(rng.standard_normal((V, R)).astype(np.float32)).astype(mx.bfloat16) for _ in range(2))
    noise = mx.array(rng.gumbel(size=(B, C)).astype(np.float32)) if noisy else None
    want = kernels.markov_drafts_reference(base, candidates, head, embed, anchor, temperature if noisy else 1.0, noise)
    got = run(kernels.MARKOV_DRAFTS, language, {
        "base": ("float32", np.array(base)), "cand": ("int32", np.array(candidates)),
        "head": ("uint16", _bf16_bits(head)), "embed": ("uint16", _bf16_bits(embed)),
        "anchor": ("int32", np.array([anchor])), "temp": ("float32", np.array([temperature if noisy else 1.0])),
        "noise": ("float32", np.array(noise) if noisy else np.zeros(1))},
        {"drafts": ("int32", B), "logits": ("float32", B * C), "embeds": ("uint16", B * R)},
        {"B": B, "C": C, "R": R, "NOISE": int(noisy)}, 1, tmp_path)
    assert got["drafts"].tolist() == want[0].tolist()
    assert np.allclose(got["logits"], np.array(want[1]).reshape(-1), rtol=1e-5, atol=1e-5)
    assert np.array_equal(got["embeds"], _bf16_bits(want[2]))
    assert np.array_equal(got["embeds"][:R], _bf16_bits(embed[anchor]))  # e_0: the anchor's
    greedy = [int(np.array(candidates)[k, np.argmax(np.array(want[1])[k])]) for k in range(B)]
    assert (got["drafts"].tolist() != greedy) == noisy  # the noise moved a pick (at these seeds)
