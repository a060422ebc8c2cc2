"""Where a decode step's GPU time goes, kernel by kernel (CUDA only).

    python scripts/gpu_timeline.py --model DIR [--rows 1] [--steps 6] [--json FILE] [--sequence FILE]
    python scripts/gpu_timeline.py --model DIR --prompt-tokens 1024 32768   # what the longer context adds
    python scripts/gpu_timeline.py --model DIR --prefill [--prompt-tokens 261] [--steps 3]
    python scripts/gpu_timeline.py --model DIR --propose [--steps 6]
    python scripts/gpu_timeline.py --model DIR --oracle [--tokens 48]

--prefill times prompts' prefills instead: each "step" a prompt of --prompt-tokens tokens
prefilled into an empty cache (generate.prefill, its chunks as a request's), after two
untimed ones of the same length. --propose times the DSpark drafter's propose pass: each
"step" one proposal from the prompt's rings, evaluated as a speculative round does
(SpeculativeDecoder.round), after four untimed ones. --oracle times speculative rounds
instead: the prompt's plain greedy reply, then a generation of --tokens tokens drafted by
the benchmarks' oracle drafter (the reply's own tokens, each right at the rate 0.56), every
draft verified (after two untimed ones), cut into rounds at each verify forward's head: where
a round's GPU time goes between one verify forward and the next (round_summary).

Runs a few decode steps (each padded as Runner.decode pads it) under PyTorch's
profiler: CUPTI records every kernel the process launches, MLX's included, with
its name and its start and end on the GPU. Prints how long the GPU was busy per
step against the step's wall time, the idle gaps between kernels, and a table of
the kernels by total time. A step whose GPU is busy for most of it is GPU-bound
(faster kernels help); one with long gaps waits on the host (fewer operations
help). `bench.py profile` times layers from the host; this is the device's view.

Needs PyTorch with CUDA in the same environment (not a dependency of the
package: `pip install torch`). On Metal, Xcode's Metal System Trace gives the
same view; there is nothing to run here.

Nsight Compute instead of PyTorch (each kernel timed alone, one after another, so
kernels that overlap in a real step are not slowed by each other, and CUPTI's
cost on graph launches is gone; no idle gaps to read):

    ncu --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --log-file times.csv \
        python scripts/gpu_timeline.py --model DIR --rows 1 --under-ncu
    python scripts/gpu_timeline.py --ncu-csv times.csv

--under-ncu runs the forwards untimed, then one more between the driver's
profiler start and stop (what `--profile-from-start off` waits for); --ncu-csv
reads ncu's table into the same kernel table, on any machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.benchmarks.harness import prompt_of  # noqa: E402


def short_name(name: str) -> str:
    """A kernel's name without its parameter list or namespaces; our custom kernels by their
    KernelSpec name and template values (MLX names them custom_kernel_<name>_<values>)."""
    name = name.split("(", 1)[0].strip()
    if name.startswith("void "):
        name = name[5:]
    custom = re.search(r"custom_kernel_(\w+)", name)
    if custom:
        return custom.group(1)
    return re.sub(r"^mlx::core::cu::", "", name.split("<", 1)[0])


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels that overlap count once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def tally(timed) -> list[tuple[str, int, float]]:
    """(kernel name, us) pairs -> each short name's count and total us, the largest total first."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for name, us in timed:
        entry = totals[short_name(name)]
        entry[0] += 1
        entry[1] += us
    return sorted(((k, c, t) for k, (c, t) in totals.items()), key=lambda row: -row[2])


