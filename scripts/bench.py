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
    python scripts/bench.py steps --model DIR [--variant u1=experts_loads_ahead:1 ...] [--verify-rows 6]
                                                # layout choices A/B'd a decode step at a time, one process

Speed is measured here and nowhere else: ratios against baselines measured in
the same run, and fractions of the memory-bandwidth floor (bytes that must
move / copy bandwidth measured in the same run, counting read + write bytes).
Runs unchanged on Metal, CUDA and the CPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parent.parent
COPY_TRIES = 3  # copy_bandwidth's measurements, the best kept
sys.path.insert(0, str(ROOT))

from dsv41_mlx.kernels import backend, device_backend, fp8_rows_tiles, fp8_rows_top64  # noqa: E402
from dsv41_mlx.quant import quantize_fp8_tiles_mx  # noqa: E402


# ----------------------------------------------------------------- measuring

def environment() -> dict:
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            # "-dirty" where the files differ from the commit (a copy of a checkout, a local edit)
            commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    device = info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    kernels_note = "" if backend() == device_backend() else " (custom kernels off: DSV41_MLX_KERNELS=0)"
    return {"date": datetime.date.today().isoformat(), "device": str(device),
            "backend": device_backend() + kernels_note, "mlx": mx.__version__, "commit": commit}


def evaluation_seconds(outputs) -> float:
    """Seconds to evaluate outputs' lazy graph, the device idle before and finished after."""
    mx.synchronize()
    tic = time.perf_counter()
    mx.eval(outputs)
    mx.synchronize()
    return time.perf_counter() - tic


def timed(make_outputs, calls: int = 20, reps: int = 7) -> float:
    """Median seconds per call: `calls` calls built into one graph, evaluated together, `reps` times."""
    mx.eval(make_outputs(0))  # warm-up (compilation, allocation)
    return statistics.median(
        evaluation_seconds([make_outputs(rep * calls + i) for i in range(calls)]) / calls for rep in range(reps))


def chained(gemm, x0: mx.array, links: int = 40, reps: int = 3) -> float:
    """Median seconds per GEMM when each waits for the one before, as a forward's GEMMs do
    (`timed`'s calls are independent, and a GPU may overlap them). Link i takes x, runs
    y = gemm(x, i) and feeds x0 + 0 * (a value of y) to link i + 1; the same chain with y = x
    is timed too and its cost per link (two element-wise operations) subtracted. y may have
    any shape (a kernel may return only a padded forward's real rows)."""
    def chain(step):
        x = x0
        for i in range(links):
            y = step(x, i).reshape(-1)[:1]  # (views: no launch)
            x = x0 + (y * 0).astype(x0.dtype)
        return x

    def per_link(step):
        return statistics.median(evaluation_seconds(chain(step)) / links for _ in range(reps))

    per_link(gemm)  # warm-up
    return per_link(gemm) - per_link(lambda x, i: x)


def host_probe_ms(reps: int = 5) -> float:
    """A fixed piece of pure-Python work (no MLX), the median of reps timings, in ms: how fast
    the host's CPU runs right now. On the lent H200 (a virtual machine) it ran 1.3-1.45x slower
    in episodes of tens of decode steps, during which the host's side of a step slowed alike;
    e2e takes it around every prompt so that a slow run shows."""
    times = []
    for _ in range(reps):
        tic, total = time.perf_counter(), 0
        for i in range(20_000):
            total += i
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def copy_bandwidth(nbytes: int = 1 << 30, tries: int = COPY_TRIES) -> float:
    """Bytes per second of a device copy (read + write), the ceiling the floors are computed from:
    the best of `tries` measurements, each the median of 5 evaluations of 5 copies. Something
    else on the device or host only slows a measurement, so the best is the steadiest ceiling:
    on the H200 one e2e measured 3125 GB/s once, where nine measurements in another process
    gave 3531-3657, and single evaluations 2504-3654."""
    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    t = min(timed(lambda i: a + float(i), calls=5, reps=5) for _ in range(tries))
    return 2 * nbytes / t


# ---------------------------------------------------------------------- head

def prompt_texts(n_prompts: int) -> list[str]:
    """The first n_prompts prose and the first n_prompts code prompts of scripts/prompts.json."""
    prompts = json.loads((ROOT / "scripts" / "prompts.json").read_text())
    return prompts["prose"][:n_prompts] + prompts["code"][:n_prompts]


