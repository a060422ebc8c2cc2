"""The DeepSeek-V4.1 target model.

Semantics follow DeepSeek's reference `inference/model.py` (rev dba1be0a),
including where it rounds to bf16, so that on the CPU this file reproduces the
reference's outputs (tests/test_parity.py). Shapes in comments use S for the
rows of this forward, hc for the hyper-connection copies, D for head_dim.

Residual stream: `hc_mult` copies. Each sub-layer collapses them with a
pre-mix (computed by the previous sub-layer), runs, and expands back through
post and Sinkhorn-normalised comb mixes of its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import LayerCache, ModelCache
from .config import ModelArgs
from . import kernels
from .kernels import rms_norm
from .engram import Engram, NgramHasher, StagedRows, pack_rows, unpack_rows
from .evaluator import BlockEvaluator, switched
from .quant import Fp8Linear, fp4_fake_quant, fp8_fake_quant, fp8_input, gemm_input_dtype

F32, BF16 = mx.float32, mx.bfloat16


# ------------------------------------------------------------------ primitives
#
# Pure functions of arrays are wrapped in `mx.compile`: MLX then runs each one's
# element-wise chain as one fused kernel instead of dozens of small ones, which
# is much of what a decode step costs on a GPU (scripts/bench.py profile). Fusion
# keeps every intermediate in its own dtype, so the results are the same bits
# (tests/test_model.py compares compiled and uncompiled forwards).

def fused(*parts: str):
    """Run a module method through `mx.compile`, with the parameters of the named
    submodules (default: the whole module) as implicit inputs, read at every call,
    so loading weights later needs no retrace.

    For methods that are pure functions of their array arguments and those
    weights; Python attributes they read are frozen at the first call. Every call
    flattens the named parts, so a method names only the parts it uses: a whole
    block is dozens of arrays, a norm and its mixes a handful.

    Each shape of the first argument (a forward's rows) gets a compiled function of its
    own: MLX finds a call's trace by comparing it with each trace of that function in
    turn, and the warm-up and prefill's chunks leave dozens; a decode step's ~240 calls
    spent ~4% of its host time searching (docs/benchmarks.md, session 16).

    A method that raises while MLX traces it (MLX 0.32) would leave the module's weights
    replaced by MLX's tracers: MLX puts the weights back only when the method returns, and
    every later forward would then fail. So the traced method never raises into MLX: it
    keeps what it raised and returns a stand-in; the call then drops that compiled function
    (with the stand-in's trace) and raises it."""

    def decorate(method):
        name = f"_fused_{method.__name__}"

        @functools.wraps(method)
        def call(self, *args):
            by_shape = self.__dict__.get(name)
            if by_shape is None:
                by_shape = {}
                object.__setattr__(self, name, by_shape)
            shape = getattr(args[0], "shape", None) if args else None
            entry = by_shape.get(shape)
            if entry is None:
                inputs = [getattr(self, p) for p in parts] if parts else self
                raised = []
                entry = by_shape[shape] = (mx.compile(functools.partial(_traced, method, self, raised),
                                                      inputs=inputs), raised)
            compiled, raised = entry
            out = compiled(*args)
            if raised:  # (the traced method raised: its weights are back, its stand-in trace dropped)
                del by_shape[shape]
                raise raised.pop()
            return out

        call.traces = name  # the instance attribute that holds them (tests start a forward afresh)
        return call

    return decorate


def _traced(method, self, raised: list, *args):
    """fused's method as MLX traces it: what it raises is kept in `raised`, and a stand-in
    returned, so that MLX finishes the trace and puts the module's weights back."""
    try:
        return method(self, *args)
    except BaseException as e:
        raised.append(e)
        return mx.array(0.0)


@functools.lru_cache(maxsize=None)
def fused_traces(cls: type) -> tuple[str, ...]:
    """The instance attributes in which a module class's fused methods keep their traces, one a
    method (what a tool or a test swaps to trace a forward afresh)."""
    return tuple(name for attr in dir(cls)
                 if isinstance(name := getattr(getattr(cls, attr, None), "traces", None), str))


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,), dtype=F32)  # BF16 in the release, widened at load
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)

    def quantized(self, x: mx.array) -> mx.array:
        """The norm through quant.fp8_input, as an FP8 GEMM takes it: one launch on a GPU."""
        if kernels.rms_norm_fits(x, quantized=True):
            return rms_norm(x, self.weight, self.eps, quantize_to=gemm_input_dtype())
        return fp8_input(self(x))