def summarize(kernels: list[tuple[float, float, str]], steps: int, gap_us: float = 50.0) -> dict:
    """kernels: (start us, end us, name) of `steps` steps -> per-step totals (ms) and a table."""
    if not kernels:
        return {"steps": steps, "kernels_per_step": 0, "span_ms": 0.0, "busy_ms": 0.0, "kernel_sum_ms": 0.0,
                "long_gaps_ms": 0.0, "table": [], "gaps": []}
    kernels = sorted(kernels)
    span = kernels[-1][1] - kernels[0][0]
    busy = busy_time([(s, e) for s, e, _ in kernels])
    idle = idle_before(kernels[1:], kernels[0][1])
    long_gaps = sum(i for i in idle if i > gap_us)
    # the idle stretches over gap_us by the kernel that follows each: what the GPU waited for
    # the host to launch (a step's boundary, or an operation the host runs before it launches)
    gaps = [{"kernel": k, "gaps_per_step": c / steps, "idle_ms_per_step": t / steps / 1e3}
            for k, c, t in tally((name, i) for (_, _, name), i in zip(kernels[1:], idle) if i > gap_us)]
    table = [{"kernel": k, "calls_per_step": c / steps, "us_per_call": t / c, "ms_per_step": t / steps / 1e3}
             for k, c, t in tally((name, end - start) for start, end, name in kernels)]
    return {"steps": steps, "kernels_per_step": len(kernels) / steps, "span_ms": span / steps / 1e3,
            "busy_ms": busy / steps / 1e3, "kernel_sum_ms": sum(e - s for s, e, _ in kernels) / steps / 1e3,
            "long_gaps_ms": long_gaps / steps / 1e3, "table": table, "gaps": gaps}


def step_kernels(kernels: list[tuple[float, float, str]], steps: int, which: int = 0
                 ) -> list[tuple[float, float, float, str]]:
    """Step `which` of `steps` equal steps' kernels (a step: its share of them by count) in the
    order they started, each as (start, us, idle before, short name): start in us from the
    step's first kernel; idle: how long the GPU ran nothing before it started (0 where another
    kernel was still running). Which operation launched which kernel reads off its neighbours;
    what a launch waited for, off its idle. (The first step under the profiler also holds the
    profiler's start: --sequence writes the last.)"""
    n = len(kernels) // steps
    ordered = sorted(kernels)[which * n: (which + 1) * n]
    if not ordered:
        return []
    return [(start - ordered[0][0], end - start, idle, short_name(name))
            for (start, end, name), idle in zip(ordered, idle_before(ordered, ordered[0][0]))]


def idle_before(kernels: list[tuple[float, float, str]], reach: float) -> list[float]:
    """How long the GPU ran nothing before each of kernels (sorted (start, end, name) us), the
    work before them having ended at `reach` (0 where another kernel was still running)."""
    idle = []
    for start, end, _ in kernels:
        idle.append(max(0.0, start - reach))
        reach = max(reach, end)
    return idle


def round_summary(kernels: list[tuple[float, float, str]], gap_us: float = 30.0) -> list[dict]:
    """Speculative rounds in a timeline of (start us, end us, name): each verify forward ends
    with its head (`head_logits`), and a round runs from one head's end to the next's (ms):
    `boundary_ms`, from the head's end to the next forward's first kernel (the first after
    the ingest's `ring_write` between them, where there is one: the verdict read back, the
    ingest, the proposal and the forward's first block built); `forward_ms` and
    `forward_busy_ms`, that forward to its head's end and the GPU's busy time in it; `busy_ms`,
    the GPU's busy time in the whole round; `gaps`, each idle stretch over gap_us in the round
    as (us from the head's end, idle us, the kernel after it)."""
    kernels = sorted(kernels)
    heads = [i for i, k in enumerate(kernels) if short_name(k[2]).startswith("head_logits")]
    rings = [i for i, k in enumerate(kernels) if short_name(k[2]).startswith("ring_write")]
    rounds = []
    for a, b in zip(heads, heads[1:]):
        t0, t1 = kernels[a][1], kernels[b][1]
        ingest = [i for i in rings if a < i < b]
        first = ingest[-1] + 1 if ingest else a + 1
        gaps = [(start - t0, idle, short_name(name))
                for (start, _, name), idle in zip(kernels[a + 1: b + 1], idle_before(kernels[a + 1: b + 1], t0))
                if idle > gap_us]
        rounds.append({"round_ms": (t1 - t0) / 1e3,
                       "busy_ms": busy_time([(max(s, t0), e) for s, e, _ in kernels[a + 1: b + 1]]) / 1e3,
                       "boundary_ms": (kernels[first][0] - t0) / 1e3, "forward_ms": (t1 - kernels[first][0]) / 1e3,
                       "forward_busy_ms": busy_time([(s, e) for s, e, _ in kernels[first: b + 1]]) / 1e3,
                       "kernels": b - a, "gaps": gaps})
    return rounds


