"""The decode FP8 GEMM kernels.

fp8_gemv: the decode FP8 GEMM at every FP8 shape of the flash-shaped model (and
wo_a's grouped one) and two ragged ones, 1..16 rows, outputs poisoned: within the
bound of another fp32 summation order of MLX's fp32-fed gather_qmm; a row
alone equals the row among 8 and among 16; with fewer real rows than rows, the
real rows the same bits and the padding zeros.

fp8_gemv_pair: attention's wq_a and wkv stacked (one launch for both) at the flash-shaped
model's shapes and a ragged one, 1..16 rows, outputs poisoned: each part the same bits
as fp8_gemv on its own rows of the stack; padded, the real rows the same and zeros after.
"""

from __future__ import annotations

import mlx.core as mx

from dsv41_mlx.kernels import fp8_gemv, fp8_gemv_pair, fp8_gemv_pair_fits, pair_halves
from scripts.benchmarks.harness import flash_args, quantised_gemm_shapes, random_scales, random_words

from . import harness
from .harness import POISON, against_fp32, quantizing_problems, random_fp8_input


def check_fp8_gemv(impl: str, seed: int) -> list[str]:
    """The decode FP8 GEMM kernel against MLX's gather_qmm fed fp32, at every FP8 shape
    of the flash-shaped model (the release's dense ones and wo_a's 8 groups) and two ragged
    ones, 1..16 rows, outputs poisoned before the launch: every value within the bound of
    another float32 summation order (`gemm_agreement`); a row alone the same bits as among
    others, at 8 rows and at 16 (row bounds RB 8 and 16 against RB 1); a dense GEMM's 2-D form the same
    bits as one group, a grouped one's stacked form (attention.Attention.output's) the same bits as
    its [S, G, K] form; asked for fewer real rows (a padded forward), those the same bits and
    the rest zeros."""
    mx.random.seed(seed)
    problems = []
    dense, grouped, _ = quantised_gemm_shapes()
    shapes = [(1, d_in, d_out) for d_in, d_out in sorted(dense)] + sorted(grouped) + [(1, 512, 96), (3, 256, 32)]
    for groups, d_in, d_out in shapes:
        w, s = random_words((groups, d_out, d_in // 4)), random_scales((groups, d_out, d_in // 32))
        for rows in (1, 2, 5, 8, 9, 16):
            x = random_fp8_input((rows, groups, d_in))
            got = fp8_gemv(x, w, s, impl=impl, init_value=POISON)
            name = f"fp8_gemv {groups}x{d_in}->{d_out} rows={rows}"
            problem, _ = against_fp32(name, got, mx.gather_qmm, x[:, :, None], w, s, rhs_indices=mx.arange(groups),
                                      transpose=True, mode="mxfp8")  # as kernels.fp8_gemv_reference
            problems.extend([problem] if problem else [])
            if rows in (8, 16) and not mx.array_equal(fp8_gemv(x[:1], w, s, impl=impl), got[:1]).item():
                problems.append(f"{name}: row 0 alone differs from row 0 of {rows}")
            if rows in (8, 16):  # a padded forward: its real rows the same bits, the padding zeros
                for real in (1, rows - 2):
                    padded = fp8_gemv(x, w, s, impl=impl, init_value=POISON, real_rows=real)
                    if not (mx.array_equal(padded[:real], got[:real]).item() and not padded[real:].any().item()):
                        problems.append(f"{name}: with {real} real rows, not the same real rows and zeros after "
                                        f"them")
            if groups == 1 and not mx.array_equal(fp8_gemv(x[:, 0], w[0], s[0], impl=impl), got[:, 0]).item():
                problems.append(f"{name}: the dense form (x [S, K], w [N, K/4]) differs from one group")
            if groups > 1:  # attention's wo_a as the model runs it: x [S, H, D] and the matrices stacked [G * N, K/4]
                flat = fp8_gemv(x.reshape(rows, -1), w.reshape(-1, w.shape[-1]), s.reshape(-1, s.shape[-1]),
                                impl=impl, init_value=POISON, groups=groups)
                if not mx.array_equal(flat, got.reshape(rows, -1)).item():
                    problems.append(f"{name}: the stacked form (groups={groups}) differs from [S, G, K] by [G, N, K/4]")
            problems.extend(quantizing_problems(name, lambda v, **kw: fp8_gemv(v, w, s, impl=impl, **kw),
                                                (rows, groups, d_in), rows in (8, 16)))
    return problems


def check_fp8_gemv_pair(impl: str, seed: int) -> list[str]:
    """fp8_gemv_pair (attention's wq_a and wkv in one launch) at the flash-shaped model's
    stacked shapes and a ragged one, 1..16 rows, outputs poisoned: each part the same bits as
    fp8_gemv on its own rows of the stack (a view, as the drafter's stages run them), and
    with fewer real rows the real rows the same bits and the padding zeros."""
    from dsv41_mlx.io.load import build_model
    from dsv41_mlx.models.attention import Attention

    mx.random.seed(seed)
    problems = []
    stacks = {(m.wq_a_wkv.weight.shape[1] * 4, m.wq_a_wkv.weight.shape[0], m.q_lora_rank)
              for _, m in build_model(flash_args()).named_modules() if isinstance(m, Attention)}
    for d_in, d_out, split in sorted(stacks) + [(512, 96, 64)]:
        w, s = random_words((d_out, d_in // 4)), random_scales((d_out, d_in // 32))
        for rows in harness.CHECK_ROWS:
            name = f"fp8_gemv_pair {d_in}->{split}+{d_out - split} rows={rows}"
            x = random_fp8_input((rows, d_in))
            if not fp8_gemv_pair_fits(x, w, split, impl):
                problems.append(f"{name}: does not fit")
                continue
            want = (fp8_gemv(x, w[:split], s[:split], impl=impl), fp8_gemv(x, w[split:], s[split:], impl=impl))
            got = pair_halves(fp8_gemv_pair(x, w, s, split, impl=impl, init_value=POISON), rows, split)
            if not all(mx.array_equal(a, b).item() for a, b in zip(got, want)):
                problems.append(f"{name}: not the bits of fp8_gemv on each matrix")
            for real in (1, rows - 2) if rows >= 8 else ():
                padded = pair_halves(fp8_gemv_pair(x, w, s, split, impl=impl, init_value=POISON, real_rows=real),
                                     rows, split)
                if not all(mx.array_equal(p[:real], b[:real]).item() and not p[real:].any().item()
                           for p, b in zip(padded, want)):
                    problems.append(f"{name}: with {real} real rows, not the same real rows and zeros after them")
    return problems
