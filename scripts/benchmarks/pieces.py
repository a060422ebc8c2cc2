"""`bench.py pieces`: one decode step's block taken apart (attention, MoE, the routed experts'
GEMM...), ms each, and on a GPU each custom kernel beside the MLX operations it stands for."""

from __future__ import annotations

import mlx.core as mx

from .harness import layer_kind, print_heading, timed


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 3], help="layer ids to take apart")


def run(args, env: dict) -> dict:
    res = bench_pieces(args.model, args.layers)
    print_pieces(env, res, args.model or "the embedded tiny checkpoint")
    return res


def bench_pieces(model_path: str | None, layer_ids: list[int]) -> dict:
    """ms per call of each piece of a decode step's block (inputs fixed, many calls per
    evaluation, so Python is out of it); the MoE with one real row (a plain decode step) and
    with all rows real, and one routed projection over one row's experts and over all rows'.
    On a GPU also each custom kernel of the decode path beside the MLX operations it stands
    for (its spec)."""
    import dsv41_mlx
    from dsv41_mlx import kernels
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.models.attention import sparse_attention
    from dsv41_mlx.models.hyper import HcMixes, hc_expand, hc_post
    from dsv41_mlx.models.layers import Rope, positions_of
    from dsv41_mlx.quant import fp8_input, gemm_input_dtype
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(model_path)
    cache = model.make_cache()
    with Runner(model) as runner:
        prefill(runner, list(range(100, 356)), cache)
        rows = runner.options.decode_rows or 1
    positions = positions_of(cache.offset, rows)
    h, pre = hc_expand(model.embed(mx.array([7] * rows)), model.args.hc_mult)
    out = {"rows": rows, "gemms_fed": str(gemm_input_dtype()).rsplit(".", 1)[-1], "layers": {}}
    for li in layer_ids:
        layer = model.layers[li]
        attn, ffn = layer.attn, layer.ffn
        x, xq, *mix = layer.attn_input(h, pre)
        rope = attn.rope.tables(positions, attn.head_dim)
        W, K = attn.window, model.args.index_topk  # each row's window slots and picks, as a decode step has
        # where the attention kernel runs, it rotates q and its output itself: queries and output do not
        rope_in_kernel = kernels.attention_fits((rows, attn.n_heads, attn.head_dim), mx.bfloat16, W, K)
        q, _ = attn.queries(xq, rope, rope_in_kernel)
        q = q.reshape(rows, attn.n_heads, attn.head_dim)  # (the kernel's unrotated q comes as [S, H * D])
        ring = mx.random.normal((W + rows, attn.head_dim)).astype(mx.bfloat16)
        kv = mx.random.normal((4 * K, attn.head_dim)).astype(mx.bfloat16)
        index = mx.random.randint(0, W + rows, (rows, W))
        picks = mx.random.randint(0, 4 * K, (rows, K)).astype(mx.uint32)
        mask, picked_mask = mx.ones((rows, W), dtype=mx.bool_), mx.ones((rows, K), dtype=mx.bool_)
        keys, picked = ring[index], kv[picks]
        o = sparse_attention(q, keys, mask, None, None, attn.attn_sink, attn.scale)
        y = attn.output(o, rope, rope_in_kernel)
        h2, x2, x2q, *ffn_mix = layer.ffn_input(y, h, *mix)
        _, ids = ffn.gate(x2)
        xe = mx.random.normal((rows, 1, 1, model.args.hidden_size)).astype(gemm_input_dtype())
        mx.eval(x, xq, mix, q, o, y, h2, x2, x2q, ffn_mix, keys, picked, ids, xe, ring, kv, index, picks)
        w13 = ffn.experts.w13
        gate, hc = ffn.gate, layer.hc_attn
        pieces = {
            "attn_input (hc mixes, collapse, norm)": lambda i: layer.attn_input(h, pre),
            "attention input's FP8 quantisation": lambda i: fp8_input(x),
            "queries": lambda i: attn.queries(xq, rope, rope_in_kernel),
            "latent_kv": lambda i: attn.latent_kv(xq, rope),
            "sparse_attention, window": lambda i: sparse_attention(q, keys, mask, None, None, attn.attn_sink,
                                                                   attn.scale),
            "sparse_attention, window + top-k": lambda i: sparse_attention(q, keys, mask, picked, picked_mask,
                                                                           attn.attn_sink, attn.scale),
            "output (wo_a, wo_b)": lambda i: attn.output(o, rope, rope_in_kernel),
            "ffn_input (expand, hc mixes, collapse, norm)": lambda i: layer.ffn_input(y, h, *mix),
            "moe, 1 real row": lambda i: ffn(x2, 1, x2q),
            f"moe, {rows} real rows": lambda i: ffn(x2, None, x2q),
            "gate": lambda i: ffn.gate(x2),
            "shared expert": lambda i: ffn.shared_experts(x2q),
            "routed gate + up projection, 1 row": lambda i: mx.gather_qmm(
                xe[:1], w13.weight, w13.scales, rhs_indices=ids[:1], transpose=True, mode="mxfp4"),
            f"routed gate + up projection, {rows} rows": lambda i: mx.gather_qmm(
                xe, w13.weight, w13.scales, rhs_indices=ids, transpose=True, mode="mxfp4"),
            "hc_post": lambda i: hc_post(y, h2, HcMixes(*ffn_mix)),
            "sub-layer input, its MLX operations": lambda i: hc.sublayer_input_unfused(h, pre, layer.attn_norm),
            "attention, gathers + MLX operations": lambda i: Rope.apply(sparse_attention(  # and the RoPEs
                Rope.apply(q, rope), ring[index], mask, kv[picks], picked_mask, attn.attn_sink, attn.scale), rope,
                inverse=True),
            "router, MLX operations": lambda i: kernels.moe_gate_reference(
                x2, gate.weight, gate.bias, gate.top_k, gate.temp, gate.route_scale, gate.normalize),
        }
        if kernels.hc_input_fits(h):
            pieces["sub-layer input, hc_input kernel"] = lambda i: kernels.hc_input(
                h, pre, hc.fn, hc.scale, hc.base, layer.attn_norm.weight, model.args.hc_sinkhorn_iters,
                model.args.rms_norm_eps, model.args.hc_eps, layer.attn_norm.eps, gemm_input_dtype())
        if rope_in_kernel:
            pieces["attention, sparse_attention kernel"] = lambda i: kernels.sparse_attention_rows(
                q, ring, index, mask, kv, picks, picked_mask, attn.attn_sink, attn.scale, rope, attn.rope.dims)
        if kernels.backend() != "mlx":
            pieces["router, moe_gate kernels"] = lambda i: kernels.moe_gate(
                x2, gate.weight, gate.bias, gate.top_k, gate.temp, gate.route_scale, gate.normalize)
        out["layers"][f"{li} ({layer_kind(layer)})"] = {name: timed(fn, calls=10, reps=5) * 1e3
                                                         for name, fn in pieces.items()}
    small = mx.ones((rows, 16))
    out["tiny_op_ms"] = timed(lambda i: small + i) * 1e3
    return out


def print_pieces(env: dict, res: dict, model: str) -> None:
    print_heading(f"A decode step's block, piece by piece, on {model}", env)
    print(f"{res['rows']} rows; ms per call, 10 calls per evaluation; quantised GEMMs fed {res['gemms_fed']}; "
          f"a tiny element-wise op costs {res['tiny_op_ms']:.3f} ms\n")
    names = list(next(iter(res["layers"].values())))
    print("| piece | " + " | ".join(f"layer {k}" for k in res["layers"]) + " |")
    print("|---|" + "---|" * len(res["layers"]))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{v[name]:.3f}" for v in res["layers"].values()) + " |")
    print()