def ncu_kernels(text: str) -> list[tuple[float, float, str]]:
    """ncu's --csv table of gpu__time_duration.sum -> (start us, end us, name) of its kernels,
    laid end to end in the order ncu profiled them (it runs them one at a time)."""
    import csv

    kernels, at, header = [], 0.0, None
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
             "second": 1e6}
    for row in csv.reader(line for line in text.splitlines() if not line.startswith("==")):
        if header is None:
            if "Kernel Name" in row and "Metric Value" in row:
                header = {name: i for i, name in enumerate(row)}
            continue
        if len(row) < len(header) or row[header["Metric Name"]] != "gpu__time_duration.sum":
            continue
        unit = row[header["Metric Unit"]]
        if unit not in scale:
            raise ValueError(f"ncu's table gives a duration in {unit!r}; expected one of {sorted(scale)}")
        us = float(row[header["Metric Value"]].replace(",", "")) * scale[unit]
        kernels.append((at, at + us, row[header["Kernel Name"]]))
        at += us
    if header is None:
        raise ValueError("no ncu table here (run ncu with --csv and --metrics gpu__time_duration.sum)")
    return kernels


def profiled_runner(model):
    """A Runner with the device's options, but for the rows gate (kernels.rows_gate): under the
    profiler a gated forward never saw the host's release (an H100 waited out both the gate's
    few seconds and minutes of it), so each forward here starts once its engram rows are
    written, as on a Mac."""
    from dsv41_mlx.runtime.options import default_options
    from dsv41_mlx.runtime.runner import Runner

    return Runner(model, dataclasses.replace(default_options(model.args), gate_rows=False))


@contextlib.contextmanager
def loaded(model_path: str):
    """Inside: the model's Runner (profiled_runner), the model loaded once."""
    import dsv41_mlx

    model, _ = dsv41_mlx.load(model_path)
    with profiled_runner(model) as runner:
        yield runner


def warm_step(runner, model_path: str, rows: int, prompt_tokens: int, prefill_only: bool = False,
              propose_only: bool = False):
    """A function that runs one more forward of `rows` tokens on the runner's model, after a
    prompt of prompt_tokens tokens and 4 untimed forwards (kernels built and loaded, compiled
    pieces traced). prefill_only: the function prefills that prompt into an empty cache
    instead (rows unused), after two untimed prefills. propose_only: the prompt's features
    ingested into the drafter's rings, the function runs one greedy propose pass from the
    prompt's next token and evaluates its drafts, logits and confidences, as
    SpeculativeDecoder.round does (rows unused; four untimed first).
    One row: a step as generate.generate_step takes it (greedy): the next forward begun before
    the token is read back (Runner.decode_ahead), so a step's kernels run from the rest of one
    forward (its engram rows first) to the next forward's block 0. More rows: a verify-sized
    forward (Runner.decode) whose token is read back before the next is built."""
    if prefill_only:
        return _prefill_step(runner, prompt_tokens)
    if propose_only:
        return _propose_step(runner, model_path, prompt_tokens)
    return _decode_step(runner, rows, prompt_tokens)


@contextlib.contextmanager
def load_warm(model_path: str, rows: int, prompt_tokens: int, prefill_only: bool = False,
              propose_only: bool = False):
    """Inside: warm_step's function for the model, loaded with the device's options but for
    the rows gate (profiled_runner)."""
    with loaded(model_path) as runner:
        yield warm_step(runner, model_path, rows, prompt_tokens, prefill_only, propose_only)


