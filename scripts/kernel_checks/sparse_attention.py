"""sparse_attention: a decode forward's attention at 64 heads x 512, a 128-key window
and 512 picks (or none), rows 1..16 at random positions, masked keys and rows with
none visible, against the query RoPE, attention.sparse_attention on gathered keys and
the inverse RoPE (the release's 64 rotated features, YaRN on compressed layers):
each row-head within 1% of its largest value, 0.1% on average; a row alone equals
the row among others; with fewer real rows than rows, the real rows the same bits
and the padding zeros; at 8 simdgroups a threadgroup the bits of the backend's count.
And a DSpark stage's use: 5 rows, each over every key of its ring and block (133).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import mlx.core as mx
import numpy as np

from dsv41_mlx.kernels import padding_zeroed, sparse_attention_rows, tuning
from scripts.benchmarks.harness import release_ropes

from . import harness


def sparse_attention_spec(q, ring, index, window_mask, kv, ids, picked_mask, sink, scale, rope, rope_dims,
                          real_rows=None):
    """What kernels.sparse_attention_rows computes, by attention.Attention's pure-MLX path: q
    ([S, H, D], or [S, H * D] with H from sink) rotated, the attention over gathered keys, its
    output rotated back (rope: Rope.tables, which say themselves which features rotate;
    rope_dims is the kernel's copy of that); rows from real_rows on (a padded forward's
    padding) zeros."""
    from dsv41_mlx.models.layers import Rope
    from dsv41_mlx.models.attention import sparse_attention

    q = q.reshape(q.shape[0], sink.shape[0], -1)
    picked = None if ids is None else kv[ids]
    o = sparse_attention(Rope.apply(q, rope), ring[index], window_mask, picked, picked_mask, sink, scale)
    return padding_zeroed(Rope.apply(o, rope, inverse=True), real_rows)


def off_by(got: np.ndarray, want: np.ndarray) -> str | None:
    """How far the kernel's output [S, H, D] is from its spec's, where past the tolerances (each
    row-head within 1% of its largest value, 0.1% on average); None within them."""
    worst = (np.abs(got - want) / (np.abs(want).max(axis=-1, keepdims=True) + 1e-30)).max()
    mean = np.abs(got - want).mean() / (np.abs(want).mean() + 1e-30)
    if worst <= 1e-2 and mean <= 1e-3:
        return None
    return f"off by {worst:.3g} of a row's largest value, {mean:.3g} on average"


def attention_rows(args: tuple, rows: slice) -> tuple:
    """sparse_attention_rows' arguments (as check_sparse_attention passes them) for some of
    the rows: q, index, the masks, ids and the RoPE tables are per row."""
    q, ring, index, wmask, kv, ids, pmask, sink, scale, rope, rope_dims = args
    rope = tuple(t[rows] for t in rope[:6]) + rope[6:]  # the rotated-feature mask is not per row
    return (q[rows], ring, index[rows], wmask[rows], kv, None if ids is None else ids[rows],
            None if pmask is None else pmask[rows], sink, scale, rope, rope_dims)


@contextlib.contextmanager
def attention_warps(impl: str, warps: int):
    """Inside: the attention kernel runs `warps` simdgroups a threadgroup on impl, and the
    layout's attention_heads heads, at every row count (no one-row layout)."""
    layout = tuning.current()
    one_row = {k: v for k, v in layout.attention_one_row.items() if k != impl}
    with tuning.using(replace(layout, attention_warps={**layout.attention_warps, impl: warps},
                              attention_one_row=one_row)):
        yield