class Linear(nn.Module):
    """BF16 weight [out, in], no bias; bf16 in and out (fp32 accumulation)."""

    def __init__(self, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((out_dims, in_dims), dtype=BF16)

    def __call__(self, x: mx.array) -> mx.array:
        return x.astype(BF16) @ self.weight.T


class Rope:
    """Interleaved-pair rotary embedding on the last `dims` features, YaRN optional.

    Matches the reference `precompute_freqs_cis` (fp32 frequencies, YaRN ramp
    between beta_fast and beta_slow) and `apply_rotary_emb` (pairs (x0, x1)
    rotated as complex numbers in fp32, result cast back to x's dtype).
    """

    def __init__(self, dims: int, base: float, original_len: int = 0, factor: float = 1.0,
                 beta_fast: float = 32, beta_slow: float = 1):
        self.dims = dims
        freqs = 1.0 / (np.float32(base) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims)))
        if original_len > 0:
            def corrected_dim(rotations):
                return dims * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(corrected_dim(beta_fast)), 0)
            high = min(math.ceil(corrected_dim(beta_slow)), dims - 1)
            ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
            smooth = (1 - ramp).astype(np.float32)
            freqs = freqs / np.float32(factor) * (1 - smooth) + freqs * smooth
        self.freqs = freqs.astype(np.float32)  # each pair's, numpy: _per_pair lays them out per width
        self._tables: dict[int, tuple] = {}  # feature width -> the last three (positions, tables)
        self._widths: dict[int, tuple[mx.array, mx.array]] = {}  # feature width -> _per_pair's arrays

    def __call__(self, x: mx.array, positions: mx.array, inverse: bool = False) -> mx.array:
        """x [S, ..., F] with positions [S]; rotates x[..., -dims:]. Inside a compiled
        function use `apply` with tables computed outside it (so that they are shared)."""
        return self.apply(x, self.tables(positions, x.shape[-1]), inverse)

    @staticmethod
    def apply(x: mx.array, tables: tuple[mx.array, ...], inverse: bool = False) -> mx.array:
        """The rotation with `tables(positions, x.shape[-1])`, x [S, F] or [S, heads, F]."""
        cos, sin, neg_sin = tables[:3] if x.ndim == 2 else tables[3:6]
        return rotate(x, cos, neg_sin if inverse else sin, tables[6])

    def tables(self, positions: mx.array, width: int) -> tuple[mx.array, ...]:
        """Per-feature factors for positions [S] and features of that width, as pairs
        [S, width/2, 2]: cos of each pair's angle on both of its features; its sin on the
        second, negated on the first; that negated (the inverse rotation); the same three
        as [S, 1, width/2, 2] (for x with a heads axis); and which features rotate
        [width/2, 2] (the last `dims`). Shaped here, once per forward, so that no rotation
        adds views of its own. Kept for the last three positions arrays used per width, the
        latest first (a forward's, which all its layers share, and its compressed groups'
        of each ratio: SharedAttention.group_positions): one set per forward instead of one
        per call. Where the same positions' tables of a greater width are kept, views of
        their last width / 2 pairs: the same values (the pairs before the last `dims`
        features do not rotate), and no launch."""
        recent = self._tables.get(width, ())  # one read: a forward in another thread may replace it
        entry = next((e for e in recent if e[0] is positions), None)
        if entry is None:
            wider = next((tables for w, entries in list(self._tables.items()) if w > width
                          for kept, tables in entries if kept is positions), None)
            entry = positions, (_rope_tables(positions, *self._per_pair(width)) if wider is None
                                else _last_pairs(wider, width // 2))
        self._tables[width] = (entry,) + tuple(e for e in recent if e is not entry)[:2]
        return entry[1]

    def _per_pair(self, width: int) -> tuple[mx.array, mx.array]:
        """For features of that width, made once: each pair's frequency [width/2] (0 for the
        pairs before the last `dims` features, which do not rotate: their angle is 0, whose
        cos is 1 and sin 0, as the reference leaves them) and which features rotate
        [width/2, 2]. From numpy, so never an operation of a forward."""
        if width not in self._widths:
            fixed = width - self.dims
            freqs = np.concatenate([np.zeros(fixed // 2, np.float32), self.freqs])
            rotated = (np.arange(width) >= fixed).reshape(width // 2, 2)
            self._widths[width] = mx.array(freqs), mx.array(rotated)
        return self._widths[width]


@mx.compile
def _rope_tables(positions: mx.array, freqs: mx.array, rotated: mx.array) -> tuple[mx.array, ...]:
    """Rope.tables' arrays, one compiled function of element-wise steps only (they fuse):
    freqs and rotated from Rope._per_pair. The pairs' layout comes from broadcasting against
    a pair axis (exact factors 1 and +-1), not from concatenating and repeating, each of
    which would be a launch. cos and sin each compute their own angles, from views of the
    positions taken first and spelled apart (reshape, new axes), so that each is one launch:
    a view between two steps, or a step both share, would be a launch of its own (the
    compiler merges equal steps)."""
    f = freqs[None, :, None]  # [1, width/2, 1]
    cos = mx.where(rotated, mx.cos(positions[:, None, None].astype(F32) * f), 1.0)  # cos(0) = 1 where nothing rotates
    signs = mx.array([-1.0, 1.0], dtype=F32)  # a pair's sin factors: (-sin, sin)
    # +0 where nothing rotates, as the reference's table
    sin = mx.where(rotated, mx.sin(positions.reshape(-1, 1, 1).astype(F32) * f) * signs, 0.0)
    flat = (cos, sin, -sin)
    return flat + tuple(t[:, None] for t in flat) + (rotated,)


def _last_pairs(tables: tuple[mx.array, ...], pairs: int) -> tuple[mx.array, ...]:
    """Rope.tables' arrays narrowed to their last `pairs` pairs of features (views)."""
    return (tuple(t[:, -pairs:] for t in tables[:3]) + tuple(t[:, :, -pairs:] for t in tables[3:6])
            + (tables[6][-pairs:],))


@functools.lru_cache(maxsize=None)
def shared_rope(dims: int, base: float, original_len: int = 0, factor: float = 1.0,
                beta_fast: float = 32, beta_slow: float = 1) -> Rope:
    """One Rope per set of parameters, shared by every layer that uses it, so that a forward
    computes its tables once."""
    return Rope(dims, base, original_len, factor, beta_fast, beta_slow)


@mx.compile
def rotate(x: mx.array, cos: mx.array, sin: mx.array, rotated: mx.array) -> mx.array:
    """Rope's rotation of x [S, ..., F] (contiguous) with Rope.tables shaped for it: each
    rotated pair (x0, x1) becomes (x0 cos - x1 sin, x1 cos + x0 sin), in fp32; the other
    features are passed through as they are. One fused element-wise pass: the pair swap is
    a view."""
    F = x.shape[-1]
    x2 = x.reshape(*x.shape[:-1], F // 2, 2)
    swapped = x2[..., ::-1]  # (x1, x0) per pair
    out = x2.astype(F32) * cos + swapped.astype(F32) * sin
    return mx.where(rotated, out.astype(x.dtype), x2).reshape(x.shape)


@mx.compile
def sparse_attention(q: mx.array, window_keys: mx.array, window_mask: mx.array,
                     picked_keys: mx.array | None, picked_mask: mx.array | None,
                     sink: mx.array, scale: float) -> mx.array:
    """Single-latent attention with a per-head sink logit (reference `sparse_attn`).

    q [S, H, D] bf16; window_keys [N, D] shared by every row (or [S, N, D],
    each row's own), window_mask [S, N]; picked_keys [S, K, D] per-row
    compressed keys, picked_mask [S, K].
    Keys are also the values. Scores and the softmax denominator are fp32; the
    probabilities are rounded to bf16 before they weight the values, relative
    to the row max (the reference does this per 64-key block; one block covers
    every row at the fixture's sizes). Rows with no visible key give zeros.
    """
    qf = q.astype(F32)
    wk = window_keys.astype(F32)
    per_row = wk.ndim == 3
    window_scores = qf @ (wk.swapaxes(1, 2) if per_row else wk.T)
    scores = mx.where(window_mask[:, None, :], window_scores * scale, -mx.inf)  # [S, H, N]
    if picked_keys is not None:
        pk = picked_keys.astype(F32)
        picked = mx.where(picked_mask[:, None, :], (qf @ pk.swapaxes(1, 2)) * scale, -mx.inf)
        scores = mx.concatenate([scores, picked], axis=-1)
    row_max = mx.maximum(scores.max(axis=-1, keepdims=True), -1e30)
    p = mx.exp(scores - row_max)
    denom = p.sum(axis=-1, keepdims=True) + mx.exp(sink.astype(F32)[:, None] - row_max)
    pb = p.astype(BF16).astype(F32)
    n = wk.shape[-2]
    out = pb[..., :n] @ wk
    if picked_keys is not None:
        out = out + pb[..., n:] @ pk
    return (out / denom).astype(BF16)


# ------------------------------------------------------------ hyper-connections

@dataclass
class HcMixes:
    pre: mx.array  # [S, hc]      collapse weights for the NEXT sub-layer
    post: mx.array  # [S, hc]     expansion of this sub-layer's output
    comb: mx.array  # [S, hc, hc] residual mixing, doubly stochastic


def hc_mixes(x: mx.array, fn: mx.array, scale: mx.array, base: mx.array,
             hc: int, iters: int, norm_eps: float, eps: float) -> HcMixes:
    """x [S, hc, dim] -> pre/post/comb mixes (reference hc_mixes + hc_split_sinkhorn, fp32)."""
    return HcMixes(*kernels.hc_split(_hc_project(x, fn, norm_eps), scale, base, hc, iters, eps))


@mx.compile
def _hc_project(x: mx.array, fn: mx.array, norm_eps: float) -> mx.array:
    """The stream [S, hc, dim] projected to its (2 + hc) * hc mixes, RMS-scaled (fp32)."""
    xf = x.reshape(x.shape[0], -1).astype(F32)
    return (xf @ fn.T) * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)


def _add_all(terms: list[mx.array]) -> mx.array:
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def hc_expand(x: mx.array, hc: int) -> tuple[mx.array, mx.array]:
    """Embeddings [S, dim] -> the stream's hc identical copies [S, hc, dim] and the
    one-hot pre-mix [S, hc] the first block collapses them with (reference: repeat,
    make_identity_pre_mix)."""
    return mx.repeat(x[:, None, :], hc, axis=1), identity_pre_mix(x.shape[0], hc)


@functools.lru_cache(maxsize=64)
def identity_pre_mix(rows: int, hc: int) -> mx.array:
    """The one-hot pre-mix [rows, hc] (1 on the first copy), kept per shape: the same for
    every forward of that many rows, so no launches of its own after the first. From numpy:
    an array kept across forwards is no operation of any stream, which a forward's blocks
    may be evaluated on another thread's (evaluator.BlockEvaluator)."""
    pre = np.zeros((rows, hc), dtype=np.float32)
    pre[:, 0] = 1.0
    return mx.array(pre)


def copies(x: mx.array, axis: int) -> list[mx.array]:
    """x's entries along a short axis, each kept as a size-1 axis, as one split: one view
    operation in the graph where a slice per entry would be as many (each view is an
    operation MLX builds and evaluates, a few microseconds of host time apiece)."""
    return mx.split(x, x.shape[axis], axis=axis)


def sum_copies(terms: mx.array) -> mx.array:
    """Sum over the hc axis (axis -2), adding the copies one by one in fp32.

    The reference's torch reduction accumulates a short outer axis in order;
    doing the same keeps every bf16 rounding that follows identical.
    """
    return _add_all(copies(terms, terms.ndim - 2)).squeeze(-2)


@mx.compile
def copies_mean(h: mx.array) -> mx.array:
    """The mean over the stream's hc copies [S, hc, dim] -> [S, dim] bf16: their fp32 sum in
    order (sum_copies) over hc, rounded to bf16 (a DSpark feature). Compiled: one fused pass
    where its steps were seven launches."""
    return (sum_copies(h.astype(F32)) / h.shape[1]).astype(BF16)


@mx.compile
def hc_pre(x: mx.array, pre: mx.array) -> mx.array:
    """Collapse copies: [S, hc, dim] x [S, hc] -> [S, dim] (fp32 sum, x's dtype out)."""
    terms = [w * c.astype(F32) for w, c in zip(copies(pre[:, :, None], 1), copies(x, 1))]  # [S, 1, dim] each
    return _add_all(terms).astype(x.dtype).squeeze(1)  # the cast before the view: fused


def hc_post(y: mx.array, residual: mx.array, mixes: HcMixes) -> mx.array:
    """Expand: copy j = post_j * y + sum_i comb[i, j] * residual_i; [S, dim] -> [S, hc, dim]."""
    return _hc_post(y, residual, mixes.post, mixes.comb)


@mx.compile
def _hc_post(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    # sum over i of comb[i, j] * residual_i, one [S, j, dim] term per i, added in order; the
    # factors ([S, j, 1] of comb transposed, [S, 1, dim] of the residual) come from one split
    # each: every view is an operation of the step's graph
    columns, rows = copies(comb.swapaxes(1, 2), 2), copies(residual, 1)
    mixed = _add_all([c * r.astype(F32) for c, r in zip(columns, rows)])  # cast after the view: fused
    return (post[..., None] * y[:, None, :].astype(F32) + mixed).astype(y.dtype)  # the cast after the view: fused


class Expansion(NamedTuple):
    """A sub-layer's output y [S, dim] not yet expanded into the stream it ran on: the stream
    is hc_post(y, residual, mixes) (`value`). A block hands the next block its MoE output so,
    because on a GPU the next block's first kernel expands it as it reads it
    (HyperConnection.expanded_input): one launch a block fewer. A tuple of arrays, so that
    mx.eval and mx.async_eval take it as it is."""
    y: mx.array  # [S, dim]
    residual: mx.array  # [S, hc, dim]
    post: mx.array  # [S, hc]
    comb: mx.array  # [S, hc, hc]

    def value(self) -> mx.array:
        return _hc_post(self.y, self.residual, self.post, self.comb)


class Folded(NamedTuple):
    """A sub-layer's output that its last GEMM put into the stream itself
    (kernels.fp8_into_stream): the new stream h [S, hc, dim] and the next sub-layer's mix
    parts [S, chunks, (2 + hc) * hc + 1], which that sub-layer's input completes
    (HyperConnection.input_from_parts) instead of projecting h again."""
    h: mx.array
    parts: mx.array

    def value(self) -> mx.array:
        return self.h


def stream_value(h: mx.array | Expansion | Folded) -> mx.array:
    """The stream [S, hc, dim], expanded where a block left it as an Expansion (a Folded holds it)."""
    return h.value() if isinstance(h, (Expansion, Folded)) else h


class HyperConnection(nn.Module):
    """The learned mix parameters of one sub-layer (checkpoint: hc_{attn,ffn}_{fn,base,scale})."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros(((2 + hc) * hc, hc * args.hidden_size), dtype=F32)
        self.base = mx.zeros(((2 + hc) * hc,), dtype=F32)
        self.scale = mx.zeros((3,), dtype=F32)
        self._hc, self._iters = hc, args.hc_sinkhorn_iters
        self._norm_eps, self._eps = args.rms_norm_eps, args.hc_eps

    def __call__(self, x: mx.array) -> HcMixes:
        return hc_mixes(x, self.fn, self.scale, self.base, self._hc, self._iters, self._norm_eps, self._eps)

    def sublayer_input(self, h: mx.array, pre: mx.array, norm: RMSNorm) -> tuple[mx.array, mx.array, HcMixes]:
        """A sub-layer's input: the stream h [S, hc, dim] collapsed by the previous sub-layer's
        pre [S, hc] and normed by `norm` (x), x through quant.fp8_input (for the sub-layer's FP8
        GEMMs), and this sub-layer's mixes of h. On a GPU, forwards of up to 16 rows run it as
        one kernel (kernels.hc_input) instead of about nine operations; this composition is
        the kernel's spec."""
        if kernels.hc_input_fits(h):
            x, xq, *mixes = kernels.hc_input(h, pre, self.fn, self.scale, self.base, norm.weight, self._iters,
                                             self._norm_eps, self._eps, norm.eps, gemm_input_dtype())
            return x, xq, HcMixes(*mixes)
        return self.sublayer_input_unfused(h, pre, norm)

    def input_from_parts(self, h: mx.array, parts: mx.array, pre: mx.array,
                         norm: RMSNorm) -> tuple[mx.array, mx.array, HcMixes]:
        """sublayer_input of a stream h that the previous sub-layer's last GEMM made together
        with this sub-layer's mix parts (a Folded): one launch (kernels.hc_input_from_parts)."""
        x, xq, *mixes = kernels.hc_input_from_parts(h, parts, pre, self.scale, self.base, norm.weight, self._iters,
                                                    self._norm_eps, self._eps, norm.eps, gemm_input_dtype())
        return x, xq, HcMixes(*mixes)

    def sublayer_input_unfused(self, h: mx.array, pre: mx.array, norm: RMSNorm) -> tuple[mx.array, mx.array, HcMixes]:
        """sublayer_input as separate operations (prefill, the CPU; bench.py pieces times it)."""
        x = norm(hc_pre(h, pre))
        return x, fp8_input(x), self(h)

    def expanded_input(self, y: mx.array, residual: mx.array, previous: HcMixes,
                       norm: RMSNorm) -> tuple[mx.array, mx.array, mx.array, HcMixes]:
        """The stream after the previous sub-layer, h = hc_post(y, residual, previous) (its output
        y [S, dim] expanded onto the stream residual [S, hc, dim] it ran on), and this
        sub-layer's input from h as sublayer_input makes it (collapsed by previous.pre):
        (h, x, xq, mixes). On a GPU, where hc_input fits, the expansion runs inside hc_input's
        first launch (kernels.hc_post_input) instead of as a launch of its own; this
        composition is the kernel's spec."""
        if kernels.hc_input_fits(residual):
            h, x, xq, *mixes = kernels.hc_post_input(
                y, residual, previous.post, previous.comb, previous.pre, self.fn, self.scale, self.base, norm.weight,
                self._iters, self._norm_eps, self._eps, norm.eps, gemm_input_dtype())
            return h, x, xq, HcMixes(*mixes)
        h = hc_post(y, residual, previous)
        return (h, *self.sublayer_input_unfused(h, previous.pre, norm))


# ------------------------------------------------------------------- attention

class Compressor(nn.Module):
    """Pools each full group of `ratio` positions into one latent (softmax gate over the group).

    Ratio 1 is a plain bf16 projection. Ratio > 1 projects in fp32 (its BF16
    weights held in fp32, as the reference holds them) and keeps the rows of an
    unfinished group in the cache until the group completes.
    Returns the new latents (bf16, normed, before RoPE) and their group ids.
    """

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.hidden_size, args.head_dim)
        if ratio > 1:
            self.wgate = Linear(args.hidden_size, args.head_dim)
            for proj in (self.wkv, self.wgate):
                proj.weight = proj.weight.astype(F32)  # widened at load
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def __call__(self, x: mx.array, state) -> tuple[mx.array | None, int]:
        first_group = state.n_groups
        if self.ratio == 1:
            state.end += x.shape[0]
            return self.norm(self.wkv(x)), first_group
        # kv | score of the new positions (two GEMMs: as one of twice the outputs, cuBLAS ran a
        # 152 us split-K kernel on an H100 in session 44, where the two took 22-27 us at once in
        # session 43's H200 timeline), then of every position not in a group yet, the
        # unfinished group's before them, read where the cache has written them
        xf = x.astype(F32)
        rows = state.append_raw(mx.concatenate([xf @ self.wkv.weight.T, xf @ self.wgate.weight.T], axis=1))
        n_full = rows.shape[0] // self.ratio
        if n_full == 0:
            return None, first_group
        groups = rows[: n_full * self.ratio].reshape(n_full, self.ratio, -1)
        width = groups.shape[2] // 2
        return self.norm(pooled(groups[..., :width], groups[..., width:])), first_group


@mx.compile
def pooled(kv: mx.array, score: mx.array) -> mx.array:
    """Each full group's rows kv [G, ratio, D] weighted by the softmax of their scores over the
    group (fp32) and summed, in bf16. Compiled: the softmax over a middle axis is several
    operations, whose element-wise steps fuse.

    Groups of two (the release's ratio) take the same steps written out per row: the group's
    max, each row's exp(score - max) over their sum, the weighted rows added. Element-wise
    only, so all of it is one launch (the spec's reductions over the group axis make it six),
    and the same values: a reduction of two terms is their one addition (tests/test_model.py)."""
    if kv.shape[1] != 2:  # (compiled per shape: a branch of the trace)
        return (kv * mx.softmax(score, axis=1, precise=True)).sum(axis=1).astype(BF16)
    first, second = score[:, 0], score[:, 1]
    top = mx.maximum(first, second)
    e_first, e_second = mx.exp(first - top), mx.exp(second - top)
    total = e_first + e_second
    return (kv[:, 0] * (e_first / total) + kv[:, 1] * (e_second / total)).astype(BF16)


@mx.compile
def head_weights(proj: mx.array, scale: float) -> mx.array:
    """The indexer's per-head weights: the projection [S, H] times scale in fp32, in bf16."""
    return (proj.astype(F32) * scale).astype(BF16)


# The indexer's key count grows as a sequence does: shapeless, so that no length retraces
@functools.partial(mx.compile, shapeless=True)
def weighted_relu(dots: mx.array, w: mx.array) -> mx.array:
    """relu(q . k) [S, H, T] (bf16) times each head's weight w [S, H], rounded to bf16 as the
    reference does, then widened to fp32 for the sum over heads."""
    return (mx.maximum(dots, 0) * w[:, :, None]).astype(F32)


_ids = mx.array(np.arange(1024, dtype=np.int32))


def positions_of(start: int, n: int) -> mx.array:
    """Positions start .. start + n - 1 [n] int32: a view of key_ids' array, so no launch and
    no memory of its own. An array made on the host each forward would cost more on CUDA: MLX
    keeps it in managed memory, which the first kernel to read it pulls to the GPU page by page
    (on the H200 the Rope tables' cast of such positions took 67-128 us, 2.5 from the view), and its
    buffer may come from MLX's cache of device buffers and be moved to managed memory first,
    with a copy that waits for the device. SharedAttention reads a forward's positions on the
    host from a numpy copy of its own (reading these back would move their memory again)."""
    return key_ids(start + n)[start:]


def key_ids(n: int) -> mx.array:
    """mx.arange(n) as a slice (a view) of one array kept across forwards, which doubles as
    sequences grow: no launch per index layer for ids that are the same every time. From
    numpy, as identity_pre_mix."""
    global _ids
    while _ids.shape[0] < n:
        _ids = mx.array(np.arange(2 * _ids.shape[0], dtype=np.int32))
    return _ids[:n]


@functools.partial(mx.compile, shapeless=True)
def negated_scores(summed: mx.array, key_ids: mx.array, visible: mx.array) -> mx.array:
    """The index scores negated, as the top-k's argpartition takes them (one launch with the
    rest): the head sum [S, T] rounded to bf16 (as the reference), fp32, negated; +inf at
    the key ids [T] a row may not see yet (id >= visible [S])."""
    return mx.where(key_ids[None, :] < visible[:, None], -summed.astype(BF16).astype(F32), mx.inf)


@functools.partial(mx.compile, shapeless=True)
def negated_candidate_scores(summed: mx.array, key_ids: mx.array, visible: mx.array,
                             candidates: mx.array) -> mx.array:
    """negated_scores, +inf also outside a row's candidate blocks (candidates [S, T])."""
    return mx.where(candidates, negated_scores(summed, key_ids, visible), mx.inf)


def indexer_scoring_length(args: ModelArgs) -> int:
    """Tokens of context past which every index layer has more compressed groups than its
    index_topk picks, so that each decode step scores them (Indexer.picks_everything: before
    that, an indexer hands on every position unscored), with a margin."""
    ratios = [args.compress_ratios[i] for i in args.index_source_layer_ids] or [1]
    return args.index_topk * max(ratios) + 64


@functools.partial(mx.compile, shapeless=True)
def every_pick_arrays(ids: mx.array, last: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
    """SharedAttention.every_pick's arrays from ids 0 .. k - 1 [k] (uint32), last = n - 1 [1]
    and visible [S]: (min(ids, last), id < visible and id <= last), both [S, k]."""
    last_rows = (visible[:, None] * 0 + last).astype(mx.uint32)  # n - 1 in each row: [S, 1], so [S, k] out
    return mx.minimum(ids[None, :], last_rows), (ids[None, :] < visible[:, None]) & (ids[None, :] <= last_rows)


class Indexer(nn.Module):
    """Scores compressed positions per query and keeps the best `index_topk`.

    score[s, t] = sum_h relu(q_sh . k_t) * w_sh with FP4 fake-quantised q and k,
    rounded to bf16 after the dot, after the weighting and after the head sum,
    as in the reference. Index-key owners (KV sources) also build the keys.
    """

    def __init__(self, args: ModelArgs, layer_id: int, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk = args.index_topk
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        self.is_candidate_source = layer_id == args.candidate_source_layer_id
        self.uses_candidates = 0 <= args.candidate_source_layer_id < layer_id
        self.candidate_blocks = args.candidate_topk_blocks
        self.candidate_block_size = args.candidate_block_size
        self._pick_ids = index_range(self.topk)  # 0 .. topk - 1 (SharedAttention.every_pick)
        self.wq_b = Fp8Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(args.hidden_size, self.n_heads)
        if owns_keys:
            self.wk = Linear(args.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latent: mx.array, positions: mx.array, rope: Rope) -> mx.array:
        """Index keys of new compressed latents [G, D] at their group positions."""
        k = rope(self.k_norm(self.wk(latent)), positions)
        return fp4_fake_quant(k, 32, "e8m0")

    def __call__(self, x, qr, positions, index_keys, visible, rope, shared) -> tuple[mx.array, mx.array]:
        """Top-k compressed ids per row [S, k] and their validity mask.

        qr: the attention's normed low-rank query, through fp8_input (Attention.queries).

        visible [S]: how many groups each row may see (groups finished at or
        before its position).

        Where the k picks hold every compressed position (n <= k) and no candidate mask
        restricts them, the scores cannot change the picks: every position a row sees is
        valid, the rest padding (SharedAttention.every_pick, the same arrays as the scored
        path's). So a context of up to k groups runs no scoring at all; past it, every step
        does.
        """
        n = index_keys.shape[0]
        # the candidate source's mask restricts something only past its blocks' worth of positions
        masks = self.is_candidate_source and n > self.candidate_blocks * self.candidate_block_size
        if self.is_candidate_source and not masks:
            shared.candidates = None  # every block kept: the later layers score unrestricted, the same
        if self.picks_everything(n, masks, shared):
            return shared.every_pick(n, self._pick_ids, visible)
        S = x.shape[0]
        q = self.wq_b.quantized(qr, shared.real_rows).reshape(S, self.n_heads, self.head_dim)
        q = fp4_fake_quant(rope(q, positions), 32, "e8m0")
        w = head_weights(self.weights_proj(x), self.weight_scale)  # [S, Hi] bf16
        dots = q.astype(BF16) @ index_keys.astype(BF16).T  # [S, Hi, T] bf16
        summed = weighted_relu(dots, w).sum(axis=1)  # [S, T]
        # the scores negated (+inf: masked), so that the top-k is argpartition's k smallest
        if self.uses_candidates and shared.candidates is not None:
            negated = negated_candidate_scores(summed, key_ids(n), visible, shared.candidates)
        else:
            negated = negated_scores(summed, key_ids(n), visible)
        if masks:
            shared.candidates = self._candidate_mask(negated, visible)
        if n < self.topk:
            # Fewer compressed positions than picks: pad with masked columns, so that every
            # forward picks `topk` (the same shapes each step: no retrace of the compiled
            # attention, whose result the masked picks do not change; tests/test_model.py)
            negated = mx.concatenate([negated, mx.full((S, self.topk - n), mx.inf)], axis=1)
        ids = mx.sort(mx.argpartition(negated, kth=self.topk - 1, axis=-1)[:, : self.topk], axis=-1)
        valid = mx.take_along_axis(negated, ids, axis=-1) < mx.inf
        return mx.minimum(ids, n - 1), valid  # a padding pick reads the last position, masked

    def picks_everything(self, n: int, masks: bool, shared: SharedAttention) -> bool:
        """Whether the top-k of n compressed positions is all of them, whatever their scores:
        n <= k, and no candidate mask to make (masks) or to apply."""
        return n <= self.topk and not masks and (not self.uses_candidates or shared.candidates is None)

    def _candidate_mask(self, negated: mx.array, visible: mx.array) -> mx.array:
        """Level one of the two-level top-k: each row keeps its best blocks of positions,
        the block holding its newest position always included. negated: the scores negated
        (negated_scores), as the top-k takes them. [S, T] bool."""
        S, n = negated.shape
        bs = self.candidate_block_size
        n_blocks = -(-n // bs)
        padded = mx.concatenate([negated, mx.full((S, n_blocks * bs - n), mx.inf)], axis=1)
        blocks = padded.reshape(S, n_blocks, bs).min(axis=-1)  # each block's best score, negated
        newest = (visible - 1) // bs
        blocks = mx.where(key_ids(n_blocks)[None, :] == newest[:, None], -mx.inf, blocks)
        k = min(self.candidate_blocks, n_blocks)
        top = mx.argpartition(blocks, kth=k - 1, axis=-1)[:, :k]
        keep_top = mx.take_along_axis(blocks, top, axis=-1) < mx.inf
        keep = mx.zeros((S, n_blocks), dtype=mx.bool_)
        keep = mx.put_along_axis(keep, top, keep_top, axis=-1)
        return mx.repeat(keep, bs, axis=1)[:, :n]


class SharedAttention:
    """What one forward hands down the layer stack (the reference's module-global
    `shared_attn`, made explicit): the index sources' top-k and the candidate mask, and how
    many rows are real."""

    def __init__(self, real_rows: int | None = None, positions: np.ndarray | None = None):
        self.real_rows = real_rows  # rows before a padded forward's padding (None: all are real)
        # the forward's positions on the host (Model.__call__'s), read instead of the positions
        # window and visible are given (positions_of says why); None: those, read back
        self.positions = positions
        self.topk: tuple[mx.array, mx.array] | None = None  # ids [S, k], valid [S, k]
        self.candidates: mx.array | None = None  # [S, T] bool
        self._window: tuple | None = None
        self._visible: dict[int, mx.array] = {}
        self._groups: dict[tuple[int, int, int], mx.array] = {}
        self._picks: dict[tuple[int, int, int], tuple[mx.array, mx.array]] = {}
        # what the forward's positions alone decide and its layers compute (RoPE tables, the
        # unscored picks): a forward built ahead starts them before its token is read
        # (Model._forward_built_ahead), while the device would wait for the token anyway,
        # rather than in the blocks that read them, after it
        self.early: list[mx.array] = []

    def rope_tables(self, rope: Rope, positions: mx.array, width: int) -> tuple[mx.array, ...]:
        """rope.tables(positions, width), its cos and sin (what every rotation with them reads)
        noted in `early` the first time."""
        tables = rope.tables(positions, width)
        if not any(a is tables[0] for a in self.early):
            self.early += tables[:2]
        return tables

    def visible(self, positions: mx.array, ratio: int) -> mx.array:
        """How many compressed groups of `ratio` positions each row may see [S] int32 (the
        groups finished at or before its position): the same for every index layer of that
        ratio in a forward, so computed once, on the host (from self.positions where given)."""
        if ratio not in self._visible:
            self._visible[ratio] = mx.array((self._on_host(positions) + 1) // ratio, dtype=mx.int32)
        return self._visible[ratio]

    def every_pick(self, n: int, pick_ids: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
        """An indexer's top-k where its k picks (pick_ids: 0 .. k - 1, uint32) hold all n <= k
        compressed positions: ids 0 .. n - 1 then n - 1 again (as argpartition's picks sorted
        and clamped), valid where a row sees the position (id < visible [S]) and it exists
        (id < n): the arrays the scored path gives. The same for every index layer of the
        forward with this n and visible (one ratio), so made once, in one launch."""
        key = (n, pick_ids.size, id(visible))
        if key not in self._picks:
            self._picks[key] = every_pick_arrays(pick_ids, key_ids(n)[n - 1:], visible)
            self.early += self._picks[key]
        return self._picks[key]

    def group_positions(self, first: int, n: int, ratio: int) -> mx.array:
        """Where compressed groups first .. first + n - 1 of `ratio` positions sit (a group at
        its first position) [n]: the same for every KV-source layer of that ratio in a
        forward, so made once, and so are their RoPE tables (Rope.tables keeps them by
        array)."""
        key = (first, n, ratio)
        if key not in self._groups:  # every ratio-th id from first * ratio on: a view, no launch
            self._groups[key] = key_ids((first + n) * ratio)[first * ratio::ratio]
        return self._groups[key]

    def _on_host(self, positions: mx.array) -> np.ndarray:
        return np.asarray(positions if self.positions is None else self.positions)

    def window(self, positions: mx.array, first: int, n_keys: int, window: int,
               row_invariant: bool, row0: int = 0) -> tuple[mx.array | None, mx.array]:
        """Which window keys each row sees, the same for every layer of a forward (their
        windows hold the same positions in the same rows of their buffers), so computed once:
        (gather index [S, W] of each row's own window, oldest first, or None where rows share
        the keys [n_keys]; mask). row0: the index counts from there (the buffer row of the
        oldest key, where the keys are read from their whole buffer: WindowCache.buffer)."""
        key = (first, n_keys, window, row_invariant, row0)
        if self._window is None or self._window[0] != key:
            pos = self._on_host(positions).astype(np.int64)  # on the host: no launches
            if row_invariant:
                key_pos = pos[:, None] - window + 1 + np.arange(window)[None, :]  # [S, W]
                # buffer rows row0 .. row0 + n_keys - 1 hold positions first .. first + n_keys - 1
                index = mx.array(np.clip(key_pos - (first - row0), row0, row0 + n_keys - 1), dtype=mx.int32)
                mask = mx.array(key_pos >= max(first, 0))
            else:
                key_pos = first + np.arange(n_keys)
                index = None
                mask = mx.array((key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window))
            self._window = (key, index, mask)
        return self._window[1], self._window[2]


class Attention(nn.Module):
    """Sliding-window attention plus, on compressed layers, the indexer's top-k compressed keys.

    One shared 512-d latent serves as key and value for all heads (MQA). The
    output loses the query RoPE again (inverse rotation) before the grouped
    low-rank output projection.
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.window = args.sliding_window
        self.ratio = args.compress_ratios[layer_id]
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.scale = self.head_dim ** -0.5
        self.eps = args.rms_norm_eps
        dim = args.hidden_size

        self.attn_sink = mx.zeros((self.n_heads,), dtype=F32)
        self.row_invariant = False  # set through Model.decode_rows
        # wq_a and wkv, both fed the layer's quantised input, stacked at load (wq_a's rows
        # first: checkpoint.stack_wq_a_wkv), so that a GPU makes both in one launch
        self.q_lora_rank = args.q_lora_rank
        self.wq_a_wkv = Fp8Linear(dim, args.q_lora_rank + self.head_dim)
        self.q_norm = RMSNorm(args.q_lora_rank, self.eps)
        self.wq_b = Fp8Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = Fp8Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank)
        self.wo_b = Fp8Linear(self.n_groups * self.o_lora_rank, dim)
        self._pair_ids = index_range(MAX_CONSTANT_ROWS * self.n_groups)  # wo_a's (row, group) pairs

        is_backbone = layer_id < args.num_hidden_layers
        self.is_kv_source = is_backbone and layer_id in args.kv_source_layer_ids
        self.is_index_source = is_backbone and layer_id in args.index_source_layer_ids
        self.kv_source = args.kv_source_of(layer_id) if self.ratio and is_backbone else None
        self.n_picks = args.index_topk if self.ratio else 0  # the indexer pads its picks to index_topk
        if self.is_kv_source:
            self.compressor = Compressor(args, self.ratio)
        if self.is_index_source:
            self.indexer = Indexer(args, layer_id, owns_keys=self.is_kv_source)

        rd = args.qk_rope_head_dim
        if self.ratio:
            self.rope = shared_rope(rd, args.compress_rope_theta, args.original_max_position_embeddings,
                                    args.rope_factor, args.beta_fast, args.beta_slow)
        else:  # window-only layers and DSpark stages: plain RoPE, no YaRN
            self.rope = shared_rope(rd, args.rope_theta)

    # rope: self.rope.tables(positions, self.head_dim), computed outside these compiled
    # methods so that every layer of a forward shares them
    # xq: the attention input through quant.fp8_input, once for both wq_a and wkv
    # rope_in_kernel: the attention kernel rotates q, and its output back, itself
    # (kernels.sparse_attention_rows), so queries leaves q unrotated and output skips the
    # inverse rotation: two launches fewer per layer
    # real: only the first `real` rows matter (a padded forward's, SharedAttention.real_rows):
    # on a GPU the FP8 GEMMs compute those alone (Fp8Linear)
    @fused("wq_a_wkv", "q_norm", "wq_b")
    def queries(self, xq: mx.array, rope: tuple, rope_in_kernel: bool = False,
                real: int | None = None) -> tuple[mx.array, mx.array]:
        """q [S, H, D] with RoPE (with rope_in_kernel unrotated, as wq_b gives it: [S, H * D]),
        and the normed low-rank qr [S, q_lora] through fp8_input, as wq_b takes it and the
        indexer's wq_b reuses it."""
        qr = self.q_norm.quantized(self.wq_a_wkv.quantized_rows(xq, 0, self.q_lora_rank, real))
        return self._queries(qr, rope, rope_in_kernel, real), qr

    @fused("wq_a_wkv", "kv_norm")
    def latent_kv(self, xq: mx.array, rope: tuple, real: int | None = None) -> mx.array:
        """Window keys [S, D]: normed, RoPE'd, FP8 fake-quantised over the whole latent."""
        return self.latent_kv_of(self.wq_a_wkv.quantized_rows(xq, self.q_lora_rank, None, real), rope)

    @fused("wq_a_wkv", "q_norm", "wq_b", "kv_norm")
    def queries_and_latent_kv(self, xq: mx.array, rope: tuple, rope_in_kernel: bool = False,
                              real: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """queries' (q, qr) and latent_kv's keys from one input, the same bits as the two
        methods. On a GPU wq_a and wkv run in one launch (kernels.fp8_gemv_pair), and q_norm
        and kv_norm in one more, which reads the two products where that launch put them
        (kernels.rms_norm_halves: no views of them)."""
        pair, split = self.wq_a_wkv, self.q_lora_rank
        one_eps = self.q_norm.eps == self.kv_norm.eps  # (the pair launches take one)
        if one_eps and kernels.fp8_gemv_pair_fits(xq, pair.weight, split):
            both = kernels.fp8_gemv_pair(xq, pair.weight, pair.scales, split, real_rows=real)
            qr, keys = kernels.rms_norm_halves(both, xq.shape[0], split, self.q_norm.weight, self.kv_norm.weight,
                                               self.kv_norm.eps, gemm_input_dtype(), both.dtype,
                                               self._latent_rope(rope))
            return self._queries(qr, rope, rope_in_kernel, real), qr, keys
        a, kv = pair.quantized_pair(xq, split, real)
        if not (one_eps and kernels.rms_norm_pair_fits(a, kv)):
            qr = self.q_norm.quantized(a)
            return self._queries(qr, rope, rope_in_kernel, real), qr, self.latent_kv_of(kv, rope)
        qr, keys = kernels.rms_norm_pair(a, self.q_norm.weight, kv, self.kv_norm.weight, self.kv_norm.eps,
                                         gemm_input_dtype(), kv.dtype, self._latent_rope(rope))
        return self._queries(qr, rope, rope_in_kernel, real), qr, keys

    def _queries(self, qr: mx.array, rope: tuple, rope_in_kernel: bool, real: int | None) -> mx.array:
        """queries' q from the normed qr: [S, H, D], or as wq_b gives it, [S, H * D], where the
        attention kernel rotates it (it reads either; no view to reshape it)."""
        q = self.wq_b.quantized(qr, real)
        return q if rope_in_kernel else Rope.apply(q.reshape(qr.shape[0], self.n_heads, self.head_dim), rope)

    def latent_kv_of(self, kv: mx.array, rope: tuple) -> mx.array:
        """latent_kv from wkv's product kv [S, D]. On a GPU the norm, the rotation and the
        fake-quant are one kernel (kernels.rms_norm)."""
        if kernels.rms_norm_fits(kv, quantized=True, rotated=True):
            return rms_norm(kv, self.kv_norm.weight, self.kv_norm.eps, quantize_to=kv.dtype,
                            rope=self._latent_rope(rope))
        return fp8_fake_quant(Rope.apply(self.kv_norm(kv), rope))

    def _latent_rope(self, rope: tuple) -> tuple[mx.array, mx.array, int]:
        """The RoPE tables as the RMSNorm kernel rotates the latent [S, D] with them: cos and sin
        [S, D / 2, 2] as they are (the kernel reads them as [S, D]: the same values in the
        same order, no view), and how many features rotate."""
        return rope[0], rope[1], self.rope.dims

    @fused("wo_a", "wo_b")
    def output(self, o: mx.array, rope: tuple, rope_in_kernel: bool = False, real: int | None = None,
               onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """Undo the query RoPE (unless rope_in_kernel: undone already), then the grouped wo_a
        (block-diagonal) and wo_b. onto: wo_b puts its output into that stream
        (Fp8Linear.into_stream) and this returns its (h, mix_parts)."""
        S = o.shape[0]
        o = o if rope_in_kernel else Rope.apply(o, rope, inverse=True)
        # wo_a is applied to bf16 activations as stored (the reference dequantises it, no act-quant)
        if kernels.fp8_gemv_fits(o, self.wo_a.weight, groups=self.n_groups):  # a decode or verify step on a GPU
            # o [S, H, D] read as [S, groups, in], wo_a's rows as its groups' matrices: no views
            o = kernels.fp8_gemv(o, self.wo_a.weight, self.wo_a.scales, real_rows=real, groups=self.n_groups)
            return self.wo_b(o, real) if onto is None else self.wo_b.into_stream(o, onto, real)
        w = self.wo_a.weight.reshape(self.n_groups, self.o_lora_rank, -1)
        s = self.wo_a.scales.reshape(self.n_groups, self.o_lora_rank, -1)
        groups = self._pair_ids[: self.n_groups]
        if S <= MAX_CONSTANT_ROWS:  # each (row, group) pair a product of one row
            o = o.reshape(S, self.n_groups, 1, -1)  # [S, groups, 1, in]
            pairs = self._pair_ids[: S * self.n_groups].reshape(S, -1)
            o = mx.gather_qmm(o.astype(gemm_input_dtype()), w, s, lhs_indices=pairs, rhs_indices=groups,
                              transpose=True, mode="mxfp8").reshape(S, -1)
        else:  # a prompt's chunk: the rows sorted by group, so that MLX runs each group's as one GEMM
            # (as (row, group) pairs it ran a matrix-vector product each: 7x as long on the H200)
            o = o.reshape(S, self.n_groups, -1).astype(gemm_input_dtype()).transpose(1, 0, 2)  # [groups, S, in]
            o = mx.gather_qmm(o.reshape(self.n_groups * S, 1, -1), w, s, rhs_indices=mx.repeat(groups, S),
                              transpose=True, mode="mxfp8", sorted_indices=True)
            o = o.reshape(self.n_groups, S, -1).transpose(1, 0, 2).reshape(S, -1)
        o = o.astype(BF16)
        return self.wo_b(o) if onto is None else self.wo_b.into_stream(o, onto, real)

    def __call__(self, x: mx.array, positions: mx.array, cache: LayerCache, caches: list[LayerCache],
                 shared: SharedAttention, xq: mx.array | None = None,
                 onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """xq: x through quant.fp8_input, where the caller has it already. onto: the output goes
        into that stream (output's onto)."""
        S = x.shape[0]
        rope = shared.rope_tables(self.rope, positions, self.head_dim)
        xq = fp8_input(x) if xq is None else xq
        # the attention kernel (rows that gather their own windows, on a GPU) takes q unrotated:
        # decided from the shapes it will have, before q exists
        kernel = self.row_invariant and kernels.attention_fits((S, self.n_heads, self.head_dim), BF16,
                                                               self.window, self.n_picks)
        real = shared.real_rows
        q, qr, kv = self.queries_and_latent_kv(xq, rope, kernel, real)
        keys, first = cache.window.update(kv)
        # row_invariant: each row gathers its own window, oldest first: the same array for a
        # position whichever forward it is computed in, so its reductions run in the same order.
        # It gathers from the keys' whole buffer, which keeps its shape across forwards where
        # the kept keys' view grows and slides (and is no view to make)
        ring, row0 = cache.window.buffer(first) if self.row_invariant else (keys, 0)
        index, window_mask = shared.window(positions, first, keys.shape[0], self.window, self.row_invariant, row0)

        kv = ids = picked_mask = None
        if self.ratio:
            if self.is_kv_source:
                self._compress(x, positions, cache, shared)
            source = caches[self.kv_source].compressor
            if self.is_index_source:
                shared.topk = None
                visible = shared.visible(positions, self.ratio)
                if source.n_groups:
                    shared.topk = self.indexer(x, qr, positions, source.index_keys, visible, self.rope, shared)
            if shared.topk is not None:
                # the pooled groups' whole buffer (group g at row g), which the picks index
                kv, (ids, picked_mask) = source.kv_buffer, shared.topk
        if kernel:
            return self.attention_and_output(q, ring, index, window_mask, kv, ids, picked_mask, self.attn_sink, rope,
                                             real, onto)
        window_keys = keys if index is None else ring[index]  # [N, D] shared, or [S, W, D] per row
        picked = None if ids is None else kv[ids]  # [S, k, D]
        o = sparse_attention(q, window_keys, window_mask, picked, picked_mask, self.attn_sink, self.scale)
        return self.output(o, rope, kernel, real, onto)

    @fused("wo_a", "wo_b")
    def attention_and_output(self, q: mx.array, ring: mx.array, index: mx.array, window_mask: mx.array,
                             kv: mx.array | None, ids: mx.array | None, picked_mask: mx.array | None,
                             sink: mx.array, rope: tuple, real: int | None,
                             onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """The attention kernel's path (rows that gather their own windows, on a GPU): one launch
        that rotates q, gathers each row's keys from the buffers as they are (ring [R, D] by
        index, kv [T, D] by ids) and rotates its output back (spec: the rotations in queries
        and output around sparse_attention), then output's projections. Compiled with them:
        its arguments keep their shapes from forward to forward (the buffers change theirs
        only when they move), so a forward replays the trace. sink: attn_sink (an argument: a
        compiled method takes its own arrays through their modules, and this one has none)."""
        o = kernels.sparse_attention_rows(q, ring, index, window_mask, kv, ids, picked_mask, sink, self.scale, rope,
                                          self.rope.dims, real)
        return self.output(o, rope, True, real, onto)

    def _compress(self, x: mx.array, positions: mx.array, cache: LayerCache, shared: SharedAttention) -> None:
        """Pool finished groups; store their index keys and RoPE'd FP4 compressed KV."""
        state = cache.compressor
        latent, first_group = self.compressor(x, state)
        if latent is None:
            return
        if self.ratio == 1:  # a group per position, this forward's: their RoPE tables are the layer's
            group_pos = positions
        else:
            group_pos = shared.group_positions(first_group, latent.shape[0], self.ratio)
        # the latent's rotation first: the index keys' narrower one then takes a view of its tables
        tables = shared.rope_tables(self.rope, group_pos, latent.shape[-1])
        kv = fp4_fake_quant(Rope.apply(latent, tables), 16, "e4m3")
        state.append_groups(kv, self.indexer.keys(latent, group_pos, self.rope))


# ------------------------------------------------------------------------- MoE

class Fp4Stack(nn.Module):
    """One projection of every routed expert: release FP4 bits in MLX `mxfp4` layout.

    weight [E, out, in/8] uint32 (eight E2M1 codes, first in the low nibble),
    scales [E, out, in/32] E8M0 bytes.
    """

    def __init__(self, n_experts: int, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((n_experts, out_dims, in_dims // 8), dtype=mx.uint32)
        self.scales = mx.zeros((n_experts, out_dims, in_dims // 32), dtype=mx.uint8)

    def __call__(self, x: mx.array, ids: mx.array, sorted_ids: bool = False, rows: mx.array | None = None,
                 quantize: bool = False, swiglu: kernels.SwiGLU | None = None) -> mx.array:
        """x [N, 1|k, 1, in] FP8-rounded activations through experts ids [N, k] -> bf16
        [N, k, 1, out]: the fp32 products summed in fp32, rounded to bf16 once (MLX's
        gather_qmm; on a GPU, a decode or verify step runs `pairs` instead). sorted_ids: ids
        are in ascending order (MLX then runs each expert's rows as one GEMM). rows: which x
        row each pair takes (default: x's own batch order). quantize: x is a bf16 activation
        to go through quant.fp8_input first. swiglu: this is a w13 stack (gate and up rows
        interleaved); the output is their kernels.swiglu_pairs [.., out / 2]."""
        x = fp8_input(x) if quantize else x
        y = mx.gather_qmm(x.astype(gemm_input_dtype()), self.weight, self.scales, lhs_indices=rows, rhs_indices=ids,
                          transpose=True, mode="mxfp4", sorted_indices=sorted_ids).astype(BF16)
        return y if swiglu is None else kernels.swiglu_pairs(y, swiglu)

    def pairs(self, x: mx.array, ids: mx.array, real: int, quantize: bool = False,
              swiglu: kernels.SwiGLU | None = None) -> mx.array:
        """A decode or verify step's (row, expert) pairs on a GPU, where kernels.fp4_experts_fits:
        x [S, in] (each of a row's experts reads its row) or [S, k, in] (pair (r, j) reads
        x[r, j]) through experts ids [S, k], the first `real` rows -> bf16 [real, k, out] (or
        the SwiGLU's [real, k, out / 2]) in one launch that reads each expert's weights once
        for all the rows that picked it. The arrays go in as they are: the kernel indexes them
        itself, so no views of them are made. quantize and swiglu as __call__'s; a bf16 x
        is quantised by the kernel as it reads it where kernels.quantizes_in_kernel."""
        in_kernel = quantize and kernels.quantizes_in_kernel(x, real, matrix_unit=True)
        if quantize and not in_kernel:
            x = fp8_input(x)
        return kernels.fp4_experts(x, self.weight, self.scales, ids, quantize_input=in_kernel, swiglu=swiglu, rows=real)


class Fp4Experts(nn.Module):
    """Every routed expert's SwiGLU projections: w13, the release's w1 (gate) and w3 (up)
    stacked along the outputs at load (one GEMM for both), and w2 (down)."""

    def __init__(self, n_experts: int, dim: int, inter: int):
        super().__init__()
        self.w13 = Fp4Stack(n_experts, dim, 2 * inter)
        self.w2 = Fp4Stack(n_experts, inter, dim)


class Expert(nn.Module):
    """The shared expert: FP8 SwiGLU, w1 (gate) and w3 (up) stacked as w13 at load."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w13, self.w2 = Fp8Linear(dim, 2 * inter), Fp8Linear(inter, dim)
        self.limit = limit

    def __call__(self, xq: mx.array, real: int | None = None, routed: mx.array | None = None,
                 onto: kernels.StreamOnto | None = None,
                 after: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """xq: the input through quant.fp8_input (shared with the routed experts); real: the
        rows that matter, the first `real` (on a GPU the others come out zeros; Fp8Linear).
        routed: the routed experts' outputs [real, k, dim] bf16, added to this one's
        (kernels.parts_added): the MoE's output. onto: w2 puts it into that stream
        (Fp8Linear.into_stream) and this returns (h, mix_parts). after: on a GPU, an array
        w13's launch waits for (kernels.fp8_gemv's)."""
        h = self.w13.quantized(xq, real, kernels.SwiGLU(self.limit), after)
        return self.w2(h, real, routed) if onto is None else self.w2.into_stream(h, onto, real, routed)


class Gate(nn.Module):
    """sqrt-softplus router: the bias picks experts, the unbiased scores weight them."""

    def __init__(self, args: ModelArgs, n_experts: int, top_k: int):
        super().__init__()
        self.weight = mx.zeros((n_experts, args.hidden_size), dtype=F32)  # BF16 in the release, widened at load
        self.bias = mx.zeros((n_experts,), dtype=F32)
        self.top_k, self.temp = top_k, args.gate_temp
        self.normalize, self.route_scale = args.norm_topk_prob, args.routed_scaling_factor
        if args.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {args.scoring_func!r} is not supported (release: sqrtsoftplus)")

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [N, dim] -> (weights [N, k] fp32, expert ids [N, k] in ascending order)."""
        return kernels.moe_gate(x, self.weight, self.bias, self.top_k, self.temp, self.route_scale, self.normalize)


SORT_EXPERTS_AT = 64  # (row, expert) pairs from which the MoE groups them by expert (prefill)
MAX_CONSTANT_ROWS = kernels.DECODE_MAX_ROWS  # forwards up to this many rows (decode, verify) take index constants


@functools.lru_cache(maxsize=None)
def index_range(n: int) -> mx.array:
    """mx.arange(n) as uint32, evaluated once (one array per size, shared by every layer):
    the gathered GEMMs' row and expert indices on the decode path slice it, so that it is
    an input of each forward's graph, not an operation in every layer of it (gather_qmm
    builds one when not given its indices). Called at construction, never while tracing."""
    ids = mx.arange(n, dtype=mx.uint32)
    mx.eval(ids)
    return ids


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        n_experts, top_k = args.moe_shape(layer_id)
        self.gate = Gate(args, n_experts, top_k)
        self.experts = Fp4Experts(n_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = Expert(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)
        self.limit = args.swiglu_limit
        self._pair_ids = index_range(SORT_EXPERTS_AT)

    @fused()
    def __call__(self, x: mx.array, rows: int | None = None, x8: mx.array | None = None,
                 onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """x [N, dim] bf16 -> [N, dim] bf16. x8: x through quant.fp8_input, where the caller has it.
        onto: the output goes into that stream (Expert's onto): -> (h, mix_parts).

        rows: only the first `rows` rows are real (a padded decode forward, Model.decode);
        the others get the shared expert alone. Each (row, expert) pair is its own
        product, so a real row's output is the same bits whatever the padding, and
        the padding reads no expert weights of its own."""
        weights, ids = self.gate(x)
        N, k = ids.shape
        real = N if rows is None else rows
        x8 = fp8_input(x) if x8 is None else x8  # once, for the routed experts and the shared expert
        # y [real, k, dim]: row r's j-th expert's output at [r, j]
        if real * k < SORT_EXPERTS_AT:  # decode and verify: each row through its own k experts
            y = self._routed_rows(x8, weights, ids, real)
        else:  # prefill: the (row, expert) pairs grouped by expert, so each expert's rows form one GEMM
            xq, weights, flat = x8[:real, None, None, :], weights[:real], ids[:real].flatten()
            order = mx.argsort(flat)
            pairs = self._routed(xq[order // k, 0], weights.flatten()[order][:, None, None], flat[order], True)
            y = pairs[mx.argsort(order)].reshape(real, k, -1)
        # the shared expert adds them to its own output, in expert-id order as the reference adds
        # them (kernels.parts_added; on a GPU inside its last GEMM); the padding rows get the
        # shared expert alone (zeros on a GPU). Its w13 waits for the router's picks (`after`):
        # a CUDA graph runs it as soon as its input is ready, and beside the router's two small
        # launches, which a one-row step waits on, it slowed them; beside the routed experts'
        # GEMMs it is hidden (one-row steps A/B'd on the H200, the same replies: docs/benchmarks.md,
        # session 33).
        return self.shared_experts(x8, rows, y, onto, after=ids)

    def _routed_rows(self, x8: mx.array, weights: mx.array, ids: mx.array, real: int) -> mx.array:
        """The routed experts of a decode or verify step: the first `real` rows of x8 [N, dim]
        (through quant.fp8_input), their weights and ids [N, k] -> bf16 [real, k, dim]. On a GPU
        two fp4_experts launches (Fp4Stack.pairs) over the arrays as they are, the SwiGLU
        written by the first; elsewhere _routed's gathered GEMMs, its spec."""
        w13, w2 = self.experts.w13, self.experts.w2
        if kernels.fp4_experts_fits(x8, w13.weight, ids, rows=real):
            h = w13.pairs(x8, ids, real, swiglu=kernels.SwiGLU(self.limit, weights))  # [real, k, inter]
            return w2.pairs(h, ids, real, quantize=True)
        weights, ids = weights[:real, :, None, None], ids[:real]
        return self._routed(x8[:real, None, None, :], weights, ids, False).reshape(real, ids.shape[1], -1)

    def _routed(self, xq: mx.array, weights: mx.array, ids: mx.array, sorted_ids: bool) -> mx.array:
        """The routed experts' SwiGLU, weighted before the down projection (as the reference):
        xq [N, 1|k, 1, dim] through experts ids [N, k] (or [N] sorted pairs) -> bf16 [.., 1, dim]."""
        rows = pairs = None  # each pair's row of x, then of h: index constants on the decode path
        if not sorted_ids and ids.size <= self._pair_ids.size:
            N, k = ids.shape
            rows, pairs = self._pair_ids[:N, None], self._pair_ids[: N * k].reshape(N, k)
        h = self.experts.w13(xq, ids, sorted_ids, rows, swiglu=kernels.SwiGLU(self.limit, weights))
        return self.experts.w2(h, ids, sorted_ids, pairs, quantize=True)  # bf16


# ----------------------------------------------------------------------- block

class Block(nn.Module):
    """Engram (some layers) -> hc attention -> hc MoE. Returns the stream and the next pre-mix."""

    attention_cls = Attention

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn = self.attention_cls(args, layer_id)
        self.ffn = MoE(args, layer_id)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hc_attn = HyperConnection(args)
        self.hc_ffn = HyperConnection(args)
        if layer_id in args.engram_layer_ids:
            self.engram = Engram(args, layer_id)

    def __call__(self, h: mx.array | Expansion | Folded, pre: mx.array, positions: mx.array, *attn_args,
                 rows: int | None = None, expand: bool = True,
                 next_fn: mx.array | None = None) -> tuple[mx.array | Expansion | Folded, mx.array]:
        """h [S, hc, dim] bf16, or the previous block's Expansion or Folded; pre [S, hc] -> (h, pre
        for the next block). rows: how many of the S rows are real (the rest pad a decode forward).
        expand=False: h is returned as an Expansion of the MoE's output, for the next block, or,
        given the next block's attention mix projection next_fn (its hc_attn.fn) and where
        kernels.fp8_into_stream_fits, as a Folded: the MoE's last GEMM put its output into the
        stream and began the next block's mixes. The attention's output goes into the stream
        the same way where it fits (else the MoE's input kernel expands it): on a GPU a
        sub-layer output is expanded by no launch of its own, but where a block's output meets
        an engram layer or ends the forward."""
        if isinstance(h, Folded):
            x, xq, *attn_mix = self.folded_attn_input(*h, pre)
            h = h.h
        elif isinstance(h, Expansion):
            h, x, xq, *attn_mix = self.expanded_attn_input(*h, pre)
        else:
            x, xq, *attn_mix = self.attn_input(h, pre)
        if kernels.fp8_into_stream_fits(self.attn.wo_b.weight, h):
            h, parts = self.attn(x, positions, *attn_args, xq=xq,
                                 onto=kernels.StreamOnto(h, attn_mix[1], attn_mix[2], self.hc_ffn.fn))
            x, xq, *ffn_mix = self.folded_ffn_input(h, parts, attn_mix[0])
        else:
            x = self.attn(x, positions, *attn_args, xq=xq)
            h, x, xq, *ffn_mix = self.ffn_input(x, h, *attn_mix)
        if not expand and next_fn is not None and kernels.fp8_into_stream_fits(self.ffn.shared_experts.w2.weight, h):
            return Folded(*self.ffn(x, rows, xq, kernels.StreamOnto(h, ffn_mix[1], ffn_mix[2], next_fn))), ffn_mix[0]
        out = Expansion(self.ffn(x, rows, xq), h, *ffn_mix[1:])
        return (out.value() if expand else out), ffn_mix[0]

    @fused("hc_attn", "attn_norm")
    def attn_input(self, h: mx.array, pre: mx.array) -> tuple[mx.array, ...]:
        """The attention's normed input, that through fp8_input, and this sub-layer's mixes
        (pre, post, comb)."""
        x, xq, mix = self.hc_attn.sublayer_input(h, pre, self.attn_norm)
        return x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_attn", "attn_norm")
    def expanded_attn_input(self, y: mx.array, residual: mx.array, post: mx.array, comb: mx.array,
                            pre: mx.array) -> tuple[mx.array, ...]:
        """attn_input of the previous block's Expansion (y, residual, post, comb), collapsed by
        pre: (h, x, xq, pre, post, comb), h the expanded stream."""
        h, x, xq, mix = self.hc_attn.expanded_input(y, residual, HcMixes(pre, post, comb), self.attn_norm)
        return h, x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_attn", "attn_norm")
    def folded_attn_input(self, h: mx.array, parts: mx.array, pre: mx.array) -> tuple[mx.array, ...]:
        """attn_input of the previous block's Folded stream h and mix parts: (x, xq, pre, post,
        comb)."""
        x, xq, mix = self.hc_attn.input_from_parts(h, parts, pre, self.attn_norm)
        return x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_ffn", "ffn_norm")
    def folded_ffn_input(self, h: mx.array, parts: mx.array, pre: mx.array) -> tuple[mx.array, ...]:
        """The MoE's input from the stream h that the attention's wo_b made with this sub-layer's
        mix parts (Attention.output's onto): (x, xq, pre, post, comb)."""
        x, xq, mix = self.hc_ffn.input_from_parts(h, parts, pre, self.ffn_norm)
        return x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_ffn", "ffn_norm")
    def ffn_input(self, x: mx.array, h: mx.array, *attn_mix: mx.array) -> tuple[mx.array, ...]:
        """The attention's output expanded into the stream, then the MoE's normed input, that
        through fp8_input, and its sub-layer's mixes: (h, x, xq, pre, post, comb)."""
        h, x, xq, mix = self.hc_ffn.expanded_input(x, h, HcMixes(*attn_mix), self.ffn_norm)
        return h, x, xq, mix.pre, mix.post, mix.comb


class Head(nn.Module):
    """Vocabulary projection: fp32 logits, as the reference computes them (x and the weight
    widened to float32, then a float32 matmul: kernels.head_logits_reference).

    The weight stays BF16, as the release stores it. A decode or verify forward on a GPU
    (up to 16 rows, or prefill's last row) runs kernels.head_logits, which reads those bytes
    once for all rows and sums each row in one order at any row count; elsewhere the spec
    widens the weight a slice at a time."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = mx.zeros((vocab, dim), dtype=BF16)

    def __call__(self, x: mx.array, real_rows: int | None = None) -> mx.array:
        if kernels.head_logits_fits(x, self.weight):
            return kernels.head_logits(x, self.weight, real_rows=real_rows)
        return kernels.head_logits_reference(x, self.weight)


class Model(nn.Module):
    """DeepSeek-V4.1: embed -> hc copies -> blocks -> collapse -> norm -> head.

    `model(ids, cache)` runs any number of new positions (prefill chunk, one
    decode step, or a verify block) and returns fp32 logits [1, S, vocab] and
    the DSpark features [1, S, len(dspark_target_layer_ids) * dim]: the mean
    over hc copies of the stream entering each target layer.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed.weight = self.embed.weight.astype(BF16)
        self.layers = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Head(args.vocab_size, args.hidden_size)
        self.hasher = NgramHasher(args) if args.engram_layer_ids else None
        self.mtp = []
        if args.has_dspark:
            from .dspark import DSparkStage, Drafter

            self.mtp = [DSparkStage(args, k) for k in range(args.num_nextn_predict_layers)]
        # the drafter (a plain attribute, not a module: its weights are the mtp stages above)
        self.drafter = Drafter(self) if self.mtp else None
        on_gpu = mx.default_device() == mx.gpu
        self.decode_rows = -(-(args.dspark_block_size + 1) // 8) * 8 if on_gpu else None
        # Start each block on the device as soon as its graph is built (mx.async_eval), so
        # that Python builds block i+1 while the device runs block i, instead of building
        # the whole forward first with the device idle. The same graph, the same bits.
        self.overlap_build = on_gpu
        # ... and on a thread of its own, so that MLX encodes block i while Python builds
        # block i + 1 (evaluate_on_thread; on the H200, session 23: a one-row decode step 1.44x
        # faster on a slow host, the same on a fast one)
        self._evaluator: BlockEvaluator | None = BlockEvaluator() if on_gpu else None
        # decode_ahead builds the whole forward while the device still runs the one before,
        # its engram rows read into a buffer made once (engram.StagedRows) when the token is
        # known; see decode_ahead
        self.build_ahead = on_gpu
        # ... and starts all of it before the token is known, the engram rows read behind a
        # gate on the device that the host opens once it has written them (kernels.rows_gate)
        self.gate_rows = kernels.rows_gate_fits()

    @property
    def evaluate_on_thread(self) -> bool:
        """Whether overlap_build's mx.async_eval of each block runs on a thread of its own
        (evaluator.BlockEvaluator: MLX encodes block i while Python builds block i + 1), the
        forward's graph then built on that thread's stream. The same graph, the same bits."""
        return self._evaluator is not None

    @evaluate_on_thread.setter
    def evaluate_on_thread(self, on: bool) -> None:
        self._evaluator = switched(self._evaluator, on)

    @property
    def decode_rows(self) -> int | None:
        """Rows every decode / verify forward is padded to (None: no padding).

        GPU matrix kernels pick their algorithm, and so their summation order,
        by shape: a 1-row decode and a 6-row verify would then round a
        position's logits differently and could pick different tokens. Padding
        both to one row count, with each row attending over its own gathered
        window, makes a position's logits the same bits in every forward
        (the losslessness contract). The CPU needs none of this: its kernels
        are row-invariant already (tests/test_model.py)."""
        return self._decode_rows

    @decode_rows.setter
    def decode_rows(self, rows: int | None) -> None:
        self._decode_rows = rows
        for layer in self.layers:
            layer.attn.row_invariant = rows is not None

    def decode(self, ids: list[int], cache: ModelCache) -> tuple[mx.array, mx.array]:
        """A decode or verify forward of a few tokens: logits [1, n, V], features [1, n, F].

        Padded to `decode_rows` rows (the padding is trimmed off the cache again)."""
        n = len(ids)
        rows = self._decode_rows or n
        if n > rows:
            raise ValueError(f"a decode forward takes at most {rows} rows, got {n}")
        return self.padded(ids, cache, rows)

    def padded(self, ids: list[int], cache: ModelCache, rows: int,
               last_logits_only: bool = False) -> tuple[mx.array, mx.array]:
        """A forward of ids padded to `rows` rows (the last token repeated), the padding
        trimmed off the cache again (rows - len(ids) <= cache.TRIM_SLACK): logits [1, n, V]
        (or the last real row's [1, 1, V]) and features [1, n, F] of the n real rows."""
        n = len(ids)
        padded = mx.array([ids + [ids[-1]] * (rows - n)], dtype=mx.int32)
        logits, features = self(padded, cache, last_logits_only, real_rows=n)
        cache.trim(rows - n)
        return (logits if last_logits_only else logits[:, :n]), features[:, :n]

    def takes_whole_stream(self, i: int) -> bool:
        """Whether block i needs the stream whole before it runs (an engram layer adds to it, a
        DSpark target layer taps it), so that a previous block's Expansion is expanded first."""
        return i in self._whole_stream_layers

    @functools.cached_property
    def _whole_stream_layers(self) -> frozenset[int]:
        return frozenset(self.args.engram_layer_ids) | frozenset(self.args.dspark_target_layer_ids)

    @functools.cached_property
    def _folds_into_next(self) -> tuple[bool, ...]:
        """Whether block i may put its output into the next block's stream (block_forward's
        next_fn): there is a next block and it has no engram (which adds to the stream first)."""
        return tuple(i + 1 < len(self.layers) and i + 1 not in self._engram_layers for i in range(len(self.layers)))

    @functools.cached_property
    def _engram_layers(self) -> tuple[int, ...]:
        """The blocks with an engram, found once: asking each block (hasattr on a module that
        lacks the attribute raises and catches an AttributeError) cost ~65 us a forward on
        the CPU, before any of its work reaches the device."""
        return tuple(i for i, layer in enumerate(self.layers) if hasattr(layer, "engram"))

    def block_forward(self, i: int, h: mx.array | Expansion | Folded, pre: mx.array, positions: mx.array,
                      cache: ModelCache, shared: SharedAttention, engram_rows: mx.array | None = None,
                      real_rows: int | None = None,
                      features: list[mx.array] | None = None) -> tuple[mx.array | Expansion | Folded, mx.array]:
        """Block i of a forward (__call__'s loop; bench.py's per-layer runs): the stream taken
        whole first where the block needs it so (takes_whole_stream), the engram's table rows
        added (engram_rows: its unpack_rows values, for an engram layer), the DSpark features
        tapped (appended to `features`, where given), then the block. Each
        block hands the next its output unexpanded (Expansion) or put into the stream with the
        next block's mixes begun (Folded; not into an engram layer, which adds to the stream
        first); the last expands it."""
        layers = self.layers
        layer = layers[i]
        if self.takes_whole_stream(i) and isinstance(h, Expansion):
            h = h.value()  # (a Folded holds its stream whole, and the next block's mixes begun)
        if engram_rows is not None:
            h = layer.engram(stream_value(h), engram_rows, real_rows)
        if features is not None and i in self.args.dspark_target_layer_ids:
            features.append(copies_mean(stream_value(h)))
        next_fn = layers[i + 1].hc_attn.fn if self._folds_into_next[i] else None
        return layer(h, pre, positions, cache.layers[i], cache.layers, shared, rows=real_rows,
                     expand=i == len(layers) - 1, next_fn=next_fn)

    def make_cache(self) -> ModelCache:
        return ModelCache([LayerCache(self.args.sliding_window,
                                      self.args.compress_ratios[i] if layer.attn.is_kv_source else 0)
                           for i, layer in enumerate(self.layers)])

    def __call__(self, ids: mx.array, cache: ModelCache | None = None, last_logits_only: bool = False,
                 real_rows: int | None = None) -> tuple[mx.array, mx.array]:
        """ids [1, S] -> (logits [1, S, V], features [1, S, F]). real_rows: only the first
        real_rows positions matter (the rest pad a decode forward and are trimmed off again)."""
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"ids must have shape [1, n]; got {ids.shape}")
        cache = cache if cache is not None else self.make_cache()
        # ids' values on the host: where ids was made from them, no GPU work (ids[0].tolist() would
        # gather on the GPU and wait for it)
        return _result(self._forward(ids, cache, np.asarray(ids)[0].tolist(), last_logits_only, real_rows))

    def decode_ahead(self, token: mx.array, cache: ModelCache, on_forward_stream: bool = False) -> DecodeAhead:
        """decode([t], cache) begun while the token t (token: int [1], as sampling.sample makes it)
        is still being computed: the forward's first block, which reads no engram, is built and
        started on the device at once, and the rest waits for t on the host (DecodeAhead.finish).
        So the device runs block 0 straight after the work that makes t, where decode would
        leave it idle while the host reads t back and builds block 0 (docs/benchmarks.md,
        session 30: the device's first work ~1.2 ms into an 18 ms step). The same graph, the
        same bits as decode.

        Where build_ahead (a GPU's default), the rest is built now as well, every block and the
        head, and only started by finish, once t's engram rows are written into the buffer the
        graph reads (engram.StagedRows, one per cache): the host builds a forward while the
        device runs the one before, and at the step's boundary only reads t, hashes it, writes
        its rows and starts the blocks built. Where gate_rows as well (CUDA's default), the
        blocks are started now, the engram rows read through a gate on the device that the host
        opens once it has written them (kernels.rows_gate): at the boundary the device waits
        only for the host to read t, hash it and write its rows, not for its launches to be
        encoded (on the H200, session 45: a one-row step 13.8 ms at the median against 15.2,
        the same replies). finish(t, settle=False) then returns while the
        evaluator's thread still starts them, for a caller whose next call is decode_ahead
        (which settles it) or settle: generate_step's loop. on_forward_stream: the token was
        drawn under forward_stream(), so the evaluator's thread starts its work straight after
        the forward before's blocks, before the host builds this forward (otherwise this thread
        starts it once the thread has started them all, after the build)."""
        rows = self._decode_rows or 1
        # the forward reads t through a node of its own (same buffer): the caller waits for
        # `token` while the evaluator's thread may still be starting block 0 (evaluator.py: why
        # the two must not share an array)
        queued = self.build_ahead and on_forward_stream and self._building_evaluator is not None
        with self.forward_stream() if queued else contextlib.nullcontext():
            feed = mx.stop_gradient(token)
        if not self.build_ahead:
            mx.async_eval(token, feed)  # t's work started from this thread, before the evaluator's may read it
            forward = self._forward(feed, cache, None, False, 1, rows)
            next(forward)  # up to where it waits for the token
            return DecodeAhead(forward, cache, rows, self._blocks_before_tokens)
        if queued:
            self._evaluator.submit(token, feed)  # after the forward before's blocks, on its thread
            token_started = self._evaluator.mark()
        forward = self._forward_built_ahead(feed, cache, rows)
        begun = DecodeAhead(forward, cache, rows, len(self.layers), self.settle, self.forward_stream)
        try:
            next(forward)  # every block built, none started
            if not queued:
                self.settle()  # the forward before started whole: this thread may start t's work
                mx.async_eval(token, feed)
            forward.send(None)  # the blocks that need no tokens started (all of them, where gated)
            if queued:  # the caller then waits for t: the thread must be done with t's work (not with the blocks)
                self._evaluator.drain(token_started)
        except BaseException:  # (the evaluator drained; the cache, as after any failed forward, not to be reused)
            forward.close()
            raise
        return begun

    def forward_stream(self):
        """A context manager: the stream forwards build their graphs on (the evaluator's, where
        overlap_build starts their blocks on its thread; else the caller's own). What is built
        under it from a forward's outputs may be handed to that thread: decode_ahead's
        on_forward_stream."""
        evaluator = self._building_evaluator
        return mx.stream(evaluator.stream) if evaluator is not None else contextlib.nullcontext()

    @property
    def _building_evaluator(self) -> BlockEvaluator | None:
        """The evaluator forwards hand their blocks to as they are built: the model's, where
        overlap_build."""
        return self._evaluator if self.overlap_build else None

    def settle(self) -> None:
        """Wait until the evaluator's thread has started everything handed to it (nothing to wait
        for without one): before this thread evaluates, or waits for, anything a forward built
        (DecodeAhead.finish(t, settle=False) returns without it)."""
        if self._evaluator is not None:
            self._evaluator.drain()

    @functools.cached_property
    def _blocks_before_tokens(self) -> int:
        """The blocks a forward builds before it needs its tokens on the host (decode_ahead):
        block 0, unless it has an engram (whose table rows the tokens pick)."""
        return 0 if 0 in self._engram_layers else 1

    def _forward(self, ids: mx.array, cache: ModelCache, tokens: list[int] | None, last_logits_only: bool,
                 real_rows: int | None, rows: int = 1):
        """A forward of positions cache.offset.., as a generator that returns (logits, features).
        tokens: ids' values on the host; or None, where ids is a token [1] still being computed on
        the device (decode_ahead; a forward of `rows` rows, the token on each): then it builds its
        first _blocks_before_tokens blocks from ids alone and waits for the tokens (`tokens =
        yield`) before the rest. Each block is started as it is built where overlap_build (on
        the evaluator's thread, with the graph built on its stream: only while building, so that
        the caller's own work while the forward waits stays on the caller's stream); the
        evaluator is drained on the way out, also where the generator is closed at its wait."""
        evaluator, building, begin = self._starting()

        def blocks(first: int, last: int, engram_values: dict[int, mx.array]) -> None:
            nonlocal h, pre
            for i in range(first, last):
                h, pre = self.block_forward(i, h, pre, positions, cache, shared, engram_values.get(i), real_rows,
                                            features)
                begin(h, pre)

        try:
            with building():
                if tokens is None:  # the token on each row: a view, made on the stream the forward is built on
                    ids = mx.broadcast_to(ids.astype(mx.int32).reshape(1, 1), (1, rows))
                positions, h, pre, shared = self._forward_start(ids, cache, real_rows)
                features = []
                ahead = self._blocks_before_tokens if tokens is None else 0
                blocks(0, ahead, {})
            if tokens is None:
                tokens = yield
            with building():
                blocks(ahead, len(self.layers), self._engram_values(cache, tokens, real_rows, begin))
                logits, feats = self._forward_end(h, pre, features, last_logits_only, real_rows)
                if evaluator is not None:
                    evaluator.submit(logits, feats)
        finally:
            if evaluator is not None:
                evaluator.drain()  # before the caller evaluates anything itself
        return logits, feats

    def _forward_built_ahead(self, token: mx.array, cache: ModelCache, rows: int):
        """decode_ahead's forward where build_ahead, as a generator: it builds every block and
        the head from the token [1] still being computed (a forward of `rows` rows, the first
        real, the token on each), the engram layers reading the cache's StagedRows, and starts
        nothing (next); then starts the blocks that need no tokens (send(None)); then, sent the
        tokens, writes their engram rows into the StagedRows, appends them to the cache, starts
        the rest and returns (logits, features) without draining the evaluator (the caller
        settles it). Closed or failing, it drains the evaluator on the way out.

        Gated (gate_rows, where kernels.rows_gate_fits): the engram rows are read through a gate
        (StagedRows.values(gated=True)), and send(None) starts every block: the device waits at
        the gate until the host, sent the tokens, has written the rows and released it, and the
        evaluator's thread has queued the forward's launches meanwhile. A gate begun is released
        however the generator ends (closed: the forward runs on the rows before, its results
        dropped)."""
        evaluator, building, begin = self._starting()
        settled = gate_begun = False
        try:
            with building():
                ids = mx.broadcast_to(token.astype(mx.int32).reshape(1, 1), (1, rows))
                positions, h, pre, shared = self._forward_start(ids, cache, 1)
                staged = self._staged_rows(cache, rows)
                gated = staged is not None and self.gate_rows
                values = dict(zip(self._engram_layers, staged.values(gated))) if staged is not None else {}
                features, built = [], []
                for i in range(len(self.layers)):
                    h, pre = self.block_forward(i, h, pre, positions, cache, shared, values.get(i), 1, features)
                    built.append((h, pre))
                logits, feats = self._forward_end(h, pre, features, False, 1)
            yield
            ahead = self._blocks_before_tokens
            for arrays in built[:ahead]:
                begin(*arrays)
            begin(*shared.early)
            rest = ([tuple(values.values())] if values else []) + built[ahead:] + [(logits, feats)]  # the rows first
            if gated:  # queued on the device now, behind the gate, rather than after the rows' write
                gate_begun = True
                for arrays in rest:
                    begin(*arrays)
                rest = []
            tokens = yield
            if staged is not None:
                staged.write(self._engram_reads(self.hasher(cache.tokens, tokens[:1])))
            cache.tokens.extend(tokens)
            if gate_begun:
                gate_begun = False
                staged.release()
            for arrays in rest:
                begin(*arrays)
            settled = True
        finally:
            if gate_begun:  # abandoned, or failed, with its gate begun: the device goes on (on the rows before)
                staged.release(check=False)
            if evaluator is not None and not settled:
                evaluator.drain()
        return logits, feats

    def _starting(self):
        """How a forward starts its blocks: (the evaluator or None, a context manager for the
        stream its graph is built on, begin(*arrays): start them on the device now, where
        overlap_build)."""
        evaluator = self._building_evaluator

        def begin(*arrays: mx.array) -> None:
            if evaluator is not None:
                evaluator.submit(*arrays)
            elif self.overlap_build:
                mx.async_eval(*arrays)

        return evaluator, self.forward_stream, begin

    def _forward_start(self, ids: mx.array, cache: ModelCache, real_rows: int | None):
        """A forward's inputs to block 0 for ids [1, S] at positions cache.offset..: (positions, h
        [S, hc, dim], pre [S, hc], the layers' SharedAttention)."""
        start, S = cache.offset, ids.shape[1]
        h, pre = hc_expand(self.embed(ids.reshape(-1)), self.args.hc_mult)
        return positions_of(start, S), h, pre, SharedAttention(real_rows, np.arange(start, start + S))

    def _forward_end(self, h, pre, features: list[mx.array], last_logits_only: bool,
                     real_rows: int | None) -> tuple[mx.array, mx.array]:
        """The last block's stream -> (logits [1, S or 1, V], features [1, S, F])."""
        S = pre.shape[0]
        x = self.norm(hc_pre(h, pre))
        if last_logits_only:
            last = S if real_rows is None else real_rows
            x, real_rows = x[last - 1: last], None
        logits = self.head(x, real_rows)[None]
        feats = mx.concatenate(features, axis=-1)[None] if features else mx.zeros((1, S, 0), dtype=BF16)
        return logits, feats

    def _engram_values(self, cache: ModelCache, tokens: list[int], real_rows: int | None,
                       begin) -> dict[int, mx.array]:
        """A forward's tokens taken in: every engram layer's table rows for their n-grams, read on
        the host and started on the device (`begin`: they read host memory, so as early as the
        tokens are known, while the device waits anyway), and the tokens appended to the cache.
        Only the real rows' n-grams are read (the first real_rows, where a padded forward's):
        a padding row's values are zeros, its outputs discarded anyway. -> {engram layer: its
        rows' values}."""
        real = tokens if real_rows is None else tokens[:real_rows]
        hashes = self.hasher(cache.tokens, real) if self.hasher is not None else None
        layers = list(self._engram_layers)
        packed, layout = pack_rows(self._engram_reads(hashes), len(tokens)) if layers else (None, [])
        cache.tokens.extend(tokens)
        values = dict(zip(layers, unpack_rows(packed, layout)))
        if values:
            begin(*values.values())
        return values

    def _engram_reads(self, hashes: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every engram layer's table rows for a forward's hashes, read on the host (EngramTable.read),
        in layer order. A forward packs them into one array before any of its GPU work is queued
        but a decode_ahead's first block (engram.pack_rows says why), or writes them into its
        StagedRows."""
        return [self.layers[i].engram.table.read(hashes[:, self.hasher.layer_index(i)]) for i in self._engram_layers]

    def _staged_rows(self, cache: ModelCache, rows: int) -> StagedRows | None:
        """The cache's StagedRows for forwards of `rows` rows (made on first use, with a gate
        where gate_rows), None without engram layers."""
        if not self._engram_layers:
            return None
        staged = cache.staged_rows.get(rows)
        if staged is None or (self.gate_rows and staged.flag is None):
            n_cols = (self.args.engram_max_ngram_size - 1) * self.args.engram_n_heads
            shapes = []
            for i in self._engram_layers:
                table = self.layers[i].engram.table
                shapes += [(rows, n_cols, table.codes.shape[1]), (rows, n_cols, table.scales.shape[1])]
            staged = cache.staged_rows[rows] = StagedRows(shapes, gated=self.gate_rows)
        return staged


def _result(forward, tokens: list[int] | None = None) -> tuple[mx.array, mx.array]:
    """A Model._forward generator run on to its (logits, features): started, or sent the tokens it
    waits for. It has its tokens then, so it must not wait again."""
    try:
        forward.send(tokens)
    except StopIteration as done:
        return done.value
    raise AssertionError("a forward waited for tokens it had been given")


class DecodeAhead:
    """A one-token decode forward begun before its token is on the host (Model.decode_ahead):
    its first blocks built and started, the rest waiting for the token (or built and waiting to
    be started, where build_ahead). `finish(t)` builds or starts the rest with the token's value
    t and returns decode's (logits [1, 1, V], features [1, 1, F]); `cancel()` abandons it (a
    caller that stops before the next token) and leaves the cache as it was before."""

    def __init__(self, forward, cache: ModelCache, rows: int, blocks_built: int, settle=None,
                 stream=contextlib.nullcontext):
        self._forward, self._cache, self._rows, self._built = forward, cache, rows, blocks_built
        self._settle = settle  # (where the forward returns without draining the evaluator)
        self._stream = stream  # the stream its outputs' first rows are taken on (the forward's)

    def finish(self, token: int, settle: bool = True) -> tuple[mx.array, mx.array]:
        """The forward for the token's value t (read back from the token decode_ahead was given:
        a forward built ahead reads its engram rows from a buffer the forward before read, so t
        must come after it). settle=False: return while the evaluator's thread may still be
        starting the forward's blocks, for a caller that builds on the result and then calls
        decode_ahead or Model.settle before evaluating or waiting for anything."""
        forward, self._forward = self._forward, None  # (nothing left to cancel, even if this fails)
        logits, features = _result(forward, [token] * self._rows)  # the padding rows repeat it, as Model.padded's
        if settle and self._settle is not None:
            self._settle()
        self._cache.trim(self._rows - 1)
        with self._stream():
            return logits[:, :1], features[:, :1]

    def cancel(self) -> None:
        if self._forward is None:  # finished (or failed finishing)
            return
        self._forward.close()  # the evaluator drained (_forward's finally)
        self._forward = None
        for layer in self._cache.layers[:self._built]:  # the blocks built wrote their layers' caches
            layer.trim(self._rows)
