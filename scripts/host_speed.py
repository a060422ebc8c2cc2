"""A decode step's host time, step by step, beside how fast the host's CPU runs meanwhile.

    python scripts/host_speed.py [--model DIR] [--steps 120] [--profile 40] [--thread on|off]

Runs plain 1-row decode steps (as `bench.py e2e`'s bare step: the forward, then the greedy
token read back) after a 261-token prompt, the warm-up first. For each step it records the
wall time, the host's build (until `Runner.decode` returns, the blocks started on the device
as they are built), the part of the build inside `mx.async_eval` (MLX evaluating the graph)
and the benchmarks' `host_probe_ms` (a fixed pure-Python loop, no MLX) just before it. Steps
over 1.2x the fastest quarter's slowest are counted as slow; the two groups' means show
whether a slow step is more work or the same work on a slower CPU (then the probe slows
alike): the lent H200's host (a virtual machine) showed episodes of tens of steps 1.25-1.45x
slower.

--thread on|off evaluates the blocks on the evaluator's thread or on the caller's
(`Options.evaluate_on_thread`; on by default on a GPU): threaded, the async_eval time is the
evaluator's, overlapping the build, so the table has no Python column.

--profile N runs the steps under cProfile as well and prints the N functions with the most
time of their own (cProfile roughly doubles Python's time; read its shares, not its times):
where the host's build goes, Python function by function, with MLX's C++ calls
(`async_eval`, `item`, each operation) as entries of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def timed_async_eval(total: list[float]):
    """Inside: every mx.async_eval adds its seconds to total[0]. Restored on exit."""
    real = mx.async_eval

    def timed(*args):
        tic = time.perf_counter()
        real(*args)
        total[0] += time.perf_counter() - tic

    mx.async_eval = timed
    try:
        yield
    finally:
        mx.async_eval = real


def measure(model_path: str | None, steps: int, profiler: cProfile.Profile | None = None,
            thread: bool | None = None, warm: bool = True) -> list[dict]:
    import dsv41_mlx
    from scripts.benchmarks.harness import host_probe_ms
    from dsv41_mlx.generate import prefill, warm_up
    from dsv41_mlx.runtime.options import default_options
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(model_path)
    options = default_options(model.args)
    if thread is not None:  # (on: each block started as it is built, on the CPU too)
        options = dataclasses.replace(options, evaluate_on_thread=thread, overlap_build=options.overlap_build or thread)
    threaded = options.overlap_build and options.evaluate_on_thread
    with Runner(model, options) as runner:
        if warm:
            warm_up(runner)
        cache = runner.make_cache()
        logits, _ = prefill(runner, [((i * 7919) % 50000 + 100) % model.args.vocab_size for i in range(261)], cache)
        token, rows, inside = int(mx.argmax(logits).item()), [], [0.0]
        with timed_async_eval(inside), (profiler or contextlib.nullcontext()):
            for _ in range(steps):
                probe, inside[0] = host_probe_ms(), 0.0
                tic = time.perf_counter()
                out, _ = runner.decode([token], cache)
                built = time.perf_counter()
                token = int(mx.argmax(out[0, -1]).item())
                rows.append({"step_ms": (time.perf_counter() - tic) * 1e3, "build_ms": (built - tic) * 1e3,
                             "async_eval_ms": inside[0] * 1e3, "probe_ms": probe, "threaded": threaded})
    return rows[2:]  # the first steps after the prompt settle the allocator's cache


def split(rows: list[dict]) -> dict[str, list[dict]]:
    """The steps as fast and slow: slow is over 1.2x the fastest quarter's slowest step."""
    cut = 1.2 * sorted(r["step_ms"] for r in rows)[max(0, len(rows) // 4 - 1)]
    return {"fast": [r for r in rows if r["step_ms"] <= cut], "slow": [r for r in rows if r["step_ms"] > cut]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded tiny one)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also run the steps under cProfile and print its N top functions by own time")
    parser.add_argument("--thread", choices=("on", "off"), default=None,
                        help="each block's mx.async_eval on the evaluator's thread or on the caller's "
                             "(Options.evaluate_on_thread; default: the device's, on where there is a GPU)")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="skip generate.warm_up (a quick smoke run: the first steps then also trace "
                             "the compiled pieces and, on a GPU, build kernels)")
    args = parser.parse_args()
    profiler = cProfile.Profile() if args.profile else None
    rows = measure(args.model, args.steps, profiler, None if args.thread is None else args.thread == "on",
                   warm=not args.no_warm_up)
    threaded = rows[0]["threaded"]
    if threaded:  # async_eval runs on the evaluator's thread, while this one builds: no difference to take
        print("(blocks evaluated on the evaluator's thread: its async_eval overlaps the build, and the Python "
              "column is not their difference)")
    print("| steps | count | step ms | build ms | in async_eval ms | Python ms | host probe ms |")
    print("|---|---|---|---|---|---|---|")
    for name, group in split(rows).items():
        if group:
            def mean(key):
                return statistics.mean(r[key] for r in group)
            python = "-" if threaded else f"{mean('build_ms') - mean('async_eval_ms'):.1f}"
            print(f"| {name} | {len(group)} | {mean('step_ms'):.1f} | {mean('build_ms'):.1f} | "
                  f"{mean('async_eval_ms'):.1f} | {python} | {mean('probe_ms'):.2f} |")
    print("\nsteps in order, ms: " + " ".join(f"{r['step_ms']:.0f}" for r in rows))
    if profiler is not None:
        print(f"\ncProfile over all {args.steps} steps (the whole loop), by own time:")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
