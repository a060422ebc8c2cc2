"""Benchmarks. Prints markdown tables (the form docs/results.md keeps) and, with --json, the numbers.

    python scripts/bench.py head               # FP8 head kernel vs BF16 / mxfp8 matmul at 129280 x 5120
    python scripts/bench.py drafts [--model M] # FP8 vs BF16 drafter head: changed drafts, acceptance
    python scripts/bench.py propose            # drafter propose (serial vs two streams) and ingest, release shapes
    python scripts/bench.py e2e --model DIR    # end to end on a checkpoint (scripts/make_flash_shaped.py),
                                               # mlx-lm beside it, also interleaved prompt by prompt
    python scripts/bench.py profile [--model M] # a decode step by layer: MLX operations and ms, compiled or not
    python scripts/bench.py pieces [--model M]  # one block's pieces (attention, MoE, experts' GEMM...), ms each
    python scripts/bench.py gemms [--real 1] [--threads 32 64 128 256]
                                                # the decode step's quantised GEMMs: MLX's and fp8_gemv
    python scripts/bench.py layouts [--rows 1 2 3 6] [--kernels fp4_experts ...]
                                                # the kernels' launch layouts that change no bit, timed
    python scripts/bench.py context --model DIR [--contexts 1024 8192 32768 131072]
                                                # prefill (with and without the elision) and decode at long
                                                # contexts, mlx-lm beside it; the decode floor at each
    python scripts/bench.py steps --model DIR [--variant u1=experts_loads_ahead:1 ...] [--verify-rows 6]
                                                # layout choices A/B'd a decode step at a time, one process
    python scripts/bench.py prefix [--model M] [--prefix-tokens 4096]
                                                # a chat's second turn resumed from the prefix cache against
                                                # it prefilled whole: time to first token, the entry's bytes
    python scripts/bench.py pipeline [--ranks 2 3] [--model M] [--tokens 32] [--prompt-tokens 256]
                                                # the layers split over N processes (mlx.launch, this machine)
                                                # against one: tok/s, each rank's link seconds and bytes

Each benchmark is a module of scripts/benchmarks/ (its arguments, its measurement, its
table); scripts/benchmarks/harness.py holds what they share. Speed is measured here and
nowhere else: ratios against baselines measured in the same run, and fractions of the
memory-bandwidth floor. Runs unchanged on Metal, CUDA and the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks import (context, drafts, e2e, gemms, head, layouts, pieces, pipeline,  # noqa: E402
                                prefix, profile, propose, steps)
from scripts.benchmarks.harness import environment  # noqa: E402

BENCHMARKS = {"head": head, "drafts": drafts, "e2e": e2e, "profile": profile, "pieces": pieces, "gemms": gemms,
              "layouts": layouts, "steps": steps, "propose": propose, "context": context, "prefix": prefix,
              "pipeline": pipeline}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name, benchmark in BENCHMARKS.items():
        p = sub.add_parser(name)
        benchmark.add_arguments(p)
        p.add_argument("--json")
    args = parser.parse_args()
    env = environment()
    res = BENCHMARKS[args.what].run(args, env)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, args.what: res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
