"""moe_gate: the router at 384 / 24 / 16 experts (top 6, 6, 3), rows 1..16: the
same experts as the spec (but where the k-th and (k+1)-th biased scores are
within float32 noise), weights within 1e-5; a row alone equals the same row
among others.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx.kernels import moe_gate, moe_gate_reference

from . import harness


def check_moe_gate(impl: str, seed: int) -> list[str]:
    """The router kernel against its spec at the release's and the flash checkpoint's shapes.
    Its dot products are summed in another order, so the k-th and (k+1)-th experts may swap
    where their biased scores are within float32 noise: such rows are counted apart; every
    other row must pick the same experts, with weights within 1e-5 (relative)."""
    rng = np.random.default_rng(seed)
    problems = []
    for E, k, normalize in ((384, 6, True), (24, 6, True), (16, 3, False)):
        w = mx.array(rng.normal(0, 1 / np.sqrt(5120), (E, 5120)).astype(np.float32))
        bias = mx.array(rng.normal(0, 0.05, E).astype(np.float32))
        for rows in harness.CHECK_ROWS:
            x = mx.array(rng.normal(0, 1, (rows, 5120)).astype(np.float32)).astype(mx.bfloat16)
            got_w, got_ids = moe_gate(x, w, bias, k, 1.0, 2.5, normalize, impl=impl)
            want_w, want_ids = moe_gate_reference(x, w, bias, k, 1.0, 2.5, normalize)
            logits = np.array(x.astype(mx.float32)) @ np.array(w).T
            biased = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20))))) + np.array(bias)
            edge = -np.sort(-biased, axis=-1)[:, k - 1: k + 1]  # the k-th and (k+1)-th biased scores
            for r in range(rows):
                if np.array_equal(np.array(got_ids[r]), np.array(want_ids[r])):
                    err = np.abs(np.array(got_w[r]) - np.array(want_w[r])) / np.abs(np.array(want_w[r]))
                    if not err.max() <= 1e-5:
                        problems.append(f"moe_gate E={E} k={k} rows={rows} row {r}: weights off by {err.max():.3g}")
                elif not edge[r, 0] - edge[r, 1] <= 1e-5 * abs(edge[r, 0]):
                    problems.append(f"moe_gate E={E} k={k} rows={rows} row {r}: other experts "
                                    f"{np.array(got_ids[r]).tolist()} vs {np.array(want_ids[r]).tolist()}")
            alone = moe_gate(x[-1:], w, bias, k, 1.0, 2.5, normalize, impl=impl)
            if not (mx.array_equal(alone[0], got_w[-1:]).item() and mx.array_equal(alone[1], got_ids[-1:]).item()):
                problems.append(f"moe_gate E={E} k={k} rows={rows}: the last row alone differs from the same row "
                                f"among {rows}")
    return problems
