"""`bench.py context`: prefill and plain greedy decode at long contexts on a checkpoint
(scripts/make_flash_shaped.py), with and without the prefill elision past the last KV source,
mlx-lm beside it where it runs (a process of its own per context); the bytes a decode step must
read at each context and the fraction of that floor reached; peak memory and the cache's bytes
per token."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from scripts.mlxlm_baseline import UNAVAILABLE_STATUS

from .harness import copy_bandwidth, decode_bytes, print_heading, prompt_of, reply_hash

CONTEXTS = (1024, 8192, 32768, 131072)
MLXLM_TIMEOUT_S = 1800  # one context's mlx-lm process, load included
BASELINE = Path(__file__).resolve().parent.parent / "mlxlm_baseline.py"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/make_flash_shaped.py) or hub id")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded after each prompt")
    p.add_argument("--no-full", action="store_true", help="skip the prefill without the elision")
    p.add_argument("--no-mlxlm", action="store_true", help="skip mlx-lm")
    p.add_argument("--mlxlm-up-to", type=int, default=None, metavar="N",
                   help="run mlx-lm only at contexts of at most N tokens")
    p.add_argument("--mlxlm-timeout", type=float, default=MLXLM_TIMEOUT_S, metavar="S",
                   help="seconds one context's mlx-lm process may take before it is stopped")


def run(args, env: dict) -> dict:
    res = bench_context(args.model, args.contexts, args.tokens, full=not args.no_full, mlxlm=not args.no_mlxlm,
                        mlxlm_up_to=args.mlxlm_up_to, mlxlm_timeout=args.mlxlm_timeout)
    print_context(env, res)
    return res


def step_read_bytes(model, context: int) -> float:
    """The bytes one decode step must read after `context` tokens, beyond the weights: each
    layer's window keys; each compressed layer's index_topk picked groups (or all of them,
    while there are fewer); each index source's index keys of every group it scores (at and
    before the candidate source, every group; after it, the candidate blocks only)."""
    args = model.args
    total = 0.0
    cand = args.candidate_source_layer_id
    for i, ratio in enumerate(args.compress_ratios[: args.num_hidden_layers]):
        total += min(context, args.sliding_window) * args.head_dim * 2  # bf16 window keys
        if not ratio:
            continue
        groups = context // ratio
        total += min(groups, args.index_topk) * args.head_dim * 2
        if i in args.index_source_layer_ids and groups > args.index_topk:
            scored = groups if cand < 0 or i <= cand else min(groups, args.candidate_topk_blocks *
                                                               args.candidate_block_size)
            total += scored * args.index_head_dim * 2
    return total


def _generate(runner, prompt: list[int], tokens: int) -> dict:
    """One plain greedy generation on a fresh cache, as generate_step runs it: the prefill's
    seconds (through the first token), the decode rate after it, the reply's hash, MLX's peak
    memory, and the cache's bytes per position after the prompt (every array it holds)."""
    from dsv41_mlx.generate import plain_steps, prefill
    from dsv41_mlx.sampling import SamplingParams

    mx.synchronize()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    cache = runner.make_cache()
    logits, _ = prefill(runner, prompt, cache)
    mx.eval(logits)
    cache_bytes = sum(a.nbytes for a in cache.state())
    steps = plain_steps(runner, cache, SamplingParams(), tokens, logits=logits)
    reply = [next(steps)]
    prefill_s = time.perf_counter() - tic
    tic = time.perf_counter()
    reply += list(steps)
    decode_s = time.perf_counter() - tic
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": (len(reply) - 1) / max(decode_s, 1e-9),
            "hash": reply_hash([reply]), "first_two": reply_hash([reply[:2]]), "peak_GB": mx.get_peak_memory() / 1e9,
            "cache_bytes_per_token": cache_bytes / len(prompt)}


SORT_BLOCK = 4096  # keys one block of MLX's CUDA sort takes; more are sorted in several passes


def long_warm_length(args) -> int:
    """A prompt length past which a prefill and a decode step use no kernel that this length
    does not: past the indexers' free picks (indexer_scoring_length), past the candidate
    source's blocks (the later index layers mask their scores from there), and with more
    index keys than one block of MLX's sort takes (several passes then). generate.warm_up
    goes past the first only: MLX would build the rest inside the first timed prefill that
    reaches them."""
    from dsv41_mlx.models.attention import indexer_scoring_length

    layer = args.candidate_source_layer_id
    ratio = args.compress_ratios[layer] if 0 <= layer < len(args.compress_ratios) else 1
    candidates = args.candidate_topk_blocks * args.candidate_block_size * max(ratio, 1)
    widest = max([args.compress_ratios[i] for i in args.index_source_layer_ids] or [1])
    return max(indexer_scoring_length(args), candidates + 64, SORT_BLOCK * widest + 64)


