"""Hyper-connections: the residual stream kept as `hc_mult` copies.

Each sub-layer collapses the copies with a pre-mix computed by the sub-layer before it,
runs, and expands its output back through post and Sinkhorn-normalised comb mixes of its
own (reference `hc_pre`, `hc_post`, `hc_split_sinkhorn`). Shapes: S rows, hc copies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..config import ModelArgs
from ..quant import fp8_input, gemm_input_dtype
from .layers import RMSNorm

F32, BF16 = mx.float32, mx.bfloat16


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
