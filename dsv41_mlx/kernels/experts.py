"""The routed experts' FP4 GEMMs of a decode or verify step on the matrix unit: fp4_experts,
and its x prepared a block at a time: mma_x_prepared."""

from __future__ import annotations

import mlx.core as mx

from . import tuning
from .build import DECODE_MAX_ROWS, KernelSpec, backend, compiled, float32s, int32s
from .gemv import MMA_MAX_K, bf16_to_quantize, gemv_fits, swiglu_arguments
from .specs import SwiGLU

FP4_EXPERTS = KernelSpec("fp4_experts", ("x", "xs", "w", "scales", "ids", "sizes", "swiglu", "weights"), ("y",),
                         "fp4_experts.metal", "fp4_experts.cu", twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x"))
MMA_X_PREP = KernelSpec("mma_x_prep", ("x", "sizes"), ("xh", "xs"), "mma_x_prep.metal", "mma_x_prep.cu",
                        twin_headers=("fp8_lane", "bf16_lane", "gemv_lane", "mma_x"))


def fp4_experts_fits(x: mx.array, w: mx.array, ids: mx.array, impl: str | None = None,
                     rows: int | None = None) -> bool:
    """Whether fp4_experts runs: a GPU, x [R, 1 or k, K] (or [R, K], as [R, 1, K]) with R <=
    DECODE_MAX_ROWS, ids [R, k], w [E, N, K/8] with N a multiple of 32 and K of 256, at most
    MMA_MAX_K. rows: R,
    where x and ids hold more rows than are computed (their first R; default all)."""
    R = ids.shape[0] if rows is None else rows
    slots = x.shape[1] if x.ndim == 3 else 1
    return (x.ndim in (2, 3) and w.ndim == 3 and ids.ndim == 2 and 0 < R <= min(ids.shape[0], x.shape[0])
            and slots in (1, ids.shape[1]) and x.shape[-1] == 8 * w.shape[2] and x.shape[-1] <= MMA_MAX_K
            and gemv_fits(R, w.shape[1], x.shape[-1], impl))


def fp4_experts(x: mx.array, w: mx.array, scales: mx.array, ids: mx.array, impl: str | None = None,
                init_value: float | None = None, quantize_input: bool = False,
                swiglu: SwiGLU | None = None, rows: int | None = None) -> mx.array:
    """The routed experts' FP4 GEMMs of a decode or verify step in one launch: x [R, 1 or k, K]
    (FP8 fake-quantised, exact in bf16; [R, K] reads as [R, 1, K]) through each row's experts
    ids [R, k] of the `mxfp4` stack w [E, N, K/8] -> bf16 [R, k, N], each expert's weights
    read once for all the rows that picked it (MLX's gather_qmm reads them once per (row,
    expert) pair). The spec is fp4_experts_reference, equal up to the order of the float32
    sums; only where fp4_experts_fits. A row's experts must be distinct (a router's top-k
    are). init_value poisons the output before the launch (for checks); quantize_input as
    fp8_gemv's. swiglu: w is the experts' gate and up projections stacked (w13); the kernel
    writes their swiglu_pairs [R, k, N / 2], times each pair's weight where swiglu has
    weights [R, k]. rows: R, where x, ids and the weights hold more rows (a padded forward's:
    only its first R, the real ones, are computed and returned). The kernel indexes its
    inputs itself, so none of them is reshaped or sliced first: no view operations."""
    impl = impl or backend()
    if not fp4_experts_fits(x, w, ids, impl, rows):
        raise ValueError(f"fp4_experts takes x [<= {DECODE_MAX_ROWS}, 1 or k, K] (or [R, K]), ids [R, k] and w "
                         f"[E, N, K/8] with N a multiple of 32 and K of 256 on a GPU, got {x.shape}, {ids.shape} and "
                         f"{w.shape} for {rows} rows on {impl}")
    bf16_to_quantize(x, quantize_input)
    R, k = (ids.shape[0] if rows is None else rows), ids.shape[1]
    N, K = w.shape[1], x.shape[-1]
    sw, limit, weights = swiglu_arguments(swiglu, ids.shape)
    slots = x.shape[1] if x.ndim == 3 else 1
    prepared = tuning.current().experts_prepare_x(R)
    if prepared:
        x, xs = mma_x_prepared(x, R * slots, quantize_input, impl)
    else:
        x, xs = x.astype(mx.bfloat16), float32s(0.0)  # (xs unread)
    (y,) = compiled(FP4_EXPERTS, impl)(
        inputs=[x, xs, w, scales, ids.astype(mx.uint32), int32s(R, k, N, K, slots), limit, weights],
        template=fp4_experts_template(R, K, quantize_input, sw, prepared),
        grid=(R * k * (N // 32) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(R, k, N // 2 if sw else N)], output_dtypes=[mx.bfloat16], init_value=init_value)
    return y


def fp4_experts_template(rows: int, k: int, quantize_input: bool, sw: int, prepared: bool) -> list[tuple[str, int]]:
    """fp4_experts' template constants for `rows` computed rows of K = k (SW as swiglu_arguments
    gives it; prepared: x from mma_x_prep, Layout.experts_prepare_x)."""
    layout = tuning.current()
    return [("NH", layout.mma_column_groups(rows)), ("QX", int(quantize_input)), ("SW", sw), ("ONE", int(rows == 1)),
            ("U", layout.experts_loads_ahead(rows, k)), ("PX", int(prepared))]


def mma_x_prepared(x: mx.array, n: int, quantize_input: bool, impl: str) -> tuple[mx.array, mx.array]:
    """x [.., K] bf16 (its first n rows of K) -> (x / s as fp16 bits, uint16 [n, K]; s, float32
    [n, K / 32]): mma_x_prep, the B side of the matrix-unit kernels' products a block at a
    time, x FP8 fake-quantised first where quantize_input."""
    K = x.shape[-1]
    return compiled(MMA_X_PREP, impl)(
        inputs=[x.astype(mx.bfloat16), int32s(n, K)], template=[("QX", int(quantize_input))],
        grid=(n * K, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(n, K), (n, K // 32)],
        output_dtypes=[mx.uint16, mx.float32])
