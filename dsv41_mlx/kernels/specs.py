"""The kernels' pure-MLX specifications: what each kernel computes, written plainly (its
wrapper runs it where the kernel does not, and the checks hold the kernel to it), and the
weight format they read. quant.py's fake-quant wrappers take theirs from here too.

FP8 here is E4M3 with power-of-two (E8M0) scales, as DeepSeek's release and reference use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from .build import int32s

FP8_MAX = 448.0
TOP_K = 64  # candidates the drafter keeps per position


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


# ------------------------------------------------------------- rows of a forward

def padding_zeroed(y: mx.array, real_rows: int | None) -> mx.array:
    """y [rows, ...] as a kernel that computes the first real_rows rows alone gives it (a padded
    forward's: build.computed_rows): the rows from real_rows on zeros."""
    if real_rows is None:
        return y
    keep = (mx.arange(y.shape[0]) < real_rows).reshape(-1, *([1] * (y.ndim - 1)))
    return mx.where(keep, y, mx.zeros_like(y))


# -------------------------------------------------------------------- fp8_rows

def fp8_rows_reference(x: mx.array, w: Fp8Matrix) -> tuple[mx.array, mx.array]:
    """Pure-MLX spec: logits = x @ dequant(w)^T in float32, then the TOP_K best per row.

    x [R, K] -> (values [R, TOP_K] float32, best first; ids [R, TOP_K] int32)."""
    logits = x.astype(mx.float32) @ w.dequantize().T
    return top_k_best(logits, mx.broadcast_to(mx.arange(logits.shape[1], dtype=mx.int32), logits.shape))


def top_k_best(values: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
    """The TOP_K largest of values [R, n] with their ids, best first."""
    part = mx.argpartition(-values, kth=TOP_K - 1, axis=-1)[:, :TOP_K]
    vals = mx.take_along_axis(values, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(mx.take_along_axis(ids, part, axis=-1),
                                                                        order, axis=-1)


# ---------------------------------------------------------------- markov_drafts

def markov_drafts_reference(base: mx.array, candidates: mx.array, head: mx.array, embed: mx.array,
                            anchor: int | mx.array, temperature: float = 1.0,
                            noise: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX spec of the drafter's Markov pass over a block (models/dspark.py's MarkovHead):
    from e_0 = embed[anchor], position k's candidate logits are base[k] [C] plus the Markov bias
    head[candidates[k]] . e_k (fp32), its draft the candidate with the largest logits /
    temperature + noise[k] (temperature 1 and no noise: the best logit), and e_{k+1} =
    embed[draft]. head, embed [V, R] bf16. -> (drafts [B] int32, logits [B, C] fp32, the
    embeddings e_k [B, R] bf16)."""
    prev = mx.array(anchor, dtype=mx.int32).reshape(1)
    rows = head[candidates].astype(mx.float32)  # [B, C, R]: every position's candidates' rows
    drafts, logits, embeds = [], [], []
    for k in range(base.shape[0]):
        e = embed[prev]  # [1, R]
        row = (base[k:k + 1] + (rows[k:k + 1] @ e.astype(mx.float32)[:, :, None])[..., 0]).reshape(-1)
        score = row if temperature == 1.0 and noise is None else \
            row / temperature + (0.0 if noise is None else noise[k])
        prev = candidates[k][mx.argmax(score, axis=-1)].astype(mx.int32).reshape(1)
        drafts.append(prev)
        logits.append(row)
        embeds.append(e)
    return mx.concatenate(drafts), mx.stack(logits), mx.concatenate(embeds)


# ------------------------------------------------------------------ ring_write

def ring_write_reference(rings: mx.array, rows: mx.array, first: int) -> mx.array:
    """Pure-MLX spec: rings [S, W, D] with rows [S, M, D] (positions first..first+M-1, M <= W)
    written to slots position % W."""
    W = rings.shape[1]
    slots = mx.arange(first, first + rows.shape[1]) % W
    out = mx.array(rings)
    out[:, slots] = rows
    return out


# -------------------------------------------------------------------- hc_split

@mx.compile
def hc_split_reference(mixes: mx.array, scale: mx.array, base: mx.array, hc: int, iters: int,
                       eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX spec (the reference's hc_split_sinkhorn, fp32): mixes [S, (2 + hc) * hc] ->
    pre [S, hc] = sigmoid + eps, post [S, hc] = 2 sigmoid, comb [S, hc, hc] = softmax over
    each row + eps, then `iters` alternations of column and row normalisation (column
    first, each sum + eps), ending on a column pass."""
    pre = mx.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * mx.sigmoid(mixes[:, hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    comb = mx.exp(comb - comb.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre, post, comb


# -------------------------------------------------------------------- moe_gate

def moe_gate_reference(x: mx.array, w: mx.array, bias: mx.array, k: int, temp: float, route_scale: float,
                       normalize: bool) -> tuple[mx.array, mx.array]:
    """Pure-MLX spec of the sqrt-softplus router (reference Gate): x [N, dim], w [E, dim] fp32,
    bias [E] -> (weights [N, k] fp32, expert ids [N, k] in ascending order). The bias picks
    the experts, the unbiased scores weight them."""
    logits = (x.astype(mx.float32) @ w.T) / temp
    scores = mx.sqrt(mx.where(logits > 20, logits, mx.log1p(mx.exp(mx.minimum(logits, 20)))))
    ids = mx.argpartition(-(scores + bias), kth=k - 1, axis=-1)[:, :k]
    ids = mx.sort(ids, axis=-1)  # the reference adds expert outputs in id order
    weights = mx.take_along_axis(scores, ids, axis=-1)
    if normalize and k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * route_scale, ids


# --------------------------------------------------------------------- rms_norm

@mx.compile
def rms_norm_reference(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Pure-MLX spec: fp32 RMSNorm scaled by `weight`, returned in x's dtype (reference
    RMSNorm): x * rsqrt(mean(x^2) + eps) * weight in fp32, over the last axis."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


# ---------------------------------------------------------------------- SwiGLU

@mx.compile
def swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """SiLU(gate) * up in fp32, up clamped to +-limit and gate from above (limit > 0)."""
    if limit > 0:
        up = mx.clip(up, -limit, limit)
        gate = mx.minimum(gate, limit)
    return gate / (1 + mx.exp(-gate)) * up  # torch's SiLU: x / (1 + e^-x)


class SwiGLU(NamedTuple):
    """The SwiGLU a GEMV kernel can apply to its outputs as it writes them (its SW): the
    matrix is a gate projection's rows and an up projection's, interleaved (w13: gate row p,
    then up row p; checkpoint.stack_gate_up), and the kernel writes
    swiglu_pairs of what it would have written, in one launch instead of two. weights: a
    routed expert pair's weight, for fp4_experts ([R, k] in its pairs' order; any shape
    that flattens so and broadcasts over the outputs where the spec runs)."""
    limit: float
    weights: mx.array | None = None


def swiglu_pairs(y: mx.array, act: SwiGLU) -> mx.array:
    """The spec of a GEMV kernel's SwiGLU: y [..., 2I] bf16, each gate output followed by its
    up output (w13's rows interleaved at load: checkpoint.stack_gate_up) -> bf16 [..., I] =
    swiglu(gate, up) [* weights], in fp32, rounded to bf16 once."""
    gate, up = y[..., 0::2], y[..., 1::2]  # views: the casts fuse
    h = swiglu(gate.astype(mx.float32), up.astype(mx.float32), act.limit)
    return (h if act.weights is None else h * act.weights).astype(mx.bfloat16)


def parts_added(y: mx.array, parts: mx.array) -> mx.array:
    """The spec of fp8_gemv's parts: y [S, N] bf16 with, in each of its first R rows, the
    parts [R, P, N] bf16 added: bf16(((parts[r, 0] + parts[r, 1]) + ...) + y[r]) in fp32 in
    that order, the later rows y's as they are (a MoE's routed experts' outputs and its
    shared expert's; the rows past R, a padded forward's padding)."""
    R, S = parts.shape[0], y.shape[0]
    total = parts[:, 0].astype(mx.float32)
    for j in range(1, parts.shape[1]):
        total = total + parts[:, j].astype(mx.float32)
    if R == S:
        return (total + y.astype(mx.float32)).astype(mx.bfloat16)
    if R == 1:  # a decode step: one select over the padding (a concatenate would be two copies)
        keep = int32s(*range(S))[:, None] < 1
        return mx.where(keep, (total + y.astype(mx.float32)).astype(mx.bfloat16), y)
    real, padding = mx.split(y, [R])
    return mx.concatenate([(total + real.astype(mx.float32)).astype(mx.bfloat16), padding])


# -------------------------------------------------------------------- fp8_gemv

def fp8_gemv_reference(x: mx.array, w: mx.array, scales: mx.array, quantize_input: bool = False,
                       real_rows: int | None = None, swiglu: SwiGLU | None = None,
                       parts: mx.array | None = None, groups: int = 0) -> mx.array:
    """Pure-MLX spec: x [S, G, K] through G `mxfp8` matrices w [G, N, K/4] (scales [G, N, K/32]),
    group g of every row through matrix g -> bf16 [S, G, N], accumulated in float32. (A
    gather_qmm: MLX 0.32.4's CUDA quantized_matmul does not broadcast stacked weights over
    rows: other values from the second row on.) quantize_input: x FP8
    fake-quantised first (quant.fp8_fake_quant). The dense form, x [..., K] through one matrix
    w [N, K/4] -> [..., N], is that of one group. real_rows: rows from there on (a padded
    forward's padding) are zeros. swiglu: w's rows a gate and an up projection, the output
    their swiglu_pairs [..., N / 2]. parts: [R, P, N] added to the first R rows (parts_added).
    groups G: the stacked form, x [S, ...] of G * K a row and w [G * N, K/4] -> [S, G * N]."""
    if groups:
        S = x.shape[0]
        y = fp8_gemv_reference(x.reshape(S, groups, -1), w.reshape(groups, -1, w.shape[-1]),
                               scales.reshape(groups, -1, scales.shape[-1]), quantize_input, real_rows)
        return y.reshape(S, -1)
    if w.ndim == 2:
        y = fp8_gemv_reference(x.reshape(-1, 1, x.shape[-1]), w[None], scales[None], quantize_input, real_rows)
        y = y.reshape(*x.shape[:-1], w.shape[0])
    else:
        y = _gathered(_quantized_input(x, quantize_input), w, scales, mx.arange(w.shape[0]), "mxfp8")
        y = padding_zeroed(y.astype(mx.bfloat16), real_rows)
    y = y if swiglu is None else swiglu_pairs(y, swiglu)
    return y if parts is None else parts_added(y, parts)


def _quantized_input(x: mx.array, quantize: bool) -> mx.array:
    """x, or x through the FP8 fake-quant spec (the GEMV kernels' QX), in x's dtype."""
    return fp8_fake_quant_reference(x) if quantize else x


def _gathered(x: mx.array, w: mx.array, scales: mx.array, ids: mx.array, mode: str) -> mx.array:
    """MLX's gather_qmm of x [R, X, K] (X = 1 or ids' second axis) through the quantised stack
    w at ids [R, X'] (or [X']), fed float32 -> float32 [R, X', N]: the two GEMV kernels' specs."""
    return mx.gather_qmm(x[:, :, None, :].astype(mx.float32), w, scales, rhs_indices=ids, transpose=True,
                         mode=mode)[:, :, 0, :]


# ----------------------------------------------------------------- fp4_experts

def fp4_experts_reference(x: mx.array, w: mx.array, scales: mx.array, ids: mx.array,
                          quantize_input: bool = False, swiglu: SwiGLU | None = None,
                          rows: int | None = None) -> mx.array:
    """Pure-MLX spec: pair (r, j) = row r's j-th expert ids[r, j] of the `mxfp4` stack w [E, N, K/8]
    (scales [E, N, K/32]) applied to x[r, 0] (x [R, 1, K], or [R, K]) or x[r, j] (x [R, k, K])
    -> bf16 [R, k, N], accumulated in float32. quantize_input: x FP8 fake-quantised first.
    swiglu: the output's swiglu_pairs [R, k, N / 2], the pairs' weights [R, k] applied. rows:
    only the first `rows` rows of x, ids and the weights (the kernel's rows=)."""
    if rows is not None:
        x, ids = x[:rows], ids[:rows]
        if swiglu is not None and swiglu.weights is not None:
            swiglu = SwiGLU(swiglu.limit, swiglu.weights[:rows])
    x = x[:, None] if x.ndim == 2 else x
    y = _gathered(_quantized_input(x, quantize_input), w, scales, ids, "mxfp4").astype(mx.bfloat16)
    if swiglu is None:
        return y
    weights = None if swiglu.weights is None else swiglu.weights.reshape(*ids.shape, 1)
    return swiglu_pairs(y, SwiGLU(swiglu.limit, weights))


# ------------------------------------------------------------------ head_logits

def head_logits_reference(x: mx.array, w: mx.array) -> mx.array:
    """The model's fp32 logits, as DeepSeek's reference computes them: x [S, D] and the bf16
    head w [V, D] both widened to float32 (exactly), then a float32 matmul -> [S, V]. The
    widened head (twice the release's bytes) is made a slice of the vocabulary at a time, so
    no float32 copy of the whole head exists at once."""
    x32 = x.astype(mx.float32)
    step = 16384
    return mx.concatenate([x32 @ w[v: v + step].astype(mx.float32).T for v in range(0, w.shape[0], step)], axis=-1)
