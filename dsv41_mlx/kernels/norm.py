"""RMSNorm in one launch, optionally rotated and FP8 fake-quantised: rms_norm, and two norms
in one launch: rms_norm_pair, rms_norm_halves."""

from __future__ import annotations

import mlx.core as mx

from .build import KernelSpec, backend, compiled, float32s, int32s
from .specs import rms_norm_reference

RMS_NORM = KernelSpec("rms_norm_rows", ("x", "w", "eps", "sizes", "rope_cos", "rope_sin"), ("y",), "rms_norm.metal",
                      "rms_norm.cu", header_files=(), twin_headers=("fp8_lane", "rms_norm_row"))
RMS_NORM_PAIR = KernelSpec("rms_norm_pair", ("x", "w", "x2", "w2", "eps", "sizes", "rope_cos", "rope_sin"),
                           ("y", "y2"), "rms_norm_pair.metal", "rms_norm_pair.cu", header_files=(),
                           twin_headers=("fp8_lane", "rms_norm_row"))


def rms_norm_fits(x: mx.array, impl: str | None = None, quantized: bool = False, rotated: bool = False) -> bool:
    """Whether the RMSNorm kernel runs for x: a GPU, bfloat16 or float32, and for the
    quantised or rotated forms a last axis of whole FP8 blocks (32)."""
    return x.size > 0 and _norm_rows_fit(x.dtype, x.shape[-1], impl, quantized or rotated)


def _norm_rows_fit(dtype: mx.Dtype, width: int, impl: str | None, whole_blocks: bool) -> bool:
    """rms_norm_fits' terms for rows of `width` values: a GPU, bfloat16 or float32, and where
    whole_blocks (the quantised or rotated forms) whole FP8 blocks (32)."""
    return (impl or backend()) != "mlx" and dtype in (mx.bfloat16, mx.float32) and not (whole_blocks and width % 32)


def rms_norm(x: mx.array, weight: mx.array, eps: float, impl: str | None = None,
             quantize_to: mx.Dtype | None = None,
             rope: tuple[mx.array, mx.array, int] | None = None) -> mx.array:
    """RMSNorm over the last axis: on a GPU one launch (a threadgroup per row) for what the
    spec does in three operations (the casts around MLX's fp32 RMSNorm); the spec elsewhere.
    rope: (cos, sin, dims), the result's last dims features then rotated as layers.rotate does
    with layers.Rope.tables' cos and sin [rows, D] (GPU only). quantize_to: the result also FP8
    fake-quantised per 32 values and stored as this dtype, in the same launch (what
    quant.fp8_input does after the spec; GPU only). Both see rms_norm_fits."""
    impl = impl or backend()
    if not rms_norm_fits(x, impl, quantize_to is not None, rope is not None):
        if quantize_to is not None or rope is not None:
            raise ValueError(f"the quantised or rotated RMSNorm kernel takes bfloat16/float32 rows of whole "
                             f"32-blocks on a GPU, got {x.dtype} {x.shape} on {impl}")
        return rms_norm_reference(x, weight, eps)
    D = x.shape[-1]
    rows = x.size // D
    out = quantize_to or x.dtype
    cos, sin, dims = rope if rope is not None else (float32s(0.0), float32s(0.0), 0)  # placeholders: unread
    kernel = compiled(RMS_NORM, impl)
    (y,) = kernel(inputs=[x, weight.astype(mx.float32), float32s(eps), int32s(rows, D), cos, sin],
                  template=[("T", x.dtype), ("O", out), ("QUANT", int(quantize_to is not None)), ("ROPE", dims)],
                  grid=(rows * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[out])
    return y


def rms_norm_pair_fits(x: mx.array, x2: mx.array, impl: str | None = None) -> bool:
    """Whether rms_norm_pair runs for x [S, D] and x2 [S, D2]: the quantised RMSNorm kernel fits
    each (x2's rotated), both 2-D of one dtype and row count."""
    return (x.ndim == x2.ndim == 2 and x.shape[0] == x2.shape[0] and x.dtype == x2.dtype
            and rms_norm_fits(x, impl, quantized=True) and rms_norm_fits(x2, impl, quantized=True, rotated=True))


def rms_norm_pair(x: mx.array, weight: mx.array, x2: mx.array, weight2: mx.array, eps: float,
                  quantize_to: mx.Dtype, quantize_to2: mx.Dtype, rope2: tuple[mx.array, mx.array, int],
                  impl: str | None = None) -> tuple[mx.array, mx.array]:
    """Two quantised RMSNorms of one eps in one launch, the second rotated: (rms_norm(x, weight,
    eps, quantize_to=quantize_to), rms_norm(x2, weight2, eps, quantize_to=quantize_to2,
    rope=rope2)), each row the same bits (attention's q_norm and kv_norm: a decode or verify
    step's launch fewer). Only where rms_norm_pair_fits."""
    impl = impl or backend()
    if not rms_norm_pair_fits(x, x2, impl):
        raise ValueError(f"rms_norm_pair takes two bfloat16/float32 inputs [S, D] and [S, D2] of whole 32-blocks on a "
                         f"GPU, got {x.dtype} {x.shape} and {x2.dtype} {x2.shape} on {impl}")
    return _rms_norm_pair(x, weight, x2, 0, weight2, x.shape, x2.shape, eps, quantize_to, quantize_to2, rope2, impl)


def rms_norm_halves(both: mx.array, rows: int, split: int, weight: mx.array, weight2: mx.array, eps: float,
                    quantize_to: mx.Dtype, quantize_to2: mx.Dtype, rope2: tuple[mx.array, mx.array, int],
                    impl: str | None = None) -> tuple[mx.array, mx.array]:
    """rms_norm_pair of fp8_gemv_pair's two products as they lie in its output `both` (pair_halves'
    views, the same bits), read there: no views made, four operations fewer a layer than
    pair_halves and rms_norm_pair. Where fp8_gemv_pair ran, this fits."""
    impl = impl or backend()
    n = both.size // rows if rows > 0 else 0
    first, second = (rows, split), (rows, n - split)
    if not (both.ndim == 1 and both.size == rows * n and 0 < split < n
            and all(_norm_rows_fit(both.dtype, w, impl, True) for w in (split, n - split))):
        raise ValueError(f"rms_norm_halves takes fp8_gemv_pair's output of {rows} rows split at {split} on a GPU, "
                         f"got {both.dtype} {both.shape} on {impl}")
    return _rms_norm_pair(both, weight, both, rows * split, weight2, first, second, eps, quantize_to, quantize_to2,
                          rope2, impl)


def _rms_norm_pair(x, weight, x2, start2, weight2, shape, shape2, eps, quantize_to, quantize_to2, rope2, impl):
    """rms_norm_pair's launch: x2's rows from element start2 of x2 on."""
    (S, D), D2 = shape, shape2[1]
    cos, sin, dims = rope2
    y, y2 = compiled(RMS_NORM_PAIR, impl)(
        inputs=[x, weight.astype(mx.float32), x2, weight2.astype(mx.float32), float32s(eps),
                int32s(S, D, D2, start2), cos, sin],
        template=[("T", x.dtype), ("O", quantize_to), ("O2", quantize_to2), ("QUANT", 1), ("ROPE", dims)],
        grid=(2 * S * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[shape, shape2],
        output_dtypes=[quantize_to, quantize_to2])
    return y, y2
