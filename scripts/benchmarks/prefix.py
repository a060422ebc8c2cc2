"""`bench.py prefix`: a chat's second turn resumed from the prefix cache (the state kept after
the first turn's reply) against the same turn prefilled whole: time to first token, their
ratio, and the bytes the cache holds for the resumed state."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from .harness import print_heading, prompt_texts

PREFIX_TOKENS = 4096
FOLLOW_UP = "Now say all of that again in one line."


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS,
                   help="the first turn's prompt, about; less where the checkpoint's context cannot hold "
                        "two turns of it (said so in the table)")
    p.add_argument("--reply-tokens", type=int, default=16, help="tokens each turn's reply generates")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each, the median kept")


def run(args, env: dict) -> dict:
    res = bench_prefix(args.model, args.prefix_tokens, args.reply_tokens, args.repeats)
    print_prefix(env, res, args.model or "the embedded tiny checkpoint")
    return res


def long_message(tokenizer, tokens: int, limit: int) -> list[dict]:
    """A one-message conversation whose prompt (chat.encode_chat) is at least `tokens` long, or
    as near as `limit` allows: the benchmark prompts' lines, one after another, as often as it
    takes."""
    from dsv41_mlx.chat import encode_chat

    lines = [line for text in prompt_texts(5) for line in text.splitlines() if line.strip()]
    parts, messages = [], []
    while True:
        parts.append(lines[len(parts) % len(lines)])
        longer = [{"role": "user", "content": "\n".join(parts)}]
        n = len(tokenizer.encode(encode_chat(longer)))
        if n > limit:
            return messages
        messages = longer
        if n >= tokens:
            return messages


def bench_prefix(model_path: str | None, prefix_tokens: int, reply_tokens: int, repeats: int) -> dict:
    import dsv41_mlx
    from dsv41_mlx.chat import encode_chat
    from dsv41_mlx.generate import stream_generate
    from dsv41_mlx.runtime.prefix_cache import PrefixCache
    from dsv41_mlx.runtime.runner import Runner

    model, tokenizer = dsv41_mlx.load(model_path)
    context = model.args.max_position_embeddings
    room = 2 * reply_tokens + 64  # the first reply, the follow-up turn and the second reply
    limit = context - room if context else prefix_tokens
    messages = long_message(tokenizer, min(prefix_tokens, limit), limit)
    first = tokenizer.encode(encode_chat(messages))
    budget = 1 << 40

    with Runner(model) as runner:
        def turn(ids, prompt_cache):
            """(seconds to the first token, the reply's tokens, the responses' cached_tokens)."""
            tic = time.perf_counter()
            responses = stream_generate(model, tokenizer, ids, max_tokens=reply_tokens, runner=runner,
                                        prompt_cache=prompt_cache)
            head = next(responses)
            seconds = time.perf_counter() - tic
            tokens = [head.token] + [r.token for r in responses]
            return seconds, tokens, head

        kept = PrefixCache.for_chat(budget, tokenizer)
        first_s, reply, _ = turn(first, kept)
        reply_text = tokenizer.decode([t for t in reply if t not in tokenizer.eos_token_ids])
        messages += [{"role": "assistant", "content": reply_text}, {"role": "user", "content": FOLLOW_UP}]
        second = tokenizer.encode(encode_chat(messages))
        entry = kept.lookup(second)

        def resumable() -> PrefixCache:
            """A cache holding only the state the second turn resumes from."""
            fresh = PrefixCache.for_chat(budget, tokenizer)
            fresh.store(entry.resume(), entry.features, entry.logits)
            return fresh

        turn(second, None), turn(second, resumable())  # every shape traced before the timed runs
        cold, resumed, cold_replies, resumed_replies, cached = [], [], set(), set(), set()
        for _ in range(repeats):
            seconds, tokens, _ = turn(second, None)
            cold.append(seconds)
            cold_replies.add(tuple(tokens))
            resumed_cache = resumable()  # (it keeps the second prompt's state, logits and all)
            seconds, resumed_reply, head = turn(second, resumed_cache)
            resumed.append(seconds)
            resumed_replies.add(tuple(resumed_reply))
            cached.add(head.cached_tokens)
        whole = PrefixCache.for_chat(budget, tokenizer)  # the whole prefill once more, its state kept
        _, cold_reply, _ = turn(second, whole)
        logits = [c.lookup(second).logits for c in (whole, resumed_cache)]
    cold_s, resumed_s = statistics.median(cold), statistics.median(resumed)
    return {"context": context, "asked_prefix_tokens": prefix_tokens, "limited": len(first) < prefix_tokens,
            "first_prompt_tokens": len(first), "second_prompt_tokens": len(second),
            "cached_tokens": sorted(cached), "first_turn_ttft_s": first_s,
            "cold_ttft_s": cold_s, "resumed_ttft_s": resumed_s, "speedup": cold_s / resumed_s,
            "entry_bytes": entry.nbytes if entry is not None else 0,
            "replies_equal": len(cold_replies | resumed_replies) == 1,
            "cold_replies_agree": len(cold_replies) == 1, "resumed_replies_agree": len(resumed_replies) == 1,
            **compare_replies(cold_reply, resumed_reply, *logits), "repeats": repeats}


def compare_replies(cold: list[int], resumed: list[int], cold_logits: mx.array, resumed_logits: mx.array) -> dict:
    """Where a reply resumed from the cache first differs from the reply prefilled whole (None: it
    does not), and how far apart the second prompt's last logits are, each way made, beside how
    far apart the whole prefill's two best logits are (a difference in the logits larger than that
    gap can change the first token)."""
    split = next((i for i, (a, b) in enumerate(zip(cold, resumed)) if a != b),
                 None if len(cold) == len(resumed) else min(len(cold), len(resumed)))
    best_two = mx.topk(cold_logits, 2)
    return {"first_difference": split,
            "logits_max_difference": mx.abs(cold_logits - resumed_logits).max().item(),
            "top_two_gap": (best_two.max() - best_two.min()).item()}


def print_prefix(env: dict, res: dict, model: str) -> None:
    print_heading(f"Prefix cache: a chat's second turn on {model}", env)
    if res["limited"]:
        print(f"(the checkpoint's context is {res['context']} tokens: the first turn's prompt is "
              f"{res['first_prompt_tokens']} tokens, not the {res['asked_prefix_tokens']} asked)\n")
    cached = "/".join(str(c) for c in res["cached_tokens"])
    print("| second turn's prompt | from the cache | TTFT prefilled whole | TTFT resumed | ratio | "
          "entry | replies equal |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['second_prompt_tokens']} tokens | {cached} tokens | {res['cold_ttft_s'] * 1e3:.1f} ms | "
          f"{res['resumed_ttft_s'] * 1e3:.1f} ms | {res['speedup']:.1f}x | {res['entry_bytes'] / 1e6:.2f} MB | "
          f"{'yes' if res['replies_equal'] else 'NO'} |")
    if not res["replies_equal"]:
        agree = {True: "agree", False: "DIFFER"}
        split = res["first_difference"]
        print(f"\nthe replies prefilled whole {agree[res['cold_replies_agree']]} with each other, the resumed ones "
              f"{agree[res['resumed_replies_agree']]}; a resumed reply "
              + ("equals the whole one" if split is None else f"first differs from the whole one at token {split}")
              + f"; the second prompt's last logits, prefilled whole against resumed, differ by up to "
              f"{res['logits_max_difference']:.4g} (the whole prefill's two best are {res['top_two_gap']:.4g} apart)")
    print(f"\nmedian of {res['repeats']} runs each; the first turn ({res['first_prompt_tokens']} tokens, cold, "
          f"its states kept) took {res['first_turn_ttft_s'] * 1e3:.1f} ms to its first token\n")