def _prefill_step(runner, prompt_tokens: int):
    """warm_step's prefill_only function, after its two untimed runs."""
    from dsv41_mlx.generate import prefill

    prompt = prompt_of(prompt_tokens, runner.args.vocab_size)

    def prefill_once():
        logits, _ = prefill(runner, prompt, runner.make_cache())
        mx.eval(logits)

    for _ in range(2):
        prefill_once()
    return prefill_once


def _propose_step(runner, model_path: str, prompt_tokens: int):
    """warm_step's propose_only function, after its four untimed runs."""
    from dsv41_mlx.generate import prefill

    drafter = drafter_of(runner, model_path, "there is no propose pass to time")
    cache = runner.make_cache()
    logits, features = prefill(runner, prompt_of(prompt_tokens, runner.args.vocab_size), cache,
                               keep_features=drafter.window)
    rings = drafter.make_cache()
    rings.end = cache.offset - features.shape[0]
    drafter.ingest(rings, features)
    anchor = int(mx.argmax(logits).item())

    def propose():
        proposal = drafter.propose(rings, anchor)
        mx.eval(proposal.drafts, proposal.logits, proposal.confidence)

    for _ in range(4):
        propose()
    return propose


def _decode_step(runner, rows: int, prompt_tokens: int):
    """warm_step's decode function, after its four untimed steps."""
    from dsv41_mlx.generate import draw_token, prefill
    from dsv41_mlx.sampling import SamplingParams

    cache = runner.make_cache()
    logits, _ = prefill(runner, prompt_of(prompt_tokens, runner.args.vocab_size), cache)
    mx.eval(logits)

    def draw(logits):  # generate_step's greedy draw
        return draw_token(runner, logits, cache.offset, SamplingParams())

    drawn = draw(logits)
    ahead = runner.decode_ahead(drawn, cache, on_forward_stream=True) if rows == 1 else None
    token = drawn.item()

    def step():
        nonlocal token, ahead
        if rows == 1:
            out, _ = ahead.finish(token, settle=False)  # settled by the next decode_ahead, as generate_step's
            drawn = draw(out)
            ahead = runner.decode_ahead(drawn, cache, on_forward_stream=True)
            token = drawn.item()
            return
        out, _ = runner.decode([token] * rows, cache)
        token = int(mx.argmax(out[0, -1]).item())
        cache.trim(rows - 1)  # a verify-sized forward keeps one position, as a plain step does

    for _ in range(4):
        step()
    return step


def drafter_of(runner, model_path: str, what: str):
    """The runner's DSpark drafter, or a clear exit where the checkpoint has none (`what`: why
    the mode needs it)."""
    if runner.drafter is None:
        raise SystemExit(f"{model_path}: this checkpoint has no DSpark stages: {what}")
    return runner.drafter


@contextlib.contextmanager
def load_oracle(model_path: str, prompt_tokens: int, tokens: int, rate: float = 0.56):
    """Inside: loads the model, takes the prompt's plain greedy reply of `tokens` tokens and
    gives a function that generates it again drafted by the benchmarks' OracleDrafter (the
    reply's own tokens, each right at `rate`; every draft verified), run twice untimed first:
    each run checks the reply is the same and returns its decoder (its stats)."""
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.sampling import SamplingParams
    from dsv41_mlx.speculative import SpeculativeDecoder
    from scripts.benchmarks.harness import OracleDrafter

    with loaded(model_path) as runner:
        prompt, greedy = prompt_of(prompt_tokens, runner.args.vocab_size), SamplingParams()
        drafter = drafter_of(runner, model_path, "there are no rounds to time")
        reply = list(generate_step(runner, prompt, greedy, tokens))

        def generate():
            decoder = SpeculativeDecoder(runner, OracleDrafter(drafter, prompt + reply, rate, seed=len(prompt)), greedy)
            if list(generate_step(runner, prompt, greedy, tokens, decoder=decoder)) != reply:
                raise AssertionError("the oracle-drafted reply differs from the plain greedy one")
            return decoder

        for _ in range(2):
            generate()
        yield generate


