"""`bench.py propose`: the drafter's propose pass (one stream, two, on its own thread) and
its ingest, at the release's shapes; one proposal's latency (one round per evaluation, as a
round pays it) against the bytes a proposal must read."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from .harness import copy_bandwidth, print_heading, release_shaped_drafter_model, timed


def add_arguments(p) -> None:
    p.add_argument("--rounds", type=int, default=10)


def run(args, env: dict) -> dict:
    res = bench_propose(args.rounds)
    print_propose(env, res)
    return res


def bench_propose(rounds: int) -> dict:
    from dsv41_mlx.runtime.drafter import Drafter

    model = release_shaped_drafter_model()
    args = model.args
    feats = (mx.random.normal((args.sliding_window + 8, 3 * args.hidden_size))).astype(mx.bfloat16)
    mx.eval(feats)
    out = {"rounds": rounds}
    # one stream; two (each stage's key path on the second); the drafter's own evaluator thread
    for mode, concurrent, thread in (("serial", False, False), ("concurrent", True, False), ("thread", True, True)):
        drafter = Drafter(model, head="fp8", concurrent=concurrent)
        drafter.evaluate_on_thread = thread
        drafter.fp8_head
        cache = drafter.make_cache()
        drafter.ingest(cache, feats[: args.sliding_window])
        mx.eval(cache.rings)

        def one(i):
            p = drafter.propose(cache, (i * 7919) % args.vocab_size)
            return [p.drafts, p.logits, p.confidence]

        out[f"propose_{mode}_ms"] = timed(one, calls=rounds, reps=5) * 1e3
        # a round's view: one proposal per evaluation, nothing else on the device
        out[f"propose_{mode}_latency_ms"] = timed(one, calls=1, reps=rounds) * 1e3
    for n in (1, 6):
        def ingest(i):
            c = drafter.make_cache()
            c.end = 1000 + i
            drafter.ingest(c, feats[i % 8: i % 8 + n])
            return c.rings
        out[f"ingest_{n}_ms"] = timed(ingest, calls=rounds, reps=5) * 1e3
    out["drafter_GB"] = sum(v.nbytes for st in model.mtp for _, v in tree_flatten(st.parameters())) / 1e9
    out["floor_bytes"] = propose_floor_bytes(drafter)
    out["copy_GB_s"] = copy_bandwidth() / 1e9
    out["floor_ms"] = out["floor_bytes"]["total"] / (out["copy_GB_s"] * 1e9) * 1e3
    return out


def propose_floor_bytes(drafter) -> dict:
    """The bytes one proposal must read, by part: the FP8 head (codes and scales); per stage every
    weight but the routed experts and the ingest's main_proj, plus the routed experts its block's
    rows take (block x top-k of them, taken as distinct: the most, and what random routing
    nearly always gives); the rings; the Markov rows gathered (the anchor's and each draft's
    embedding, each position's 64 candidates' head rows); the block's embedding rows."""
    model, block = drafter.model, drafter.block
    args = model.args
    stages, experts = 0, 0
    for stage in drafter.stages:
        for name, v in tree_flatten(stage.parameters()):
            if ".experts." in f".{name}":  # the routed experts' stacks (not shared_experts)
                per_expert = v.nbytes // v.shape[0]
                experts += per_expert * min(block * stage.ffn.gate.top_k, v.shape[0])
            elif not name.startswith(("main_proj", "main_norm", "markov_head")):
                stages += v.nbytes
    head = drafter.fp8_head
    markov = drafter.stages[-1].markov_head
    rank_bytes = markov.embed.weight.shape[1] * markov.embed.weight.dtype.size
    parts = {"fp8_head": head.codes.nbytes + head.scales.nbytes, "stage_weights": stages, "routed_experts": experts,
             "rings": len(drafter.stages) * drafter.window * args.head_dim * 2,
             "markov": block * rank_bytes + block * 64 * markov.head.weight.shape[1] * markov.head.weight.dtype.size,
             "embed_rows": block * args.hidden_size * model.embed.weight.dtype.size}
    parts["total"] = sum(parts.values())
    return parts


def print_propose(env: dict, res: dict) -> None:
    print_heading("DSpark propose and ingest at release shapes", env)
    print(f"3 stages, block 5, 128 routed experts top-3, FP8 dense / FP4 experts, FP8 head with top-64; "
          f"stage weights {res['drafter_GB']:.2f} GB; {res['rounds']} rounds per evaluation\n")
    print("| propose serial ms | propose two streams ms | concurrent / serial | propose on its thread ms | "
          "thread / serial | ingest 1 row ms | ingest 6 rows ms |")
    print("|---|---|---|---|---|---|---|")
    serial = res["propose_serial_ms"]
    print(f"| {serial:.3f} | {res['propose_concurrent_ms']:.3f} | {res['propose_concurrent_ms'] / serial:.2f} | "
          f"{res['propose_thread_ms']:.3f} | {res['propose_thread_ms'] / serial:.2f} | {res['ingest_1_ms']:.3f} | "
          f"{res['ingest_6_ms']:.3f} |")
    print()
    floor = res["floor_bytes"]
    print(f"one proposal per evaluation (a round's latency) against its byte floor: "
          f"{floor['total'] / 1e9:.3f} GB ({', '.join(f'{k} {v / 1e9:.3f}' for k, v in floor.items() if k != 'total')}) "
          f"at the copy bandwidth {res['copy_GB_s']:.0f} GB/s = {res['floor_ms']:.3f} ms\n")
    print("| mode | latency ms | x floor |")
    print("|---|---|---|")
    for mode in ("serial", "concurrent", "thread"):
        ms = res[f"propose_{mode}_latency_ms"]
        print(f"| {mode} | {ms:.3f} | {ms / res['floor_ms']:.1f} |")
    print()
