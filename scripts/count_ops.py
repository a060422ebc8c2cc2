"""Count the MLX operations of one decode step on the GPU path, on any machine.

    python scripts/count_ops.py [--model DIR] [--rows 8]

Builds a padded decode step's graph as a CUDA GPU would (bf16-fed GEMMs, each row
gathering its own window, the custom kernels) without running it: every custom
kernel is stubbed by one operation that depends on all of its inputs, so the
count is the step's kernel launches as MLX would issue them (views excluded).
Prints the count per layer kind and for the whole step, and how many times each
kernel was called. On the CPU an RMSNorm outside the kernels counts as its three
operations, where a GPU runs one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dsv41_mlx  # noqa: E402
from dsv41_mlx import kernels  # noqa: E402
from dsv41_mlx.generate import prefill  # noqa: E402


@contextlib.contextmanager
def gpu_path_with_stub_kernels(calls: collections.Counter):
    """Inside: the kernels' dispatch takes the CUDA path, and every custom kernel is one
    operation over all of its inputs (counted in calls). Restored on exit, but the graphs
    traced inside stay in MLX's compile cache (module-level compiled functions): use it in a
    process of its own, as this script does."""

    def compiled(spec, language):
        def run(inputs, output_shapes, output_dtypes, **_):
            calls[spec.name] += 1
            anchor = mx.depends([inputs[0]], list(inputs[1:]))[0] if len(inputs) > 1 else inputs[0]
            one = mx.max(anchor)
            return [mx.broadcast_to(one, shape).astype(dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

        return run

    saved = kernels._compiled, kernels.backend, kernels.device_backend
    kernels._compiled, kernels.backend, kernels.device_backend = compiled, lambda: "cuda", lambda: "cuda"
    try:
        yield
    finally:
        kernels._compiled, kernels.backend, kernels.device_backend = saved


def count(model_path: str | None, rows: int, prompt: int = 300) -> dict:
    import bench

    model, _ = dsv41_mlx.load(model_path)
    cache = model.make_cache()
    prefill(model, [100 + (7 * i) % 900 for i in range(prompt)], cache)  # on the machine's own path
    calls = collections.Counter()
    model.decode_rows = rows
    per_kind, names, total = {}, {}, 0

    def on_layer(i, run):
        nonlocal total
        h, pre = run()
        ops = bench.graph_ops(h, pre)
        n = bench.kernels(ops) - ops.get("Depends", 0)  # the stubs' dependency markers are no launches
        kind = bench.layer_kind(model.layers[i])
        per_kind.setdefault(kind, []).append(n)
        names.setdefault(kind, collections.Counter()).update(ops)
        total += n
        mx.eval(h, pre)
        return h, pre

    with gpu_path_with_stub_kernels(calls):
        logits = bench.decode_by_layer(model, 7, cache, on_layer)
        ops = bench.graph_ops(logits)
    total += bench.kernels(ops) - ops.get("Depends", 0)
    return {"total": total, "per_kind": per_kind, "kernel_calls": dict(calls),
            "names_per_kind": {kind: dict(c) for kind, c in names.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny one)")
    parser.add_argument("--rows", type=int, default=8, help="rows a decode step is padded to (GPU: 8)")
    args = parser.parse_args()
    res = count(args.model, args.rows)
    print("| layer kind | layers | operations per layer |")
    print("|---|---|---|")
    for kind, counts in res["per_kind"].items():
        print(f"| {kind} | {len(counts)} | {', '.join(map(str, sorted(set(counts))))} |")
    print(f"\noperations per decode step: {res['total']}; kernel calls: {res['kernel_calls']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
