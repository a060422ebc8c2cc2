"""The building blocks every layer shares: RMSNorm, the bf16 Linear, rotary embeddings, and
`fused`, which runs a module method as one compiled function.

Semantics follow DeepSeek's reference `inference/model.py` (rev dba1be0a), including where
it rounds to bf16. Pure functions of arrays are wrapped in `mx.compile`: MLX then runs
each element-wise chain as one fused kernel, with every intermediate in its own dtype, so
the results are the same bits (tests/test_model.py compares compiled and uncompiled
forwards).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..kernels import rms_norm
from ..quant import fp8_input, gemm_input_dtype

F32, BF16 = mx.float32, mx.bfloat16


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
    turn, and the warm-up and prefill's chunks leave dozens, which each of a decode step's
    ~240 calls would search.

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


_ids = mx.array(np.arange(1024, dtype=np.int32))


def positions_of(start: int, n: int) -> mx.array:
    """Positions start .. start + n - 1 [n] int32: a view of key_ids' array, so no launch and
    no memory of its own. An array made on the host each forward would cost more on CUDA: MLX
    keeps it in managed memory, which the first kernel to read it pulls to the GPU page by
    page, and its buffer may come from MLX's cache of device buffers and be moved to managed
    memory first, with a copy that waits for the device. SharedAttention reads a forward's positions on the
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


@functools.lru_cache(maxsize=None)
def index_range(n: int) -> mx.array:
    """mx.arange(n) as uint32, evaluated once (one array per size, shared by every layer):
    the gathered GEMMs' row and expert indices on the decode path slice it, so that it is
    an input of each forward's graph, not an operation in every layer of it (gather_qmm
    builds one when not given its indices). Called at construction, never while tracing."""
    ids = mx.arange(n, dtype=mx.uint32)
    mx.eval(ids)
    return ids
