"""Benchmarks. Prints markdown tables (the form docs/benchmarks.md keeps) and, with --json, the numbers.

    python scripts/bench.py head               # FP8 head kernel vs BF16 / mxfp8 matmul at 129280 x 5120
    python scripts/bench.py drafts [--model M] # FP8 vs BF16 drafter head: changed drafts, acceptance

Speed is measured here and nowhere else: ratios against baselines measured in
the same run, and fractions of the memory-bandwidth floor (bytes that must
move / copy bandwidth measured in the same run, counting read + write bytes).
Runs unchanged on Metal, CUDA and the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv41_mlx.kernels import backend, fp8_rows_tiles, fp8_rows_top64  # noqa: E402
from dsv41_mlx.quant import quantize_fp8_tiles_mx  # noqa: E402


# ----------------------------------------------------------------- measuring

def environment() -> dict:
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    device = info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    return {"date": datetime.date.today().isoformat(), "device": str(device), "backend": backend(),
            "mlx": mx.__version__, "commit": commit}


def timed(make_outputs, calls: int = 20, reps: int = 7) -> float:
    """Median seconds per call: `calls` calls built into one graph, evaluated together, `reps` times."""
    mx.eval(make_outputs(0))  # warm-up (compilation, allocation)
    samples = []
    for rep in range(reps):
        outs = [make_outputs(rep * calls + i) for i in range(calls)]
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        samples.append((time.perf_counter() - tic) / calls)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device copy (read + write), the ceiling the floors are computed from."""
    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    t = timed(lambda i: a + float(i), calls=5, reps=5)
    del a
    return 2 * nbytes / t


# ---------------------------------------------------------------------- head

def bench_head(vocab: int, dim: int, rows_list: list[int]) -> dict:
    impl = backend()
    bw = copy_bandwidth()
    mx.random.seed(0)
    weight = (mx.random.normal((vocab, dim)) * 0.02).astype(mx.bfloat16)
    tic = time.perf_counter()
    head = quantize_fp8_tiles_mx(weight)
    mx.eval(head.codes, head.scales)
    build_s = time.perf_counter() - tic
    wq, sq = head.to_mxfp8()
    mx.eval(wq, sq)
    results = {"copy_GBps": bw / 1e9, "fp8_head_GB": head.nbytes / 1e9, "build_s": build_s, "rows": []}
    for rows in rows_list:
        xs = [mx.random.normal((rows, dim)).astype(mx.bfloat16) for _ in range(8)]
        xf = [x.astype(mx.float32) for x in xs]
        mx.eval(xs, xf)
        row = {"rows": rows,
               "bf16_ms": timed(lambda i: xs[i % 8] @ weight.T) * 1e3,
               "mxfp8_qmm_ms": timed(lambda i: mx.quantized_matmul(xs[i % 8], wq, sq, transpose=True,
                                                                   mode="mxfp8")) * 1e3}
        floor_bytes = head.nbytes + rows * dim * 4 + rows * (vocab // 256) * 64 * 8
        row["floor_ms"] = floor_bytes / bw * 1e3
        if impl != "mlx":
            row["kernel_ms"] = timed(lambda i: fp8_rows_tiles(xf[i % 8], head, impl)) * 1e3
            row["kernel_top64_ms"] = timed(lambda i: fp8_rows_top64(xf[i % 8], head, impl)) * 1e3
        else:
            row["kernel_ms"] = row["kernel_top64_ms"] = timed(lambda i: fp8_rows_top64(xf[i % 8], head, "mlx")) * 1e3
        results["rows"].append(row)
    return results


def print_head(env: dict, res: dict, vocab: int, dim: int) -> None:
    print(f"### FP8 drafter head, {vocab} x {dim} ({env['date']}, {env['device']}, {env['backend']}, "
          f"MLX {env['mlx']}, commit {env['commit']})\n")
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s (read + write); FP8 head {res['fp8_head_GB']:.3f} GB, "
          f"built in {res['build_s'] * 1e3:.0f} ms\n")
    print("| rows | BF16 matmul ms | mxfp8 quantized_matmul ms | fp8_rows kernel ms | + final top-64 ms | "
          "FP8 floor ms | kernel / floor | BF16 / kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['rows']} | {r['bf16_ms']:.3f} | {r['mxfp8_qmm_ms']:.3f} | {r['kernel_ms']:.3f} | "
              f"{r['kernel_top64_ms']:.3f} | {r['floor_ms']:.3f} | {r['kernel_ms'] / r['floor_ms']:.2f} | "
              f"{r['bf16_ms'] / r['kernel_ms']:.2f} |")
    print()


