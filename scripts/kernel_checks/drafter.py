"""The drafter's kernels.

fp8_rows: release head shape (129280 x 5120) and a small ragged one, rows 1, 2,
5, 8, 16, fresh random inputs each time, outputs poisoned before the launch
(every element must be written). Each 256-output tile's 64 candidates must be
that tile's 64 best by the spec's float32 logits (a swap is allowed only
between values closer than the tolerance), with values matching the spec's.

ring_write: random rings and rows, writes that wrap, byte equality.

markov_drafts: a block of 5 positions over 64 candidates at the release's vocabulary and Markov
rank, greedy and with a temperature and noise: the drafts and embeddings the spec's exactly,
the logits within float32 rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx.kernels import (TILE, TOP_K, fp8_rows_tiles, fp8_rows_top64, markov_drafts, markov_drafts_reference,
                               ring_write, ring_write_reference)
from dsv41_mlx.quant import quantize_fp8_tiles_mx

from .harness import POISON


def check_fp8_rows(n: int, k: int, rows: int, impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    head = quantize_fp8_tiles_mx((mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16))
    x = mx.random.normal((rows, k)).astype(mx.bfloat16).astype(mx.float32)
    logits = x @ head.dequantize().T  # the spec's float32 logits [rows, n]
    vals, ids = fp8_rows_tiles(x, head, impl, init_value=POISON)
    mx.eval(logits, vals, ids)
    logits, vals, ids = np.array(logits), np.array(vals), np.array(ids)
    tol = 1e-5 * np.abs(logits).max()
    problems = []
    if (vals == POISON).any() or (ids == int(POISON)).any():
        problems.append("unwritten outputs")
    tiles = vals.shape[1]
    padded = np.full((rows, tiles * TILE), -np.inf, np.float32)
    padded[:, :n] = logits
    for r in range(rows):
        for t in range(tiles):
            got_ids = ids[r, t]
            if not np.all((got_ids >= t * TILE) & (got_ids < min((t + 1) * TILE, n))):
                problems.append(f"row {r} tile {t}: ids outside the tile")
                break
            ref_vals = padded[r, got_ids]
            if np.abs(vals[r, t] - ref_vals).max() > tol:
                problems.append(f"row {r} tile {t}: values off by {np.abs(vals[r, t] - ref_vals).max():.3g}")
                break
            kth = np.sort(padded[r, t * TILE:(t + 1) * TILE])[-TOP_K]
            if (ref_vals < kth - tol).any() or len(set(got_ids.tolist())) != TOP_K:
                problems.append(f"row {r} tile {t}: not the tile's 64 best")
                break
            if np.any(np.diff(vals[r, t]) > 0):
                problems.append(f"row {r} tile {t}: not sorted best first")
                break
    best_vals, best_ids = fp8_rows_top64(x, head, impl)
    ref_vals, ref_ids = fp8_rows_top64(x, head, "mlx")
    if np.abs(np.array(best_vals) - np.array(ref_vals)).max() > tol:
        problems.append("final top-64 values differ from the spec")
    return problems


def check_ring_write(impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    problems = []
    for stages, window, dim, m, first in [(3, 128, 512, 6, 125), (3, 128, 512, 128, 1000), (2, 8, 64, 3, 7)]:
        rings = mx.random.normal((stages, window, dim)).astype(mx.bfloat16)
        rows = mx.random.normal((stages, m, dim)).astype(mx.bfloat16)
        got = ring_write(rings, rows, first, impl)
        ref = ring_write_reference(rings, rows, first)
        if not mx.array_equal(got, ref).item():
            problems.append(f"ring_write {stages}x{window}x{dim} m={m} first={first} differs")
    return problems


def check_markov_drafts(impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    B, C, V, R = 5, 64, 129280, 16
    problems = []
    head, embed = (mx.random.normal((V, R)).astype(mx.bfloat16) for _ in range(2))
    for temperature, noisy in ((1.0, False), (0.7, True)):
        base = mx.random.normal((B, C)) * 3
        candidates = mx.random.randint(0, V, (B, C)).astype(mx.int32)
        noise = mx.random.gumbel((B, C)) if noisy else None
        got = markov_drafts(base, candidates, head, embed, 1234, temperature, noise, impl)
        want = markov_drafts_reference(base, candidates, head, embed, 1234, temperature, noise)
        if got[0].tolist() != want[0].tolist():
            problems.append(f"markov_drafts (temperature {temperature}): drafts {got[0].tolist()}, "
                            f"the spec's {want[0].tolist()}")
        if not mx.allclose(got[1], want[1], rtol=1e-5, atol=1e-5).item():
            problems.append(f"markov_drafts (temperature {temperature}): logits off by "
                            f"{mx.abs(got[1] - want[1]).max().item():.3g}")
        if not mx.array_equal(got[2], want[2]).item():
            problems.append(f"markov_drafts (temperature {temperature}): embeddings differ")
    return problems
