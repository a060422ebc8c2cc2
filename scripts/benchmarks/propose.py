"""`bench.py propose`: the drafter's propose pass (one stream, two, on its own thread) and
its ingest, at the release's shapes."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from .harness import print_heading, release_shaped_drafter_model, timed


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
    for n in (1, 6):
        def ingest(i):
            c = drafter.make_cache()
            c.end = 1000 + i
            drafter.ingest(c, feats[i % 8: i % 8 + n])
            return c.rings
        out[f"ingest_{n}_ms"] = timed(ingest, calls=rounds, reps=5) * 1e3
    out["drafter_GB"] = sum(v.nbytes for st in model.mtp for _, v in tree_flatten(st.parameters())) / 1e9
    return out


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