def under_ncu(model_path: str, rows: int, prompt_tokens: int, prefill_only: bool = False,
              propose_only: bool = False) -> None:
    """One forward (or prefill, or propose pass) between the CUDA driver's profiler start and stop
    (for ncu, see the top)."""
    import ctypes

    with load_warm(model_path, rows, prompt_tokens, prefill_only, propose_only) as step:
        driver = ctypes.CDLL("libcuda.so.1")  # MLX links the runtime statically: the driver's calls
        mx.synchronize()
        driver.cuProfilerStart()
        step()
        mx.synchronize()
        driver.cuProfilerStop()


def record(model_path: str, rows: int, steps: int, contexts: list[int], prefill_only: bool = False,
           propose_only: bool = False) -> list[tuple[list[tuple[float, float, str]], float]]:
    """For each context in turn, the GPU kernels of `steps` decode steps of `rows` tokens after a
    prompt of that many tokens (prefill_only: of `steps` prefills of that prompt; propose_only:
    of `steps` propose passes after it), and the wall seconds per step under the profiler. One
    process for all of them: the model loads and MLX builds its kernels once."""
    results = []
    with loaded(model_path) as runner:
        for prompt_tokens in contexts:
            step = warm_step(runner, model_path, rows, prompt_tokens, prefill_only, propose_only)
            kernels, _, wall = profiled(lambda: [step() for _ in range(steps)])
            results.append((kernels, wall / steps))
            step = None  # (its cache freed before the next context's prompt)
    return results


def growth(first: dict, last: dict, table: str = "table") -> list[dict]:
    """Two contexts' summaries (summarize) -> every kernel's ms a step in each and how much it
    grew from the first to the last, the most grown first: what a longer context adds.
    table "gaps": the idle stretches before each kernel instead of its own time."""
    calls, ms = ("calls_per_step", "ms_per_step") if table == "table" else ("gaps_per_step", "idle_ms_per_step")
    a = {row["kernel"]: row for row in first[table]}
    b = {row["kernel"]: row for row in last[table]}
    rows = []
    for kernel in a.keys() | b.keys():
        before, after = a.get(kernel, {}), b.get(kernel, {})
        rows.append({"kernel": kernel, "calls_first": before.get(calls, 0.0), "calls_last": after.get(calls, 0.0),
                     "first_ms": before.get(ms, 0.0), "last_ms": after.get(ms, 0.0)})
        rows[-1]["grew_ms"] = rows[-1]["last_ms"] - rows[-1]["first_ms"]
    return sorted(rows, key=lambda row: (-row["grew_ms"], row["kernel"]))


