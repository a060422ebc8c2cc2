"""`bench.py e2e`: end to end on a checkpoint (scripts/make_flash_shaped.py), mlx-lm beside it:
prefill, verify forwards and their floors, plain and drafted decoding (the model's drafter
and the oracle), each against plain greedy and against mlx-lm also interleaved prompt by
prompt, and what a target speed-up asks of a verify forward."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from .harness import (COPY_TRIES, OracleDecoders, OracleDrafter, copy_bandwidth, decode_bytes, host_probe_ms,
                      print_heading, prompt_texts, reply_hash)
from .propose import propose_floor_bytes

PAIRED_LATER = "measured after this table, printed below it"
ORACLE_TARGET = 1.8  # drafted decode at the oracle rate against plain decode: the speed-up aimed at


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/make_flash_shaped.py) or hub id")
    p.add_argument("--prompts", type=int, default=1, help="prose and code prompts each")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per prompt and run")
    p.add_argument("--oracle-rate", type=float, default=0.56)
    p.add_argument("--no-paired", action="store_true",
                   help="skip ours and mlx-lm interleaved prompt by prompt (it holds both models at once)")


def run(args, env: dict) -> dict:
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
    return res


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

        oracle_decoder = OracleDecoders(runner, oracle_rate)  # drafts right at oracle_rate on each reply
        flipped = not runner.options.verify_ahead
        other_ahead = "verify built ahead" if flipped else "verify built after the drafts"

        for label, params, make in [
            ("plain greedy", greedy, None),
            ("plain coupled", coupled, None),
            # the checkpoint's drafter under the default policy (schedule: it decodes plainly
            # where drafting does not pay), its verify costs measured once for the runner
            ("drafted greedy", greedy, lambda p, seq: SpeculativeDecoder(runner, runner.drafter, p, confidence="schedule")),
            ("drafted coupled", coupled, lambda p, seq: SpeculativeDecoder(runner, runner.drafter, p, confidence="schedule")),
            # the same drafter in a round at every step, every draft verified: its propose pass's
            # time in the loop, round after round (the schedule soon stops proposing for it)
            ("drafted greedy, every draft verified", greedy,
             lambda p, seq: SpeculativeDecoder(runner, runner.drafter, p, confidence="off")),
            # the same, each round's verify forward begun as the options do not say (Options.verify_ahead)
            (f"drafted greedy, every draft verified, {other_ahead}", greedy,
             lambda p, seq: SpeculativeDecoder(runner, runner.drafter, p, confidence="off", verify_ahead=flipped)),
            (f"oracle {oracle_rate:.2f} greedy", greedy, oracle_decoder),
            (f"oracle {oracle_rate:.2f} greedy, {other_ahead}", greedy,
             lambda p, seq: oracle_decoder(p, seq, verify_ahead=flipped)),
            # the same drafts, each round verifying the number of them the schedule policy picks from
            # the drafter's confidence and the verify costs the engine measured (in its warm-up), as
            # generate's default does
            (f"oracle {oracle_rate:.2f} greedy, schedule", greedy,
             lambda p, seq: oracle_decoder(p, seq, confidence="schedule")),
        ]:
            elapsed, produced, replies, stats, oracle, step_s = 0.0, 0, [], [], [0, 0], []
            probes = [host_probe_ms()]
            known = runs.get("plain greedy", {}).get("replies", [None] * len(ids_list))

            def decoder_for(i):
                """The row's decoder for prompt i (None: plain), the oracle's knowing its reply (the
                plain greedy run's; the warm-up's too: an oracle past what it knows drafts only
                wrong tokens, and its schedule's outlook carries to the timed replies)."""
                return make(params, ids_list[i] + (known[i] or [])) if make else None

            warm = time.perf_counter()  # a short untimed run first: kernel builds and compile traces
            list(generate_step(runner, ids_list[0], params, 4, decoder=decoder_for(0)))
            print(f"  {label}: warm-up {time.perf_counter() - warm:.1f} s", flush=True)
            for i, ids in enumerate(ids_list):
                decoder = decoder_for(i)
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
                run["plain_steps"] = sum(s["plain_steps"] for s in stats)
                run["verified_ahead"] = sum(s["verified_ahead"] for s in stats)
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
        if runner.drafter is not None and runner.drafter.head == "fp8":  # what a proposal must read, at this run's bandwidth
            out["propose_floor_ms"] = propose_floor_bytes(runner.drafter)["total"] / (out["copy_GBps"] * 1e9) * 1e3

        # the oracle against plain greedy interleaved prompt by prompt: the runs above are minutes
        # apart, and each met the host's speed of its own moment; every draft verified, then the
        # schedule policy (what generate and the server use by default)
        out["paired_oracle"] = paired_speedup(runner, ids_list, tokens,
                                              lambda i: oracle_decoder(greedy, ids_list[i] + references[i]))
        print(f"  paired oracle: {out['paired_oracle']}", flush=True)
        out["paired_oracle_schedule"] = paired_speedup(
            runner, ids_list, tokens, lambda i: oracle_decoder(greedy, ids_list[i] + references[i], confidence="schedule"))
        print(f"  paired oracle, schedule: {out['paired_oracle_schedule']}", flush=True)
        # the checkpoint's drafter as generate drafts by default (schedule): whether drafting
        # costs anything where the drafter is poorly matched, against plain greedy of the same moment
        out["paired_drafted"] = paired_speedup(
            runner, ids_list, tokens, lambda i: SpeculativeDecoder(runner, runner.drafter, greedy, confidence="schedule"))
        print(f"  paired drafted, schedule: {out['paired_drafted']}", flush=True)

        # ours and mlx-lm interleaved prompt by prompt (both loaded): the ratio above compares runs
        # minutes apart, and the host's speed drifts
        skipped = paired_skip_reason(paired, out["mlxlm"], machine_memory())
        if report is not None and not skipped:
            report({**out, "paired": {"skipped": PAIRED_LATER}})
        out["paired"] = {"skipped": skipped} if skipped else paired_plain_decode(runner, model_path, ids_list, tokens)
        print(f"  paired plain decode: {out['paired']}", flush=True)
        return out


def long_context_prompt(ids_list: list[list[int]], length: int) -> list[int]:
    """A prompt of `length` tokens: the prompts one after another, over again as needed."""
    ids = []
    while len(ids) < length:
        for prompt in ids_list:
            ids.extend(prompt)
    return ids[:length]


def step_summary(step_s: list[list[float]]) -> dict:
    """Each prompt's plain decoding steps (seconds, in order) -> their median and mean (ms), each
    prompt's first step, the slowest, and what steps over 1.5x the median add a prompt beyond
    it: whether a run's rate is set by its typical step or by a few slow ones."""
    every = [t * 1e3 for run in step_s for t in run]
    median = statistics.median(every)
    excess = sum(t - median for t in every if t > 1.5 * median) / len(step_s)
    return {"median_ms": median, "mean_ms": statistics.mean(every), "first_ms": [run[0] * 1e3 for run in step_s],
            "max_ms": max(every), "slow_excess_ms": excess}


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
    print_heading(f"End to end on {model}", env)
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
    print("| run | tok/s | x plain greedy | floor fraction | drafts accepted / verified / proposed | rounds "
          "(verified ahead) / plain steps | propose ms | verify ms | ingest ms | host probe ms | reply hash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in res["runs"].items():
        frac = (1e3 / res["floor_ms"]) and r["tok_s"] * res["floor_ms"] / 1e3
        drafted = f"{r['accepted']} / {r['verified']} / {r['proposed']}" if "proposed" in r else "-"
        rounds = f"{r['rounds']} ({r.get('verified_ahead', 0)}) / {r['plain_steps']}" if "rounds" in r else "-"
        ms = [f"{r[k]:.1f}" if k in r else "-" for k in ("propose_ms", "verify_ms", "ingest_ms")]
        print(f"| {label} | {r['tok_s']:.2f} | {r['tok_s'] / plain:.2f} | {frac:.1%} | {drafted} | {rounds} | "
              + " | ".join(ms) + f" | {r['host_probe_ms']:.2f} | {r['hash']} |")
    print()
    every = res["runs"].get("drafted greedy, every draft verified")
    if every is not None and "propose_floor_ms" in res:
        print(f"the checkpoint's drafter's propose pass in the loop (every draft verified, a round at every step): "
              f"{every['propose_ms']:.2f} ms a round, {every['propose_ms'] / res['propose_floor_ms']:.1f}x its byte "
              f"floor of {res['propose_floor_ms']:.3f} ms (`bench.py propose`'s bytes at this run's copy bandwidth)\n")
    if "long_context" in res:
        long = res["long_context"]
        print(f"plain greedy after a {long['prompt_tokens']}-token prompt (the prompts above one after another; "
              f"every index layer then scores its picks at each step, where after the short prompts each picks "
              f"every compressed position without scoring): {long['tok_s']:.2f} tok/s, "
              f"{long['tok_s'] / plain:.2f}x the short prompts' plain greedy, "
              f"{long['tok_s'] * res['floor_ms'] / 1e3:.1%} of the floor (host probe {long['host_probe_ms']:.2f} ms)\n")
    for key, label in (("paired_oracle", f"oracle {res['oracle_rate']:.2f} greedy"),
                       ("paired_oracle_schedule", f"oracle {res['oracle_rate']:.2f} greedy, schedule"),
                       ("paired_drafted", "drafted greedy (the checkpoint's drafter, schedule)")):
        if key in res:
            po = res[key]
            print(f"{label} and plain greedy interleaved prompt by prompt "
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
