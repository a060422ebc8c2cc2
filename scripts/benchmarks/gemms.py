"""`bench.py gemms`: the decode step's quantised GEMMs, MLX's and the kernels' (fp8_gemv,
fp4_experts), independent and chained, against the copy bandwidth."""

from __future__ import annotations

import mlx.core as mx

from .harness import chained, copy_bandwidth, print_heading, quantised_gemm_shapes, random_scales, random_words, timed


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, default=8, help="rows of the forward (a GPU's decode and verify: 8)")
    p.add_argument("--real", type=int, default=None,
                   help="rows fp8_gemv computes, the padded forward's real ones (1: plain decode; 2..7: verify)")
    p.add_argument("--threads", type=int, nargs="*", default=[], choices=[32, 64, 128, 256],
                   help="also time fp8_gemv chained with each of these threads per output")


def run(args, env: dict) -> dict:
    res = bench_gemms(rows=args.rows, real=args.real, threads=tuple(args.threads))
    print_gemms(env, res)
    return res


def bench_gemms(rows: int = 8, experts: int = 24, dim: int = 5120, inter: int = 2304,
                cache_bytes: int = 256 << 20, real: int | None = None, threads: tuple[int, ...] = ()) -> dict:
    """The quantised GEMMs of a decode step, ms per call: the routed experts' mxfp4 GEMMs (24
    experts, top-6) fed fp32 or bf16, and every FP8 GEMM shape of the flash-shaped model (the
    release's dense shapes, and wo_a's grouped one) through MLX's quantized_matmul /
    gather_qmm fed bf16 and, on a GPU, through kernels.fp8_gemv, with each one's share of the
    copy bandwidth. Every call reads its own copy of the weights, from copies that overflow
    any cache, as a decode step reads each weight once. real: fp8_gemv computes that many of
    the rows (a padded forward's real rows; default all). threads: also the chained fp8_gemv
    with each of these threads per output (C), to compare layouts in a forward's conditions."""
    from dsv41_mlx import kernels

    mx.random.seed(0)
    top = 6
    gpu = kernels.backend() != "mlx"
    w13, s13 = random_words((experts, inter, dim // 8), fp4=True), random_scales((experts, inter, dim // 32))
    w2, s2 = random_words((experts, dim, inter // 8), fp4=True), random_scales((experts, dim, inter // 32))
    ids = mx.sort(mx.random.randint(0, experts, (rows, top)).astype(mx.uint32), axis=-1)
    x, h = mx.random.normal((rows, 1, 1, dim)), mx.random.normal((rows, top, 1, inter))
    mx.eval(w13, s13, w2, s2, ids, x, h)
    out = {"rows": rows, "real": real or rows, "experts": experts, "copy_GBps": copy_bandwidth() / 1e9,
           "routed": {}, "fp8": []}
    for dtype in (mx.float32, mx.bfloat16):
        name = str(dtype).rsplit(".", 1)[-1]
        xt, ht = x.astype(dtype), h.astype(dtype)
        mx.eval(xt, ht)
        out["routed"][f"routed up ({dim} -> {inter}), mxfp4, {name} in"] = timed(
            lambda i: mx.gather_qmm(xt, w13, s13, rhs_indices=ids, transpose=True, mode="mxfp4"), 10, 3) * 1e3
        out["routed"][f"routed down ({inter} -> {dim}), mxfp4, {name} in"] = timed(
            lambda i: mx.gather_qmm(ht, w2, s2, rhs_indices=ids, transpose=True, mode="mxfp4"), 10, 3) * 1e3
    # chained, bf16 in: x per row [rows, 1, dim] into gate + up, x per pair [rows, top, inter] into down
    xb, hb = x[:, 0].astype(mx.bfloat16), h[:, :, 0].astype(mx.bfloat16)
    mx.eval(xb, hb)
    up, down = (w13, s13), (w2, s2)
    out["routed_chained"] = {
        f"routed up ({dim} -> {inter}), mxfp4, bfloat16 in": chained(
            lambda v, i: mx.gather_qmm(v[:, :, None], *up, rhs_indices=ids, transpose=True, mode="mxfp4"), xb) * 1e3,
        f"routed down ({inter} -> {dim}), mxfp4, bfloat16 in": chained(
            lambda v, i: mx.gather_qmm(v[:, :, None], *down, rhs_indices=ids, transpose=True, mode="mxfp4"), hb) * 1e3}
    if gpu:  # each expert read once for all the rows that picked it
        out["routed"][f"routed up ({dim} -> {inter}), fp4_experts"] = timed(
            lambda i: kernels.fp4_experts(xb, w13, s13, ids), 10, 3) * 1e3
        out["routed"][f"routed down ({inter} -> {dim}), fp4_experts"] = timed(
            lambda i: kernels.fp4_experts(hb, w2, s2, ids), 10, 3) * 1e3
        out["routed_chained"][f"routed up ({dim} -> {inter}), fp4_experts"] = chained(
            lambda v, i: kernels.fp4_experts(v, *up, ids), xb) * 1e3
        out["routed_chained"][f"routed down ({inter} -> {dim}), fp4_experts"] = chained(
            lambda v, i: kernels.fp4_experts(v, *down, ids), hb) * 1e3
    w13 = s13 = w2 = s2 = up = down = None  # the routed stacks freed before the FP8 GEMMs' copies are made

    dense, grouped, _ = quantised_gemm_shapes()
    shapes = [(1, d_in, d_out) for d_in, d_out in sorted(dense)] + sorted(grouped)
    for groups, d_in, d_out in shapes:
        nbytes = groups * d_out * d_in * (1 + 1 / 32)
        copies = max(1, min(64, -(-cache_bytes // int(nbytes))))
        ws = [(random_words((groups, d_out, d_in // 4)), random_scales((groups, d_out, d_in // 32)))
              for _ in range(copies)]
        xq = mx.random.normal((rows, groups, d_in)).astype(mx.bfloat16)
        mx.eval(ws, xq)
        if groups == 1:
            def mlx_gemm(v, i):
                w, sc = ws[i % copies]
                return mx.quantized_matmul(v[:, 0], w[0], sc[0], transpose=True, mode="mxfp8")
        else:
            g = mx.arange(groups)

            def mlx_gemm(v, i):
                w, sc = ws[i % copies]
                return mx.gather_qmm(v[:, :, None], w, sc, rhs_indices=g, transpose=True, mode="mxfp8")
        row = {"shape": f"{groups} x {d_in} -> {d_out}" if groups > 1 else f"{d_in} -> {d_out}",
               "MB": nbytes / 1e6, "mlx_ms": timed(lambda i: mlx_gemm(xq, i), 10, 3) * 1e3,
               "mlx_chained_ms": chained(mlx_gemm, xq) * 1e3}
        if gpu:
            row["kernel_ms"] = timed(lambda i: kernels.fp8_gemv(xq, *ws[i % copies], real_rows=real), 10, 3) * 1e3
            row["kernel_chained_ms"] = chained(
                lambda v, i: kernels.fp8_gemv(v, *ws[i % copies], real_rows=real), xq) * 1e3
            row["default_threads"] = kernels.gemv_threads_per_output(d_in, groups * d_out)
            row["kernel_chained_ms_by_threads"] = {
                c: chained(lambda v, i: kernels.fp8_gemv(v, *ws[i % copies], real_rows=real, threads=c), xq) * 1e3
                for c in threads}
            # an activation not yet quantised: act_quant then the kernel, or the kernel quantising as it reads
            row["act_quant_kernel_chained_ms"] = chained(
                lambda v, i: kernels.fp8_gemv(kernels.act_quant_fp8(v, kernels.backend()), *ws[i % copies]), xq) * 1e3
            row["quantizing_kernel_chained_ms"] = chained(
                lambda v, i: kernels.fp8_gemv(v, *ws[i % copies], quantize_input=True), xq) * 1e3
        out["fp8"].append(row)
        ws = None  # freed before the next shape's copies are made
    return out


def print_gemms(env: dict, res: dict) -> None:
    print_heading("Quantised GEMMs of a decode step", env)
    print(f"{res['rows']} rows; routed: top-6 of {res['experts']} experts; "
          f"copy bandwidth {res['copy_GBps']:.0f} GB/s\n")
    print("ms per call: independent calls, 10 per evaluation (a GPU may overlap them); chained: each call "
          "waiting for the one before, as in a forward\n")
    print("| GEMM | ms per call | chained ms |")
    print("|---|---|---|")
    for name, ms in res["routed"].items():
        chain = res["routed_chained"].get(name)
        print(f"| {name} | {ms:.3f} | {'-' if chain is None else f'{chain:.3f}'} |")
    print()
    kernel = any("kernel_ms" in r for r in res["fp8"])
    print("| FP8 GEMM (bf16 in) | weights MB | floor ms | MLX ms | MLX / floor | MLX chained ms |"
          + (" fp8_gemv ms | fp8_gemv / floor | fp8_gemv chained ms | MLX / fp8_gemv | chained: MLX / fp8_gemv |"
             if kernel else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|---|" if kernel else ""))
    for r in res["fp8"]:
        floor = r["MB"] / 1e3 / res["copy_GBps"] * 1e3  # reading the weights once at the copy rate
        line = (f"| {r['shape']} | {r['MB']:.1f} | {floor:.4f} | {r['mlx_ms']:.4f} | {r['mlx_ms'] / floor:.2f} | "
                f"{r['mlx_chained_ms']:.4f} |")
        if "kernel_ms" in r:
            line += (f" {r['kernel_ms']:.4f} | {r['kernel_ms'] / floor:.2f} | {r['kernel_chained_ms']:.4f} | "
                     f"{r['mlx_ms'] / r['kernel_ms']:.2f} | {_ratio(r['mlx_chained_ms'], r['kernel_chained_ms'])} |")
        print(line)
    print()
    swept = sorted({c for r in res["fp8"] for c in r.get("kernel_chained_ms_by_threads", {})})
    if swept:
        print(f"fp8_gemv chained ms by threads per output (C), {res['real']} of {res['rows']} rows computed; "
              "* the kernel's default for that K\n")
        print("| FP8 GEMM | " + " | ".join(f"C = {c}" for c in swept) + " |")
        print("|---|" + "---|" * len(swept))
        for r in res["fp8"]:
            by = r.get("kernel_chained_ms_by_threads", {})
            cells = [("-" if c not in by else f"{by[c]:.4f}" + ("*" if c == r["default_threads"] else ""))
                     for c in swept]
            print(f"| {r['shape']} | " + " | ".join(cells) + " |")
        print()
    if any("quantizing_kernel_chained_ms" in r for r in res["fp8"]):
        print("An activation not yet FP8 fake-quantised, chained ms: act_quant then fp8_gemv (two launches), "
              "against fp8_gemv quantising as it reads (one)\n")
        print("| FP8 GEMM | act_quant + fp8_gemv | fp8_gemv quantising |")
        print("|---|---|---|")
        for r in res["fp8"]:
            print(f"| {r['shape']} | {r['act_quant_kernel_chained_ms']:.4f} | {r['quantizing_kernel_chained_ms']:.4f} |")
        print()


def _ratio(a: float, b: float) -> str:
    """a / b, or '-' where b is no more than noise (a chained cost at or under zero)."""
    return f"{a / b:.2f}" if b > 0 else "-"
