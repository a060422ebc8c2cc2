"""The hyper-connection kernels.

hc_split: random mixes at 1..300 rows, release hc 4 / 20 iterations, within
2e-6 of the spec (the spec's exp and sigmoid are not bit for bit the kernel's).

hc_input: a sub-layer's input from the stream at hc 4, dim 5120, rows 1..16, against
hyper.HyperConnection.sublayer_input's pure-MLX composition: x within a bf16 step
(equal in 99% of values), the mixes within 2e-5; a row alone equals the row among
others.

hc_post_input: the same with the stream expanded inside the kernel from the previous
sub-layer's output (hyper.hc_post's spec): the stream within a bf16 step of hc_post's
(equal in 99%), the rest as hc_input's against the spec of the kernel's own stream.

fp8_into_stream: wo_b and the shared expert's w2 (parts added) putting their output into
the stream (fp8_mma_hc), rows 1..16 with a padding row: the stream the same bits as
fp8_gemv then hc_post_input; the next sub-layer's input from the kernel's mix parts
(hc_input_from_parts) as hc_input's against the spec of that stream; a row alone equals
the row among others.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx import kernels
from dsv41_mlx.kernels import fp8_gemv, hc_input, hc_post_input, hc_split, hc_split_reference, rms_norm_reference
from dsv41_mlx.quant import fp8_fake_quant_reference
from scripts.benchmarks.harness import flash_args, random_scales, random_words

from . import harness
from .harness import bf16_step_problem, bits_differ, mixed_parts, random_fp8_input, raw_activation


def check_hc_split(impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    problems = []
    hc, iters, eps = 4, 20, 1e-6
    for rows in (1, 8, 37, 300):
        mixes = mx.random.normal((rows, (2 + hc) * hc)) * 3
        scale, base = mx.random.normal((3,)), mx.random.normal(((2 + hc) * hc,))
        got = hc_split(mixes, scale, base, hc, iters, eps, impl)
        ref = hc_split_reference(mixes, scale, base, hc, iters, eps)
        for name, a, b in zip(("pre", "post", "comb"), got, ref):
            err = mx.abs(a - b).max().item()
            if not err <= 2e-6:
                problems.append(f"hc_split rows={rows} {name} off by {err:.3g}")
        sums = got[2].sum(axis=-2)  # the last pass normalised the columns
        if not mx.allclose(sums, mx.ones_like(sums), atol=1e-4).item():
            problems.append(f"hc_split rows={rows}: comb columns do not sum to 1")
    return problems


def hc_input_spec(h, pre_in, fn, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to):
    """What kernels.hc_input computes, by hyper.HyperConnection.sublayer_input's pure-MLX path."""
    from dsv41_mlx.models.hyper import hc_pre

    hf = h.reshape(h.shape[0], -1).astype(mx.float32)  # the stream projected to its mixes, RMS-scaled
    projected = (hf @ fn.T) * mx.rsqrt(mx.mean(hf * hf, axis=-1, keepdims=True) + hc_norm_eps)
    mixes = hc_split_reference(projected, scale, base, h.shape[1], iters, eps)
    x = rms_norm_reference(hc_pre(h, pre_in), norm_w, norm_eps)
    return (x, fp8_fake_quant_reference(x).astype(quantize_to), *mixes)


def hc_parameters(rng, hc: int, dim: int) -> tuple[mx.array, ...]:
    """A sub-layer's random hyper-connection parameters for the checks: its mix projection fn
    [(2 + hc) * hc, hc * dim], scale [3], base and the RMSNorm weight [dim], float32."""
    M = (2 + hc) * hc
    fn = mx.array(rng.normal(0, 1 / np.sqrt(hc * dim), (M, hc * dim)).astype(np.float32))
    scale = mx.array(rng.normal(0, 1, 3).astype(np.float32))
    base = mx.array(rng.normal(0, 1, M).astype(np.float32))
    norm_w = mx.array(rng.normal(1, 0.2, dim).astype(np.float32))
    return fn, scale, base, norm_w


