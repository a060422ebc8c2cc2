"""gemv_epilogues: both GEMV kernels' SwiGLU epilogue at the model's gate and up
projections (FP8 shared expert, FP4 routed stacks with each pair's weight) and a ragged
one each, and fp8_gemv's added parts (the MoE's sum) at the shared expert's down
projection and a ragged one; 1..16 rows, clamped and not, fed FP8 and raw (quantised in
the kernel) input, padded: the same bits as the kernel's plain output through the spec
(kernels.swiglu_pairs, kernels.parts_added).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx.kernels import SwiGLU, fp4_experts, fp8_gemv, parts_added, swiglu_pairs
from scripts.benchmarks.harness import flash_args, quantised_gemm_shapes, random_scales, random_words

from . import harness
from .harness import POISON, bits_differ, mixed_parts, random_fp8_input, raw_activation


def check_gemv_epilogues(impl: str, seed: int) -> list[str]:
    """The GEMV kernels' epilogues, 1..16 rows: the SwiGLU (swiglu=) at the flash-shaped
    model's gate and up projections (the shared experts' FP8 w13, the routed experts' FP4 w13
    stacks with each pair's weight) and a ragged one of each (`swiglu_problems`), and
    fp8_gemv's added parts at the shared experts' down projection and a ragged one
    (`parts_problems`)."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    problems = []
    dense, _, experts = quantised_gemm_shapes()
    inter2 = 2 * flash_args().moe_intermediate_size
    for d_in, d_out in sorted(shape for shape in dense if shape[1] == inter2) + [(512, 96)]:
        w, s = random_words((d_out, d_in // 4)), random_scales((d_out, d_in // 32))
        for rows in harness.CHECK_ROWS:
            problems.extend(swiglu_problems(f"fp8_gemv {d_in}->{d_out} rows={rows}",
                                            lambda v, **kw: fp8_gemv(v, w, s, impl=impl, **kw),
                                            random_fp8_input((rows, d_in)), None, rows - 2 if rows > 2 else None))
    for d_in, d_out in sorted(shape for shape in dense if shape[0] == inter2 // 2) + [(512, 96)]:
        w, s = random_words((d_out, d_in // 4)), random_scales((d_out, d_in // 32))
        for rows in harness.CHECK_ROWS:
            problems.extend(parts_problems(f"fp8_gemv {d_in}->{d_out} rows={rows}",
                                           lambda v, **kw: fp8_gemv(v, w, s, impl=impl, **kw), (rows, d_in), d_out))
    for n_experts, d_in, d_out in sorted(shape for shape in experts if shape[2] == inter2) + [(5, 256, 96)]:
        w, s = random_words((n_experts, d_out, d_in // 8), fp4=True), random_scales((n_experts, d_out, d_in // 32))
        for rows in harness.CHECK_ROWS:
            top = min(6, n_experts)
            ids = mx.array(np.sort([rng.choice(n_experts, top, replace=False) for _ in range(rows)], axis=1)
                           .astype(np.uint32))
            problems.extend(swiglu_problems(f"fp4_experts {n_experts}x{d_in}->{d_out} rows={rows}",
                                            lambda v, **kw: fp4_experts(v, w, s, ids, impl=impl, **kw),
                                            random_fp8_input((rows, 1, d_in)), mx.random.uniform(shape=(rows, top, 1)),
                                            None))
    return problems


def parts_problems(name: str, kernel, shape: tuple, n: int) -> list[str]:
    """fp8_gemv adding a MoE's routed parts [rows, 6, n] to its output as it writes it
    (parts=) against the same kernel's plain output through the spec, kernels.parts_added:
    the same bits, outputs poisoned; fed an FP8 input and a raw one it quantises; and, from
    3 rows on, a padded forward's (parts for the real rows, the padding zeros)."""
    problems = []
    x, raw = random_fp8_input(shape), raw_activation(shape)
    cases = [("", x, shape[0], {}), (", quantising its input", raw, shape[0], {"quantize_input": True})]
    if shape[0] > 2:
        cases.append((", 2 real rows", x, 2, {"real_rows": 2}))
    for what, v, real, kw in cases:
        parts = mixed_parts(real, n)
        problems += epilogue_problems(f"{name}, parts added{what}", kernel(v, parts=parts, init_value=POISON, **kw),
                                      parts_added(kernel(v, **kw), parts), "parts_added to its output")
    return problems


def epilogue_problems(label: str, got: mx.array, want: mx.array, spec: str) -> list[str]:
    """A kernel's output with an epilogue against its plain output through the epilogue's
    spec (want): [] where they are the same bits, else what differs."""
    if got.shape != want.shape:
        return [f"{label}: shape {got.shape}, the spec's {want.shape}"]
    differ = bits_differ(got, want)
    return [f"{label}: {differ} values differ from {spec}"] if differ else []


def swiglu_problems(name: str, kernel, x: mx.array, weights: mx.array | None, real: int | None) -> list[str]:
    """A GEMV kernel writing the SwiGLU of its outputs' pairs (swiglu=, each gate row followed
    by its up row) against the same kernel's plain output through the spec, kernels.swiglu_pairs:
    the same bits, outputs poisoned. Clamped at a limit that some of the outputs pass and at
    none (limit 0), fed an FP8 input and a raw one it quantises, and, where real is given, a
    padded forward's (the padding zeros either way)."""
    problems = []
    plain = kernel(x)
    for limit in (float(mx.abs(plain.astype(mx.float32)).max().item()) / 4, 0.0):
        act = SwiGLU(limit, weights)
        cases = [("", x, {}), (", quantising its input", raw_activation(x.shape), {"quantize_input": True})]
        if real is not None:
            cases.append((f", {real} real rows", x, {"real_rows": real}))
        for what, v, kw in cases:
            problems += epilogue_problems(f"{name}, SwiGLU at limit {limit:g}{what}",
                                          kernel(v, swiglu=act, init_value=POISON, **kw),
                                          swiglu_pairs(kernel(v, **kw), act), "swiglu_pairs of its output")
    return problems
