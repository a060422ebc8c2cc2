"""The activation fake-quantisers' kernels, each bit for bit its spec: FP8 (act_quant_fp8,
for quant.fp8_fake_quant) and FP4 (fp4_quant, for quant.fp4_fake_quant)."""

from __future__ import annotations

import mlx.core as mx

from .build import KernelSpec, backend, compiled, int32s

ACT_QUANT = KernelSpec("act_quant_fp8", ("x", "n"), ("y",), "act_quant.metal", "act_quant.cu", header_files=(),
                       twin_headers=("fp8_lane",))
FP4_QUANT = KernelSpec("fp4_quant", ("x", "n"), ("y",), "fp4_quant.metal", "fp4_quant.cu", header_files=())


def act_quant_fp8(x: mx.array, impl: str, dtype: mx.Dtype | None = None) -> mx.array:
    """The kernel for quant.fp8_fake_quant (its spec) with blocks of 32: x of any shape whose
    last axis is a multiple of 32, bfloat16 or float32; the same shape back, rounded to x's
    dtype and stored as `dtype` (default x's; float32 saves a cast before an FP8 GEMM)."""
    floats = (mx.bfloat16, mx.float32)
    dtype = dtype or x.dtype
    if x.shape[-1] % 32 or x.dtype not in floats or dtype not in floats:
        raise ValueError(f"act_quant_fp8 takes bfloat16/float32 with a last axis multiple of 32, got "
                         f"{x.dtype} {x.shape} -> {dtype}")
    kernel = compiled(ACT_QUANT, impl)
    (y,) = kernel(inputs=[x, int32s(x.size)], template=[("T", x.dtype), ("O", dtype)],
                  grid=(-(-x.size // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[x.shape], output_dtypes=[dtype])
    return y


def fp4_quant_fits(x: mx.array, block: int, impl: str | None = None) -> bool:
    """Whether the FP4 kernel runs for x: a GPU, bfloat16 or float32, blocks of 16 or 32 along
    the last axis and x.size a multiple of 32 (whole SIMD groups)."""
    impl = impl or backend()
    return (impl != "mlx" and block in (16, 32) and not x.shape[-1] % block and not x.size % 32
            and x.dtype in (mx.bfloat16, mx.float32))


def fp4_quant(x: mx.array, block: int, e4m3_scale: bool, impl: str) -> mx.array:
    """The kernel for quant.fp4_fake_quant (its spec: quant.fp4_fake_quant_reference): x of any
    shape, bfloat16 or float32, x.size a multiple of 32 and the last axis of `block` (16 or 32);
    the same shape and dtype back. e4m3_scale: the scale format (E4M3 or a power of two)."""
    if not fp4_quant_fits(x, block, impl):
        raise ValueError(f"fp4_quant takes bfloat16/float32 in blocks of 16 or 32 (size a multiple of 32), "
                         f"got {x.dtype} {x.shape} in blocks of {block} on {impl}")
    (y,) = compiled(FP4_QUANT, impl)(
        inputs=[x, int32s(x.size)],
        template=[("T", x.dtype), ("BLOCK", block), ("SCALE_E4M3", int(e4m3_scale))],
        grid=(-(-x.size // 256) * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])
    return y
