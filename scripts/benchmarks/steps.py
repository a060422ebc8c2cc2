"""`bench.py steps`: variants of the kernels' layout choices A/B'd a decode step at a time in one
process, each with its own traces, their replies compared."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import fields

from .harness import layout_choices, print_heading, prompt_texts, reply_hash


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/make_flash_shaped.py) or hub id")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=CHOICE[@A/B/..]:VALUE[,...]",
                   help="a variant of the kernels' layout choices (kernels.tuning.Layout's functions), e.g. "
                        "u1=experts_loads_ahead:1, or "
                        "w2u2=mma_loads_ahead@2304/1:2 (only for the calls with those arguments)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip generate.warm_up (each variant's untimed runs still come first)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=1, help="prose and code prompts each")
    p.add_argument("--verify-rows", type=int, default=0, help="also time verify forwards of 1..N rows")


def run(args, env: dict) -> dict:
    res = bench_steps(args.model, dict(parse_variant(v) for v in args.variant), args.tokens, args.rounds,
                      args.prompts, args.verify_rows, warm=not args.no_warm_up)
    print_steps(env, res, args.model)
    return res


def parse_variant(text: str) -> tuple[str, dict[str, list]]:
    """`NAME=RULE[,RULE...]` (bench.py steps --variant), RULE `CHOICE:VALUE` or `CHOICE@A/B/..:VALUE`
    -> (NAME, {CHOICE: [(args or None, VALUE), ...]}): the layout choice CHOICE (a field of
    dsv41_mlx.kernels.tuning.Layout that is a function, e.g. experts_loads_ahead(rows, k)) made
    to return VALUE, an int, on every call, or only on calls with the int arguments A, B, ..
    (e.g. mma_loads_ahead@2304/1:2: K 2304 at one row), the package's own answer otherwise
    (variant_choice)."""
    from dsv41_mlx.kernels.tuning import Layout

    functions = {f.name for f in fields(Layout) if callable(getattr(Layout(), f.name))}
    name, _, spec = text.partition("=")
    choices: dict[str, list] = {}
    for item in filter(None, spec.split(",")):
        head, _, value = item.partition(":")
        choice, at, args = head.partition("@")
        ints = args.split("/") if at else []
        if (choice not in functions or not value.lstrip("-").isdigit()
                or (at and not all(a.lstrip("-").isdigit() for a in ints))):
            raise SystemExit(f"--variant {text!r}: {item!r} is not CHOICE[@A/B/..]:VALUE with CHOICE a function "
                             f"of kernels.tuning.Layout ({', '.join(sorted(functions))}) and VALUE (and A, B, ..) ints")
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
    A layout choice (Layout.mma_loads_ahead, ...) is read while a launch is traced: a trace
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
        from dsv41_mlx.kernels import tuning

        package = tuning.current()
        with layout_choices({c: variant_choice(rules, getattr(package, c)) for c, rules in variants[name].items()}):
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
    print_heading("Step A/B of kernel layouts", env)
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
