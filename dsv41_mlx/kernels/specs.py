"""The pure-MLX specifications shared by the kernels and the model: what a kernel computes,
written plainly, and the weight format it reads.

FP8 here is E4M3 with power-of-two (E8M0) scales, as DeepSeek's release and reference use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

FP8_MAX = 448.0


def pow2_ceil_scale(amax: mx.array, max_value: float) -> mx.array:
    """2**ceil(log2(amax / max_value)) in float32, read off the IEEE bits.

    `amax * fp32(1/max_value)` is rounded first, as the reference kernels do; a
    zero mantissa means the product is already a power of two.
    """
    x = amax.astype(mx.float32) * mx.array(1.0 / max_value, dtype=mx.float32)
    bits = x.view(mx.int32)
    exponent = (bits >> 23) & 0xFF
    ceil_log2 = exponent - 127 + ((bits & 0x7FFFFF) != 0).astype(mx.int32)
    return ((ceil_log2 + 127) << 23).view(mx.float32)


def e4m3_round(x: mx.array) -> mx.array:
    """float32 -> nearest E4M3 value (RNE, saturating at +-448), as float32."""
    return mx.from_fp8(mx.to_fp8(x), dtype=mx.float32)


@mx.compile
def fp8_fake_quant_reference(x: mx.array, block: int = 32) -> mx.array:
    """Pure-MLX spec: E4M3 quantise-dequantise over blocks of `block` along the last axis.

    Scale per block: power of two 2**ceil(log2(amax/448)), amax floored at 1e-4
    (the reference `act_quant` with scale_fmt ue8m0). Returns x's dtype.
    """
    shape = x.shape
    g = x.astype(mx.float32).reshape(*shape[:-1], shape[-1] // block, block)
    amax = mx.maximum(mx.abs(g).max(axis=-1, keepdims=True), 1e-4)
    s = pow2_ceil_scale(amax, FP8_MAX)
    y = e4m3_round(g / s) * s
    return y.reshape(shape).astype(x.dtype)


def fp8_tiles_to_mx(codes: mx.array, tile_scales: mx.array, tile: int = 32) -> tuple[mx.array, mx.array]:
    """Release FP8 weight -> MLX `mxfp8` layout (exact).

    codes uint8 [out, in] -> uint32 [out, in/4] (four codes per word, first in
    the low byte); tile scales [ceil(out/32), in/32] -> per-row group scales
    [out, in/32], each tile scale repeated over its 32 rows.
    """
    out_dim, in_dim = codes.shape
    packed = codes.reshape(out_dim, in_dim // 4, 4).view(mx.uint32).reshape(out_dim, in_dim // 4)
    scales = mx.repeat(tile_scales, tile, axis=0)[:out_dim]
    return packed, scales


@dataclass
class Fp8Matrix:
    """A weight [N, K] in the release's FP8 format: E4M3 codes, one E8M0 scale per 32x32 tile."""

    codes: mx.array  # [N, K] uint8
    scales: mx.array  # [N/32, K/32] uint8 (E8M0 bytes: scale = 2**(byte - 127))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self) -> mx.array:
        """float32 [N, K]: each code's value times its tile's scale."""
        N, K = self.shape
        values = mx.from_fp8(self.codes, dtype=mx.float32).reshape(N // 32, 32, K // 32, 32)
        scale = ((self.scales.astype(mx.int32) << 23).view(mx.float32))[:, None, :, None]
        return (values * scale).reshape(N, K)

    def to_mxfp8(self) -> tuple[mx.array, mx.array]:
        """The same bits in MLX's `mxfp8` layout (for mx.quantized_matmul)."""
        return fp8_tiles_to_mx(self.codes, self.scales)
