"""`bench.py head`: the FP8 drafter head's kernel (fp8_rows) against a BF16 and an mxfp8
matmul at the release's 129280 x 5120, and its floor."""

from __future__ import annotations

import time

import mlx.core as mx

from dsv41_mlx.kernels import backend, fp8_rows_tiles, fp8_rows_top64
from dsv41_mlx.quant import quantize_fp8_tiles_mx

from .harness import copy_bandwidth, print_heading, timed


def add_arguments(p) -> None:
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--dim", type=int, default=5120)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 10, 15])


def run(args, env: dict) -> dict:
    res = bench_head(args.vocab, args.dim, args.rows)
    print_head(env, res, args.vocab, args.dim)
    return res


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
        xs = [mx.random.normal((rows, dim)).astype(mx.bfloat16) for _ in range(8)]  # as the drafter feeds the head
        mx.eval(xs)
        row = {"rows": rows,
               "bf16_ms": timed(lambda i: xs[i % 8] @ weight.T) * 1e3,
               "mxfp8_qmm_ms": timed(lambda i: mx.quantized_matmul(xs[i % 8], wq, sq, transpose=True,
                                                                   mode="mxfp8")) * 1e3}
        floor_bytes = head.nbytes + rows * dim * 4 + rows * (vocab // 256) * 64 * 8
        row["floor_ms"] = floor_bytes / bw * 1e3
        if impl != "mlx":
            row["kernel_ms"] = timed(lambda i: fp8_rows_tiles(xs[i % 8], head, impl)) * 1e3
            row["kernel_top64_ms"] = timed(lambda i: fp8_rows_top64(xs[i % 8], head, impl)) * 1e3
        else:
            row["kernel_ms"] = row["kernel_top64_ms"] = timed(lambda i: fp8_rows_top64(xs[i % 8], head, "mlx")) * 1e3
        results["rows"].append(row)
    return results


def print_head(env: dict, res: dict, vocab: int, dim: int) -> None:
    print_heading(f"FP8 drafter head, {vocab} x {dim}", env)
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
