"""MLX's own quantised GEMMs (mxfp8 dense and grouped, mxfp4 experts) fed bf16 vs fed fp32,
at every shape of the flash-shaped model, decode to prefill row counts (quant.gemm_input_dtype
feeds bf16 on CUDA): at most 1% of values apart, each within the bound of another fp32
summation order (many ulps where a sum nearly cancels); NaN-free weight codes; an expert
product of one row alone equals that row's inside 8 rows.
"""

from __future__ import annotations

import mlx.core as mx

from scripts.benchmarks.harness import quantised_gemm_shapes, random_scales, random_words

from .harness import against_fp32, random_fp8_input


def check_gemms_bf16(seed: int, rows_list=(1, 5, 8, 16, 37, 256)) -> tuple[list[str], list[str]]:
    """MLX's quantised GEMMs fed bf16 against the same GEMMs fed fp32, at every shape of the
    flash-shaped model, at decode / verify and prefill row counts (quant.gemm_input_dtype
    feeds bf16 on CUDA). The inputs are exact in bf16 and both kernels accumulate in fp32,
    so the bf16 one may differ only where its fp32 sum, taken in another order, rounds to
    another bf16 (`gemm_agreement`). Also: a gathered (row, expert) product must not depend
    on the other rows (the MoE runs a padded forward's real rows alone). The random weights
    hold no NaN codes (E4M3's 0x7F and 0xFF): one would make the whole output row NaN on
    both sides and the comparison empty. Returns (problems, notes on the values that differ)."""
    mx.random.seed(seed)
    problems, notes = [], []

    def compare(name, gemm, x, w, s, **kw):
        narrow = gemm(x, w, s, **kw)
        problem, note = against_fp32(name, narrow, gemm, x, w, s, **kw)
        problems.extend([problem] if problem else [])
        notes.extend([note] if note else [])
        return narrow

    fp8_input, words, scales = random_fp8_input, random_words, random_scales
    dense, grouped, experts = quantised_gemm_shapes()
    for d_in, d_out in sorted(dense):
        w, s = words((d_out, d_in // 4)), scales((d_out, d_in // 32))
        for rows in rows_list:
            compare(f"mxfp8 {d_in}->{d_out} rows={rows}", mx.quantized_matmul, fp8_input((rows, d_in)), w, s,
                    transpose=True, mode="mxfp8")
    for groups, d_in, d_out in sorted(grouped):
        w, s, g = words((groups, d_out, d_in // 4)), scales((groups, d_out, d_in // 32)), mx.arange(groups)
        for rows in rows_list:
            o = mx.random.normal((rows, groups, 1, d_in)).astype(mx.bfloat16)
            compare(f"grouped mxfp8 {groups}x{d_in}->{d_out} rows={rows}", mx.gather_qmm, o, w, s,
                    rhs_indices=g, transpose=True, mode="mxfp8")
    top = 6
    for n_experts, d_in, d_out in sorted(experts):
        w, s = words((n_experts, d_out, d_in // 8), fp4=True), scales((n_experts, d_out, d_in // 32))
        for rows in (1, 5, 8, 16):  # decode and verify; prefill groups its pairs by expert (sorted)
            ids = mx.random.randint(0, n_experts, (rows, top)).astype(mx.uint32)
            x = fp8_input((rows, 1, 1, d_in))
            narrow = compare(f"mxfp4 {n_experts}x{d_in}->{d_out} rows={rows}", mx.gather_qmm, x, w, s,
                             rhs_indices=ids, transpose=True, mode="mxfp4")
            if rows > 1:
                alone = mx.gather_qmm(x[:1], w, s, rhs_indices=ids[:1], transpose=True, mode="mxfp4")
                if not mx.array_equal(alone, narrow[:1]).item():
                    problems.append(f"mxfp4 {n_experts}x{d_in}->{d_out}: row 0 alone differs from row 0 of {rows}")
    return problems, notes