def check_hc_input(impl: str, seed: int) -> list[str]:
    """The sub-layer input kernel against its spec at the release's shape (hc 4, dim 5120,
    20 Sinkhorn passes), rows 1..16. Its sums run in another order, so: x (bf16) within one
    bf16 step of the spec in every value and equal in at least 99% of them; the mixes within
    2e-5. These tolerances are set before any GPU run of the kernel. A row alone equals the
    same row among others."""
    return _check_sublayer_input(impl, seed, expanded=False)


def check_hc_post_input(impl: str, seed: int) -> list[str]:
    """hc_post_input (the stream expanded from the previous sub-layer's output inside the
    sub-layer input's first launch) against hyper.hc_post then hc_input's spec, as
    check_hc_input: the new stream h within one bf16 step of hc_post's in every value and equal
    in at least 99% of them (a multiply and an add may fuse differently); the rest against the
    spec of the kernel's own h, with check_hc_input's tolerances; a row alone equals the same
    row among others."""
    return _check_sublayer_input(impl, seed, expanded=True)


def _check_sublayer_input(impl: str, seed: int, expanded: bool) -> list[str]:
    from dsv41_mlx.models.hyper import HcMixes, hc_post

    rng = np.random.default_rng(seed)
    problems = []
    hc, dim, iters = 4, 5120, 20
    name = "hc_post_input" if expanded else "hc_input"
    fn, scale, base, norm_w = hc_parameters(rng, hc, dim)
    for rows in harness.CHECK_ROWS:
        h = mx.array(rng.normal(0, 1, (rows, hc, dim)).astype(np.float32)).astype(mx.bfloat16)
        pre_in = mx.array(rng.uniform(0, 1, (rows, hc)).astype(np.float32))
        args = (fn, scale, base, norm_w, iters, 1e-6, 1e-6, 1e-6, mx.bfloat16 if rows % 2 else mx.float32)
        if expanded:  # h is the residual; the kernel makes the stream from it
            y = mx.array(rng.normal(0, 1, (rows, dim)).astype(np.float32)).astype(mx.bfloat16)
            post = mx.array(rng.uniform(0, 2, (rows, hc)).astype(np.float32))
            comb = mx.array(rng.uniform(0, 1, (rows, hc, hc)).astype(np.float32))
            inputs = (y, h, post, comb, pre_in)
            got_h, *got = hc_post_input(*inputs, *args, impl=impl)
            problem = bf16_step_problem(got_h, hc_post(y, h, HcMixes(pre_in, post, comb)))
            if problem:
                problems.append(f"{name} rows={rows} h: {problem}")
            want = hc_input_spec(got_h, pre_in, *args)
            alone = hc_post_input(*(a[-1:] for a in inputs), *args, impl=impl)[1:]
        else:
            got = hc_input(h, pre_in, *args, impl=impl)
            want = hc_input_spec(h, pre_in, *args)
            alone = hc_input(h[-1:], pre_in[-1:], *args, impl=impl)
        problems += sublayer_input_problems(f"{name} rows={rows}", got, want)
        if not all(mx.array_equal(a, b[-1:]).item() for a, b in zip(alone, got)):
            problems.append(f"{name} rows={rows}: the last row alone differs from the same row among {rows}")
    return problems


def sublayer_input_problems(label: str, got: tuple, want: tuple) -> list[str]:
    """A sub-layer input kernel's (x, xq, pre, post, comb) against hc_input_spec's: x within a
    bf16 step (equal in 99% of values), xq act_quant's bits of the kernel's own x, the mixes
    within 2e-5."""
    problems = []
    problem = bf16_step_problem(got[0], want[0])
    if problem:
        problems.append(f"{label} x: {problem}")
    differ = bits_differ(got[1], fp8_fake_quant_reference(got[0]).astype(want[1].dtype))
    if differ:
        problems.append(f"{label} xq: {differ} values differ from act_quant of its x")
    for part, a, b in zip(("pre", "post", "comb"), got[2:], want[2:]):
        err = mx.abs(a - b).max().item()
        if not err <= 2e-5:
            problems.append(f"{label} {part} off by {err:.3g}")
    return problems


