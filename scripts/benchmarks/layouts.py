"""`bench.py layouts`: the kernels' launch layouts that change no bit, every candidate timed
chained against the one the package picks, its output compared bit for bit."""

from __future__ import annotations

import statistics

import mlx.core as mx

from .harness import chained, copy_bandwidth, layout_choices, print_heading, random_scales, random_words, release_ropes

LAYOUT_ROWS = (1, 2, 3, 6)  # rows computed: a decode step's, verify forwards'
ATTENTION_CANDIDATES = ((2, 8), (2, 16), (1, 8), (1, 16), (1, 32))  # (heads, simdgroups) a threadgroup
LAYOUT_KERNELS = ("fp4_experts", "fp8_mma", "fp8_mma_hc", "sparse_attention")


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=list(LAYOUT_ROWS),
                   help="rows computed, of a padded forward of 8 (1: a decode step; 2..7: verify forwards)")
    p.add_argument("--kernels", nargs="+", default=list(LAYOUT_KERNELS), choices=LAYOUT_KERNELS,
                   help="the kernels whose layouts to time")


def run(args, env: dict) -> dict:
    res = bench_layouts(tuple(args.rows), which=tuple(args.kernels))
    print_layouts(env, res)
    return res


def bench_layouts(rows_list: tuple[int, ...] = LAYOUT_ROWS, forward_rows: int = 8, experts: int = 24,
                  which: tuple[str, ...] = LAYOUT_KERNELS) -> dict:
    """The kernels' launch layouts that change no bit, at the release's one-layer shapes:
    every candidate timed chained (us a call, cold weights) in a padded forward of
    forward_rows rows that computes `rows` of them, its output compared bit for bit with
    the layout the package picks (kernels.tuning.Layout: experts_loads_ahead and
    mma_loads_ahead, the blocks a warp of fp4_experts / fp8_mma (and fp8_mma_hc, the GEMMs that
    put their output into the stream) loads ahead, U, which only CUDA's twins read; fp8_mma's
    with its tiles' rows, mma_tile_rows, as "TR/U"; attention: the attention's heads and
    simdgroups a threadgroup). `which`: the kernels of LAYOUT_KERNELS to time. A candidate
    that does not launch is reported with its error. Each case carries its floor,
    the bytes it must read over the copy bandwidth: a chain whose host encodes a link slower
    than the GPU runs it times the host, and a time under the floor shows it. Nothing to
    time on the CPU."""
    from dsv41_mlx import kernels
    from dsv41_mlx.kernels import tuning
    from dsv41_mlx.quant import fp8_fake_quant_reference

    impl = kernels.backend()
    package = tuning.current()
    out = {"impl": impl, "forward_rows": forward_rows, "cases": []}
    if impl == "mlx":
        return out
    out["copy_GBps"] = copy_bandwidth() / 1e9

    def measure(kernel, shape, rows, run, x0, candidates, default, nbytes):
        """candidates: (layout, {Layout field: value}) each; default: the layout the package picks."""
        base = mx.array(run(x0, 0))  # the package's own layout
        floor = nbytes / out["copy_GBps"] / 1e3  # us
        for value, choices in candidates:
            row = {"kernel": kernel, "shape": shape, "rows": rows, "layout": value, "default": value == default,
                   "floor_us": floor}
            with layout_choices(choices):
                try:
                    row["us"] = chained(run, x0) * 1e6
                    row["same_bits"] = bool(mx.array_equal(run(x0, 0), base).item())
                except (RuntimeError, ValueError) as e:  # a layout past the device's limits: reported
                    row["error"] = str(e).splitlines()[0][:80]
            out["cases"].append(row)

    def cold_fp8(n, k):  # copies of a random FP8 matrix [n, k] that overflow any cache, and its bytes
        nbytes = n * k * (1 + 1 / 32)
        count = max(2, -(-(256 << 20) // int(nbytes)))
        return [(random_words((n, k // 4)), random_scales((n, k // 32))) for _ in range(count)], nbytes

    def fp8_input(shape):
        return fp8_fake_quant_reference(mx.random.normal(shape).astype(mx.bfloat16)).astype(mx.bfloat16)

    mx.random.seed(0)
    copies, top, dim, inter = 4, 6, 5120, 2304  # four copies of each stack: cold weights at every call
    if "fp4_experts" in which:
        w13 = [(random_words((experts, 2 * inter, dim // 8), fp4=True),
                random_scales((experts, 2 * inter, dim // 32))) for _ in range(copies)]
        w2 = [(random_words((experts, dim, inter // 8), fp4=True), random_scales((experts, dim, inter // 32)))
              for _ in range(copies)]
        ids = [mx.argsort(mx.random.uniform(shape=(forward_rows, experts)), axis=-1)[:, :top].astype(mx.uint32)
               for _ in range(copies)]
        weights, x, h = mx.random.uniform(shape=(forward_rows, top)), fp8_input((forward_rows, 1, dim)), \
            mx.random.normal((forward_rows, top, inter)).astype(mx.bfloat16)
        mx.eval(w13, w2, ids, weights, x, h)
        candidates = [(u, {"experts_loads_ahead": lambda rows, k, u=u: u}) for u in (1, 2, 3, 4)]

        def expert_bytes(stacks, rows):  # the experts the computed rows pick, read once each (mean over copies)
            per_expert = (stacks[0][0].nbytes + stacks[0][1].nbytes) / experts
            return per_expert * statistics.mean(len(set(c[:rows].flatten().tolist())) for c in ids)

        for rows in rows_list:
            act = kernels.SwiGLU(7.0, weights)
            measure("fp4_experts", f"{dim} -> 2 x {inter} + SwiGLU", rows,
                    lambda v, i, r=rows: kernels.fp4_experts(v, *w13[i % copies], ids[i % copies], swiglu=act, rows=r),
                    x, candidates, package.experts_loads_ahead(rows, dim), expert_bytes(w13, rows))
            measure("fp4_experts", f"{inter} -> {dim}, x quantised in the kernel", rows,
                    lambda v, i, r=rows: kernels.fp4_experts(v, *w2[i % copies], ids[i % copies], quantize_input=True,
                                                             rows=r),
                    h, candidates, package.experts_loads_ahead(rows, inter), expert_bytes(w2, rows))
        del w13, w2

    u_mma = [(u, {"mma_loads_ahead": lambda k, rows, u=u: u}) for u in (2, 4, 6, 8)]
    # fp8_mma's layouts: its tiles' rows (Layout.mma_tile_rows) / U, as "TR/U"
    tiles_u_mma = [(f"{tr}/{u}", {"mma_tile_rows": lambda n, k, tr=tr: tr, **choices})
                   for tr in (32, 16) for u, choices in u_mma]
    mma_shapes = ((1280, 32768, None), (8192, 5120, None), (5120, 4608, kernels.SwiGLU(7.0)), (2304, 5120, None))
    for k, n, swiglu in mma_shapes if "fp8_mma" in which else ():
        ws, nbytes = cold_fp8(n, k)
        count = len(ws)
        xq = fp8_input((forward_rows, 1, k))  # (bench.chained feeds x [S, 1, K] back)
        mx.eval(ws, xq)
        for rows in rows_list:
            measure("fp8_mma", f"{k} -> {n}" + (" + SwiGLU" if swiglu else ""), rows,
                    lambda v, i, r=rows, ws=ws, c=count, sw=swiglu: kernels.fp8_gemv(v, *ws[i % c], swiglu=sw,
                                                                                     real_rows=r),
                    xq, tiles_u_mma, f"{package.mma_tile_rows(n, k)}/{package.mma_loads_ahead(k, rows)}", nbytes)
        del ws

    if "fp8_mma_hc" in which:  # a sub-layer's last GEMM, its output put into the stream: wo_b, the shared w2
        hc, n = 4, dim
        residual = mx.random.normal((forward_rows, hc, n)).astype(mx.bfloat16)
        onto = kernels.StreamOnto(residual, mx.random.uniform(shape=(forward_rows, hc)),
                                  mx.random.uniform(shape=(forward_rows, hc, hc)),
                                  mx.random.normal(((2 + hc) * hc, hc * n)) * 0.01)
        routed = mx.random.normal((forward_rows, top, n)).astype(mx.bfloat16)  # the shared w2 adds the routed experts'
        mx.eval(onto, routed)
        for k in (8192, inter):
            ws, nbytes = cold_fp8(n, k)
            count = len(ws)
            xb = mx.random.normal((forward_rows, k)).astype(mx.bfloat16)  # quantised in the kernel, as a forward's
            mx.eval(ws, xb)
            for rows in rows_list:
                parts = routed[:rows] if k == inter else None
                measure("fp8_mma_hc", f"{k} -> {n} into the stream" + (f", {top} parts added" if k == inter else ""),
                        rows, lambda v, i, r=rows, ws=ws, c=count, parts=parts: kernels.fp8_into_stream(
                            v, *ws[i % c], onto, quantize_input=True, real_rows=r, parts=parts)[0],
                        xb, u_mma, package.mma_loads_ahead(k, rows), nbytes)
            del ws

    if "sparse_attention" not in which:
        return out
    heads, head_dim, window, picks, ring_rows, kv_rows = 64, 512, 128, 512, 160, 700
    rope = release_ropes()[0]
    ring = mx.random.normal((ring_rows, head_dim)).astype(mx.bfloat16)
    kv = mx.random.normal((kv_rows, head_dim)).astype(mx.bfloat16)
    sink = mx.random.normal((heads,))
    q = mx.random.normal((forward_rows, 1, heads * head_dim)).astype(mx.bfloat16)
    index = mx.random.randint(0, ring_rows, (forward_rows, window)).astype(mx.int32)
    picked = mx.random.randint(0, kv_rows, (forward_rows, picks)).astype(mx.uint32)
    wmask = mx.random.uniform(shape=(forward_rows, window)) < 0.9
    pmask = mx.random.uniform(shape=(forward_rows, picks)) < 0.7
    tables = rope.tables(mx.arange(300, 300 + forward_rows, dtype=mx.int32), head_dim)
    mx.eval(ring, kv, sink, q, index, picked, wmask, pmask, tables)
    # (heads, simdgroups) at every row count: no one-row layout of its own
    layouts = [((heads, warps), {"attention_heads": heads, "attention_warps": {impl: warps}, "attention_one_row": {}})
               for heads, warps in ATTENTION_CANDIDATES]
    for rows in rows_list:
        measure("sparse_attention", f"{heads} heads x {head_dim}, {window} + {picks} keys", rows,
                lambda v, i, r=rows: kernels.sparse_attention_rows(
                    v.reshape(forward_rows, heads, head_dim), ring, index, wmask, kv, picked, pmask, sink,
                    head_dim ** -0.5, tables, rope.dims, real_rows=r).reshape(forward_rows, 1, -1),
                q, layouts, package.attention(impl, rows),
                ring.nbytes + kv.nbytes)  # at least the keys, once
    return out


def print_layouts(env: dict, res: dict) -> None:
    print_heading("Kernel launch layouts", env)
    if not res["cases"]:
        print("no GPU kernels here (Metal or CUDA): nothing to time\n")
        return
    print(f"us a call, chained, cold weights; rows computed of a {res['forward_rows']}-row padded forward; "
          "* the layout kernels picks; same bits: the output equals that layout's; floor: the bytes the call "
          f"must read over the copy bandwidth ({res['copy_GBps']:.0f} GB/s); a time under it (!) cannot be the "
          "GPU's: there the chain timed the host's encoding of its launches\n")
    print("| kernel | shape | rows | layout | us a call | floor us | x the default's | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    default = {(c["kernel"], c["shape"], c["rows"]): c.get("us") for c in res["cases"] if c["default"]}
    for c in res["cases"]:
        layout = str(c["layout"]) + ("*" if c["default"] else "")
        if "error" in c:
            print(f"| {c['kernel']} | {c['shape']} | {c['rows']} | {layout} | fails: {c['error']} | | | |")
            continue
        base = default.get((c["kernel"], c["shape"], c["rows"]))
        ratio = f"{c['us'] / base:.2f}" if base else "-"
        below = " !" if c["us"] < c["floor_us"] else ""
        print(f"| {c['kernel']} | {c['shape']} | {c['rows']} | {layout} | {c['us']:.1f}{below} | "
              f"{c['floor_us']:.1f} | {ratio} | {'yes' if c['same_bits'] else 'NO'} |")
    print()
