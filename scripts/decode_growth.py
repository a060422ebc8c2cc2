"""Where a decode step's time grows with context, on any machine.

    python scripts/decode_growth.py [--model DIR] [--contexts 1024 4096 16384] [--attention-contexts ...]

Two tables:
- Whole steps: a checkpoint (default: the release's layer layout at small widths,
  `make_flash_shaped.py DIR --small`, written to a temporary folder) prefilled with a
  made-up prompt of each length, then plain decode forwards (Runner.decode) timed one by
  one; and the MLX operations one decode forward's graph holds at each context.
- Per layer role at the release's attention sizes (64 heads x 512, index 32 x 128, top-512,
  candidate blocks 2048 x 8): one Attention module per role, random weights, its caches filled
  to each context with random rows; one forward of the runtime's decode rows timed per layer
  (the layers run in the model's order, sharing one SharedAttention as a forward does, each
  repetition on copies of the filled caches), and
  the indexer's pieces apart: the scoring GEMM and its weighting, the top-k, the cache's
  append of one group.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dsv41_mlx  # noqa: E402
from dsv41_mlx.cache import LayerCache, RowBuffer  # noqa: E402
from dsv41_mlx.config import ModelArgs  # noqa: E402
from dsv41_mlx.generate import prefill  # noqa: E402
from dsv41_mlx.models.attention import Attention, SharedAttention, negated_scores, weighted_relu  # noqa: E402
from dsv41_mlx.models.layers import key_ids  # noqa: E402
from dsv41_mlx.quant import fp8_input  # noqa: E402
from dsv41_mlx.runtime.options import default_options  # noqa: E402
from dsv41_mlx.runtime.runner import Runner  # noqa: E402
from scripts.benchmarks.harness import graph_ops, prompt_of  # noqa: E402
from scripts.make_flash_shaped import flash_config, fp8_codes  # noqa: E402

BF16 = mx.bfloat16


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() evaluated, after one untimed run."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times)


# -- whole decode steps ------------------------------------------------------------------------

def whole_steps(model_dir: str, contexts: list[int], steps: int) -> list[dict]:
    """Each context's median decode forward (ms) after its prompt, and the ops of one forward."""
    model, _ = dsv41_mlx.load(model_dir)
    mx.eval(model.parameters())
    rows = []
    with Runner(model) as runner:
        for n in contexts:
            cache = runner.make_cache()
            tic = time.perf_counter()
            logits, _ = prefill(runner, prompt_of(n, model.args.vocab_size), cache)
            mx.eval(logits)
            prefill_s = time.perf_counter() - tic
            times, token = [], 5
            for _ in range(steps + 1):
                tic = time.perf_counter()
                logits, _ = runner.decode([token], cache)
                mx.eval(logits)
                times.append(time.perf_counter() - tic)
            # one forward built, not run, then rolled back: its graph's size
            logits, _ = runner.decode([token], cache)
            ops = sum(graph_ops(logits, *cache.state()).values())
            mx.eval(logits)
            rows.append({"context": n, "prefill_s": prefill_s, "step_ms": 1e3 * statistics.median(times[1:]),
                         "ops": ops})
            print(f"  {n}: {rows[-1]}", flush=True)
    return rows


# -- the attention at the release's sizes, per layer role --------------------------------------

ROLES = {0: "window only", 2: "ratio 2, KV + index source", 3: "ratio 2, reads layer 2's picks",
         20: "ratio 1, KV + index + candidate source", 24: "ratio 1, index source (candidates)",
         25: "ratio 1, reads layer 24's picks"}


def release_args() -> ModelArgs:
    return ModelArgs.from_dict(flash_config())


