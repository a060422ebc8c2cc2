"""Count replies that change when drafting is on (the losslessness contract; goal: 0).

    python scripts/check_lossless.py [--model M] [--prompts 6] [--tokens 32]

Greedy and coupled sampling, drafting on vs off, with the device's row-invariant
decode padding (Options.decode_rows, the default on GPUs) and, for comparison, without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dsv41_mlx  # noqa: E402
from dsv41_mlx.generate import generate_step  # noqa: E402
from dsv41_mlx.runtime.options import default_options  # noqa: E402
from dsv41_mlx.runtime.runner import Runner  # noqa: E402
from dsv41_mlx.sampling import SamplingParams  # noqa: E402
from dsv41_mlx.speculative import SpeculativeDecoder  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model, _ = dsv41_mlx.load(args.model)
    prompts = [[(97 * i + 31 * j) % 8000 + 100 for j in range(5 + 7 * i)] for i in range(args.prompts)]
    options = default_options(model.args)
    failures = 0
    for rows in dict.fromkeys([options.decode_rows, None]):
        with Runner(model, dataclasses.replace(options, decode_rows=rows)) as runner:
            for name, params in (("greedy", SamplingParams()), ("coupled", SamplingParams(temperature=0.8, seed=3))):
                diverged = 0
                for ids in prompts:
                    plain = list(generate_step(runner, ids, params, args.tokens))
                    decoder = SpeculativeDecoder(runner, runner.drafter, params, confidence="off")
                    drafted = list(generate_step(runner, ids, params, args.tokens, decoder=decoder))
                    diverged += plain != drafted
                label = f"padded to {rows} rows" if rows else "unpadded"
                print(f"{name:8s} {label:18s}: {diverged} of {len(prompts)} replies differ with drafting on")
                if rows == options.decode_rows:
                    failures += diverged
    print("LOSSLESS" if not failures else f"{failures} DIVERGENT REPLIES in the default mode")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