def check_fp8_into_stream(impl: str, seed: int) -> list[str]:
    """kernels.fp8_into_stream (fp8_mma_hc) at the release's two shapes that take it, wo_b
    (8192 -> 5120, its input quantised in the kernel) and the shared expert's w2 (its inputs ->
    5120, the routed experts' parts added), rows 1..16 of a forward one row longer (the padding
    row's y zeros), against two launches of the other kernels on the same inputs: fp8_gemv's
    output y put into the stream by hc_post_input. The stream h the same bits (fp8_mma's y
    and hc_post_mix's arithmetic, hc_expand), so it meets the spec as those two do (checks
    fp8_gemv and hc_post_input; against hyper.hc_post of fp8_gemv_reference's y directly, a
    few values of h lie more than a bf16 step apart: where y's sum nearly cancels, the two
    orders of its float32 sums differ by many ulps, within fp8_gemv's bound). Then
    hc_input_from_parts of the kernel's mix parts against hc_input's spec of h, with
    check_hc_input's tolerances; a row alone equals the same row among others."""
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    problems = []
    args, hc, iters = flash_args(), 4, 20
    dim = args.hidden_size
    fn, scale, base, norm_w = hc_parameters(rng, hc, dim)
    for name, k, ap in (("wo_b", args.o_groups * args.o_lora_rank, 0), ("shared w2", args.moe_intermediate_size, 6)):
        w, s = random_words((dim, k // 4)), random_scales((dim, k // 32))
        for rows in harness.CHECK_ROWS:
            S = min(rows + 1, kernels.DECODE_MAX_ROWS)
            x = raw_activation((S, k)) if ap == 0 else random_fp8_input((S, k))
            gemm = {"quantize_input": ap == 0, "real_rows": rows, "parts": mixed_parts(rows, dim) if ap else None}
            residual = mx.array(rng.normal(0, 1, (S, hc, dim)).astype(np.float32)).astype(mx.bfloat16)
            post = mx.array(rng.uniform(0, 2, (S, hc)).astype(np.float32))
            comb = mx.array(rng.uniform(0, 1, (S, hc, hc)).astype(np.float32))
            pre_in = mx.array(rng.uniform(0, 1, (S, hc)).astype(np.float32))
            hc_args = (scale, base, norm_w, iters, 1e-6, 1e-6, 1e-6, mx.bfloat16)
            onto = kernels.StreamOnto(residual, post, comb, fn)
            label = f"fp8_into_stream {name} rows={rows} of {S}"
            h, parts = kernels.fp8_into_stream(x, w, s, onto, impl=impl, **gemm)
            y = fp8_gemv(x, w, s, impl=impl, **gemm)
            want_h = kernels.hc_post_input(y, residual, post, comb, pre_in, fn, *hc_args, impl=impl)[0]
            differ = bits_differ(h, want_h)
            if differ:
                problems.append(f"{label}: {differ} values of h differ from fp8_gemv then hc_post_input's")
            got = kernels.hc_input_from_parts(h, parts, pre_in, *hc_args, impl=impl)
            problems += sublayer_input_problems(label, got, hc_input_spec(h, pre_in, fn, *hc_args))
            if rows > 1:
                r = rows - 1  # the last real row alone
                one = {**gemm, "real_rows": 1, "parts": None if ap == 0 else gemm["parts"][r:]}
                alone = kernels.fp8_into_stream(x[r:r + 1], w, s, kernels.StreamOnto(*(a[r:r + 1] for a in onto[:3]), fn),
                                                impl=impl, **one)
                if not (mx.array_equal(alone[0], h[r:r + 1]).item() and mx.array_equal(alone[1], parts[r:r + 1]).item()):
                    problems.append(f"{label}: the last real row alone differs from the same row among {S}")
    return problems
