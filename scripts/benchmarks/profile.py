"""`bench.py profile`: where a plain decode step goes, layer by layer: MLX operations and ms,
compiled and not, and the whole step with each block started as it is built and without."""

from __future__ import annotations

import dataclasses
import statistics
import time

import mlx.core as mx

from .harness import decode_by_layer, graph_ops, launches, layer_kind, print_heading


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed")


def run(args, env: dict) -> dict:
    res = bench_profile(args.model, args.steps)
    print_profile(env, res, args.model or "the embedded tiny checkpoint")
    return res


def bench_profile(model_path: str | None, steps: int) -> dict:
    """Where a plain decode step goes: MLX operations per layer (compiled and not) and, on the
    device, each layer's time (evaluated one at a time) and the whole step's."""
    import dsv41_mlx
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.runtime.options import default_options
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(model_path)
    options = default_options(model.args)
    out = {"layers": [layer_kind(layer) for layer in model.layers], "rows": options.decode_rows or 1}
    for compiled in (True, False):
        (mx.enable_compile if compiled else mx.disable_compile)()
        cache = model.make_cache()
        with Runner(model, options) as runner:
            prefill(runner, list(range(100, 100 + 256)), cache)
        ops, times = [], [[] for _ in model.layers]

        def count(i, run):  # each layer's inputs are evaluated: its graph is its own operations
            h, pre = run()
            ops.append(launches(graph_ops(h, pre)))
            mx.eval(h, pre)
            return h, pre

        logits = decode_by_layer(model, 7, cache, count, options.decode_rows)
        total = sum(ops) + launches(graph_ops(logits))

        def timed_layer(i, run):
            mx.synchronize()
            tic = time.perf_counter()
            h, pre = run()
            mx.eval(h, pre)
            mx.synchronize()
            times[i].append(time.perf_counter() - tic)
            return h, pre

        for step in range(steps + 1):
            if step == 1:  # the first step warms up
                times = [[] for _ in model.layers]
            mx.eval(decode_by_layer(model, 11 + step, cache, timed_layer, options.decode_rows))
        step_ms, build_ms = {}, {}
        for overlap in (False, True):  # blocks started as they are built (Options.overlap_build) or not
            step_ms[overlap], build_ms[overlap] = [], []
            with Runner(model, dataclasses.replace(options, overlap_build=overlap)) as runner:
                for step in range(steps + 1):
                    mx.synchronize()
                    tic = time.perf_counter()
                    logits, _ = runner.decode([21 + step], cache)
                    built = time.perf_counter()
                    mx.eval(logits)
                    mx.synchronize()
                    step_ms[overlap].append((time.perf_counter() - tic) * 1e3)
                    build_ms[overlap].append((built - tic) * 1e3)
        out["compiled" if compiled else "uncompiled"] = {
            "ops_total": total, "ops_per_layer": ops, "step_ms": statistics.median(step_ms[False][1:]),
            "build_ms": statistics.median(build_ms[False][1:]),
            "overlapped_step_ms": statistics.median(step_ms[True][1:]),
            "layer_ms": [statistics.median(t) * 1e3 for t in times]}
    mx.enable_compile()
    return out


def print_profile(env: dict, res: dict, model: str) -> None:
    print_heading(f"Where a decode step goes on {model}", env)
    c, u = res["compiled"], res["uncompiled"]
    print(f"one decode step ({res['rows']} rows): compiled {c['step_ms']:.1f} ms ({c['build_ms']:.1f} ms of it "
          f"building the graph in Python), {c['ops_total']} operations; uncompiled (`mx.disable_compile`) "
          f"{u['step_ms']:.1f} ms ({u['build_ms']:.1f} building), {u['ops_total']} operations "
          f"(operations exclude views); with each block started on the device as soon as it is built "
          f"(`Options.overlap_build`): compiled {c['overlapped_step_ms']:.1f} ms, uncompiled "
          f"{u['overlapped_step_ms']:.1f} ms\n")
    print("| layer kind | layers | ops per layer | ms per layer | us per op | ops uncompiled | ms uncompiled |")
    print("|---|---|---|---|---|---|---|")
    kinds: dict[str, list[int]] = {}
    for i, kind in enumerate(res["layers"]):
        kinds.setdefault(kind, []).append(i)
    for kind, idx in kinds.items():
        def mean(key, run):
            return statistics.mean(run[key][i] for i in idx)
        print(f"| {kind} | {len(idx)} | {mean('ops_per_layer', c):.0f} | {mean('layer_ms', c):.2f} | "
              f"{1e3 * mean('layer_ms', c) / mean('ops_per_layer', c):.1f} | {mean('ops_per_layer', u):.0f} | "
              f"{mean('layer_ms', u):.2f} |")
    print(f"\nsum of layers evaluated one by one: compiled {sum(c['layer_ms']):.1f} ms, "
          f"uncompiled {sum(u['layer_ms']):.1f} ms\n")