def _each_way(model, base, ways, prompt: list[int], tokens: int, into: dict, say: str) -> None:
    """Generate after `prompt` each way a row prefills (ways: (label, elide_prefill)), a fresh
    runner each: into[label] gets the figures (`tokens` decoded elided, 2 in full), or
    into[f"{label}_stopped"] why it stopped (out of memory, say), and the ways after it are not
    run. Each is printed under `say`."""
    from dsv41_mlx.runtime.runner import Runner

    for label, elide in ways:
        try:
            with Runner(model, replace(base, elide_prefill=elide)) as runner:
                into[label] = _generate(runner, prompt, tokens if elide else 2)
            print(f"  {say}, {label}: {into[label]}", flush=True)
        except (MemoryError, RuntimeError, ValueError) as e:  # where it stops, said in the table
            into[f"{label}_stopped"] = f"{type(e).__name__}: {e}"[:200]
            print(f"  {say}, {label}: stopped: {into[f'{label}_stopped']}", flush=True)
            break
        finally:
            gc.collect()
            mx.clear_cache()  # the run's freed buffers given back: the next run's sizes differ


def bench_context(model_path: str, contexts: list[int], tokens: int, full: bool = True, mlxlm: bool = True,
                  warm: bool = True, mlxlm_up_to: int | None = None, mlxlm_timeout: float = MLXLM_TIMEOUT_S) -> dict:
    """Each context's rows (see the module's docstring); warm: every request shape run once first
    (generate.warm_up), so that no kernel build or trace lands in a timing."""
    import dsv41_mlx
    from dsv41_mlx.generate import warm_up
    from dsv41_mlx.runtime.options import default_options
    from dsv41_mlx.runtime.runner import Runner

    model, _ = dsv41_mlx.load(model_path)
    mx.eval(model.parameters())
    args = model.args
    weights, _ = decode_bytes(model, 1)
    out = {"copy_GB_s": copy_bandwidth() / 1e9, "weights_GB": weights / 1e9, "tokens": tokens, "rows": []}
    base = default_options(args)
    ways = (("elided", True), ("full", False)) if full else (("elided", True),)  # how each row prefills
    limit = args.max_position_embeddings
    runs = [n for n in contexts if not (limit and n + tokens > limit)]
    if warm:
        with Runner(model) as runner:
            warm_up(runner)
        # the long prompts' kernels too, untimed, each way a row prefills: a context as long as
        # long_warm_length (or the longest that runs, if shorter), then two tokens
        long = min(long_warm_length(args), max(runs, default=0))
        if runs and long > min(runs):
            tic = time.perf_counter()
            out["long_warm_up"] = {"tokens": long}
            _each_way(model, base, ways, prompt_of(long, args.vocab_size), 2, out["long_warm_up"],
                      f"warm-up at {long} tokens")
            out["long_warm_up"]["s"] = time.perf_counter() - tic
    for n in contexts:
        row = {"context": n}
        out["rows"].append(row)
        if n not in runs:
            row["skipped"] = f"past the model's context of {limit} tokens"
            continue
        _each_way(model, base, ways, prompt_of(n, args.vocab_size), tokens, row, f"{n} tokens")
        if "elided" in row:
            step_bytes = weights + step_read_bytes(model, n)
            row["step_GB"] = step_bytes / 1e9
            row["floor_tok_s"] = out["copy_GB_s"] * 1e9 / step_bytes
    del model
    gc.collect()
    mx.clear_cache()
    if mlxlm:
        out["mlxlm"] = bench_mlxlm_contexts(model_path, [r["context"] for r in out["rows"] if "elided" in r
                                                             and (mlxlm_up_to is None or r["context"] <= mlxlm_up_to)], tokens,
                                            args.vocab_size, mlxlm_timeout)
    return out


def bench_mlxlm_contexts(model_path: str, contexts: list[int], tokens: int, vocab: int,
                         timeout: float = MLXLM_TIMEOUT_S) -> dict:
    """mlx-lm's prefill and decode rates, peak memory and reply hash at each context, or why it
    did not run there ({"stopped": ...}); {"unavailable": ...} for all of them without mlx-lm 0.32.x.

    Each context runs scripts/mlxlm_baseline.py in a fresh process: mlx-lm shares no memory, cache
    or device state with our engine or with the previous context, and a fault there (a CUDA one
    leaves the whole process's device unusable) costs that context's entry only."""
    from dsv41_mlx.io.checkpoint import resolve_model_dir
    from dsv41_mlx.io.tiny import default_checkpoint

    model_dir = default_checkpoint() if model_path is None else resolve_model_dir(model_path)  # a hub id, too
    res = {}
    for n in contexts:
        res[n] = _mlxlm_in_child(model_dir, prompt_of(n, vocab), tokens, timeout)
        if "unavailable" in res[n]:
            return res[n]
        print(f"  mlx-lm, {n} tokens: {res[n]}", flush=True)
    return res