def randomised(module, seed: int):
    """module with random weights: FP8 codes of moderate size with scales near 1/sqrt(fan in),
    floats small, norms one."""
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(module.parameters()):
        if p.dtype == mx.uint32:  # FP8 E4M3 codes, 4 a word
            new.append((name, mx.array(fp8_codes((*p.shape[:-1], p.shape[-1] * 4), rng).view(np.uint32))))
        elif p.dtype == mx.uint8:  # E8M0 scales
            fan_in = p.shape[-1] * 32
            new.append((name, mx.full(p.shape, int(127 - np.ceil(np.log2(np.sqrt(fan_in)))), dtype=mx.uint8)))
        elif "norm" in name and p.ndim == 1:
            new.append((name, mx.ones(p.shape, dtype=p.dtype)))
        else:
            new.append((name, mx.array(rng.standard_normal(p.shape).astype(np.float32) * 0.02).astype(p.dtype)))
    module.update(tree_unflatten(new))
    mx.eval(module.parameters())
    return module


def filled_caches(args: ModelArgs, context: int, rng) -> list[LayerCache]:
    """Every layer's cache as after `context` positions: the window's kept rows, and on the KV
    sources every finished group's pooled kv and index keys (random rows, no pending group)."""
    caches = []
    for i in range(args.num_hidden_layers):
        ratio = args.compress_ratios[i] if i in args.kv_source_layer_ids else 0
        c = LayerCache(args.sliding_window, ratio)
        keep = min(context, args.sliding_window + 16)
        c.window.end = context - keep
        c.window.update(mx.array(rng.standard_normal((keep, args.head_dim)).astype(np.float32)).astype(BF16))
        if ratio:
            groups = context // ratio
            kv = mx.array(rng.standard_normal((groups, args.head_dim)).astype(np.float32)).astype(BF16)
            keys = mx.array(rng.standard_normal((groups, args.index_head_dim)).astype(np.float32)).astype(BF16)
            c.compressor.append_groups(kv, keys)
            if ratio > 1:  # the raw rows a trim may reopen groups from
                c.compressor.end = c.compressor.raw_start = groups * ratio - 16
                c.compressor.append_raw(mx.array(rng.standard_normal((16, 2 * args.head_dim)).astype(np.float32)))
            c.compressor.end = groups * ratio
        caches.append(c)
    mx.eval([cache_arrays(c) for c in caches])
    return caches


def cache_arrays(c: LayerCache) -> list[mx.array]:
    """Every array a layer's cache holds: its window's rows, and a KV source's raw rows, pooled
    kv and index keys."""
    arrays = [c.window.keys]
    if c.compressor is not None:
        arrays += [c.compressor.raw, c.compressor.kv, c.compressor.index_keys]
    return [a for a in arrays if a is not None]