def profiled(run):
    """run() under PyTorch's profiler -> (the CUDA kernels it launched, as (start us, end us,
    name); what run returned; its wall seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tic = time.perf_counter()
        result = run()
        wall = time.perf_counter() - tic
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == cuda], result, wall


def print_rounds(model_path: str, prompt_tokens: int, tokens: int, json_path: str | None) -> int:
    """--oracle: one oracle-drafted generation under the profiler, its rounds (round_summary),
    reported by rounds_report."""
    with load_oracle(model_path, prompt_tokens, tokens) as generate:
        kernels, decoder, _ = profiled(generate)
    rounds = round_summary(kernels)
    report = rounds_report(rounds, decoder.stats, prompt_tokens)
    if report is None:
        print("gpu_timeline: no whole round in the timeline (a longer --tokens gives some)", file=sys.stderr)
        return 2
    text, summary = report
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps({**summary, "rounds": rounds, "prompt_tokens": prompt_tokens,
                                               "tokens": tokens}, indent=1))
    return 0


def rounds_report(rounds: list[dict], stats, prompt_tokens: int) -> tuple[str, dict] | None:
    """round_summary's rounds of one generation and its decoder's DraftStats -> (the text
    --oracle prints, its figures): the medians over the rounds, the first and last two left
    out where there are more than four (the prompt's ingest, the reply's short last rounds),
    beside the host's round (the decoder's propose, verify and ingest a round), and a middle
    round's idle stretches. None where there is no whole round."""
    import statistics

    kept = rounds[2:-2] or rounds
    if not kept:
        return None
    med = {key: statistics.median(r[key] for r in kept) for key in
           ("round_ms", "busy_ms", "boundary_ms", "forward_ms", "forward_busy_ms")}
    idle = statistics.median(sum(g[1] for g in r["gaps"]) / 1e3 for r in kept)
    host_ms = (stats.propose_s + stats.verify_s + stats.ingest_s) * 1e3 / stats.rounds
    lines = [f"oracle rounds after {prompt_tokens} tokens ({stats.summary()}): {host_ms:.2f} ms a round on the "
             f"host under the profiler (its propose, verify and ingest); the medians of {len(kept)} rounds: a round "
             f"{med['round_ms']:.2f} ms from one verify forward's head to the next's, the GPU busy "
             f"{med['busy_ms']:.2f}, idle stretches over 30 us {idle:.2f} ms; from the head's end to the next "
             f"forward's first kernel {med['boundary_ms']:.2f} ms, then the forward {med['forward_ms']:.2f} ms "
             f"(busy {med['forward_busy_ms']:.2f})", "",
             "a middle round's idle stretches over 30 us:", "",
             "| from the head's end, us | idle us | the kernel after |", "|---|---|---|"]
    for at, gap, name in kept[len(kept) // 2]["gaps"]:
        lines.append(f"| {at:.0f} | {gap:.0f} | {name if len(name) <= 60 else name[:57] + '...'} |")
    return "\n".join(lines), {"medians": med, "idle_ms": idle, "host_ms_per_round": host_ms}


def table_name(kernel: str) -> str:
    """A kernel's name as the tables print it: MLX's fused kernels' long names cut to 60."""
    return kernel if len(kernel) <= 60 else kernel[:57] + "..."


def print_table(res: dict, top: int) -> None:
    """summarize's kernel table, its `top` rows, as markdown."""
    print("| kernel | calls / step | us / call | ms / step |\n|---|---|---|---|")
    for row in res["table"][:top]:
        print(f"| {table_name(row['kernel'])} | {row['calls_per_step']:.1f} | {row['us_per_call']:.1f} | {row['ms_per_step']:.3f} |")


def print_growth(first: dict, last: dict, grown: list[dict], waited: list[dict], top: int) -> None:
    """What the last context adds to the first: the step's totals, then the `top` kernels that
    grew most (growth), and the `top` idle stretches by the kernel after them that grew most
    (growth of "gaps"), as markdown."""
    print(f"from {first['prompt_tokens']} to {last['prompt_tokens']} tokens: wall {first['wall_ms']:.1f} -> "
          f"{last['wall_ms']:.1f} ms, GPU busy {first['busy_ms']:.1f} -> {last['busy_ms']:.1f} ms, idle gaps over "
          f"50 us {first['long_gaps_ms']:.1f} -> {last['long_gaps_ms']:.1f} ms, kernels "
          f"{first['kernels_per_step']:.0f} -> {last['kernels_per_step']:.0f} a step\n")
    tables = [("| kernel | calls / step | ms / step | grew ms |", grown),
              ("\nthe idle stretches over 50 us, by the kernel the GPU then waited to start (what the host did "
               "before launching it), the most grown first:\n\n"
               "| kernel after the wait | waits / step | idle ms / step | grew ms |", waited)]
    for head, rows in tables:
        print(head + "\n|---|---|---|---|")
        for row in rows[:top]:
            print(f"| {table_name(row['kernel'])} | {row['calls_first']:.1f} -> {row['calls_last']:.1f} | "
                  f"{row['first_ms']:.3f} -> {row['last_ms']:.3f} | {row['grew_ms']:+.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (scripts/make_flash_shaped.py)")
    parser.add_argument("--rows", type=int, default=1, help="tokens per forward (1: a decode step; up to 6: verify)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[261],
                        help="context before the steps (indexer_scoring_length or more: every index layer "
                             "scores; fewer: the indexers pick every position unscored); several: each in "
                             "turn in this process, and what the last adds to the first, kernel by kernel")
    parser.add_argument("--prefill", action="store_true",
                        help="time prefills of a --prompt-tokens prompt into an empty cache instead of decode steps")
    parser.add_argument("--propose", action="store_true",
                        help="time the DSpark drafter's propose passes after the prompt instead of decode steps")
    parser.add_argument("--oracle", action="store_true",
                        help="time speculative rounds drafted by the benchmarks' oracle drafter instead of decode "
                             "steps")
    parser.add_argument("--tokens", type=int, default=48, help="--oracle: the reply's tokens")
    parser.add_argument("--top", type=int, default=30, help="kernels to list")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sequence", default=None, help="write the last step's kernels, in order, to this file")
    parser.add_argument("--under-ncu", action="store_true",
                        help="one forward for ncu --profile-from-start off to time (see the top)")
    parser.add_argument("--ncu-csv", default=None, help="print the kernel table of ncu's --csv output in this file")
    args = parser.parse_args()
    if args.ncu_csv:
        try:
            kernels = ncu_kernels(Path(args.ncu_csv).read_text())
        except (OSError, ValueError) as e:
            print(f"gpu_timeline: {args.ncu_csv}: {e}", file=sys.stderr)
            return 2
        res = summarize(kernels, 1)
        print(f"(ncu: each kernel timed alone) kernel time summed {res['kernel_sum_ms']:.2f} ms, "
              f"{res['kernels_per_step']:.0f} kernels\n")
        print_table(res, args.top)
        return 0
    if not args.model:
        parser.error("--model is required (except with --ncu-csv)")
    if args.prefill + args.propose + args.oracle > 1:
        parser.error("--prefill, --propose and --oracle time different things: give one")
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        print("gpu_timeline needs MLX on CUDA (on a Mac, Xcode's Metal System Trace shows the same)", file=sys.stderr)
        return 2
    if (args.under_ncu or args.oracle) and len(args.prompt_tokens) > 1:
        parser.error("--under-ncu and --oracle take one --prompt-tokens")
    if args.under_ncu:
        under_ncu(args.model, args.rows, args.prompt_tokens[0], args.prefill, args.propose)
        return 0
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("torch has no CUDA here")
    except ImportError as e:
        print(f"gpu_timeline needs PyTorch with CUDA for its profiler: {e}", file=sys.stderr)
        return 2
    if args.oracle:
        return print_rounds(args.model, args.prompt_tokens[0], args.tokens, args.json)
    results = []
    for n, (kernels, wall) in zip(args.prompt_tokens, record(args.model, args.rows, args.steps, args.prompt_tokens,
                                                             args.prefill, args.propose)):
        res = {**summarize(kernels, args.steps), "wall_ms": wall * 1e3, "rows": args.rows, "prefill": args.prefill,
               "propose": args.propose, "prompt_tokens": n}
        what = (f"prefill of {n} tokens" if args.prefill else f"propose pass after {n} tokens" if args.propose
                else f"{args.rows}-row forward after {n} tokens")
        print(f"{what}: wall {wall * 1e3:.1f} ms a step under the profiler; GPU span "
              f"{res['span_ms']:.1f} ms, busy {res['busy_ms']:.1f} ms, kernel time summed {res['kernel_sum_ms']:.1f} "
              f"ms, idle gaps over 50 us {res['long_gaps_ms']:.1f} ms; {res['kernels_per_step']:.0f} kernels a step\n")
        print_table(res, args.top)
        print()
        if args.sequence:
            last = step_kernels(kernels, args.steps, args.steps - 1)
            Path(args.sequence).write_text("   start      us    idle kernel\n" + "".join(
                f"{start:8.1f} {us:7.1f} {idle:7.1f} {name}\n" for start, us, idle, name in last))
        results.append(res)
    out = results[0] if len(results) == 1 else {"contexts": results}
    if len(results) > 1:
        out["growth"] = growth(results[0], results[-1])
        out["gaps_growth"] = growth(results[0], results[-1], "gaps")
        print_growth(results[0], results[-1], out["growth"], out["gaps_growth"], args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
