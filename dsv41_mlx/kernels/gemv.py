"""The dense FP8 GEMMs of a decode or verify step, each weight byte read once for all rows:
fp8_gemv (the scalar kernel, or fp8_mma on the matrix unit for large matrices), two stacked
matrices in one launch (fp8_gemv_pair), and a sub-layer's last GEMM with its output put into
the hyper-connection stream (fp8_into_stream); their SwiGLU and added parts as epilogues."""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

from . import tuning
from .build import (DECODE_MAX_ROWS, KernelSpec, any_shape, backend, compiled, computed_rows, constant, float32s,
                    int32s)
from .hyper import hc_input_fits
from .specs import SwiGLU

FP8_GEMV = KernelSpec("fp8_gemv", ("x", "w", "scales", "sizes", "swiglu", "parts"), ("y",), "fp8_gemv.metal",
                      "fp8_gemv.cu", twin_headers=("fp8_lane", "bf16_lane", "gemv_lane"))
FP8_MMA = KernelSpec("fp8_mma", ("x", "w", "scales", "sizes", "swiglu", "parts", "after"), ("y",), "fp8_mma.metal",
                     "fp8_mma.cu", twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x"), end="fp8_mma_y")
# fp8_mma whose output goes straight into the hyper-connection stream (fp8_mma_hc.metal)
FP8_MMA_HC = KernelSpec("fp8_mma_hc", ("x", "w", "scales", "sizes", "parts", "residual", "post", "comb", "fn"),
                        ("h", "mix_parts"), "fp8_mma.metal", "fp8_mma.cu",
                        twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x", "hc_expand"), end="fp8_mma_hc")
# The matrix-unit kernels (fp8_mma, fp4_experts) stage a tile's weight scales, K bytes, in a
# fixed threadgroup buffer (mma_x.cuh's mma_tile_scales, which holds the same MMA_MAX_K): K at
# most this (the release's largest is wo_b's 8192)
MMA_MAX_K = 8192


def swiglu_arguments(act: SwiGLU | None, pairs: tuple[int, int] = (0, 0)) -> tuple[int, mx.array, mx.array]:
    """A GEMV kernel's SW and its swiglu and weights inputs: SW 0 without a SwiGLU (neither
    read), 1 with [limit], 2 with [limit] and the pairs' weights (fp4_experts: one for each
    of its ids' pairs [R, k], passed as they are: the kernel reads pair (r, j)'s at r * k + j)."""
    unread = float32s(0.0)
    if act is None:
        return 0, unread, unread
    if act.weights is None:
        return 1, float32s(float(act.limit)), unread
    weights = act.weights
    if weights.size != math.prod(pairs) or (weights.ndim == 2 and weights.shape[1] != pairs[1]):
        raise ValueError(f"a SwiGLU's weights are one a (row, expert) pair {pairs}, got {weights.shape}")
    return 2, float32s(float(act.limit)), weights.astype(mx.float32)


def fp8_gemv_fits(x: mx.array, w: mx.array, impl: str | None = None, groups: int = 0) -> bool:
    """Whether fp8_gemv runs for x [S, G, K] and w [G, N, K/4], or x [..., K] and one matrix
    w [N, K/4], or (groups G) x [S, ...] of G * K values a row and G matrices stacked in w
    [G * N, K/4]: a GPU, at most DECODE_MAX_ROWS rows (a decode or verify step's forward;
    prefill keeps MLX's GEMMs), N a multiple of 32 and K of 256 (every FP8 GEMM of the
    release)."""
    if groups:
        K = 4 * w.shape[-1]
        return (x.ndim >= 2 and w.ndim == 2 and w.shape[0] % groups == 0 and x.size == x.shape[0] * groups * K
                and gemv_fits(x.shape[0], w.shape[0] // groups, K, impl))
    if w.ndim == 2:
        return (x.ndim >= 1 and x.size > 0 and x.shape[-1] == 4 * w.shape[1]
                and gemv_fits(x.size // x.shape[-1], w.shape[0], x.shape[-1], impl))
    return (x.ndim == 3 and w.ndim == 3 and x.shape[1] == w.shape[0] and x.shape[2] == 4 * w.shape[2]
            and gemv_fits(x.shape[0], w.shape[1], x.shape[2], impl))


def gemv_fits(rows: int, n: int, k: int, impl: str | None) -> bool:
    """The two GEMV kernels' common terms: a GPU, at most DECODE_MAX_ROWS rows, n outputs a
    multiple of 32 and k inputs of 256 (the last two dropped where the kernels dispatched to
    take any shape: build.dispatching)."""
    return ((impl or backend()) != "mlx" and rows <= DECODE_MAX_ROWS
            and ((n % 32 == 0 and k % 256 == 0) or any_shape()))


def gemv_threads_per_output(k: int, outputs: int) -> int:
    """fp8_gemv's C: how many threads split the k inputs of an output, 32 (a simdgroup) to 256
    (a threadgroup), the fewest that leave each thread at most 10 steps of 16 inputs and give
    a matrix of `outputs` outputs at least 256 threadgroups. A forward is a chain of GEMMs,
    each waiting for the last, so a GEMM's time is its latency: more threads per output put
    more bytes in flight at once, and a matrix of few outputs (wq_a's 1280, wkv's 512) would
    otherwise keep most of a GPU's cores idle. Depends on the matrix's shape only, so each
    output's order of additions is the same in every forward (Layout.gemv_fill)."""
    fill = tuning.current().gemv_fill
    c = 32
    while c < 256 and (160 * c < k or outputs * c < fill):
        c *= 2
    return c


def fp8_gemv(x: mx.array, w: mx.array, scales: mx.array, impl: str | None = None,
             init_value: float | None = None, quantize_input: bool = False,
             real_rows: int | None = None, threads: int | None = None, swiglu: SwiGLU | None = None,
             parts: mx.array | None = None, groups: int = 0, after: mx.array | None = None) -> mx.array:
    """The FP8 GEMMs of a decode or verify step in one launch each: x [S, G, K] (FP8
    fake-quantised or bf16 values, exact in bf16) through G `mxfp8` matrices w [G, N, K/4] ->
    bf16 [S, G, N] (attention's wo_a: its groups), or x [..., K] through one matrix w [N, K/4]
    -> bf16 [..., N] (a dense GEMM, with no reshapes around it). groups G: w [G * N, K/4] holds
    the G matrices stacked and x [S, ...] G * K values a row (attention's [S, heads, head_dim]
    as it is) -> bf16 [S, G * N]: the same launch as with x [S, G, K] and w [G, N, K/4], whose
    bytes these are, without the views that would reshape them. Each weight byte is
    read once for all rows; the spec is fp8_gemv_reference (MLX's gather_qmm), equal up to the
    order of the float32 sums (scripts/check_kernels.py); only where fp8_gemv_fits.
    init_value poisons the output before the launch (for checks). quantize_input: x is a bf16
    activation the kernel FP8 fake-quantises as it reads it: the bits of quant.fp8_input
    followed by this kernel, in one launch. real_rows: only the first real_rows rows are
    computed (default all); the rest, a padded forward's padding (Runner.padded), come
    out zeros, their weight reads and sums spared. threads: the threads per output (C), for
    `bench.py gemms --threads` to compare layouts; a forward keeps the default,
    gemv_threads_per_output(K, N * G), so that a sum's order depends on the matrix's shape alone.
    swiglu: w is a SwiGLU's gate and up projections stacked (the shared expert's w13); the
    kernel writes their swiglu_pairs [..., N / 2] instead (no weights here). parts: [R, P, N]
    bf16, R the computed rows, added to the output as it is written (parts_added: a MoE's
    routed experts' outputs and the shared expert's sum, of a dense x [S, K]; P <= 16).
    after: an array the launch on the matrix unit (fp8_mma) takes as an input it never reads, so
    that it waits for it: MLX's CUDA graphs run a launch as soon as the arrays it takes are
    written, beside any other that is ready, and `after` places this one (moe.MoE: the
    shared expert's w13 beside the routed experts, not beside the router)."""
    impl = impl or backend()
    if not fp8_gemv_fits(x, w, impl, groups):
        raise ValueError(f"fp8_gemv takes x [<= {DECODE_MAX_ROWS}, G, K] and w [G, N, K/4], or x [..., K] of at most "
                         f"{DECODE_MAX_ROWS} rows and w [N, K/4], or x [S, ...] of G * K a row and w [G * N, K/4] "
                         f"(groups G), with N a multiple of 32 and K of 256 on a GPU, got {x.shape} and {w.shape} "
                         f"({groups} groups) on {impl}")
    bf16_to_quantize(x, quantize_input)
    if swiglu is not None and swiglu.weights is not None:
        raise ValueError("fp8_gemv's SwiGLU takes no weights (fp4_experts' pairs have them)")
    if groups:
        K, G = 4 * w.shape[1], groups
        S, N = x.shape[0], w.shape[0] // groups
    else:
        K, G = x.shape[-1], (w.shape[0] if w.ndim == 3 else 1)
        S, N = x.size // (G * K), w.shape[-2]
    rows = computed_rows(real_rows, S)
    sw, limit, _ = swiglu_arguments(swiglu)
    if parts is not None and (w.ndim != 2 or x.ndim != 2 or swiglu is not None):
        raise ValueError(f"fp8_gemv adds parts to a dense GEMM's x [S, K] without a SwiGLU: got parts {parts.shape} "
                         f"for x {x.shape}, w {w.shape}{' with a SwiGLU' if swiglu is not None else ''}")
    added, ap = _added_parts("fp8_gemv", parts, rows, N)
    if threads is None and rows > 0 and fp8_gemv_on_matrix_unit(N, K, G):
        layout = tuning.current()
        tr = layout.mma_tile_rows(N, K)
        (y,) = compiled(FP8_MMA, impl)(
            inputs=[x.astype(mx.bfloat16), w, scales, int32s(rows, N, K, G, S), limit, added,
                    limit if after is None else after],
            template=[("NH", layout.mma_column_groups(rows)), ("QX", int(quantize_input)), ("SW", sw), ("AP", ap),
                      ("ONE", int(rows == 1)), ("U", layout.mma_loads_ahead(K, rows)), ("TR", tr)],
            grid=(G * (N // tr) * 256, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[(*x.shape[:-1], N // 2 if sw else N)], output_dtypes=[mx.bfloat16], init_value=init_value)
        return y
    return _gemv_launch(FP8_GEMV, impl, [x.astype(mx.bfloat16), w, scales, int32s(rows, N, K, G, S), limit, added],
                        rows, G, N, x.shape[:-1], init_value, quantize_input,
                        threads or gemv_threads_per_output(K, N * G), sw, [("AP", ap), ("SPLIT", 0)],
                        (S, G * N) if groups else None)


def _added_parts(kernel: str, parts: mx.array | None, rows: int, n: int) -> tuple[mx.array, int]:
    """A dense FP8 GEMM kernel's parts input and its AP: parts [rows, P, n] as bf16 and P
    (1..16), added to the output as it is written (parts_added); without parts, a constant
    the kernel never reads and AP 0."""
    if parts is None:
        return constant(mx.bfloat16, 0.0), 0
    if parts.ndim != 3 or parts.shape[0] != rows or parts.shape[2] != n or not 0 < parts.shape[1] <= 16:
        raise ValueError(f"{kernel} adds parts [computed rows, 1..16, N]: got {parts.shape} for {rows} computed rows "
                         f"and N {n}")
    return parts.astype(mx.bfloat16), parts.shape[1]


def fp8_gemv_pair_fits(x: mx.array, w: mx.array, split: int, impl: str | None = None) -> bool:
    """Whether fp8_gemv_pair runs for x [S, K] and w [N, K/4], two matrices of `split` and
    N - split outputs stacked: fp8_gemv fits x [S, K] and each matrix alone, neither runs on
    the matrix unit, and each output's threads (C) are the same in the pair as in a launch
    of its own matrix (gemv_threads_per_output), so each is summed in the same order, with
    each matrix whole thread groups of the pair's layout."""
    if x.ndim != 2 or w.ndim != 2 or not 0 < split < w.shape[0] or not fp8_gemv_fits(x, w, impl):
        return False
    N, K = w.shape[0], x.shape[-1]
    c = gemv_threads_per_output(K, N)
    tile = 256 // c * 4  # a threadgroup's outputs at T = 4 (Layout.gemv_layout's most)
    return all(gemv_fits(x.shape[0], n, K, impl) and not fp8_gemv_on_matrix_unit(n, K)
               and gemv_threads_per_output(K, n) == c and n % tile == 0 for n in (split, N - split))


def fp8_gemv_pair(x: mx.array, w: mx.array, scales: mx.array, split: int, impl: str | None = None,
                  init_value: float | None = None, real_rows: int | None = None) -> mx.array:
    """Two dense FP8 GEMMs of one input in one launch (attention's wq_a and wkv, both fed the
    layer's quantised input): w [N, K/4] (scales [N, K/32]) the two `mxfp8` matrices stacked,
    the first `split` rows one -> both products in one bf16 array [S * N]: x [S, K] through the
    first matrix ([S, split], row by row), then through the second ([S, N - split]), each the
    bits fp8_gemv gives for its own matrix (the kernel's SPLIT writes the two apart).
    pair_halves views them as two arrays; rms_norm_halves reads them where they lie. x is fed
    as it is (no quantize_input); real_rows as fp8_gemv's. Only where fp8_gemv_pair_fits."""
    impl = impl or backend()
    if not fp8_gemv_pair_fits(x, w, split, impl):
        raise ValueError(f"fp8_gemv_pair takes x [<= {DECODE_MAX_ROWS}, K] and two stacked matrices w [N, K/4] split "
                         f"at a row that leaves each whole thread groups of fp8_gemv's layout, off the matrix unit, "
                         f"got x {x.shape}, w {w.shape}, split {split} on {impl}")
    S, K = x.shape
    N = w.shape[0]
    rows = computed_rows(real_rows, S)
    y = _gemv_launch(FP8_GEMV, impl, [x.astype(mx.bfloat16), w, scales, int32s(rows, N, K, 1, S), float32s(0.0),
                                      constant(mx.bfloat16, 0.0)],
                     rows, 1, N, (S,), init_value, False, gemv_threads_per_output(K, N), 0,
                     [("AP", 0), ("SPLIT", split)], (S * N,))
    return y


def pair_halves(both: mx.array, rows: int, split: int) -> tuple[mx.array, mx.array]:
    """fp8_gemv_pair's output as its two products: row-contiguous views [rows, split] and
    [rows, N - split]."""
    n = both.size // rows
    return both[: rows * split].reshape(rows, split), both[rows * split:].reshape(rows, n - split)


def fp8_gemv_on_matrix_unit(n: int, k: int, groups: int = 1) -> bool:
    """Whether fp8_gemv runs a GEMM of `groups` matrices of n outputs and k inputs on the
    matrix unit: a dense matrix of at least Layout.mma_min_outputs outputs and at most MMA_MAX_K
    inputs."""
    return groups == 1 and n >= tuning.current().mma_min_outputs and k <= MMA_MAX_K


class StreamOnto(NamedTuple):
    """Where a sub-layer's last GEMM puts its output y [S, N] with fp8_into_stream: the
    hyper-connection stream residual [S, hc, N] bf16 the sub-layer ran on, the sub-layer's
    mixes post [S, hc] and comb [S, hc, hc], and the next sub-layer's mix projection fn
    [(2 + hc) * hc, hc * N] float32. A tuple of arrays (a compiled method takes it as one)."""
    residual: mx.array
    post: mx.array
    comb: mx.array
    fn: mx.array


def fp8_into_stream_fits(w: mx.array, residual: mx.array, impl: str | None = None) -> bool:
    """Whether fp8_into_stream runs the dense FP8 GEMM of w [N, K/4] for the stream residual
    [S, hc, N]: hc_input fits the stream (a GPU, a decode or verify step's rows), and fp8_gemv
    runs the GEMM on the matrix unit (fp8_mma; any GEMM as wide as the stream where the kernels
    dispatched to take any shape: build.dispatching)."""
    return (w.ndim == 2 and residual.ndim == 3 and residual.shape[2] == w.shape[0] and hc_input_fits(residual, impl)
            and gemv_fits(residual.shape[0], w.shape[0], 4 * w.shape[1], impl)
            and (fp8_gemv_on_matrix_unit(w.shape[0], 4 * w.shape[1]) or any_shape()))


def fp8_into_stream(x: mx.array, w: mx.array, scales: mx.array, onto: StreamOnto, impl: str | None = None,
                    quantize_input: bool = False, real_rows: int | None = None,
                    parts: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """A sub-layer's last FP8 GEMM with its output y = fp8_gemv(x, w, scales, ..) [S, N] put into
    the hyper-connection stream in the same launch (fp8_mma_hc): -> (h, mix_parts), h [S, hc, N]
    bf16 the new stream hyper.hc_post(y, onto.residual, onto.post, onto.comb) (hc_post_mix's bits
    for the same y), mix_parts [S, N / 32, (2 + hc) * hc + 1] float32 each tile of 32 features'
    share of h's projection by onto.fn and of its sum of squares, which hc_input_from_parts
    completes into the next sub-layer's input: a launch (hc_post_mix) a sub-layer fewer, and the
    2 MB of fn read by N / 32 threadgroups instead of hyper.HC_MIX_CHUNKS. x [S, K], quantize_input,
    real_rows and parts as fp8_gemv's (a dense GEMM without a SwiGLU); every row of h, a padded
    forward's padding included (its y zeros), as hc_post_mix makes them. The spec is
    fp8_gemv_reference, hyper.hc_post and the mix projection (scripts/check_kernels.py); only
    where fp8_into_stream_fits."""
    impl = impl or backend()
    residual, post, comb, fn = onto  # (a compiled method hands a StreamOnto on as a plain tuple)
    S, hc, N = residual.shape
    if not (fp8_into_stream_fits(w, residual, impl) and x.ndim == 2 and x.shape == (S, 4 * w.shape[1])):
        raise ValueError(f"fp8_into_stream takes x [S, K], w [N, K/4] on the matrix unit and a stream [S, hc, N] that "
                         f"hc_input fits, got x {x.shape}, w {w.shape}, stream {residual.dtype} {residual.shape} "
                         f"on {impl}")
    bf16_to_quantize(x, quantize_input)
    K = x.shape[1]
    rows = computed_rows(real_rows, S)
    added, ap = _added_parts("fp8_into_stream", parts, rows, N)
    if rows == 0:
        raise ValueError("fp8_into_stream computes at least one row")
    f32, M = mx.float32, (2 + hc) * hc
    layout = tuning.current()
    h, mix_parts = compiled(FP8_MMA_HC, impl)(
        inputs=[x.astype(mx.bfloat16), w, scales, int32s(rows, N, K, 1, S), added, residual, post.astype(f32),
                comb.astype(f32), fn.astype(f32)],
        template=[("NH", layout.mma_column_groups(rows)), ("QX", int(quantize_input)), ("AP", ap),
                  ("ONE", int(rows == 1)), ("HC", hc), ("U", layout.mma_loads_ahead(K, rows)), ("TR", 32)],
        grid=(N // 32 * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, hc, N), (S, N // 32, M + 1)], output_dtypes=[mx.bfloat16, f32])
    return h, mix_parts


def quantizes_in_kernel(x: mx.array, rows: int, matrix_unit: bool = False) -> bool:
    """Whether a GEMV kernel that fits should quantise x itself: bf16 input (the kernels
    quantise no other) of at most Layout.quantize_in_kernel_rows computed rows, or
    Layout.quantize_in_mma_rows for a kernel on the matrix unit (fp8_mma, fp4_experts)."""
    layout = tuning.current()
    return x.dtype == mx.bfloat16 and rows <= (layout.quantize_in_mma_rows if matrix_unit
                                               else layout.quantize_in_kernel_rows)


def bf16_to_quantize(x: mx.array, quantize_input: bool) -> None:
    """The GEMV kernels quantise only bf16 input: a wider one would be rounded to bf16 first,
    and rounded twice it could land elsewhere than the spec's one rounding."""
    if quantize_input and x.dtype != mx.bfloat16:
        raise ValueError(f"a GEMV kernel quantises bfloat16 input only, got {x.dtype}")


def _gemv_launch(spec: KernelSpec, impl: str, inputs: list, rows: int, sets: int, n: int, lead: tuple,
                 init_value: float | None, quantize_input: bool, threads: int, sw: int, more: list,
                 shape: tuple | None = None) -> mx.array:
    """Launch fp8_gemv for `rows` computed rows (up to 16): `sets` matrices of n outputs, a
    threadgroup of 256 threads per (256 / C) * T outputs of a matrix -> bf16 [*lead, n], or
    [*lead, n / 2] with a SwiGLU (sw > 0); shape: those values in another shape (fp8_gemv_pair's
    two products, written apart, on one axis; a grouped GEMM's [S, G * N]). threads: C
    (gemv_threads_per_output, or bench's choice); (RB, T): Layout.gemv_layout(rows). more: the
    kernel's other template constants."""
    if threads not in (32, 64, 128, 256):  # a threadgroup then holds 32 to 4 outputs: N is a multiple of 32
        raise ValueError(f"a GEMV kernel takes 32, 64, 128 or 256 threads per output, got {threads}")
    rb, t = tuning.current().gemv_layout(rows)
    (y,) = compiled(spec, impl)(
        inputs=inputs,
        template=[("RB", rb), ("T", t), ("C", threads), ("QX", int(quantize_input)), ("SW", sw), *more],
        grid=(sets * n // (256 // threads * t) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[shape or (*lead, n // 2 if sw else n)], output_dtypes=[mx.bfloat16], init_value=init_value)
    return y
