"""FP8 / FP4 / E8M0 codecs.

Two families live here:

* activation fake-quantisation in MLX (`fp8_fake_quant`, `fp4_fake_quant`):
  quantise then dequantise, exactly as DeepSeek's reference kernels do before
  every FP8/FP4 GEMM and on cached KV / index keys;
* weight codecs in numpy, used to build checkpoints in the release format
  (`quantize_fp8_tiles`, `quantize_fp4_rows`) and to repack release tensors
  into MLX's `mxfp8` / `mxfp4` layouts (`fp4_rows_to_mx`; FP8's is kernels.specs.fp8_tiles_to_mx).

Release storage: FP8 E4M3 codes with one E8M0 scale (byte = exponent + 127)
per 32x32 tile; FP4 E2M1 two per byte (low nibble = even input) with one E8M0
scale per 32 inputs of a row.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import kernels
from .kernels.specs import FP8_MAX, Fp8Matrix, e4m3_round, fp8_fake_quant_reference, pow2_ceil_scale

FP4_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# Round-to-nearest-even boundaries between consecutive E2M1 magnitudes; an exact
# tie rounds up only where the upper code is even (0.75, 1.75, 3.5).
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


# ---------------------------------------------------------------- MLX (runtime)

def fp8_fake_quant(x: mx.array, block: int = 32, dtype: mx.Dtype | None = None,
                   impl: str | None = None) -> mx.array:
    """E4M3 quantise-dequantise over blocks of `block` along the last axis (see the reference),
    rounded to x's dtype and returned as `dtype` (default: x's).

    On a GPU, blocks of 32 run as one kernel launch (kernels.act_quant_fp8),
    bit for bit the pure-MLX spec, which runs everywhere else.
    """
    impl = impl or kernels.backend()
    dtype = dtype or x.dtype
    if impl == "mlx" or block != 32 or x.shape[-1] % 32 or x.dtype not in (mx.bfloat16, mx.float32):
        return fp8_fake_quant_reference(x, block).astype(dtype)
    return kernels.act_quant_fp8(x, impl, dtype)


def e2m1_round(v: mx.array) -> mx.array:
    """float32 in [-6, 6] -> nearest E2M1 value (RNE), sign of zero kept."""
    mag = mx.abs(v)[..., None]
    mids = mx.array(_E2M1_MIDS, dtype=mx.float32)
    code = (mag > mids).sum(axis=-1) + ((mag == mids) & mx.array(_E2M1_TIE_UP)).sum(axis=-1)
    values = mx.array(E2M1_VALUES)[code]
    negative = v.astype(mx.float32).view(mx.int32) < 0  # sign bit: -0.0 stays -0.0
    return mx.where(negative, -values, values)


def fp4_fake_quant(x: mx.array, block: int = 32, scale_format: str = "e8m0", impl: str | None = None) -> mx.array:
    """E2M1 quantise-dequantise over blocks of `block` along the last axis (see the spec,
    fp4_fake_quant_reference). On a GPU one kernel launch (kernels.fp4_quant), bit for bit
    the spec, which runs everywhere else."""
    impl = impl or kernels.backend()
    if scale_format not in ("e4m3", "e8m0") or not kernels.fp4_quant_fits(x, block, impl):
        return fp4_fake_quant_reference(x, block, scale_format)
    return kernels.fp4_quant(x, block, scale_format == "e4m3", impl)


@mx.compile
def fp4_fake_quant_reference(x: mx.array, block: int = 32, scale_format: str = "e8m0") -> mx.array:
    """Pure-MLX spec: E2M1 quantise-dequantise over blocks of `block` along the last axis.

    scale_format "e8m0": power-of-two scale 2**ceil(log2(amax/6)) (index keys
    and queries, block 32). "e4m3": scale = E4M3(amax/6), amax floored at
    6*2**-9 (compressed KV, block 16). Matches the reference `fp4_act_quant`.
    """
    shape = x.shape
    g = x.astype(mx.float32).reshape(*shape[:-1], shape[-1] // block, block)
    amax = mx.abs(g).max(axis=-1, keepdims=True)
    if scale_format == "e4m3":
        s = e4m3_round(mx.maximum(amax, 6 * 2.0**-9) / FP4_MAX)
    elif scale_format == "e8m0":
        s = pow2_ceil_scale(mx.maximum(amax, 6 * 2.0**-126), FP4_MAX)
    else:
        raise ValueError(f"unknown FP4 scale format {scale_format!r}")
    v = mx.clip(g / s, -FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * s).reshape(shape).astype(x.dtype)


class Fp8Linear(nn.Module):
    """Release FP8 weight (E4M3, E8M0 scale per 32x32 tile) held in MLX `mxfp8` layout.

    The input is FP8 fake-quantised per 32 values first, as the reference
    quantises every activation that enters an FP8 GEMM; the product is
    accumulated in fp32 and returned as bf16.
    """

    def __init__(self, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((out_dims, in_dims // 4), dtype=mx.uint32)
        self.scales = mx.zeros((out_dims, in_dims // 32), dtype=mx.uint8)

    # real: the rows of x that matter, the first `real` (a padded decode or verify forward's,
    # Runner.padded); on a GPU the others are not computed and come out zeros
    # parts: [real, P, out] bf16 added to the product (kernels.parts_added; fp8_linear)
    def __call__(self, x: mx.array, real: int | None = None, parts: mx.array | None = None) -> mx.array:
        return fp8_linear(x, self.weight, self.scales, real, parts)

    def into_stream(self, x: mx.array, onto: kernels.StreamOnto, real: int | None = None,
                    parts: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The product of x [S, in] (bf16, as __call__ takes it), parts added, put into the
        hyper-connection stream in the same launch (kernels.fp8_into_stream): -> (h, mix_parts).
        Only where kernels.fp8_into_stream_fits this weight and onto's stream."""
        rows = kernels.computed_rows(real, x.shape[0])
        in_kernel = kernels.quantizes_in_kernel(x, rows, matrix_unit=True)
        return kernels.fp8_into_stream(x if in_kernel else fp8_input(x), self.weight, self.scales, onto,
                                       quantize_input=in_kernel, real_rows=real, parts=parts)

    def quantized(self, xq: mx.array, real: int | None = None, swiglu: kernels.SwiGLU | None = None,
                  after: mx.array | None = None) -> mx.array:
        """The product for an input already through `fp8_input`: an activation that feeds
        several FP8 GEMMs is quantised once (on a GPU, one kernel launch fewer each).
        swiglu: this is a SwiGLU's w13 (fp8_matmul). after: as fp8_matmul's."""
        return fp8_matmul(xq, self.weight, self.scales, real, swiglu, after=after)

    # Two matrices stacked (attention's wq_a and wkv): the first `split` output rows one, the
    # rest the other. A slice of whole rows is a view of the same bytes, so each product is
    # the bits of that matrix held alone.
    def quantized_rows(self, xq: mx.array, start: int, stop: int | None = None,
                       real: int | None = None) -> mx.array:
        """`quantized` through output rows start .. stop of the weight."""
        return fp8_matmul(xq, self.weight[start:stop], self.scales[start:stop], real)

    def quantized_pair(self, xq: mx.array, split: int, real: int | None = None) -> tuple[mx.array, mx.array]:
        """Both stacked matrices' products, rows .. split and split .., in one launch where
        kernels.fp8_gemv_pair fits (a decode or verify step on a GPU), else one each."""
        if kernels.fp8_gemv_pair_fits(xq, self.weight, split):
            both = kernels.fp8_gemv_pair(xq, self.weight, self.scales, split, real_rows=real)
            return kernels.pair_halves(both, xq.shape[0], split)
        return self.quantized_rows(xq, 0, split, real), self.quantized_rows(xq, split, None, real)


