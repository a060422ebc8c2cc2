"""Count the MLX operations of one decode step on the GPU path, on any machine.

    python scripts/count_ops.py [--model DIR] [--rows 8] [--prompt 300]

(The release's layer layout on any machine: a checkpoint from `make_flash_shaped.py DIR --small`.)

Builds a padded decode step's graph as a CUDA GPU would (bf16-fed GEMMs, each row
gathering its own window, the custom kernels) without running it: every custom
kernel is stubbed by one operation that depends on all of its inputs, so the
count is the step's kernel launches as MLX would issue them. The stubs take any
shape, so the GEMV kernels' shape terms are dropped and a small checkpoint's
GEMMs count as the release's do. Views (reshapes, slices, broadcasts, ...) are
counted apart: they launch nothing, but each is an operation MLX evaluates.
Prints both per layer kind and for the whole step, how many times each
kernel was called, and the launches the step left unevaluated in the cache (which a
later forward would run). On the CPU an RMSNorm outside the kernels counts as its three
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

import dsv41_mlx  # noqa: E402
from dsv41_mlx import kernels  # noqa: E402
from dsv41_mlx.generate import prefill  # noqa: E402
from dsv41_mlx.runtime.runner import Runner  # noqa: E402
from scripts.benchmarks.harness import VIEWS, decode_by_layer, graph_dot, launches, layer_kind  # noqa: E402


@contextlib.contextmanager
def gpu_path_with_stub_kernels(calls: collections.Counter):
    """Inside: the kernels' dispatch takes a CUDA device's path (kernels.dispatching; its GEMMs
    bf16-fed), and every custom kernel is one operation (a Depends) over all of its inputs,
    its outputs broadcasts of a zero made beforehand (counted in calls). Restored on exit, but
    the graphs traced inside stay in MLX's compile cache (module-level compiled functions): use
    it in a process of its own, as this script does."""
    zeros = {}

    def compiled(spec, language):
        def run(inputs, output_shapes, output_dtypes, template=(), **_):
            calls[spec.name + ("_pair" if dict(template).get("SPLIT") else "")] += 1  # fp8_gemv_pair apart
            outs = [mx.broadcast_to(zeros[dtype], tuple(shape)) for shape, dtype in zip(output_shapes, output_dtypes)]
            return mx.depends(outs, list(inputs))

        return run

    for dtype in (mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.int32, mx.float16, mx.bfloat16, mx.float32):
        zeros[dtype] = mx.zeros((), dtype=dtype)
    mx.eval(list(zeros.values()))
    # any_shape: the GEMV kernels fit any matrix, and the sub-layers' last GEMMs (wo_b, the
    # shared w2: the stream's width of outputs, on the matrix unit at the release's 5120) put
    # their output into the stream where it fits
    with kernels.dispatching("cuda", compiled, device="cuda", any_shape=True):
        yield


def census(*outputs) -> tuple[int, int, collections.Counter]:
    """(launches, views, primitive counts) of the lazy graph behind outputs (nothing is
    evaluated). A stub is one launch (its Depends); the broadcasts that make its outputs (those
    a Depends node takes in) are no views of the model's and are not counted (inside a
    compiled method, equal broadcasts of two stubs are one node). A Depends of the model's
    own (one that takes in no such broadcast) launches nothing and is not counted."""
    import re

    dot = graph_dot(*outputs)
    labels = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)"', dot))
    ops = collections.Counter(label.split()[0] for label in labels.values())
    makes = dict((array, node) for node, array in re.findall(r'^(\d+) -> "([^"]+)"', dot, flags=re.M))
    stub_feeds = [(makes.get(array), node) for array, node in re.findall(r'^"([^"]+)" -> (\d+)', dot, flags=re.M)
                  if labels.get(node) == "Depends" and labels.get(makes.get(array)) == "Broadcast"]
    stub_outputs, stubs = {made for made, _ in stub_feeds}, {node for _, node in stub_feeds}
    own = sum(label == "Depends" and node not in stubs for node, label in labels.items())
    return launches(ops) - own, sum(v for k, v in ops.items() if k in VIEWS) - len(stub_outputs), ops


def count(model_path: str | None, rows: int, prompt: int = 300) -> dict:
    model, _ = dsv41_mlx.load(model_path)
    cache = model.make_cache()
    with Runner(model) as runner:  # on the machine's own path
        prefill(runner, [100 + (7 * i) % 900 for i in range(prompt)], cache)
    calls = collections.Counter()
    per_kind, views_per_kind, names = {}, {}, {}
    total = total_views = 0

    def on_layer(i, run):
        nonlocal total, total_views
        h, pre = run()
        launches, views, ops = census(h, pre)
        kind = layer_kind(model.layers[i])
        per_kind.setdefault(kind, []).append(launches)
        views_per_kind.setdefault(kind, []).append(views)
        names.setdefault(kind, collections.Counter()).update(ops)
        total, total_views = total + launches, total_views + views
        mx.eval(h, pre)
        return h, pre

    with gpu_path_with_stub_kernels(calls):
        logits = decode_by_layer(model, 7, cache, on_layer, decode_rows=rows)
        launches, views, _ = census(logits)
        mx.eval(logits)
        # what the step wrote into the cache but left unevaluated: a later forward would run it
        left = census(*cache.state())[0]
    return {"total": total + launches, "views": total_views + views, "left_in_cache": left, "per_kind": per_kind,
            "views_per_kind": views_per_kind, "kernel_calls": dict(calls),
            "names_per_kind": {kind: dict(c) for kind, c in names.items()}}


def count_propose(model_path: str | None, prompt: int = 300) -> dict:
    """The launches of one propose pass (runtime/drafter.py) on the GPU path, per DSpark stage,
    the head, and the Markov steps with the confidence head, after the drafter's rings took a
    prompt's features; and of one ingest of a round's rows."""
    model, _ = dsv41_mlx.load(model_path)
    with Runner(model) as runner:  # on the machine's own path
        drafter = runner.drafter
        cache = model.make_cache()
        _, features = prefill(runner, [100 + (7 * i) % 900 for i in range(prompt)], cache,
                              keep_features=drafter.window)
        rings = drafter.make_cache()
        rings.end = cache.offset - features.shape[0]
        drafter.ingest(rings, features)
        mx.eval(rings.rings)
        drafter.evaluate_on_thread = False  # built whole on this thread: its graph read below
        calls = collections.Counter()
        stages, begun = [], []
        with gpu_path_with_stub_kernels(calls):
            drafter.fp8_head  # built on the GPU path before the pass, not inside it
            proposal = drafter.propose(rings, 7, built=lambda *arrays: begun.append(arrays))
            seen = 0
            for arrays in begun:  # each stage's output, then the head's: the launches new at each
                total = census(*arrays)[0]
                stages.append(total - seen)
                seen = total
            whole = census(proposal.drafts, proposal.logits, proposal.confidence)[0]
            committed = features[-(drafter.block + 1):]  # a round's rows: its anchor and every draft
            ingest = census(drafter.ring_rows(committed, mx.arange(rings.end, rings.end + committed.shape[0])))[0]
    n = len(drafter.stages)
    return {"stages": stages[:n], "head": stages[n] if len(stages) > n else 0, "markov_and_confidence": whole - seen,
            "total": whole, "ingest": ingest, "kernel_calls": dict(calls)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny one)")
    parser.add_argument("--rows", type=int, default=8, help="rows a decode step is padded to (GPU: 8)")
    parser.add_argument("--prompt", type=int, default=300,
                        help="tokens prefilled before the step (few: the indexers pick every position unscored)")
    parser.add_argument("--propose", action="store_true", help="count the drafter's propose pass instead")
    args = parser.parse_args()
    if args.propose:
        res = count_propose(args.model, args.prompt)
        heads = [f"stage {k}" for k in range(len(res["stages"]))]
        heads += ["head", "Markov steps and confidence", "propose pass", "ingest of a round"]
        print("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads))
        print(f"| {' | '.join(map(str, res['stages']))} | {res['head']} | {res['markov_and_confidence']} | "
              f"{res['total']} | {res['ingest']} |")
        print(f"\nkernel calls: {res['kernel_calls']}")
        return 0
    res = count(args.model, args.rows, args.prompt)
    print("| layer kind | layers | launches per layer | views per layer |")
    print("|---|---|---|---|")
    for kind, counts in res["per_kind"].items():
        views = res["views_per_kind"][kind]
        print(f"| {kind} | {len(counts)} | {', '.join(map(str, sorted(set(counts))))} | "
              f"{', '.join(map(str, sorted(set(views))))} |")
    print(f"\nper decode step: {res['total']} launches, {res['views']} views, {res['left_in_cache']} launches left "
          f"unevaluated in the cache; kernel calls: {res['kernel_calls']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
