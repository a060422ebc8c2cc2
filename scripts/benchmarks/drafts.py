"""`bench.py drafts`: the FP8 against the BF16 drafter head on the benchmark prompts: the
drafts that change, and each head's acceptance."""

from __future__ import annotations

import mlx.core as mx

from .harness import print_heading, prompt_texts


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=5, help="prose and code prompts each")


def run(args, env: dict) -> dict:
    res = bench_drafts(args.model, args.max_tokens, args.prompts)
    print_drafts(env, res, args.model or "the embedded tiny checkpoint")
    return res


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
    print_heading(f"FP8 vs BF16 drafter head on {model}", env, with_backend=False)
    print("| prompts | tokens each | drafts compared | drafts changed | acceptance BF16 head | "
          "acceptance FP8 head | replies identical |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['prompts']} | {res['max_tokens']} | {res['total']} | {res['changed']} "
          f"({res['changed'] / max(res['total'], 1):.1%}) | {res['acceptance']['bf16']:.3f} "
          f"({res['accepted']['bf16']}) | {res['acceptance']['fp8']:.3f} ({res['accepted']['fp8']}) | "
          f"{'yes' if res['identical'] else 'NO'} |")
    print()
