"""fp4_experts: the routed experts' FP4 GEMMs at the model's expert stacks and a ragged
one, 1..16 rows of distinct experts, x per row and per slot, outputs poisoned: within
the bound of another fp32 summation order of MLX's fp32-fed gather_qmm; a row alone
equals the row among 8 and among 16.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx.kernels import SwiGLU, fp4_experts
from scripts.benchmarks.harness import quantised_gemm_shapes, random_scales, random_words

from .harness import POISON, against_fp32, quantizing_problems, random_fp8_input


def check_fp4_experts(impl: str, seed: int) -> list[str]:
    """The routed-expert FP4 kernel against MLX's gather_qmm fed fp32, at the flash-shaped
    model's expert stacks (gate + up, down; target and DSpark) and a ragged one, 1..16 rows
    of distinct sorted experts, x per row and per slot, outputs poisoned before the launch:
    every value within the bound of another float32 summation order (`gemm_agreement`); a row
    alone the same bits as among others, at 8 rows and at 16; the first rows of longer inputs
    (rows=, a padded forward's arrays as they are, with and without the weighted SwiGLU) the
    bits of those rows alone."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    problems = []
    _, _, experts = quantised_gemm_shapes()
    for n_experts, d_in, d_out in sorted(experts) + [(5, 256, 96)]:
        w, s = random_words((n_experts, d_out, d_in // 8), fp4=True), random_scales((n_experts, d_out, d_in // 32))
        top = min(6, n_experts)
        for rows in (1, 2, 5, 8, 9, 16):
            picks = np.sort([rng.choice(n_experts, top, replace=False) for _ in range(rows)], axis=1)
            ids = mx.array(picks.astype(np.uint32))
            for per_slot in (False, True):
                x = random_fp8_input((rows, top if per_slot else 1, d_in))
                got = fp4_experts(x, w, s, ids, impl=impl, init_value=POISON)
                name = f"fp4_experts {n_experts}x{d_in}->{d_out} rows={rows} x per {'slot' if per_slot else 'row'}"
                problem, _ = against_fp32(name, got, mx.gather_qmm, x[:, :, None], w, s, rhs_indices=ids,
                                          transpose=True, mode="mxfp4")
                problems.extend([problem] if problem else [])
                if rows in (8, 16) and not mx.array_equal(fp4_experts(x[:1], w, s, ids[:1], impl=impl), got[:1]).item():
                    problems.append(f"{name}: row 0 alone differs from row 0 of {rows}")
                if rows in (8, 16):  # a padded forward's arrays as they are, its real rows computed (Fp4Stack.pairs)
                    xs = x if per_slot else x[:, 0]  # as the gate and up projection: x [S, K], a weighted SwiGLU
                    weights = mx.array(rng.random((rows, top)).astype(np.float32))
                    for real in (1, rows - 2):
                        act, act_real = (None, None) if per_slot else (SwiGLU(7.0, weights),
                                                                       SwiGLU(7.0, weights[:real]))
                        alone = fp4_experts(xs[:real], w, s, ids[:real], impl=impl, swiglu=act_real)
                        padded = fp4_experts(xs, w, s, ids, impl=impl, init_value=POISON, rows=real, swiglu=act)
                        if not mx.array_equal(alone, padded).item():
                            problems.append(f"{name}: {real} rows of {rows} (rows={real}) differ from those rows "
                                            f"alone")
                problems.extend(quantizing_problems(
                    name, lambda v, **kw: fp4_experts(v, w, s, ids[: v.shape[0]], impl=impl, **kw),
                    x.shape, rows in (8, 16)))
    return problems