def gemm_input_dtype() -> mx.Dtype:
    """What the quantised GEMMs (`mxfp8` and `mxfp4`, dense and gathered) are fed.

    Their inputs are FP8-rounded or bf16 activations, exact in bf16 and in fp32,
    and MLX's kernels accumulate in fp32 either way. On CUDA the bf16-fed ones run
    faster and give the fp32-fed result rounded to bf16 but for rare values, their
    fp32 sums taken in another order (most one bf16 ulp apart, sums that nearly
    cancel further; all within the bound of fp32 reordering, which
    scripts/check_kernels.py checks at every shape of the model). The CPU's bf16 kernels round along the way (hundreds of ulps),
    and Metal's are not yet checked on a Mac: fp32 there."""
    return mx.bfloat16 if kernels.device_backend() == "cuda" else mx.float32


def fp8_input(x: mx.array) -> mx.array:
    """x as an FP8 GEMM takes it: fake-quantised per 32 values, in `gemm_input_dtype()`."""
    return fp8_fake_quant(x, dtype=gemm_input_dtype())


def fp8_matmul(xq: mx.array, weight: mx.array, scales: mx.array, real: int | None = None,
               swiglu: kernels.SwiGLU | None = None, parts: mx.array | None = None,
               after: mx.array | None = None) -> mx.array:
    """An `fp8_input` activation times an `mxfp8` weight, bf16 out: on a GPU, a decode or
    verify step's few rows through kernels.fp8_gemv (each weight byte read once for all
    rows; real: only the first `real` rows computed, the padding's zeros), otherwise MLX's
    quantized_matmul (every row). swiglu: the weight is a SwiGLU's gate and up projections
    stacked, the output their kernels.swiglu_pairs (on a GPU, written by fp8_gemv itself).
    parts: [R, P, out] bf16 added to the first R rows (kernels.parts_added; on a GPU, by
    fp8_gemv as it writes them, where x is [S, K] and R its computed rows). after: on a GPU, an
    array the launch waits for (kernels.fp8_gemv's); MLX's own path runs in order anyway."""
    if _gemv_takes(xq, weight, kernels.computed_rows(real, xq.size // xq.shape[-1]), parts):
        return kernels.fp8_gemv(xq, weight, scales, real_rows=real, swiglu=swiglu, parts=parts, after=after)
    y = _fp8_matmul_mlx(xq, weight, scales)
    y = y if swiglu is None else kernels.swiglu_pairs(y, swiglu)
    return y if parts is None else kernels.parts_added(y, parts)


def _gemv_takes(x: mx.array, weight: mx.array, rows: int, parts: mx.array | None) -> bool:
    """Whether kernels.fp8_gemv runs this product: it fits, and parts, where given, are one
    for each of the `rows` computed rows of a dense x [S, K] (else MLX's GEMM, then
    kernels.parts_added)."""
    return kernels.fp8_gemv_fits(x, weight) and (parts is None or (x.ndim == 2 and parts.shape[0] == rows))


@mx.compile
def _fp8_matmul_mlx(xq: mx.array, weight: mx.array, scales: mx.array) -> mx.array:
    return mx.quantized_matmul(xq, weight, scales, transpose=True, mode="mxfp8").astype(mx.bfloat16)


@mx.compile
def fp8_linear(x: mx.array, weight: mx.array, scales: mx.array, real: int | None = None,
               parts: mx.array | None = None) -> mx.array:
    """Fp8Linear's product: FP8 fake-quantised x times an `mxfp8` weight, bf16 out, parts
    added as fp8_matmul adds them. On a GPU, a decode step's bf16 x (and a verify step's, for
    a matrix on the matrix unit) is quantised by kernels.fp8_gemv as it reads it: the bits of
    fp8_input then fp8_matmul, in one launch instead of two (kernels.quantizes_in_kernel)."""
    rows = kernels.computed_rows(real, x.size // x.shape[-1])
    if _gemv_takes(x, weight, rows, parts) and kernels.quantizes_in_kernel(
            x, rows, kernels.fp8_gemv_on_matrix_unit(weight.shape[0], x.shape[-1])):
        return kernels.fp8_gemv(x, weight, scales, quantize_input=True, real_rows=real, parts=parts)
    return fp8_matmul(fp8_input(x), weight, scales, real, parts=parts)


def quantize_fp8_tiles_mx(w: mx.array) -> Fp8Matrix:
    """[N, K] (N, K multiples of 32) -> the release FP8 format, built on the default device.

    Per 32x32 tile: scale 2**ceil(log2(amax/448)) with amax floored at 2**-100
    (so every scale byte is >= 1, as the kernels assume), codes E4M3 rounded to
    nearest even. Equals `quantize_fp8_tiles` bit for bit.
    """
    N, K = w.shape
    if N % 32 or K % 32:
        raise ValueError(f"FP8 tiles need both dimensions to be multiples of 32, got {w.shape}")
    tiles = w.astype(mx.float32).reshape(N // 32, 32, K // 32, 32)
    amax = mx.maximum(mx.abs(tiles).max(axis=(1, 3), keepdims=True), 2.0 ** -100)
    scale = pow2_ceil_scale(amax, FP8_MAX)
    codes = mx.to_fp8(tiles / scale).reshape(N, K)
    scale_bytes = ((scale.view(mx.int32) >> 23) & 0xFF).astype(mx.uint8).reshape(N // 32, K // 32)
    return Fp8Matrix(codes, scale_bytes)


# ------------------------------------------------------------- numpy (weights)

def e8m0_decode(codes: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 powers of two (byte 255 is NaN in the format)."""
    codes = np.asarray(codes).astype(np.int32)
    out = np.ldexp(np.float32(1.0), np.minimum(codes, 254) - 127).astype(np.float32)
    return np.where(codes == 255, np.float32(np.nan), out)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 (fn) bytes -> float32."""
    return np.array(mx.from_fp8(mx.array(codes.astype(np.uint8)), dtype=mx.float32))


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 bytes, round-to-nearest-even, saturating at +-448."""
    return np.array(mx.to_fp8(mx.array(x.astype(np.float32))))


def _pow2_scale_np(amax: np.ndarray, max_value: float) -> np.ndarray:
    x = (amax.astype(np.float32) * np.float32(1.0 / max_value)).astype(np.float32)
    bits = x.view(np.int32)
    ceil_log2 = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    return ceil_log2.astype(np.int32)  # exponent of the scale


def quantize_fp8_tiles(w: np.ndarray, tile: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (E4M3 codes uint8 [out, in], E8M0 scales uint8 [ceil(out/t), ceil(in/t)]).

    One power-of-two scale per tile (2**ceil(log2(amax/448))), codes rounded
    to nearest even: the release weight format.
    """
    out_dim, in_dim = w.shape
    to, ti = -(-out_dim // tile), -(-in_dim // tile)
    padded = np.zeros((to * tile, ti * tile), np.float32)
    padded[:out_dim, :in_dim] = w
    tiles = padded.reshape(to, tile, ti, tile)
    amax = np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-30)
    exponent = _pow2_scale_np(amax, FP8_MAX)
    scale = np.ldexp(np.float32(1.0), exponent)[:, None, :, None]
    codes = e4m3_encode(tiles / scale).reshape(to * tile, ti * tile)[:out_dim, :in_dim]
    return codes, (exponent + 127).astype(np.uint8)


def quantize_fp8_rows(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """[rows, cols] float -> (E4M3 codes uint8 [rows, cols], E8M0 scales uint8 [rows, cols/group]).

    One power-of-two scale per `group` columns of each row: the engram table format.
    """
    rows, cols = w.shape
    g = w.astype(np.float32).reshape(rows, cols // group, group)
    exponent = _pow2_scale_np(np.maximum(np.abs(g).max(-1, keepdims=True), 1e-30), FP8_MAX)
    codes = e4m3_encode(g / np.ldexp(np.float32(1.0), exponent)).reshape(rows, cols)
    return codes, (exponent[..., 0] + 127).astype(np.uint8)


def _e2m1_codes_np(v: np.ndarray) -> np.ndarray:
    mag = np.abs(v)[..., None]
    mids = np.array(_E2M1_MIDS, np.float32)
    code = (mag > mids).sum(-1) + ((mag == mids) & np.array(_E2M1_TIE_UP)).sum(-1)
    return (code | (np.signbit(v) << 3)).astype(np.uint8)


def quantize_fp4_rows(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (packed E2M1 int8 [out, in/2], E8M0 scales uint8 [out, in/32]).

    Scale per 32 inputs of a row: 2**ceil(log2(amax/6)); input 2j goes in the
    low nibble of byte j, input 2j+1 in the high nibble.
    """
    out_dim, in_dim = w.shape
    g = w.astype(np.float32).reshape(out_dim, in_dim // group, group)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 1e-30)
    exponent = _pow2_scale_np(amax, FP4_MAX)
    v = np.clip(g / np.ldexp(np.float32(1.0), exponent), -FP4_MAX, FP4_MAX)
    codes = _e2m1_codes_np(v).reshape(out_dim, in_dim)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8).view(np.int8), (exponent[..., 0] + 127).astype(np.uint8)


def fp4_decode(packed: np.ndarray) -> np.ndarray:
    """Packed E2M1 [.., in/2] (int8 or uint8) -> float32 [.., in]."""
    b = packed.view(np.uint8)
    table = np.concatenate([E2M1_VALUES, -E2M1_VALUES])
    return np.stack([table[b & 0xF], table[b >> 4]], axis=-1).reshape(*b.shape[:-1], -1)


def fp4_rows_to_mx(packed: mx.array) -> mx.array:
    """Release FP4 weight int8 [.., out, in/2] -> MLX `mxfp4` words uint32 [.., out, in/8] (exact)."""
    *lead, half_in = packed.shape
    return packed.view(mx.uint8).reshape(*lead, half_in // 4, 4).view(mx.uint32).reshape(*lead, half_in // 4)