def check_sparse_attention(impl: str, seed: int) -> list[str]:
    """The attention kernel against its spec at the release's shape (64 heads x 512, a
    128-key window, 512 picks or none; the last 64 features rotated, by the compressed
    layers' YaRN RoPE where there are picks, by the window-only layers' plain one where
    not), rows 1..16 at random positions, with masked window slots and picks, a row whose
    window is all masked and one with no visible key at all. Its sums run in another order
    (and a probability may round to the other bf16 neighbour), so: each row-head within 1%
    of its largest value, and on average within 0.1%. These tolerances are set before any
    GPU run of the kernel. A row alone equals the same row among others; q as wq_b gives it,
    [S, H * D], the bits of [S, H, D]; at 8 simdgroups a threadgroup (Layout.attention_warps),
    the bits of the backend's own count."""
    rng = np.random.default_rng(seed)
    problems = []
    H, D, W, K, R, T = 64, 512, 128, 512, 160, 700
    ropes = dict(zip((K, 0), release_ropes()))  # by the picks: compressed layers have them
    ring = mx.array(rng.normal(0, 1, (R, D)).astype(np.float32)).astype(mx.bfloat16)
    kv = mx.array(rng.normal(0, 1, (T, D)).astype(np.float32)).astype(mx.bfloat16)
    sink = mx.array(rng.normal(0, 1, H).astype(np.float32))
    for picks in (K, 0):
        for rows in harness.CHECK_ROWS:
            q = mx.array(rng.normal(0, 1, (rows, H, D)).astype(np.float32)).astype(mx.bfloat16)
            index = mx.array(rng.integers(0, R, (rows, W)).astype(np.int32))
            wmask = rng.random((rows, W)) < 0.9
            if rows > 1:
                wmask[1] = False  # a row that sees no window key
            ids = mx.array(rng.integers(0, T, (rows, picks)).astype(np.uint32)) if picks else None
            pmask = rng.random((rows, picks)) < 0.7
            if rows > 2:
                wmask[2], pmask[2] = False, False  # a row that sees no key at all: zeros
            rope = ropes[picks].tables(mx.array(rng.integers(0, 1 << 20, rows).astype(np.int32)), D)
            args = (q, ring, index, mx.array(wmask), kv if picks else None, ids,
                    mx.array(pmask) if picks else None, sink, D ** -0.5, rope, ropes[picks].dims)
            got = np.array(sparse_attention_rows(*args, impl=impl).astype(mx.float32))
            want = np.array(sparse_attention_spec(*args).astype(mx.float32))
            if (off := off_by(got, want)) is not None:
                problems.append(f"sparse_attention picks={picks} rows={rows}: {off}")
            alone = sparse_attention_rows(*attention_rows(args, slice(-1, None)), impl=impl)
            if not np.array_equal(np.array(alone.astype(mx.float32)), got[-1:]):
                problems.append(f"sparse_attention picks={picks} rows={rows}: the last row alone differs")
            flat = sparse_attention_rows(q.reshape(rows, -1), *args[1:], impl=impl)  # as wq_b gives q: [S, H * D]
            if not np.array_equal(np.array(flat.astype(mx.float32)), got):
                problems.append(f"sparse_attention picks={picks} rows={rows}: q as [S, H * D] differs from [S, H, D]")
            with attention_warps(impl, 8):
                eight = sparse_attention_rows(*args, impl=impl)
            if not np.array_equal(np.array(eight.astype(mx.float32)), got):
                problems.append(f"sparse_attention picks={picks} rows={rows}: 8 simdgroups a threadgroup differ "
                                f"from {tuning.current().attention_warps.get(impl)}")
            if rows in (8, 16):  # a padded forward: its real rows the same bits, the padding zeros
                for real in (1, rows - 2):
                    padded = np.array(sparse_attention_rows(*args, real, impl=impl).astype(mx.float32))
                    if not (np.array_equal(padded[:real], got[:real]) and not padded[real:].any()):
                        problems.append(f"sparse_attention picks={picks} rows={rows}: with {real} real rows, "
                                        f"not the same real rows and zeros after them")
    # a DSpark stage's (models/dspark.py): its 5 rows, each row's window every key of its ring (some
    # slots not yet written) and of the block, no picks
    from dsv41_mlx.models.dspark import every_key

    rows, keys = 5, W + 5
    q = mx.array(rng.normal(0, 1, (rows, H, D)).astype(np.float32)).astype(mx.bfloat16)
    stage_keys = mx.array(rng.normal(0, 1, (keys, D)).astype(np.float32)).astype(mx.bfloat16)
    visible = np.broadcast_to(rng.random(keys) < 0.8, (rows, keys))
    rope = ropes[0].tables(mx.array(rng.integers(0, 1 << 20, rows).astype(np.int32)), D)
    args = (q, stage_keys, every_key(rows, keys), mx.array(visible), None, None, None, sink, D ** -0.5, rope,
            ropes[0].dims)
    got = np.array(sparse_attention_rows(*args, impl=impl).astype(mx.float32))
    want = np.array(sparse_attention_spec(*args).astype(mx.float32))
    if (off := off_by(got, want)) is not None:
        problems.append(f"sparse_attention, a DSpark stage's {rows} rows over {keys} keys: {off}")
    return problems
