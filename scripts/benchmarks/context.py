"""`bench.py context`: prefill and plain greedy decode at long contexts on a checkpoint
(scripts/make_flash_shaped.py), with and without the prefill elision past the last KV source,
mlx-lm beside it where it runs; the bytes a decode step must read at each context and the
fraction of that floor reached; peak memory and the cache's bytes per token."""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import mlx.core as mx

from .harness import copy_bandwidth, decode_bytes, print_heading, prompt_of, reply_hash

CONTEXTS = (1024, 8192, 32768, 131072)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/make_flash_shaped.py) or hub id")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded after each prompt")
    p.add_argument("--no-full", action="store_true", help="skip the prefill without the elision")
    p.add_argument("--no-mlxlm", action="store_true", help="skip mlx-lm")
    p.add_argument("--mlxlm-up-to", type=int, default=None, metavar="N",
                   help="run mlx-lm only at contexts of at most N tokens")


def run(args, env: dict) -> dict:
    res = bench_context(args.model, args.contexts, args.tokens, full=not args.no_full, mlxlm=not args.no_mlxlm,
                        mlxlm_up_to=args.mlxlm_up_to)
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


def bench_context(model_path: str, contexts: list[int], tokens: int, full: bool = True, mlxlm: bool = True,
                  warm: bool = True, mlxlm_up_to: int | None = None) -> dict:
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
    if warm:
        with Runner(model) as runner:
            warm_up(runner)
    for n in contexts:
        row = {"context": n}
        out["rows"].append(row)
        if args.max_position_embeddings and n + tokens > args.max_position_embeddings:
            row["skipped"] = f"past the model's context of {args.max_position_embeddings} tokens"
            continue
        prompt = prompt_of(n, args.vocab_size)
        for label, elide in (("elided", True), ("full", False)) if full else (("elided", True),):
            try:
                with Runner(model, replace(base, elide_prefill=elide)) as runner:
                    row[label] = _generate(runner, prompt, tokens if elide else 2)
                print(f"  {n} tokens, {label}: {row[label]}", flush=True)
            except (MemoryError, RuntimeError, ValueError) as e:  # where it stops, said in the table
                row[f"{label}_stopped"] = f"{type(e).__name__}: {e}"[:200]
                print(f"  {n} tokens, {label}: stopped: {row[f'{label}_stopped']}", flush=True)
                break
            finally:
                gc.collect()
                mx.clear_cache()  # the run's freed buffers given back: the next run's sizes differ
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
                                            args.vocab_size)
    return out


def bench_mlxlm_contexts(model_path: str, contexts: list[int], tokens: int, vocab: int) -> dict:
    """mlx-lm's prefill and decode rates at each context, or why it did not run there."""
    from scripts.mlxlm_baseline import MlxLmUnavailable, bench_mlxlm

    res = {}
    for n in contexts:
        try:
            base = bench_mlxlm(model_path, prompt_of(n, vocab), tokens)
            res[n] = {"prefill_tok_s": base.prefill_tok_s, "decode_tok_s": base.decode_tok_s,
                      "peak_GB": base.peak_memory_gb}
        except MlxLmUnavailable as e:
            return {"unavailable": str(e)}
        except (MemoryError, RuntimeError, ValueError) as e:
            res[n] = {"stopped": f"{type(e).__name__}: {e}"[:200]}
        mx.clear_cache()
        print(f"  mlx-lm, {n} tokens: {res[n]}", flush=True)
    return res


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