def reply_hash(tokens: list) -> str:
    """A reply's token ids (or several replies') as a short hash: equal replies, equal hashes."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]


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
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.runtime.drafter import Drafter
    from dsv41_mlx.runtime.runner import Runner
    from dsv41_mlx.sampling import SamplingParams
    from dsv41_mlx.speculative import SpeculativeDecoder

    model, tokenizer = dsv41_mlx.load(model_path)
    texts = prompt_texts(n_prompts)
    heads = {h: Drafter(model, head=h) for h in ("bf16", "fp8")}
    params = SamplingParams()
    changed = total = 0
    out = {"prompts": len(texts), "max_tokens": max_tokens}
    acceptance = {h: [0, 0] for h in heads}
    identical = True
    with Runner(model) as runner:
        for text in texts:
            ids = tokenizer.encode(text)
            reply = list(generate_step(runner, ids, params, max_tokens, decoder=None))
            _, features = runner(mx.array([ids + reply[:-1]], dtype=mx.int32))
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
                decoder = SpeculativeDecoder(runner, d, params, confidence="off")
                drafted = list(generate_step(runner, ids, params, max_tokens, decoder=decoder))
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


# ------------------------------------------------------------------- propose

RELEASE_DSPARK_EXPERTS = {"dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}  # the release's


def release_shaped_drafter_model(backbone_layers: int = 3):
    """A model whose drafter (3 stages, FP8/FP4 formats), embedding and head have the release's
    shapes, with random weights, built in memory; the backbone is a few plain window layers
    (the propose pass never runs it)."""
    from mlx.utils import tree_unflatten

    from dsv41_mlx.config import ModelArgs
    from dsv41_mlx.io.load import build_model
    from dsv41_mlx.io.tiny import TINY_TEXT_CONFIG
    from scripts.make_flash_shaped import RELEASE_TEXT

    text = {**TINY_TEXT_CONFIG, **RELEASE_TEXT, **RELEASE_DSPARK_EXPERTS, "num_hidden_layers": backbone_layers,
            "compress_ratios": [0] * (backbone_layers + 3), "kv_source_layer_ids": [],
            "index_source_layer_ids": [], "candidate_source_layer_id": -1, "engram_layer_ids": [],
            "engram_num_embeddings": [], "dspark_target_layer_ids": list(range(backbone_layers))[-3:],
            "n_routed_experts": 8, "num_experts_per_tok": 2}
    args = ModelArgs.from_dict({"model_type": "deepseek_v41", "text_config": text,
                                "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                        "scale_fmt": "ue8m0", "expert_dtype": "fp4"}})
    model = build_model(args)
    new = []
    for name, v in tree_flatten(model.parameters()):
        if v.dtype == mx.uint32 and name.endswith("weight"):  # packed FP8 / FP4 codes
            fp4 = ".experts." in name
            codes = mx.random.randint(0, 256 if fp4 else 127, (v.size * 4,)).astype(mx.uint8)
            v = codes.view(mx.uint32).reshape(v.shape)
        elif v.dtype == mx.uint8:  # E8M0 scales: 2**-7
            v = mx.full(v.shape, 120, dtype=mx.uint8)
        elif mx.issubdtype(v.dtype, mx.floating):
            v = (mx.random.normal(v.shape) * 0.02).astype(v.dtype)
        new.append((name, v))
        mx.eval(v)
    model.update(tree_unflatten(new))
    return model


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
    print(f"### DSpark propose and ingest at release shapes ({env['date']}, {env['device']}, {env['backend']}, "
          f"MLX {env['mlx']}, commit {env['commit']})\n")
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


# ----------------------------------------------------------------------- e2e

class OracleDrafter:
    """Proposes the target's own continuation, each draft right with probability `rate`
    (else a wrong token), from a fixed generator: what a drafter with that acceptance rate
    would let the engine do. Its confidence in each draft is that rate (a calibrated
    drafter), which the `schedule` verify policy uses. Labelled as such wherever it is
    reported."""

    def __init__(self, drafter, sequence: list[int], rate: float, seed: int = 0):
        import numpy as np

        self.inner, self.sequence, self.rate = drafter, sequence, rate
        self.block, self.window, self.verify_costs = drafter.block, drafter.window, None
        self.rng = np.random.default_rng(seed)
        self.right = self.made = 0  # drafts made equal to the continuation, of all made

    def make_cache(self):
        return self.inner.make_cache()

    def ingest(self, cache, features):
        self.inner.ingest(cache, features)

    def ingest_ahead(self, cache, features):
        return self.inner.ingest_ahead(cache, features)

    def propose(self, cache, anchor, pick):
        from dsv41_mlx.runtime.drafter import Proposal

        drafts = []
        for k in range(self.block):
            pos = cache.end + 1 + k
            token = self.sequence[pos] if pos < len(self.sequence) else 0
            right = self.rng.random() < self.rate
            drafts.append(token if right else (token + 1) % 129280)
            self.right, self.made = self.right + right, self.made + 1
        logit = math.log(self.rate / (1 - self.rate)) if 0 < self.rate < 1 else (30.0 if self.rate else -30.0)
        return Proposal(mx.array(drafts, dtype=mx.int32), mx.zeros((self.block, 1)), mx.full((self.block,), logit))


def experts_taken(n_experts: int, k: int, rows: int) -> float:
    """Routed experts `rows` rows take in all, on average, if each row picks its k of the
    n_experts independently and uniformly (what a random-weight router comes near): an
    expert is left out by all rows with probability (1 - k / n_experts) ** rows. One row: k."""
    return float(k) if rows == 1 else n_experts * (1 - (1 - k / n_experts) ** rows)


def decode_bytes(model, rows: int = 1) -> tuple[float, float]:
    """(bytes a forward of `rows` decode rows must read, of which routed experts): every dense
    weight of the backbone and the head once, the embedding rows, and the routed experts the
    rows take (one row: its top-k a layer; more: experts_taken, each expert read once for all
    the rows that picked it, as fp4_experts reads it)."""
    args = model.args
    total = experts = 0
    for i, layer in enumerate(model.layers):
        n_experts, k = args.moe_shape(i)
        for name, v in tree_flatten(layer.parameters()):
            if ".experts." in name:
                per_expert = v.nbytes // v.shape[0]
                experts += per_expert * experts_taken(n_experts, k, rows)
            else:
                total += v.nbytes
    head = model.head.weight.nbytes  # the release's BF16 head, read as it is stored (deepseek_v41.Head)
    total += experts + head + rows * model.embed.weight.nbytes // args.vocab_size
    return total, experts


def oracle_budget(rate: float, plain_ms: float, verify_ms: list[float], floor_ms: list[float],
                  round_ms: float, target: float) -> list[dict]:
    """What `target` x plain decode asks of the verify forward, for each number of drafts k a
    round could verify (k + 1 rows: verify_ms[k] and floor_ms[k], ms; [0] one row): a round
    yields (1 - rate ** (k + 1)) / (1 - rate) tokens on average (drafts accepted until the
    first miss, and the target's own token), so it may take that many plain steps (plain_ms)
    over `target`; less what a round spends beside the forward (round_ms: propose and
    ingest), that is the verify forward's budget, and floor / budget the fraction of its
    floor it would have to reach. Measured beside it: the forward's time and its fraction.

    Over a plain step: `margin_ms`, what the budget leaves the k rows beyond one over a plain
    step (negative: the budget is under a plain step); `added_ms`, what the measured forward
    adds over a plain step; `extra_floor_ms`, what those rows' own bytes (the experts they take
    beyond one row's) take at the copy bandwidth. `at_floor`: the speedup if every forward ran
    at its floor and a round cost nothing beside it (the tokens a round times the one-row
    floor over the k + 1 rows' floor)."""
    rows = []
    for k in range(1, len(verify_ms)):
        tokens = (1 - rate ** (k + 1)) / (1 - rate)
        budget = tokens * plain_ms / target - round_ms
        rows.append({"drafts": k, "tokens": tokens, "verify_budget_ms": budget,
                     "needed_fraction": floor_ms[k] / budget if budget > 0 else float("inf"),
                     "verify_ms": verify_ms[k], "fraction": floor_ms[k] / verify_ms[k],
                     "margin_ms": budget - plain_ms, "added_ms": verify_ms[k] - plain_ms,
                     "extra_floor_ms": floor_ms[k] - floor_ms[0], "at_floor": tokens * floor_ms[0] / floor_ms[k]})
    return rows


def paired_skip_reason(asked: bool, mlxlm: dict, memory: int | None) -> str | None:
    """Why the paired decode cannot run (None: it can): not asked, no mlx-lm, or memory
    (checkpoint.machine_memory; None: not known) that cannot hold both models with room to
    work (three times one model's weights)."""
    if not asked:
        return "--no-paired"
    if "unavailable" in mlxlm:
        return mlxlm["unavailable"]
    if memory is not None and memory < 3 * mlxlm["weights_GB"] * 1e9:
        return f"both models need ~{3 * mlxlm['weights_GB']:.0f} GB, the device has {memory / 1e9:.0f} GB"
    return None


def decode_rate(runner, ids: list[int], params, tokens: int, decoder=None) -> float:
    """Tokens a second of one reply (generate.generate_step), its prefill and first token left
    out of the rate."""
    from dsv41_mlx.generate import generate_step

    steps = generate_step(runner, ids, params, tokens, decoder=decoder)
    next(steps)
    tic = time.perf_counter()
    n = len(list(steps))
    return n / (time.perf_counter() - tic)


def prefill_rate(runner, ids: list[int]) -> float:
    """Prompt tokens a second of one prefill on a fresh cache through its first token (the
    greedy pick read back), as scripts/mlxlm_baseline.greedy times mlx-lm's."""
    from dsv41_mlx.generate import prefill

    mx.synchronize()
    tic = time.perf_counter()
    logits, _ = prefill(runner, ids, runner.make_cache())
    mx.argmax(logits).item()
    return len(ids) / (time.perf_counter() - tic)


def interleaved(ours, theirs, prompts: int, rounds: int = 2) -> dict:
    """Two decode rates of each prompt i, ours(i) and theirs(i), taken back to back (who goes
    first alternating), for every prompt, `rounds` times, so that both meet the host's speed
    of that moment: the pairs' ratios ours / theirs, their median, each side's median rate and
    the host probe's median (taken before each pair)."""
    ours_rates, their_rates, ratios, probes = [], [], [], []
    for r in range(rounds):
        for i in range(prompts):
            probes.append(host_probe_ms())
            if (r + i) % 2 == 0:
                a, b = ours(i), theirs(i)
            else:
                b, a = theirs(i), ours(i)
            ours_rates.append(a)
            their_rates.append(b)
            ratios.append(a / b)
    return {"pairs": len(ratios), "ratio": statistics.median(ratios), "ratios": ratios,
            "tok_s": statistics.median(ours_rates), "their_tok_s": statistics.median(their_rates),
            "host_probe_ms": statistics.median(probes)}


def paired_speedup(runner, ids_list: list[list[int]], tokens: int, make_decoder, rounds: int = 2) -> dict:
    """A speculative decoder's speed-up over plain greedy decode, the two interleaved prompt by
    prompt (interleaved; as paired_plain_decode pairs ours with mlx-lm): prompt i decoded
    through make_decoder(i) (a fresh decoder) and plainly; tok_s the decoder's, plain_tok_s
    plain decode's."""
    from dsv41_mlx.sampling import SamplingParams

    res = interleaved(
        lambda i: decode_rate(runner, ids_list[i], SamplingParams(), tokens, decoder=make_decoder(i)),
        lambda i: decode_rate(runner, ids_list[i], SamplingParams(), tokens), len(ids_list), rounds)
    res["plain_tok_s"] = res.pop("their_tok_s")
    return res


def paired_plain_decode(runner, model_path, ids_list: list[list[int]], tokens: int, rounds: int = 2) -> dict:
    """Plain greedy decode of ours and of mlx-lm interleaved prompt by prompt (interleaved),
    both models loaded; tok_s ours, mlxlm_tok_s mlx-lm's. Then their prefills through the
    first token the same way (prefill_rate; every prompt seen before by both): "prefill", the
    same keys. Raises MlxLmUnavailable without mlx-lm 0.32.x."""
    from dsv41_mlx.sampling import SamplingParams
    from scripts.mlxlm_baseline import greedy, load_mlxlm

    theirs = load_mlxlm(model_path)
    try:
        greedy(theirs, ids_list[0], 4)  # its kernels built and its traces made before timing

        def mlxlm(i):
            reply, _, seconds = greedy(theirs, ids_list[i], tokens)
            return (len(reply) - 1) / seconds

        def mlxlm_prefill(i):
            _, seconds, _ = greedy(theirs, ids_list[i], 1)
            return len(ids_list[i]) / seconds

        res = interleaved(lambda i: decode_rate(runner, ids_list[i], SamplingParams(), tokens), mlxlm,
                          len(ids_list), rounds)
        res["prefill"] = interleaved(lambda i: prefill_rate(runner, ids_list[i]), mlxlm_prefill, len(ids_list), rounds)
    finally:
        theirs = None  # (the closures' reference too: dropped before the cache is cleared)
        mx.clear_cache()
    for r in (res, res["prefill"]):
        r["mlxlm_tok_s"] = r.pop("their_tok_s")
    return res


def bench_e2e(model_path: str, n_prompts: int, tokens: int, oracle_rate: float, paired: bool = True,
              report=None) -> dict:
    """Everything `bench.py e2e` measures. report(results so far), where given, is called before
    the paired measurement, the slowest part and the last: a run stopped during it (a time
    limit) has printed its tables already."""
    import dsv41_mlx
    from dsv41_mlx.generate import generate_step, prefill, warm_up
    from dsv41_mlx.models.attention import indexer_scoring_length
    from dsv41_mlx.runtime.runner import Runner
    from dsv41_mlx.sampling import SamplingParams
    from dsv41_mlx.speculative import SpeculativeDecoder, measure_verify_costs

    from dsv41_mlx.io.checkpoint import machine_memory, resolve_model_dir
    from dsv41_mlx.config import ModelArgs
    from dsv41_mlx.tokenizer import load_tokenizer
    from scripts.mlxlm_baseline import MlxLmUnavailable, bench_mlxlm

    model_path = resolve_model_dir(model_path)
    ids_list = [load_tokenizer(model_path).encode(t) for t in prompt_texts(n_prompts)]
    vocab = ModelArgs.from_file(model_path / "config.json").vocab_size
    if max(max(ids) for ids in ids_list) >= vocab:  # before mlx-lm, which would gather past its table
        raise SystemExit(f"{model_path}: its tokenizer makes ids past the model's vocabulary of {vocab}: "
                         "the prompts cannot run on it")
    out = {"oracle_rate": oracle_rate}
    # the baseline first, on the same prompts, so that each engine has the device to itself
    try:
        before = host_probe_ms()
        base = bench_mlxlm(model_path, ids_list, tokens)
        out["mlxlm"] = {"prefill_tok_s": base.prefill_tok_s, "decode_tok_s": base.decode_tok_s,
                        "weights_GB": base.weights_gb, "load_s": base.load_s,
                        "host_probe_ms": statistics.median([before, host_probe_ms()])}
    except MlxLmUnavailable as e:
        out["mlxlm"] = {"unavailable": str(e)}
    print(f"  mlx-lm: {out['mlxlm']}", flush=True)
    tic = time.perf_counter()
    model, _ = dsv41_mlx.load(model_path)
    out["load_s"] = time.perf_counter() - tic

    with Runner(model) as runner:
        # prefill: first the warm-up a server runs before serving (generate.warm_up: every chunk
        # shape once, a few tokens of each kind), so that the GPU kernels are built and loaded and the compiled
        # pieces traced before anything is timed (on CUDA: seconds of NVRTC per kernel the first
        # time on a machine, and seconds of loading in every new process); then every prompt (new
        # lengths: what a served request sees), then every prompt again
        out["host_probe_ms"] = host_probe_ms()
        out["warm_up_s"] = warm_up(runner)
        print(f"  warm-up (generate.warm_up, kernel builds and loads included): {out['warm_up_s']:.1f} s", flush=True)
        # the floor: measured once the device has been working (the warm-up), not straight after the load
        bw = copy_bandwidth()
        out["copy_GBps"] = bw / 1e9
        step_bytes, expert_bytes = decode_bytes(model)
        out.update(bytes_per_token_GB=step_bytes / 1e9, routed_expert_GB=expert_bytes / 1e9,
                   floor_ms=step_bytes / bw * 1e3)
        for key in ("prefill_tok_s", "prefill_seen_tok_s"):
            tic, n = time.perf_counter(), 0
            for ids in ids_list:
                logits, _ = prefill(runner, ids, runner.make_cache())
                mx.eval(logits)
                n += len(ids)
            out[key] = n / (time.perf_counter() - tic)
        print(f"  prefill: {out['prefill_tok_s']:.1f} tok/s, prompts seen before {out['prefill_seen_tok_s']:.1f}",
              flush=True)

        # verify forwards of 1..6 rows on a cache holding one window
        out["verify_ms"] = [c * 1e3 for c in measure_verify_costs(runner, model.args.dspark_block_size + 1)]
        out["verify_floor_ms"] = [decode_bytes(model, rows)[0] / bw * 1e3
                                  for rows in range(1, len(out["verify_ms"]) + 1)]
        # a plain decode step without the generation loop around it (the forward, then the greedy
        # token read back), beside the loop's own rate below: what the loop adds per token
        cache = runner.make_cache()
        logits, _ = prefill(runner, ids_list[0], cache)
        token, steps = int(mx.argmax(logits).item()), []
        for _ in range(9):
            tic = time.perf_counter()
            out_logits, _ = runner.decode([token], cache)
            token = int(mx.argmax(out_logits[0, -1]).item())
            steps.append(time.perf_counter() - tic)
        out["bare_step_ms"] = statistics.median(steps[1:]) * 1e3

        # plain greedy decode after a prompt long enough that every index layer scores its picks:
        # the prompts above are short enough that each indexer picks every compressed position
        # without scoring (Indexer.picks_everything), which a long context does not
        long_ids = long_context_prompt(ids_list, indexer_scoring_length(model.args))
        steps = generate_step(runner, long_ids, SamplingParams(), tokens)
        next(steps)  # prefill and the first token stay out of the rate
        tic = time.perf_counter()
        produced = len(list(steps))
        out["long_context"] = {"prompt_tokens": len(long_ids), "tok_s": produced / (time.perf_counter() - tic),
                               "host_probe_ms": host_probe_ms()}
        print(f"  plain greedy after a {len(long_ids)}-token prompt: {out['long_context']['tok_s']:.2f} tok/s",
              flush=True)

        runs = {}
        greedy, coupled = SamplingParams(), SamplingParams(temperature=0.8, seed=7)

        def oracle_decoder(p, seq, confidence="off", verify_costs=None):  # drafts right at oracle_rate on seq
            return SpeculativeDecoder(runner, OracleDrafter(model.drafter, seq, oracle_rate, seed=len(seq)), p,
                                      confidence=confidence, verify_costs=verify_costs)

        for label, params, make in [
            ("plain greedy", greedy, None),
            ("plain coupled", coupled, None),
            ("drafted greedy", greedy, lambda p, seq: SpeculativeDecoder(runner, model.drafter, p, confidence="off")),
            ("drafted coupled", coupled, lambda p, seq: SpeculativeDecoder(runner, model.drafter, p, confidence="off")),
            (f"oracle {oracle_rate:.2f} greedy", greedy, oracle_decoder),
            # the same drafts, each round verifying the number of them the schedule policy picks from
            # the drafter's confidence and the verify costs measured above
            (f"oracle {oracle_rate:.2f} greedy, schedule", greedy,
             lambda p, seq: oracle_decoder(p, seq, confidence="schedule",
                                           verify_costs=[ms / 1e3 for ms in out["verify_ms"]])),
        ]:
            elapsed, produced, replies, stats, oracle, step_s = 0.0, 0, [], [], [0, 0], []
            probes = [host_probe_ms()]
            warm = time.perf_counter()  # a short untimed run first: kernel builds and compile traces
            list(generate_step(runner, ids_list[0], params, 4, decoder=make(params, ids_list[0]) if make else None))
            print(f"  {label}: warm-up {time.perf_counter() - warm:.1f} s", flush=True)
            for i, ids in enumerate(ids_list):
                reference = runs.get("plain greedy", {}).get("replies", [None] * len(ids_list))[i]
                decoder = make(params, ids + (reference or [])) if make else None
                steps = generate_step(runner, ids, params, tokens, decoder=decoder)
                first = next(steps)  # prefill and the first token stay out of the decode rate
                rest, stamps = [], [time.perf_counter()]
                for token in steps:
                    stamps.append(time.perf_counter())
                    rest.append(token)
                elapsed += time.perf_counter() - stamps[0]
                if make is None:  # plain decoding hands out a token a step: each step's time
                    step_s.append([b - a for a, b in zip(stamps, stamps[1:])])
                produced += len(rest)
                probes.append(host_probe_ms())
                replies.append([first] + rest)
                if decoder is not None:
                    stats.append(decoder.stats.as_dict())
                if isinstance(getattr(decoder, "drafter", None), OracleDrafter):
                    oracle = [oracle[0] + decoder.drafter.right, oracle[1] + decoder.drafter.made]
                print(f"  {label}, prompt {i}: {len(rest)} tokens in {stamps[-1] - stamps[0]:.1f} s", flush=True)
            run = {"tok_s": produced / elapsed, "replies": replies, "hash": reply_hash(replies),
                   "host_probe_ms": statistics.median(probes)}
            if stats:
                run["proposed"] = sum(s["proposed"] for s in stats)
                run["accepted"] = sum(s["accepted"] for s in stats)
                run["verified"] = sum(s["verified"] for s in stats)
                run["propose_ms"] = statistics.mean(s["propose_ms_per_round"] for s in stats)
                run["ingest_ms"] = statistics.mean(s["ingest_ms_per_round"] for s in stats)
                run["verify_ms"] = statistics.mean(s["verify_ms_per_round"] for s in stats)
                run["rounds"] = sum(s["rounds"] for s in stats)
            if oracle[1]:
                run["oracle_right_rate"] = oracle[0] / oracle[1]  # the rate its draws realised
            if step_s:
                run["steps"] = step_summary(step_s)
            runs[label] = run
            print(f"  {label}: {run['tok_s']:.2f} tok/s", flush=True)
        oracle_run = runs[f"oracle {oracle_rate:.2f} greedy"]
        out["oracle_budget"] = oracle_budget(oracle_rate, 1e3 / runs["plain greedy"]["tok_s"], out["verify_ms"],
                                             out["verify_floor_ms"], oracle_run["propose_ms"] + oracle_run["ingest_ms"],
                                             ORACLE_TARGET)
        references = runs["plain greedy"]["replies"]
        for run in runs.values():
            del run["replies"]
        out["runs"] = runs

        # the oracle against plain greedy interleaved prompt by prompt: the runs above are minutes
        # apart, and each met the host's speed of its own moment; every draft verified, then the
        # schedule policy (what generate and the server use by default)
        out["paired_oracle"] = paired_speedup(runner, ids_list, tokens,
                                              lambda i: oracle_decoder(greedy, ids_list[i] + references[i]))
        print(f"  paired oracle: {out['paired_oracle']}", flush=True)
        costs = [ms / 1e3 for ms in out["verify_ms"]]
        out["paired_oracle_schedule"] = paired_speedup(
            runner, ids_list, tokens,
            lambda i: oracle_decoder(greedy, ids_list[i] + references[i], confidence="schedule", verify_costs=costs))
        print(f"  paired oracle, schedule: {out['paired_oracle_schedule']}", flush=True)

        # ours and mlx-lm interleaved prompt by prompt (both loaded): the ratio above compares runs
        # minutes apart, and the host's speed drifts
        skipped = paired_skip_reason(paired, out["mlxlm"], machine_memory())
        if report is not None and not skipped:
            report({**out, "paired": {"skipped": PAIRED_LATER}})
        out["paired"] = {"skipped": skipped} if skipped else paired_plain_decode(runner, model_path, ids_list, tokens)
        print(f"  paired plain decode: {out['paired']}", flush=True)
        return out


PAIRED_LATER = "measured after this table, printed below it"
ORACLE_TARGET = 1.8  # drafted decode at the oracle rate against plain decode: the speed-up aimed at


def parse_variant(text: str) -> tuple[str, dict[str, list]]:
    """`NAME=RULE[,RULE...]` (bench.py steps --variant), RULE `CHOICE:VALUE` or `CHOICE@A/B/..:VALUE`
    -> (NAME, {CHOICE: [(args or None, VALUE), ...]}): dsv41_mlx.kernels' layout choice CHOICE
    (a function, e.g. experts_loads_ahead(rows, k)) made to return VALUE, an int, on every call,
    or only on calls with the int arguments A, B, .. (e.g. mma_loads_ahead@2304/1:2: K 2304 at
    one row), the package's own answer otherwise (variant_choice)."""
    from dsv41_mlx import kernels

    name, _, spec = text.partition("=")
    choices: dict[str, list] = {}
    for item in filter(None, spec.split(",")):
        head, _, value = item.partition(":")
        choice, at, args = head.partition("@")
        ints = args.split("/") if at else []
        if (not callable(getattr(kernels, choice, None)) or not value.lstrip("-").isdigit()
                or (at and not all(a.lstrip("-").isdigit() for a in ints))):
            raise SystemExit(f"--variant {text!r}: {item!r} is not CHOICE[@A/B/..]:VALUE with CHOICE a function "
                             "of dsv41_mlx.kernels and VALUE (and A, B, ..) ints")
        choices.setdefault(choice, []).append((tuple(int(a) for a in ints) if at else None, int(value)))
    if not name or not choices:
        raise SystemExit(f"--variant {text!r}: expected NAME=CHOICE[@A/B/..]:VALUE[,...]")
    return name, choices


def variant_choice(rules: list, package):
    """A layout choice from parse_variant's rules for it: the first rule whose arguments match
    the call's (or that has none) gives its value, else the package's function `package` answers."""
    def choice(*args):
        for when, value in rules:
            if when is None or when == args:
                return value
        return package(*args)

    return choice


@contextlib.contextmanager
def own_traces(model, store: dict):
    """Inside: the model's fused methods (layers.fused: mx.compile'd, each module's traces kept on
    it, one a shape) use the traces in `store`, and trace afresh where it has none; on the way
    out the traces made or used inside go back into `store` and the model's own are restored.
    A layout choice (kernels.mma_loads_ahead, ...) is read while a launch is traced: a trace
    made under one variant's choices keeps them, so each variant needs traces of its own (else
    every variant would replay the warm-up's traces, the package's)."""
    from dsv41_mlx.models.layers import fused_traces

    modules = model.modules()

    def take(module):
        return {k: module.__dict__.pop(k) for k in fused_traces(type(module)) if k in module.__dict__}

    own = [take(m) for m in modules]
    for i, m in enumerate(modules):
        for k, traces in store.get(i, {}).items():
            object.__setattr__(m, k, traces)
    try:
        yield
    finally:
        for i, m in enumerate(modules):
            store[i] = take(m)
            for k, traces in own[i].items():
                object.__setattr__(m, k, traces)


def variant_label(choices: dict[str, list]) -> str:
    return ", ".join(f"{c}{'' if when is None else str(when).replace(',)', ')')} {v}"
                     for c, rules in choices.items() for when, v in rules) or "-"


def bench_steps(model_path: str, variants: dict[str, dict[str, list]], tokens: int = 48, rounds: int = 3,
                n_prompts: int = 1, verify_rows: int = 0, warm: bool = True) -> dict:
    """Variants of the kernels' layout choices A/B'd in one process, a step at a time: plain
    greedy decoding (generate.generate_step) of the first n_prompts prose and code prompts,
    `tokens` each, every variant in turn (who goes first alternating round by round), `rounds`
    times; a run's step is the time between two tokens handed out, its first two left out,
    and a run gives its median step. Variant "kernels" (the package's own choices) comes
    first; the others are {name: {choice: rules}} (parse_variant). Each variant's replies are
    hashed: a layout changes no bit, so all must match. verify_rows: also each variant's verify
    forwards of 1..verify_rows distinct rows (speculative.measure_verify_costs), every round.
    Each variant traces the model's fused methods under its own choices and keeps those traces
    (own_traces), in untimed runs of every prompt and verify forward before any is timed.
    warm: generate.warm_up first (every shape a server's forwards take: the package's traces
    and kernels)."""
    import dsv41_mlx
    from dsv41_mlx.io.checkpoint import resolve_model_dir
    from dsv41_mlx.generate import generate_step, warm_up
    from dsv41_mlx.runtime.runner import Runner
    from dsv41_mlx.sampling import SamplingParams
    from dsv41_mlx.speculative import measure_verify_costs
    from dsv41_mlx.tokenizer import load_tokenizer

    model_path = resolve_model_dir(model_path)
    ids_list = [load_tokenizer(model_path).encode(t) for t in prompt_texts(n_prompts)]
    model, _ = dsv41_mlx.load(model_path)
    variants = {"kernels": {}, **variants}
    traces = {name: {} for name in variants}

    @contextlib.contextmanager
    def use(name):
        from dsv41_mlx import kernels

        with kernels_choices({c: variant_choice(rules, getattr(kernels, c)) for c, rules in variants[name].items()}):
            if name == "kernels":  # the package's choices: the model's own traces, the warm-up's
                yield
            else:
                with own_traces(model, traces[name]):
                    yield

    with Runner(model) as runner:
        def run(ids):
            stamps, reply = [], []
            for t in generate_step(runner, ids, SamplingParams(), tokens):
                stamps.append(time.perf_counter())
                reply.append(t)
            steps = [b - a for a, b in zip(stamps, stamps[1:])][2:]
            return statistics.median(steps) * 1e3, reply_hash(reply)

        out = {"tokens": tokens, "rounds": rounds, "prompt_tokens": [len(i) for i in ids_list], "variants": {}}
        tic = time.perf_counter()
        out["warm_up_s"] = warm_up(runner) if warm else 0.0
        if warm:  # (minutes on a GPU whose kernel cache is cold: say so before the variants' own)
            print(f"  warm-up: {out['warm_up_s']:.1f} s", flush=True)
        for name in variants:  # each variant's kernels built and its traces made before anything is timed
            start = time.perf_counter()
            with use(name):
                for ids in ids_list:
                    run(ids[:64])
                    run(ids)
                if verify_rows:  # (on CUDA without the warm-up, a variant's first verify forwards build kernels)
                    measure_verify_costs(runner, verify_rows, repeats=1)
            out["variants"][name] = {"choices": {c: [[w, x] for w, x in rules] for c, rules in variants[name].items()},
                                     "step_ms": [[] for _ in ids_list], "hashes": set(),
                                     "verify_ms": []}
            print(f"  {name}: traced and its kernels built, untimed, in {time.perf_counter() - start:.1f} s",
                  flush=True)
        out["warm_s"] = time.perf_counter() - tic
        names = list(variants)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                res = out["variants"][name]
                with use(name):
                    for i, ids in enumerate(ids_list):
                        ms, digest = run(ids)
                        res["step_ms"][i].append(ms)
                        res["hashes"].add((i, digest))
                    if verify_rows:
                        res["verify_ms"].append([c * 1e3 for c in measure_verify_costs(runner, verify_rows, repeats=1)])
                print(f"  round {r} {name}: " + ", ".join(f"{m[-1]:.2f}" for m in res["step_ms"]) + " ms a step"
                      + (f", verify {res['verify_ms'][-1][-1]:.2f} ms at {verify_rows} rows" if verify_rows else ""),
                      flush=True)
    base = out["variants"]["kernels"]
    for name, res in out["variants"].items():
        res["median_ms"] = [statistics.median(m) for m in res["step_ms"]]
        # each run against the base's run of the same prompt and round (run back to back)
        res["x_base"] = statistics.median(a / b for m, bm in zip(res["step_ms"], base["step_ms"])
                                          for a, b in zip(m, bm))
        res["wins"] = sum(a < b for m, bm in zip(res["step_ms"], base["step_ms"]) for a, b in zip(m, bm))
        res["same_replies"] = res["hashes"] == base["hashes"]
        if verify_rows:
            res["verify_median_ms"] = [statistics.median(c) for c in zip(*res["verify_ms"])]
    for res in out["variants"].values():  # (a set: not JSON)
        res["hashes"] = sorted(d for _, d in res["hashes"])
    return out


def print_steps(env: dict, res: dict, model: str) -> None:
    print(f"### Step A/B of kernel layouts ({env['date']}, {env['device']}, {env['backend']}, MLX {env['mlx']}, "
          f"commit {env['commit']})\n")
    print(f"{model}: plain greedy, {res['tokens']} tokens a run, prompts of {res['prompt_tokens']} tokens, "
          f"{res['rounds']} rounds of every variant in turn (first alternating); a run's median step (ms), then "
          "the median over rounds; x kernels: the median of each run over the same prompt's and round's run "
          "with the package's choices (below 1: faster), wins: runs faster than it\n")
    verify = any(v["verify_ms"] for v in res["variants"].values())
    print("| variant | choices | " + " | ".join(f"prompt {i} ms" for i in range(len(res["prompt_tokens"])))
          + " | x kernels | wins | same replies |" + (" verify ms, 1.. rows |" if verify else ""))
    print("|---|---|" + "---|" * len(res["prompt_tokens"]) + "---|---|---|" + ("---|" if verify else ""))
    for name, v in res["variants"].items():
        choices = variant_label(v["choices"])
        runs = sum(len(m) for m in v["step_ms"])
        print(f"| {name} | {choices} | " + " | ".join(f"{m:.2f}" for m in v["median_ms"])
              + f" | {v['x_base']:.3f} | {v['wins'] if name != 'kernels' else '-'}/{runs} | "
              + ("yes" if v["same_replies"] else "NO") + " |"
              + (" " + " / ".join(f"{c:.1f}" for c in v.get("verify_median_ms", [])) + " |" if verify else ""))
    print()


def long_context_prompt(ids_list: list[list[int]], length: int) -> list[int]:
    """A prompt of `length` tokens: the prompts one after another, over again as needed."""
    ids = []
    while len(ids) < length:
        for prompt in ids_list:
            ids.extend(prompt)
    return ids[:length]


def paired_row(paired: dict) -> str:
    """The mlx-lm table's paired row, or why there is none."""
    if "ratio" not in paired:
        return f"\npaired decode not run: {paired.get('skipped', 'not measured')}\n"
    pre = paired["prefill"]
    return (f"| decode tok/s, paired (the two interleaved prompt by prompt; median of {paired['pairs']} "
            f"pairs' ratios; host probe {paired['host_probe_ms']:.2f} ms) | {paired['tok_s']:.2f} | "
            f"{paired['mlxlm_tok_s']:.2f} | {paired['ratio']:.2f} |\n"
            f"| prefill tok/s through the first token, paired (prompts both have seen; median of {pre['pairs']} "
            f"pairs' ratios; host probe {pre['host_probe_ms']:.2f} ms) | {pre['tok_s']:.1f} | "
            f"{pre['mlxlm_tok_s']:.1f} | {pre['ratio']:.2f} |\n")


def print_e2e(env: dict, res: dict, model: str) -> None:
    print(f"### End to end on {model} ({env['date']}, {env['device']}, {env['backend']}, MLX {env['mlx']}, "
          f"commit {env['commit']})\n")
    print(f"load {res['load_s']:.0f} s; copy bandwidth {res['copy_GBps']:.0f} GB/s (the best of {COPY_TRIES} "
          f"measurements, after the warm-up); a decode step reads "
          f"{res['bytes_per_token_GB']:.2f} GB ({res['routed_expert_GB']:.2f} GB routed experts): floor "
          f"{res['floor_ms']:.2f} ms/token\n")
    print(f"warm-up {res['warm_up_s']:.1f} s (generate.warm_up, as `server --warm-up` runs it: every chunk shape "
          f"once and a few tokens of each kind; on CUDA it builds the GPU kernels: MLX's own the first time on a "
          f"machine, cached on disk after, and this package's custom kernels in every new process); "
          f"prefill {res['prefill_tok_s']:.1f} tok/s "
          f"({res['prefill_seen_tok_s']:.1f} for prompts seen before: "
          f"no new shapes to trace); a bare decode step (forward + greedy token, no generation loop) "
          f"{res['bare_step_ms']:.1f} ms; verify forward ms at 1..6 rows of distinct tokens: "
          + ", ".join(f"{v:.1f}" for v in res["verify_ms"])
          + "; their floors (the experts that many rows take if each picks its own uniformly, "
            "`experts_taken`): " + ", ".join(f"{v:.2f}" for v in res["verify_floor_ms"])
          + "; the fraction of it each reached: "
          + ", ".join(f"{f / v:.1%}" for f, v in zip(res["verify_floor_ms"], res["verify_ms"])) + "\n")
    plain = res["runs"]["plain greedy"]["tok_s"]
    base = res["mlxlm"]
    if "unavailable" in base:
        print(f"side by side: {base['unavailable']}\n")
    else:
        print("side by side with mlx-lm (its deepseek_v41 on the same checkpoint, engram layers removed, which "
              "it cannot run; ours runs them), same prompts, plain greedy:\n")
        print("| | ours | mlx-lm | ours / mlx-lm |")
        print("|---|---|---|---|")
        print(f"| prefill tok/s | {res['prefill_tok_s']:.1f} | {base['prefill_tok_s']:.1f} | "
              f"{res['prefill_tok_s'] / base['prefill_tok_s']:.2f} |")
        print(f"| decode tok/s | {plain:.2f} | {base['decode_tok_s']:.2f} | {plain / base['decode_tok_s']:.2f} |")
        print(f"| decode, fraction of the floor | {plain * res['floor_ms'] / 1e3:.1%} | "
              f"{base['decode_tok_s'] * res['floor_ms'] / 1e3:.1%} | |")
        print(f"| host probe ms (median around the run) | {res['runs']['plain greedy']['host_probe_ms']:.2f} | "
              f"{base['host_probe_ms']:.2f} | |")
        print(paired_row(res.get("paired", {})))
    print(f"host probe (a fixed pure-Python loop, `host_probe_ms`): {res['host_probe_ms']:.2f} ms after the load; "
          "each run's median of its probes (before it and after each prompt) is in the table: a larger one "
          "means the host's CPU ran slower during that run, and so did every step's host side\n")
    print("| run | tok/s | x plain greedy | floor fraction | drafts accepted / verified / proposed | propose ms | "
          "verify ms | ingest ms | host probe ms | reply hash |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in res["runs"].items():
        frac = (1e3 / res["floor_ms"]) and r["tok_s"] * res["floor_ms"] / 1e3
        drafted = f"{r['accepted']} / {r['verified']} / {r['proposed']}" if "proposed" in r else "-"
        ms = [f"{r[k]:.1f}" if k in r else "-" for k in ("propose_ms", "verify_ms", "ingest_ms")]
        print(f"| {label} | {r['tok_s']:.2f} | {r['tok_s'] / plain:.2f} | {frac:.1%} | {drafted} | "
              + " | ".join(ms) + f" | {r['host_probe_ms']:.2f} | {r['hash']} |")
    print()
    if "long_context" in res:
        long = res["long_context"]
        print(f"plain greedy after a {long['prompt_tokens']}-token prompt (the prompts above one after another; "
              f"every index layer then scores its picks at each step, where after the short prompts each picks "
              f"every compressed position without scoring): {long['tok_s']:.2f} tok/s, "
              f"{long['tok_s'] / plain:.2f}x the short prompts' plain greedy, "
              f"{long['tok_s'] * res['floor_ms'] / 1e3:.1%} of the floor (host probe {long['host_probe_ms']:.2f} ms)\n")
    for key, policy in (("paired_oracle", ""), ("paired_oracle_schedule", ", schedule")):
        if key in res:
            po = res[key]
            print(f"oracle {res['oracle_rate']:.2f} greedy{policy} and plain greedy interleaved prompt by prompt "
                  f"(median of {po['pairs']} pairs' ratios; host probe {po['host_probe_ms']:.2f} ms): "
                  f"{po['tok_s']:.2f} against {po['plain_tok_s']:.2f} tok/s, **{po['ratio']:.2f}x**\n")
    if "oracle_budget" in res:
        print(f"what {ORACLE_TARGET}x plain greedy at the oracle rate {res['oracle_rate']:.2f} asks of a verify "
              f"forward (`oracle_budget`: a round of k drafts yields the tokens below on average, so it may take "
              f"that many plain greedy steps ({1e3 / plain:.2f} ms each, the run's mean) over {ORACLE_TARGET}, less "
              f"the oracle run's propose and ingest a round):\n")
        print("| drafts verified | rows | tokens a round | verify budget ms | floor fraction it needs | "
              "verify ms measured | its floor fraction | over a plain step: budget leaves ms | measured adds ms | "
              "the rows beyond one's bytes at the copy bandwidth ms | x plain, every forward at its floor |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for b in res["oracle_budget"]:
            needed = f"{b['needed_fraction']:.1%}" if b["verify_budget_ms"] > 0 else "out of reach"
            print(f"| {b['drafts']} | {b['drafts'] + 1} | {b['tokens']:.2f} | {b['verify_budget_ms']:.1f} | "
                  f"{needed} | {b['verify_ms']:.1f} | {b['fraction']:.1%} | {b['margin_ms']:.1f} | "
                  f"{b['added_ms']:.1f} | {b['extra_floor_ms']:.1f} | {b['at_floor']:.2f} |")
        print("\n(over a plain step: what the budget leaves a verify forward beyond a plain step's time, what "
              "the measured forward takes beyond it, and what the bytes of its rows beyond the first (the experts "
              "they take beyond one row's) take at the copy bandwidth; at its floor: the tokens a round times the "
              "one-row floor over this forward's, the oracle's speedup where every forward read at the copy "
              "bandwidth and a round cost nothing else)\n")
    for label, r in res["runs"].items():
        if "steps" in r:
            st = r["steps"]
            print(f"{label}, its steps (ms): median {st['median_ms']:.2f} (the rate's mean {st['mean_ms']:.2f}), "
                  f"each prompt's first {' / '.join(f'{v:.1f}' for v in st['first_ms'])}, the slowest "
                  f"{st['max_ms']:.1f}; steps over 1.5x the median add {st['slow_excess_ms']:.1f} ms a prompt "
                  f"(the mean over the median: {st['mean_ms'] - st['median_ms']:.2f} ms a step)\n")
        if "oracle_right_rate" in r:
            print(f"{label}: {r['rounds']} rounds, {(r['accepted'] + r['rounds']) / r['rounds']:.2f} tokens per "
                  f"round; its drafts were right at a rate of {r['oracle_right_rate']:.2f} (the rate it stands "
                  f"for drawn per draft)\n")


def step_summary(step_s: list[list[float]]) -> dict:
    """Each prompt's plain decoding steps (seconds, in order) -> their median and mean (ms), each
    prompt's first step, the slowest, and what steps over 1.5x the median add a prompt beyond
    it: whether a run's rate is set by its typical step or by a few slow ones."""
    every = [t * 1e3 for run in step_s for t in run]
    median = statistics.median(every)
    excess = sum(t - median for t in every if t > 1.5 * median) / len(step_s)
    return {"median_ms": median, "mean_ms": statistics.mean(every), "first_ms": [run[0] * 1e3 for run in step_s],
            "max_ms": max(every), "slow_excess_ms": excess}


# ------------------------------------------------------------------- profile

VIEWS = {"Split", "Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "View", "Transpose", "AsStrided", "Copy",
         "Flatten", "Unflatten"}


def graph_dot(*outputs) -> str:
    """The lazy graph behind outputs in Graphviz text, MLX's export (nothing is evaluated)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return f.read()


def graph_ops(*outputs) -> collections.Counter:
    """Primitive counts of the lazy graph behind outputs (nothing is evaluated)."""
    labels = re.findall(r'label\s*=\s*"([^"]+)"', graph_dot(*outputs))
    return collections.Counter(label.split()[0] for label in labels)


def kernels(ops) -> int:
    return sum(v for k, v in ops.items() if k not in VIEWS)


def layer_kind(layer) -> str:
    attn = layer.attn
    return ("engram + " if hasattr(layer, "engram") else "") + (
        "window only" if not attn.ratio else
        f"ratio {attn.ratio}" + (" KV source" if attn.is_kv_source else "") + (" + indexer" if attn.is_index_source else ""))


def decode_by_layer(model, token: int, cache, on_layer, decode_rows: int | None = None) -> mx.array:
    """One decode step of `token` through the model's steps (Model.start, take_tokens, block,
    finish), padded as Runner.decode pads it under Options(decode_rows=decode_rows) (each row
    over its own window where set), calling on_layer(i, run) for each block, where run()
    builds block i and returns its outputs (the stream, the next pre-mix) and on_layer
    returns them; returns the logits."""
    rows = decode_rows or 1
    tokens = [token] * rows
    forward = model.start(mx.array([tokens], dtype=mx.int32), cache, 1, decode_rows is not None)
    engram_rows = model.take_tokens(cache, tokens, 1)
    for i in range(len(model.layers)):
        def run(i=i):
            model.block(i, forward, cache, engram_rows.get(i))
            return forward.h, forward.pre
        forward.h, forward.pre = on_layer(i, run)
    logits, _ = model.finish(forward)
    cache.trim(rows - 1)
    return logits


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
            ops.append(kernels(graph_ops(h, pre)))
            mx.eval(h, pre)
            return h, pre

        logits = decode_by_layer(model, 7, cache, count, options.decode_rows)
        total = sum(ops) + kernels(graph_ops(logits))

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


def bench_pieces(model_path: str | None, layer_ids: list[int]) -> dict:
    """ms per call of each piece of a decode step's block (inputs fixed, many calls per
    evaluation, so Python is out of it); the MoE with one real row (a plain decode step) and
    with all rows real, and one routed projection over one row's experts and over all rows'.
    On a GPU also each custom kernel of the decode path beside the MLX operations it stands
    for (its spec)."""
    import dsv41_mlx
    from dsv41_mlx import kernels
    from dsv41_mlx.generate import prefill
    from dsv41_mlx.models.attention import sparse_attention
    from dsv41_mlx.models.hyper import HcMixes, hc_expand, hc_post
    from dsv41_mlx.models.layers import Rope, positions_of
    from dsv41_mlx.quant import fp8_input, gemm_input_dtype
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(model_path)
    cache = model.make_cache()
    with Runner(model) as runner:
        prefill(runner, list(range(100, 356)), cache)
        rows = runner.options.decode_rows or 1
    positions = positions_of(cache.offset, rows)
    h, pre = hc_expand(model.embed(mx.array([7] * rows)), model.args.hc_mult)
    out = {"rows": rows, "gemms_fed": str(gemm_input_dtype()).rsplit(".", 1)[-1], "layers": {}}
    for li in layer_ids:
        layer = model.layers[li]
        attn, ffn = layer.attn, layer.ffn
        x, xq, *mix = layer.attn_input(h, pre)
        rope = attn.rope.tables(positions, attn.head_dim)
        W, K = attn.window, model.args.index_topk  # each row's window slots and picks, as a decode step has
        # where the attention kernel runs, it rotates q and its output itself: queries and output do not
        rope_in_kernel = kernels.attention_fits((rows, attn.n_heads, attn.head_dim), mx.bfloat16, W, K)
        q, _ = attn.queries(xq, rope, rope_in_kernel)
        q = q.reshape(rows, attn.n_heads, attn.head_dim)  # (the kernel's unrotated q comes as [S, H * D])
        ring = mx.random.normal((W + rows, attn.head_dim)).astype(mx.bfloat16)
        kv = mx.random.normal((4 * K, attn.head_dim)).astype(mx.bfloat16)
        index = mx.random.randint(0, W + rows, (rows, W))
        picks = mx.random.randint(0, 4 * K, (rows, K)).astype(mx.uint32)
        mask, picked_mask = mx.ones((rows, W), dtype=mx.bool_), mx.ones((rows, K), dtype=mx.bool_)
        keys, picked = ring[index], kv[picks]
        o = sparse_attention(q, keys, mask, None, None, attn.attn_sink, attn.scale)
        y = attn.output(o, rope, rope_in_kernel)
        h2, x2, x2q, *ffn_mix = layer.ffn_input(y, h, *mix)
        _, ids = ffn.gate(x2)
        xe = mx.random.normal((rows, 1, 1, model.args.hidden_size)).astype(gemm_input_dtype())
        mx.eval(x, xq, mix, q, o, y, h2, x2, x2q, ffn_mix, keys, picked, ids, xe, ring, kv, index, picks)
        w13 = ffn.experts.w13
        gate, hc = ffn.gate, layer.hc_attn
        pieces = {
            "attn_input (hc mixes, collapse, norm)": lambda i: layer.attn_input(h, pre),
            "attention input's FP8 quantisation": lambda i: fp8_input(x),
            "queries": lambda i: attn.queries(xq, rope, rope_in_kernel),
            "latent_kv": lambda i: attn.latent_kv(xq, rope),
            "sparse_attention, window": lambda i: sparse_attention(q, keys, mask, None, None, attn.attn_sink,
                                                                   attn.scale),
            "sparse_attention, window + top-k": lambda i: sparse_attention(q, keys, mask, picked, picked_mask,
                                                                           attn.attn_sink, attn.scale),
            "output (wo_a, wo_b)": lambda i: attn.output(o, rope, rope_in_kernel),
            "ffn_input (expand, hc mixes, collapse, norm)": lambda i: layer.ffn_input(y, h, *mix),
            "moe, 1 real row": lambda i: ffn(x2, 1, x2q),
            f"moe, {rows} real rows": lambda i: ffn(x2, None, x2q),
            "gate": lambda i: ffn.gate(x2),
            "shared expert": lambda i: ffn.shared_experts(x2q),
            "routed gate + up projection, 1 row": lambda i: mx.gather_qmm(
                xe[:1], w13.weight, w13.scales, rhs_indices=ids[:1], transpose=True, mode="mxfp4"),
            f"routed gate + up projection, {rows} rows": lambda i: mx.gather_qmm(
                xe, w13.weight, w13.scales, rhs_indices=ids, transpose=True, mode="mxfp4"),
            "hc_post": lambda i: hc_post(y, h2, HcMixes(*ffn_mix)),
            "sub-layer input, its MLX operations": lambda i: hc.sublayer_input_unfused(h, pre, layer.attn_norm),
            "attention, gathers + MLX operations": lambda i: Rope.apply(sparse_attention(  # and the RoPEs
                Rope.apply(q, rope), ring[index], mask, kv[picks], picked_mask, attn.attn_sink, attn.scale), rope,
                inverse=True),
            "router, MLX operations": lambda i: kernels.moe_gate_reference(
                x2, gate.weight, gate.bias, gate.top_k, gate.temp, gate.route_scale, gate.normalize),
        }
        if kernels.hc_input_fits(h):
            pieces["sub-layer input, hc_input kernel"] = lambda i: kernels.hc_input(
                h, pre, hc.fn, hc.scale, hc.base, layer.attn_norm.weight, model.args.hc_sinkhorn_iters,
                model.args.rms_norm_eps, model.args.hc_eps, layer.attn_norm.eps, gemm_input_dtype())
        if rope_in_kernel:
            pieces["attention, sparse_attention kernel"] = lambda i: kernels.sparse_attention_rows(
                q, ring, index, mask, kv, picks, picked_mask, attn.attn_sink, attn.scale, rope, attn.rope.dims)
        if kernels.backend() != "mlx":
            pieces["router, moe_gate kernels"] = lambda i: kernels.moe_gate(
                x2, gate.weight, gate.bias, gate.top_k, gate.temp, gate.route_scale, gate.normalize)
        out["layers"][f"{li} ({layer_kind(layer)})"] = {name: timed(fn, calls=10, reps=5) * 1e3
                                                         for name, fn in pieces.items()}
    small = mx.ones((rows, 16))
    out["tiny_op_ms"] = timed(lambda i: small + i) * 1e3
    return out


def bench_gemms(rows: int = 8, experts: int = 24, dim: int = 5120, inter: int = 2304,
                cache_bytes: int = 256 << 20, real: int | None = None, threads: tuple[int, ...] = ()) -> dict:
    """The quantised GEMMs of a decode step, ms per call: the routed experts' mxfp4 GEMMs (24
    experts, top-6) fed fp32 or bf16, and every FP8 GEMM shape of the flash-shaped model (the
    release's dense shapes, and wo_a's grouped one) through MLX's quantized_matmul /
    gather_qmm fed bf16 and, on a GPU, through kernels.fp8_gemv, with each one's share of the
    copy bandwidth. Every call reads its own copy of the weights, from copies that overflow
    any cache, as a decode step reads each weight once. real: fp8_gemv computes that many of
    the rows (a padded forward's real rows; default all). threads: also the chained fp8_gemv
    with each of these threads per output (C), to compare layouts in a forward's conditions."""
    from dsv41_mlx import kernels
    from scripts.check_kernels import quantised_gemm_shapes, random_scales as scales, random_words as words

    mx.random.seed(0)
    top = 6
    gpu = kernels.backend() != "mlx"
    w13, s13 = words((experts, inter, dim // 8), fp4=True), scales((experts, inter, dim // 32))
    w2, s2 = words((experts, dim, inter // 8), fp4=True), scales((experts, dim, inter // 32))
    ids = mx.sort(mx.random.randint(0, experts, (rows, top)).astype(mx.uint32), axis=-1)
    x, h = mx.random.normal((rows, 1, 1, dim)), mx.random.normal((rows, top, 1, inter))
    mx.eval(w13, s13, w2, s2, ids, x, h)
    out = {"rows": rows, "real": real or rows, "experts": experts, "copy_GBps": copy_bandwidth() / 1e9,
           "routed": {}, "fp8": []}
    for dtype in (mx.float32, mx.bfloat16):
        name = str(dtype).rsplit(".", 1)[-1]
        xt, ht = x.astype(dtype), h.astype(dtype)
        mx.eval(xt, ht)
        out["routed"][f"routed up ({dim} -> {inter}), mxfp4, {name} in"] = timed(
            lambda i: mx.gather_qmm(xt, w13, s13, rhs_indices=ids, transpose=True, mode="mxfp4"), 10, 3) * 1e3
        out["routed"][f"routed down ({inter} -> {dim}), mxfp4, {name} in"] = timed(
            lambda i: mx.gather_qmm(ht, w2, s2, rhs_indices=ids, transpose=True, mode="mxfp4"), 10, 3) * 1e3
    # chained, bf16 in: x per row [rows, 1, dim] into gate + up, x per pair [rows, top, inter] into down
    xb, hb = x[:, 0].astype(mx.bfloat16), h[:, :, 0].astype(mx.bfloat16)
    mx.eval(xb, hb)
    up, down = (w13, s13), (w2, s2)
    out["routed_chained"] = {
        f"routed up ({dim} -> {inter}), mxfp4, bfloat16 in": chained(
            lambda v, i: mx.gather_qmm(v[:, :, None], *up, rhs_indices=ids, transpose=True, mode="mxfp4"), xb) * 1e3,
        f"routed down ({inter} -> {dim}), mxfp4, bfloat16 in": chained(
            lambda v, i: mx.gather_qmm(v[:, :, None], *down, rhs_indices=ids, transpose=True, mode="mxfp4"), hb) * 1e3}
    if gpu:  # each expert read once for all the rows that picked it
        out["routed"][f"routed up ({dim} -> {inter}), fp4_experts"] = timed(
            lambda i: kernels.fp4_experts(xb, w13, s13, ids), 10, 3) * 1e3
        out["routed"][f"routed down ({inter} -> {dim}), fp4_experts"] = timed(
            lambda i: kernels.fp4_experts(hb, w2, s2, ids), 10, 3) * 1e3
        out["routed_chained"][f"routed up ({dim} -> {inter}), fp4_experts"] = chained(
            lambda v, i: kernels.fp4_experts(v, *up, ids), xb) * 1e3
        out["routed_chained"][f"routed down ({inter} -> {dim}), fp4_experts"] = chained(
            lambda v, i: kernels.fp4_experts(v, *down, ids), hb) * 1e3
    w13 = s13 = w2 = s2 = up = down = None  # the routed stacks freed before the FP8 GEMMs' copies are made

    dense, grouped, _ = quantised_gemm_shapes()
    shapes = [(1, d_in, d_out) for d_in, d_out in sorted(dense)] + sorted(grouped)
    for groups, d_in, d_out in shapes:
        nbytes = groups * d_out * d_in * (1 + 1 / 32)
        copies = max(1, min(64, -(-cache_bytes // int(nbytes))))
        ws = [(words((groups, d_out, d_in // 4)), scales((groups, d_out, d_in // 32))) for _ in range(copies)]
        xq = mx.random.normal((rows, groups, d_in)).astype(mx.bfloat16)
        mx.eval(ws, xq)
        if groups == 1:
            def mlx_gemm(v, i):
                w, sc = ws[i % copies]
                return mx.quantized_matmul(v[:, 0], w[0], sc[0], transpose=True, mode="mxfp8")
        else:
            g = mx.arange(groups)

            def mlx_gemm(v, i):
                w, sc = ws[i % copies]
                return mx.gather_qmm(v[:, :, None], w, sc, rhs_indices=g, transpose=True, mode="mxfp8")
        row = {"shape": f"{groups} x {d_in} -> {d_out}" if groups > 1 else f"{d_in} -> {d_out}",
               "MB": nbytes / 1e6, "mlx_ms": timed(lambda i: mlx_gemm(xq, i), 10, 3) * 1e3,
               "mlx_chained_ms": chained(mlx_gemm, xq) * 1e3}
        if gpu:
            row["kernel_ms"] = timed(lambda i: kernels.fp8_gemv(xq, *ws[i % copies], real_rows=real), 10, 3) * 1e3
            row["kernel_chained_ms"] = chained(
                lambda v, i: kernels.fp8_gemv(v, *ws[i % copies], real_rows=real), xq) * 1e3
            row["default_threads"] = kernels.gemv_threads_per_output(d_in, groups * d_out)
            row["kernel_chained_ms_by_threads"] = {
                c: chained(lambda v, i: kernels.fp8_gemv(v, *ws[i % copies], real_rows=real, threads=c), xq) * 1e3
                for c in threads}
            # an activation not yet quantised: act_quant then the kernel, or the kernel quantising as it reads
            row["act_quant_kernel_chained_ms"] = chained(
                lambda v, i: kernels.fp8_gemv(kernels.act_quant_fp8(v, kernels.backend()), *ws[i % copies]), xq) * 1e3
            row["quantizing_kernel_chained_ms"] = chained(
                lambda v, i: kernels.fp8_gemv(v, *ws[i % copies], quantize_input=True), xq) * 1e3
        out["fp8"].append(row)
        ws = None  # freed before the next shape's copies are made
    return out


# ------------------------------------------------------------------- layouts

LAYOUT_ROWS = (1, 2, 3, 6)  # rows computed: a decode step's, verify forwards'
ATTENTION_CANDIDATES = ((2, 8), (2, 16), (1, 8), (1, 16), (1, 32))  # (heads, simdgroups) a threadgroup


@contextlib.contextmanager
def kernels_choice(name: str, fn):
    """Inside: dsv41_mlx.kernels' layout choice `name` (a function) is fn; restored on the way out."""
    from dsv41_mlx import kernels

    saved = getattr(kernels, name)
    setattr(kernels, name, fn)
    try:
        yield
    finally:
        setattr(kernels, name, saved)


@contextlib.contextmanager
def kernels_choices(choices: dict):
    """Inside: each of dsv41_mlx.kernels' layout choices name -> fn in `choices` (kernels_choice)."""
    with contextlib.ExitStack() as stack:
        for name, fn in choices.items():
            stack.enter_context(kernels_choice(name, fn))
        yield


LAYOUT_KERNELS = ("fp4_experts", "fp8_mma", "fp8_mma_hc", "sparse_attention")


def bench_layouts(rows_list: tuple[int, ...] = LAYOUT_ROWS, forward_rows: int = 8, experts: int = 24,
                  which: tuple[str, ...] = LAYOUT_KERNELS) -> dict:
    """The kernels' launch layouts that change no bit, at the release's one-layer shapes:
    every candidate timed chained (us a call, cold weights) in a padded forward of
    forward_rows rows that computes `rows` of them, its output compared bit for bit with
    the layout kernels picks (kernels.experts_loads_ahead and mma_loads_ahead: the blocks a
    warp of fp4_experts / fp8_mma (and fp8_mma_hc, the GEMMs that put their output into the
    stream) loads ahead, U, which only CUDA's twins read; fp8_mma's with its tiles' rows,
    kernels.mma_tile_rows, as "TR/U"; kernels.attention_layout: the attention's heads and
    simdgroups a threadgroup). `which`: the kernels of LAYOUT_KERNELS to time. A candidate
    that does not launch is reported with its error. Each case carries its floor,
    the bytes it must read over the copy bandwidth: a chain whose host encodes a link slower
    than the GPU runs it times the host, and a time under the floor shows it. Nothing to
    time on the CPU."""
    from dsv41_mlx import kernels
    from dsv41_mlx.quant import fp8_fake_quant_reference
    from scripts.check_kernels import random_scales, random_words, release_ropes

    impl = kernels.backend()
    out = {"impl": impl, "forward_rows": forward_rows, "cases": []}
    if impl == "mlx":
        return out
    out["copy_GBps"] = copy_bandwidth() / 1e9

    def measure(kernel, shape, rows, run, x0, candidates, default, nbytes):
        """candidates: (layout, {kernels' choice name: fn}) each; default: the layout kernels picks."""
        base = mx.array(run(x0, 0))  # kernels' own layout
        floor = nbytes / out["copy_GBps"] / 1e3  # us
        for value, choices in candidates:
            row = {"kernel": kernel, "shape": shape, "rows": rows, "layout": value, "default": value == default,
                   "floor_us": floor}
            with kernels_choices(choices):
                try:
                    row["us"] = chained(run, x0) * 1e6
                    row["same_bits"] = bool(mx.array_equal(run(x0, 0), base).item())
                except (RuntimeError, ValueError) as e:  # a layout past the device's limits: reported
                    row["error"] = str(e).splitlines()[0][:80]
            out["cases"].append(row)

    def cold_fp8(n, k):  # copies of a random FP8 matrix [n, k] that overflow any cache, and its bytes
        nbytes = n * k * (1 + 1 / 32)
        count = max(2, -(-(256 << 20) // int(nbytes)))
        return [(random_words((n, k // 4)), random_scales((n, k // 32))) for _ in range(count)], nbytes

    def fp8_input(shape):
        return fp8_fake_quant_reference(mx.random.normal(shape).astype(mx.bfloat16)).astype(mx.bfloat16)

    mx.random.seed(0)
    copies, top, dim, inter = 4, 6, 5120, 2304  # four copies of each stack: cold weights at every call
    if "fp4_experts" in which:
        w13 = [(random_words((experts, 2 * inter, dim // 8), fp4=True),
                random_scales((experts, 2 * inter, dim // 32))) for _ in range(copies)]
        w2 = [(random_words((experts, dim, inter // 8), fp4=True), random_scales((experts, dim, inter // 32)))
              for _ in range(copies)]
        ids = [mx.argsort(mx.random.uniform(shape=(forward_rows, experts)), axis=-1)[:, :top].astype(mx.uint32)
               for _ in range(copies)]
        weights, x, h = mx.random.uniform(shape=(forward_rows, top)), fp8_input((forward_rows, 1, dim)), \
            mx.random.normal((forward_rows, top, inter)).astype(mx.bfloat16)
        mx.eval(w13, w2, ids, weights, x, h)
        candidates = [(u, {"experts_loads_ahead": lambda rows, k, u=u: u}) for u in (1, 2, 3, 4)]

        def expert_bytes(stacks, rows):  # the experts the computed rows pick, read once each (mean over copies)
            per_expert = (stacks[0][0].nbytes + stacks[0][1].nbytes) / experts
            return per_expert * statistics.mean(len(set(c[:rows].flatten().tolist())) for c in ids)

        for rows in rows_list:
            act = kernels.SwiGLU(7.0, weights)
            measure("fp4_experts", f"{dim} -> 2 x {inter} + SwiGLU", rows,
                    lambda v, i, r=rows: kernels.fp4_experts(v, *w13[i % copies], ids[i % copies], swiglu=act, rows=r),
                    x, candidates, kernels.experts_loads_ahead(rows, dim), expert_bytes(w13, rows))
            measure("fp4_experts", f"{inter} -> {dim}, x quantised in the kernel", rows,
                    lambda v, i, r=rows: kernels.fp4_experts(v, *w2[i % copies], ids[i % copies], quantize_input=True,
                                                             rows=r),
                    h, candidates, kernels.experts_loads_ahead(rows, inter), expert_bytes(w2, rows))
        del w13, w2

    u_mma = [(u, {"mma_loads_ahead": lambda k, rows, u=u: u}) for u in (2, 4, 6, 8)]
    # fp8_mma's layouts: its tiles' rows (kernels.mma_tile_rows) / U, as "TR/U"
    tiles_u_mma = [(f"{tr}/{u}", {"mma_tile_rows": lambda n, k, tr=tr: tr, **choices})
                   for tr in (32, 16) for u, choices in u_mma]
    mma_shapes = ((1280, 32768, None), (8192, 5120, None), (5120, 4608, kernels.SwiGLU(7.0)), (2304, 5120, None))
    for k, n, swiglu in mma_shapes if "fp8_mma" in which else ():
        ws, nbytes = cold_fp8(n, k)
        count = len(ws)
        xq = fp8_input((forward_rows, 1, k))  # (bench.chained feeds x [S, 1, K] back)
        mx.eval(ws, xq)
        for rows in rows_list:
            measure("fp8_mma", f"{k} -> {n}" + (" + SwiGLU" if swiglu else ""), rows,
                    lambda v, i, r=rows, ws=ws, c=count, sw=swiglu: kernels.fp8_gemv(v, *ws[i % c], swiglu=sw,
                                                                                     real_rows=r),
                    xq, tiles_u_mma, f"{kernels.mma_tile_rows(n, k)}/{kernels.mma_loads_ahead(k, rows)}", nbytes)
        del ws

    if "fp8_mma_hc" in which:  # a sub-layer's last GEMM, its output put into the stream: wo_b, the shared w2
        hc, n = 4, dim
        residual = mx.random.normal((forward_rows, hc, n)).astype(mx.bfloat16)
        onto = kernels.StreamOnto(residual, mx.random.uniform(shape=(forward_rows, hc)),
                                  mx.random.uniform(shape=(forward_rows, hc, hc)),
                                  mx.random.normal(((2 + hc) * hc, hc * n)) * 0.01)
        routed = mx.random.normal((forward_rows, top, n)).astype(mx.bfloat16)  # the shared w2 adds the routed experts'
        mx.eval(onto, routed)
        for k in (8192, inter):
            ws, nbytes = cold_fp8(n, k)
            count = len(ws)
            xb = mx.random.normal((forward_rows, k)).astype(mx.bfloat16)  # quantised in the kernel, as a forward's
            mx.eval(ws, xb)
            for rows in rows_list:
                parts = routed[:rows] if k == inter else None
                measure("fp8_mma_hc", f"{k} -> {n} into the stream" + (f", {top} parts added" if k == inter else ""),
                        rows, lambda v, i, r=rows, ws=ws, c=count, parts=parts: kernels.fp8_into_stream(
                            v, *ws[i % c], onto, quantize_input=True, real_rows=r, parts=parts)[0],
                        xb, u_mma, kernels.mma_loads_ahead(k, rows), nbytes)
            del ws

    if "sparse_attention" not in which:
        return out
    heads, head_dim, window, picks, ring_rows, kv_rows = 64, 512, 128, 512, 160, 700
    rope = release_ropes()[0]
    ring = mx.random.normal((ring_rows, head_dim)).astype(mx.bfloat16)
    kv = mx.random.normal((kv_rows, head_dim)).astype(mx.bfloat16)
    sink = mx.random.normal((heads,))
    q = mx.random.normal((forward_rows, 1, heads * head_dim)).astype(mx.bfloat16)
    index = mx.random.randint(0, ring_rows, (forward_rows, window)).astype(mx.int32)
    picked = mx.random.randint(0, kv_rows, (forward_rows, picks)).astype(mx.uint32)
    wmask = mx.random.uniform(shape=(forward_rows, window)) < 0.9
    pmask = mx.random.uniform(shape=(forward_rows, picks)) < 0.7
    tables = rope.tables(mx.arange(300, 300 + forward_rows, dtype=mx.int32), head_dim)
    mx.eval(ring, kv, sink, q, index, picked, wmask, pmask, tables)
    layouts = [(c, {"attention_layout": lambda impl, rows, c=c: c}) for c in ATTENTION_CANDIDATES]
    for rows in rows_list:
        measure("sparse_attention", f"{heads} heads x {head_dim}, {window} + {picks} keys", rows,
                lambda v, i, r=rows: kernels.sparse_attention_rows(
                    v.reshape(forward_rows, heads, head_dim), ring, index, wmask, kv, picked, pmask, sink,
                    head_dim ** -0.5, tables, rope.dims, real_rows=r).reshape(forward_rows, 1, -1),
                q, layouts, kernels.attention_layout(impl, rows),
                ring.nbytes + kv.nbytes)  # at least the keys, once
    return out


def print_layouts(env: dict, res: dict) -> None:
    print(f"### Kernel launch layouts ({env['date']}, {env['device']}, {env['backend']}, MLX {env['mlx']}, "
          f"commit {env['commit']})\n")
    if not res["cases"]:
        print("no GPU kernels here (Metal or CUDA): nothing to time\n")
        return
    print(f"us a call, chained, cold weights; rows computed of a {res['forward_rows']}-row padded forward; "
          "* the layout kernels picks; same bits: the output equals that layout's; floor: the bytes the call "
          f"must read over the copy bandwidth ({res['copy_GBps']:.0f} GB/s); a time under it (!) cannot be the "
          "GPU's: there the chain timed the host's encoding of its launches\n")
    print("| kernel | shape | rows | layout | us a call | floor us | x the default's | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    default = {(c["kernel"], c["shape"], c["rows"]): c.get("us") for c in res["cases"] if c["default"]}
    for c in res["cases"]:
        layout = str(c["layout"]) + ("*" if c["default"] else "")
        if "error" in c:
            print(f"| {c['kernel']} | {c['shape']} | {c['rows']} | {layout} | fails: {c['error']} | | | |")
            continue
        base = default.get((c["kernel"], c["shape"], c["rows"]))
        ratio = f"{c['us'] / base:.2f}" if base else "-"
        below = " !" if c["us"] < c["floor_us"] else ""
        print(f"| {c['kernel']} | {c['shape']} | {c['rows']} | {layout} | {c['us']:.1f}{below} | "
              f"{c['floor_us']:.1f} | {ratio} | {'yes' if c['same_bits'] else 'NO'} |")
    print()


def print_gemms(env: dict, res: dict) -> None:
    print(f"### Quantised GEMMs of a decode step ({env['date']}, {env['device']}, {env['backend']}, MLX {env['mlx']}, "
          f"commit {env['commit']})\n")
    print(f"{res['rows']} rows; routed: top-6 of {res['experts']} experts; "
          f"copy bandwidth {res['copy_GBps']:.0f} GB/s\n")
    print("ms per call: independent calls, 10 per evaluation (a GPU may overlap them); chained: each call "
          "waiting for the one before, as in a forward\n")
    print("| GEMM | ms per call | chained ms |")
    print("|---|---|---|")
    for name, ms in res["routed"].items():
        chain = res["routed_chained"].get(name)
        print(f"| {name} | {ms:.3f} | {'-' if chain is None else f'{chain:.3f}'} |")
    print()
    kernel = any("kernel_ms" in r for r in res["fp8"])
    print("| FP8 GEMM (bf16 in) | weights MB | floor ms | MLX ms | MLX / floor | MLX chained ms |"
          + (" fp8_gemv ms | fp8_gemv / floor | fp8_gemv chained ms | MLX / fp8_gemv | chained: MLX / fp8_gemv |"
             if kernel else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|---|" if kernel else ""))
    for r in res["fp8"]:
        floor = r["MB"] / 1e3 / res["copy_GBps"] * 1e3  # reading the weights once at the copy rate
        line = (f"| {r['shape']} | {r['MB']:.1f} | {floor:.4f} | {r['mlx_ms']:.4f} | {r['mlx_ms'] / floor:.2f} | "
                f"{r['mlx_chained_ms']:.4f} |")
        if "kernel_ms" in r:
            line += (f" {r['kernel_ms']:.4f} | {r['kernel_ms'] / floor:.2f} | {r['kernel_chained_ms']:.4f} | "
                     f"{r['mlx_ms'] / r['kernel_ms']:.2f} | {_ratio(r['mlx_chained_ms'], r['kernel_chained_ms'])} |")
        print(line)
    print()
    swept = sorted({c for r in res["fp8"] for c in r.get("kernel_chained_ms_by_threads", {})})
    if swept:
        print(f"fp8_gemv chained ms by threads per output (C), {res['real']} of {res['rows']} rows computed; "
              "* the kernel's default for that K\n")
        print("| FP8 GEMM | " + " | ".join(f"C = {c}" for c in swept) + " |")
        print("|---|" + "---|" * len(swept))
        for r in res["fp8"]:
            by = r.get("kernel_chained_ms_by_threads", {})
            cells = [("-" if c not in by else f"{by[c]:.4f}" + ("*" if c == r["default_threads"] else ""))
                     for c in swept]
            print(f"| {r['shape']} | " + " | ".join(cells) + " |")
        print()
    if any("quantizing_kernel_chained_ms" in r for r in res["fp8"]):
        print("An activation not yet FP8 fake-quantised, chained ms: act_quant then fp8_gemv (two launches), "
              "against fp8_gemv quantising as it reads (one)\n")
        print("| FP8 GEMM | act_quant + fp8_gemv | fp8_gemv quantising |")
        print("|---|---|---|")
        for r in res["fp8"]:
            print(f"| {r['shape']} | {r['act_quant_kernel_chained_ms']:.4f} | {r['quantizing_kernel_chained_ms']:.4f} |")
        print()


def _ratio(a: float, b: float) -> str:
    """a / b, or '-' where b is no more than noise (a chained cost at or under zero)."""
    return f"{a / b:.2f}" if b > 0 else "-"


def print_pieces(env: dict, res: dict, model: str) -> None:
    print(f"### A decode step's block, piece by piece, on {model} ({env['date']}, {env['device']}, "
          f"{env['backend']}, MLX {env['mlx']}, commit {env['commit']})\n")
    print(f"{res['rows']} rows; ms per call, 10 calls per evaluation; quantised GEMMs fed {res['gemms_fed']}; "
          f"a tiny element-wise op costs {res['tiny_op_ms']:.3f} ms\n")
    names = list(next(iter(res["layers"].values())))
    print("| piece | " + " | ".join(f"layer {k}" for k in res["layers"]) + " |")
    print("|---|" + "---|" * len(res["layers"]))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{v[name]:.3f}" for v in res["layers"].values()) + " |")
    print()


def print_profile(env: dict, res: dict, model: str) -> None:
    print(f"### Where a decode step goes on {model} ({env['date']}, {env['device']}, {env['backend']}, "
          f"MLX {env['mlx']}, commit {env['commit']})\n")
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
    p = sub.add_parser("e2e")
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/make_flash_shaped.py) or hub id")
    p.add_argument("--prompts", type=int, default=1, help="prose and code prompts each")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per prompt and run")
    p.add_argument("--oracle-rate", type=float, default=0.56)
    p.add_argument("--no-paired", action="store_true",
                   help="skip ours and mlx-lm interleaved prompt by prompt (it holds both models at once)")
    p.add_argument("--json")
    p = sub.add_parser("profile")
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed")
    p.add_argument("--json")
    p = sub.add_parser("pieces")
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 3], help="layer ids to take apart")
    p.add_argument("--json")
    p = sub.add_parser("gemms")
    p.add_argument("--rows", type=int, default=8, help="rows of the forward (a GPU's decode and verify: 8)")
    p.add_argument("--real", type=int, default=None,
                   help="rows fp8_gemv computes, the padded forward's real ones (1: plain decode; 2..7: verify)")
    p.add_argument("--threads", type=int, nargs="*", default=[], choices=[32, 64, 128, 256],
                   help="also time fp8_gemv chained with each of these threads per output")
    p.add_argument("--json")
    p = sub.add_parser("layouts")
    p.add_argument("--rows", type=int, nargs="+", default=list(LAYOUT_ROWS),
                   help="rows computed, of a padded forward of 8 (1: a decode step; 2..7: verify forwards)")
    p.add_argument("--kernels", nargs="+", default=list(LAYOUT_KERNELS), choices=LAYOUT_KERNELS,
                   help="the kernels whose layouts to time")
    p.add_argument("--json")
    p = sub.add_parser("steps")
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/make_flash_shaped.py) or hub id")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=CHOICE[@A/B/..]:VALUE[,...]",
                   help="a variant of dsv41_mlx.kernels' layout choices, e.g. u1=experts_loads_ahead:1, or "
                        "w2u2=mma_loads_ahead@2304/1:2 (only for the calls with those arguments)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip generate.warm_up (each variant's untimed runs still come first)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=1, help="prose and code prompts each")
    p.add_argument("--verify-rows", type=int, default=0, help="also time verify forwards of 1..N rows")
    p.add_argument("--json")
    p = sub.add_parser("propose")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json")
    args = parser.parse_args()
    env = environment()
    if args.what == "head":
        res = bench_head(args.vocab, args.dim, args.rows)
        print_head(env, res, args.vocab, args.dim)
    elif args.what == "e2e":
        printed = []  # the tables, printed before the paired measurement where there is one

        def report(partial):
            print_e2e(env, partial, args.model)
            printed.append(True)

        res = bench_e2e(args.model, args.prompts, args.tokens, args.oracle_rate, paired=not args.no_paired,
                        report=report)
        if printed:
            print("the paired decode and prefill (ours and mlx-lm interleaved prompt by prompt), ours / mlx-lm:\n\n"
                  "| | ours | mlx-lm | ours / mlx-lm |\n|---|---|---|---|\n" + paired_row(res["paired"]))
        else:
            print_e2e(env, res, args.model)
    elif args.what == "profile":
        res = bench_profile(args.model, args.steps)
        print_profile(env, res, args.model or "the embedded tiny checkpoint")
    elif args.what == "pieces":
        res = bench_pieces(args.model, args.layers)
        print_pieces(env, res, args.model or "the embedded tiny checkpoint")
    elif args.what == "gemms":
        res = bench_gemms(rows=args.rows, real=args.real, threads=tuple(args.threads))
        print_gemms(env, res)
    elif args.what == "layouts":
        res = bench_layouts(tuple(args.rows), which=tuple(args.kernels))
        print_layouts(env, res)
    elif args.what == "steps":
        res = bench_steps(args.model, dict(parse_variant(v) for v in args.variant), args.tokens, args.rounds,
                          args.prompts, args.verify_rows, warm=not args.no_warm_up)
        print_steps(env, res, args.model)
    elif args.what == "propose":
        res = bench_propose(args.rounds)
        print_propose(env, res)
    else:
        res = bench_drafts(args.model, args.max_tokens, args.prompts)
        print_drafts(env, res, args.model or "the embedded tiny checkpoint")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, args.what: res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