def mlxlm_command(model_path: str, prompt_file: Path, tokens: int, json_file: Path) -> list[str]:
    """The command line of one mlx-lm run: the prompt's ids read from prompt_file, the run's
    numbers written to json_file."""
    return [sys.executable, str(BASELINE), str(model_path), "--prompt-ids", str(prompt_file),
            "--tokens", str(tokens), "--json", str(json_file)]


def _mlxlm_in_child(model_path: str, prompt: list[int], tokens: int, timeout: float) -> dict:
    """One context's bench_context["mlxlm"] entry, measured in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file, json_file = Path(tmp, "prompt.json"), Path(tmp, "run.json")
        prompt_file.write_text(json.dumps(prompt))
        try:
            done = subprocess.run(mlxlm_command(model_path, prompt_file, tokens, json_file),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"stopped": f"no result after {timeout:g} s (killed)"}
        if done.returncode == 0 and json_file.exists():
            run = json.loads(json_file.read_text())
            return {"prefill_tok_s": run["prefill_tok_s"], "decode_tok_s": run["decode_tok_s"],
                    "peak_GB": run["peak_memory_gb"], "hash": reply_hash(run["replies"])}
    if done.returncode == UNAVAILABLE_STATUS:  # mlx-lm's one-line reason, printed last
        return {"unavailable": (done.stdout.strip() or "mlx-lm: unavailable").splitlines()[-1]}
    said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1].strip()
    if done.returncode < 0:
        status = f"killed by signal {-done.returncode} ({signal.strsignal(-done.returncode)})"
    else:
        status = f"exit status {done.returncode}" + (", no result written" if done.returncode == 0 else "")
    return {"stopped": f"{status}: {said}"[:200]}


def print_context(env: dict, res: dict) -> None:
    print_heading("Long contexts: prefill and plain greedy decode", env)
    print(f"decode floor: the weights a step reads ({res['weights_GB']:.2f} GB) plus the context's window keys, "
          f"picked compressed groups and scored index keys, at the copy bandwidth ({res['copy_GB_s']:.0f} GB/s); "
          f"{res['tokens']} tokens decoded after each prompt\n")
    theirs = res.get("mlxlm", {})
    print("| context | prefill tok/s (elided) | prefill tok/s (full) | elided / full | mlx-lm prefill tok/s | "
          "ours / mlx-lm | decode tok/s | x the shortest's | decode floor tok/s | floor fraction | "
          "mlx-lm decode tok/s | peak GB | cache bytes / token | reply hash | first two tokens, elided = full |")
    print("|" + "---|" * 15)
    first = None
    for r in res["rows"]:
        n = r["context"]
        if "elided" not in r:
            print(f"| {n} | {r.get('skipped') or r.get('elided_stopped')} |" + " |" * 14)
            continue
        e, f, m = r["elided"], r.get("full"), theirs.get(n, {})
        first = first or e["decode_tok_s"]
        full_p = f"{f['prefill_tok_s']:.0f}" if f else r.get("full_stopped", "-")
        ratio = f"{e['prefill_tok_s'] / f['prefill_tok_s']:.2f}" if f else "-"
        mp = f"{m['prefill_tok_s']:.0f}" if "prefill_tok_s" in m else m.get("stopped", "-")
        mr = f"{e['prefill_tok_s'] / m['prefill_tok_s']:.2f}" if "prefill_tok_s" in m else "-"
        md = f"{m['decode_tok_s']:.1f}" if "decode_tok_s" in m else "-"
        same = ("yes" if e["first_two"] == f["first_two"] else "**no**") if f else "-"
        print(f"| {n} | {e['prefill_tok_s']:.0f} | {full_p} | {ratio} | {mp} | {mr} | {e['decode_tok_s']:.1f} | "
              f"{e['decode_tok_s'] / first:.2f} | {r['floor_tok_s']:.1f} | {e['decode_tok_s'] / r['floor_tok_s']:.1%} | "
              f"{md} | {e['peak_GB']:.1f} | {e['cache_bytes_per_token']:.0f} | {e['hash']} | {same} |")
    if "unavailable" in theirs:
        print(f"\nmlx-lm: {theirs['unavailable']}")
    print("\n(the full prefill decodes 2 tokens only: its first two are compared with the elided run's)")