def attention_rows(contexts: list[int], rows: int, reps: int, row_invariant: bool | None = None) -> list[dict]:
    """Per context: each role's layer forward (ms), run in the model's order with one
    SharedAttention, and the indexer's pieces at its sizes. A forward of `rows` rows holds one
    real row, the rest padding; row_invariant: each row gathers its own window, as in the
    runtime's padded decode forwards (SharedAttention's; None: whether the runtime pads them
    here, Options.decode_rows)."""
    args = release_args()
    layers = {i: randomised(Attention(args, i), i) for i in ROLES}
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((rows, args.hidden_size)).astype(np.float32)).astype(BF16)
    xq = fp8_input(x)
    if row_invariant is None:
        row_invariant = default_options(args).decode_rows is not None
    out = []
    for n in contexts:
        caches = filled_caches(args, n, rng)
        positions_np = np.arange(n, n + rows)
        positions = mx.array(positions_np, dtype=mx.int32)
        per_layer = collections.defaultdict(list)
        for _ in range(reps + 1):
            # each repetition on copies of the caches the layers write (a layer writes only its
            # own; the others are read as they are): every forward starts from the filled state,
            # whatever its row count (a trim undoes at most cache.TRIM_SLACK rows, and only of
            # the caches a forward wrote)
            run = list(caches)
            for i in layers:
                run[i] = caches[i].copy()
            mx.eval([cache_arrays(run[i]) for i in layers])
            shared = SharedAttention(1, positions_np, row_invariant)
            for i, layer in layers.items():
                tic = time.perf_counter()
                mx.eval(layer(x, positions, run[i], run, shared, xq=xq), cache_arrays(run[i]))
                per_layer[i].append(time.perf_counter() - tic)
            del run
        row = {"context": n}
        for i in layers:
            row[f"layer {i}"] = 1e3 * statistics.median(per_layer[i][1:])
        row.update(indexer_pieces(args, caches, n, rows, reps, rng))
        out.append(row)
        print(f"  {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "context"), flush=True)
        del caches
    return out


def indexer_pieces(args: ModelArgs, caches: list[LayerCache], n: int, rows: int, reps: int, rng) -> dict:
    """The ratio-1 indexer's pieces over its n groups: the scores (GEMM over every index key,
    head weighting and sum, masking), the top-k of them (argpartition over every group, sorted),
    the gather of the picked groups; and the append of one group to the cache's buffers."""
    src = caches[20].compressor
    keys = src.index_keys
    q = mx.array(rng.standard_normal((rows, args.index_n_heads, args.index_head_dim)).astype(np.float32)).astype(BF16)
    w = mx.array(rng.standard_normal((rows, args.index_n_heads)).astype(np.float32)).astype(BF16)
    visible = mx.array(np.arange(n, n + rows) + 1, dtype=mx.int32)

    def scores():
        summed = weighted_relu(q @ keys.T, w).sum(axis=1)
        return negated_scores(summed, key_ids(keys.shape[0]), visible)

    negated = scores()
    mx.eval(negated)
    k = args.index_topk

    def topk():
        return mx.sort(mx.argpartition(negated, kth=k - 1, axis=-1)[:, :k], axis=-1)

    ids = topk()
    mx.eval(ids)
    buf = RowBuffer(256)
    buf.append(src.kv)
    one = src.kv[:1] + 0
    mx.eval(buf.rows, one)

    def append():
        r = buf.append(one)
        buf.drop_back(1)
        return r

    return {"index scores": timed(scores, reps), "top-k": timed(topk, reps),
            "gather picks": timed(lambda: src.kv_buffer[ids], reps), "append one group": timed(append, reps)}


def print_tables(steps: list[dict], attn: list[dict], env: str) -> None:
    print(f"\n## Decode step by context ({env})\n")
    if steps:
        first = steps[0]["step_ms"]
        print("| context | prefill s | decode step ms | x the shortest's | ops in a step |")
        print("|---|---|---|---|---|")
        for r in steps:
            print(f"| {r['context']} | {r['prefill_s']:.1f} | {r['step_ms']:.2f} | {r['step_ms'] / first:.2f} | "
                  f"{r['ops']} |")
    if attn:
        cols = [k for k in attn[0] if k != "context"]
        print("\nPer layer role at the release's attention sizes, ms (layer roles: "
              + "; ".join(f"{i}: {r}" for i, r in ROLES.items()) + ")\n")
        print("| context | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for r in attn:
            print(f"| {r['context']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: make_flash_shaped.py --small, made here)")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    p.add_argument("--attention-contexts", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    p.add_argument("--steps", type=int, default=8, help="decode forwards timed per context")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    env = f"{mx.default_device()}, MLX {mx.__version__}"
    steps = []
    if a.contexts:
        with tempfile.TemporaryDirectory() as tmp:
            model = a.model
            if model is None:
                model = str(Path(tmp) / "small")
                subprocess.run([sys.executable, str(ROOT / "scripts" / "make_flash_shaped.py"), model, "--small"],
                               check=True, stdout=subprocess.DEVNULL)
            print("whole steps:", flush=True)
            steps = whole_steps(model, a.contexts, a.steps)
    print("attention at the release's sizes:", flush=True)
    rows = default_options(release_args()).decode_rows or 1
    attn = attention_rows(a.attention_contexts, rows, a.reps) if a.attention_contexts else []
    print_tables(steps, attn, env + f", {rows} rows a decode forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