# -------------------------------------------------------------------- drafts

def bench_drafts(model_path: str | None, max_tokens: int, n_prompts: int) -> dict:
    """FP8 vs BF16 drafter head on the benchmark prompts: proposals from identical ring
    states (teacher-forced along the plain greedy reply), then drafted replies and acceptance."""
    import dsv41_mlx
    from dsv41_mlx.dspark import Drafter
    from dsv41_mlx.generate import generate_step, prefill
    from dsv41_mlx.sampling import SamplingParams
    from dsv41_mlx.speculative import SpeculativeDecoder

    model, tokenizer = dsv41_mlx.load(model_path)
    prompts = json.loads((ROOT / "scripts" / "prompts.json").read_text())
    texts = (prompts["prose"][:n_prompts] + prompts["code"][:n_prompts])
    heads = {h: Drafter(model, head=h) for h in ("bf16", "fp8")}
    params = SamplingParams()
    changed = total = 0
    out = {"prompts": len(texts), "max_tokens": max_tokens}
    acceptance = {h: [0, 0] for h in heads}
    identical = True
    for text in texts:
        ids = tokenizer.encode(text)
        reply = list(generate_step(model, ids, params, max_tokens, decoder=None))
        _, features = model(mx.array([ids + reply[:-1]], dtype=mx.int32))
        rings = {h: d.make_cache() for h, d in heads.items()}
        for h, d in heads.items():
            d.ingest(rings[h], features[0, : len(ids)])
        for t, anchor in enumerate(reply[:-1]):
            proposals = {h: d.propose(rings[h], anchor) for h, d in heads.items()}
            a, b = (proposals[h].drafts.tolist() for h in ("bf16", "fp8"))
            changed += sum(x != y for x, y in zip(a, b))
            total += len(a)
            for h, d in heads.items():
                d.ingest(rings[h], features[0, len(ids) + t: len(ids) + t + 1])
        for h, d in heads.items():
            decoder = SpeculativeDecoder(model, d, params, confidence="off")
            drafted = list(generate_step(model, ids, params, max_tokens, decoder=decoder))
            identical &= drafted == reply
            acceptance[h][0] += decoder.stats.accepted
            acceptance[h][1] += decoder.stats.verified
    out.update(changed=changed, total=total, identical=identical,
               acceptance={h: a / max(v, 1) for h, (a, v) in acceptance.items()},
               accepted={h: a for h, (a, _) in acceptance.items()})
    return out


def print_drafts(env: dict, res: dict, model: str) -> None:
    print(f"### FP8 vs BF16 drafter head on {model} ({env['date']}, {env['device']}, MLX {env['mlx']}, "
          f"commit {env['commit']})\n")
    print("| prompts | tokens each | drafts compared | drafts changed | acceptance BF16 head | "
          "acceptance FP8 head | replies identical |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['prompts']} | {res['max_tokens']} | {res['total']} | {res['changed']} "
          f"({res['changed'] / max(res['total'], 1):.1%}) | {res['acceptance']['bf16']:.3f} "
          f"({res['accepted']['bf16']}) | {res['acceptance']['fp8']:.3f} ({res['accepted']['fp8']}) | "
          f"{'yes' if res['identical'] else 'NO'} |")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("head")
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--dim", type=int, default=5120)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 10, 15])
    p.add_argument("--json")
    p = sub.add_parser("drafts")
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=5, help="prose and code prompts each")
    p.add_argument("--json")
    args = parser.parse_args()
    env = environment()
    if args.what == "head":
        res = bench_head(args.vocab, args.dim, args.rows)
        print_head(env, res, args.vocab, args.dim)
    else:
        res = bench_drafts(args.model, args.max_tokens, args.prompts)
        print_drafts(env, res, args.model or "the embedded tiny checkpoint")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, args.what: res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
