"""`bench.py pipeline`: the target's layers split over N processes (runtime/pipeline.py), each
launched here by `mlx.launch -n N --backend ring`, against one process on the same checkpoint in
the same run: prefill and decode tok/s, plain greedy and drafted (generate_step through a
PipelineRunner), the replies' hashes (equal to one process's), and per decode token, each rank's
seconds in its Link (evaluating what it sends, sending, waiting for the rank before, receiving)
and the bytes that cross the ring.

Ranks on one machine share its cores, memory bandwidth and (with one GPU) its one device: the
figures measure the protocol and the host's side of it, not what ranks on machines of their own
gain.

Every rank after the first receives rank 0's messages one for one (each passes on what it gets),
so rank 0's count of messages sent marks the same point in every rank's stream of messages: a
rank after the first notes its counts before each message it receives, and after the run the
counts at rank 0's marks are gathered from every rank. A stretch on such a rank begins where the
first message rank 0 sent in it arrives (the wait for it began before rank 0's mark, while the
ranks after it and rank 0 were still on the message before) and ends once it has handled the last.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import fields, replace

import mlx.core as mx

from dsv41_mlx.generate import generate_step, make_decoder
from dsv41_mlx.io.load import load_launched
from dsv41_mlx.runtime.pipeline import FORWARD, STREAM_FORMS, Link, LinkCounts, PipelineRunner, Step, serve
from dsv41_mlx.runtime.runner import Runner
from dsv41_mlx.sampling import SamplingParams

from .harness import ROOT, mlx_launch, print_heading, prompt_of, reply_hash

RUNS = ("plain", "drafted")
MARKS = ("start", "first", "end")  # of a run: before its prefill, at its first token, after its last
RESULT = "pipeline result: "  # rank 0's line of figures on stdout
COUNTS = [f.name for f in fields(LinkCounts)]


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint (default: the embedded tiny one)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3], help="process counts to split over (each >= 2)")
    p.add_argument("--tokens", type=int, default=32, help="tokens each reply decodes")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prompt's length")


def run(args, env: dict) -> dict:
    res = bench_pipeline(args.model, args.ranks, args.tokens, args.prompt_tokens)
    print_pipeline(env, res, args.model or "the embedded tiny checkpoint")
    return res


# ------------------------------------------------------------ the launcher

def bench_pipeline(model: str | None, ranks: list[int], tokens: int, prompt_tokens: int,
                   timeout: float = 1200) -> dict:
    """One process's figures, then each rank count's (`measure` in processes of their own)."""
    if any(n < 2 for n in ranks):
        raise ValueError(f"--ranks: each count must be >= 2 (one process is measured anyway), got {ranks}")
    if tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (decoding is timed after the first token), got {tokens}")
    command = [sys.executable, "-m", "scripts.benchmarks.pipeline", model or "", str(tokens), str(prompt_tokens)]
    res = {"prompt_tokens": prompt_tokens, "tokens": tokens, "one": _launched(1, command, timeout), "split": []}
    for n in ranks:
        res["split"].append(_launched(n, command, timeout))
    return res


def _launched(ranks: int, command: list[str], timeout: float) -> dict:
    """rank 0's figures of `command` run in one process, or over `ranks` under mlx.launch."""
    if ranks > 1:
        command = mlx_launch(ranks, command)
    tic = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:  # (mlx.launch exits 0 whatever its ranks do)
        raise RuntimeError(f"{ranks} process(es) gave no figures:\n{done.stderr[-3000:]}")
    print(f"  {ranks} process(es): {time.perf_counter() - tic:.0f} s", flush=True)
    return json.loads(lines[-1][len(RESULT):])


# ------------------------------------------------------------- the ranks

def measure(model_path: str | None, tokens: int, prompt_tokens: int) -> dict | None:
    """This process's part: in one process, or as a rank of the pipeline mlx.launch started.
    Rank 0 runs each generation once untimed (every shape traced), then timed, marking its
    Link's counts at each run's MARKS; it returns the figures (the other ranks None)."""
    group = mx.distributed.init()
    model, _ = load_launched(model_path, group)
    if group.size() == 1:
        runner, link = Runner(model), None
    else:
        link = NotingLink(group)
        if group.rank() > 0:
            serve(model, link)  # until rank 0's STOP
            marks = _share(group, None)
            _gather(group, [link.noted[m] for m in marks] + [link.arrived(m) for m in marks])
            return None
        runner = PipelineRunner(model, link)
    prompt = prompt_of(prompt_tokens, model.args.vocab_size)
    runs = RUNS if runner.drafter is not None else RUNS[:1]
    out = {"ranks": group.size(), "runs": {}}
    with runner:
        for label in runs:
            _generation(runner, prompt, tokens, label == "drafted")
        marked = []  # rank 0's counts at each mark
        for label in runs:
            out["runs"][label] = _generation(runner, prompt, tokens, label == "drafted", link, marked)
    if link is not None:
        marks = _share(group, [counts.sent for counts in marked])
        every = _gather(group, marked + marked)  # [rank][the counts at each mark, then at its next arrival]
        for k, label in enumerate(runs):
            start, first, end = (k * len(MARKS) + i for i in range(len(MARKS)))
            figures = out["runs"][label]
            figures["links"] = [{"prefill": _per(counts[first], counts[len(marks) + start], prompt_tokens),
                                 "decode": _per(counts[end], counts[len(marks) + first], figures["tokens"] - 1)}
                                for counts in every]
            figures["marks"] = marks[k * len(MARKS): (k + 1) * len(MARKS)]
    return out


def _generation(runner, prompt: list[int], tokens: int, drafted: bool, link=None, marked: list | None = None) -> dict:
    """One greedy reply through generate_step: prefill tok/s through its first token, decode
    tok/s after it; with a link, its counts added to `marked` at MARKS (and a decode forward's arrays)."""
    def mark():
        if link is not None:
            marked.append(link.counts.copy())

    params = SamplingParams()
    decoder = make_decoder(runner, params, drafted)
    mark()
    tic = time.perf_counter()
    steps = generate_step(runner, prompt, params, tokens, decoder=decoder)
    reply = [next(steps)]
    first = time.perf_counter()
    mark()
    reply += list(steps)
    end = time.perf_counter()
    mark()
    out = {"prefill_tok_s": len(prompt) / (first - tic), "decode_tok_s": (len(reply) - 1) / (end - first),
           "tokens": len(reply), "hash": reply_hash([reply])}
    if link is not None and not drafted:
        out["decode_forward"] = link.forward  # (the last forward sent: a plain decode's, one row)
    return out


def _per(later, earlier, n: int) -> dict:
    """What a Link did between two of its counts, per token (n of them)."""
    return {name: (getattr(later, name) - getattr(earlier, name)) / n for name in COUNTS}


def _share(group, marks: list[int] | None) -> list[int]:
    """Rank 0's marks (message counts, None elsewhere), on every rank."""
    size = len(RUNS) * len(MARKS)
    mine = mx.array((marks or []) + [-1] * (size - len(marks or [])), dtype=mx.int64)
    every = mx.distributed.all_gather(mine[None], group=group, stream=mx.cpu).tolist()
    return [m for m in every[0] if m >= 0]


def _gather(group, counts: list[LinkCounts]) -> list[list[LinkCounts]]:
    """Every rank's `counts` (as many on each), on every rank: [rank][k] (seconds as ns on the wire)."""
    rows = [[round(getattr(c, name) * 1e9) if name.endswith("_s") else getattr(c, name) for name in COUNTS]
            for c in counts]
    every = mx.distributed.all_gather(mx.array(rows, dtype=mx.int64)[None], group=group, stream=mx.cpu).tolist()
    return [[LinkCounts(**{name: v / 1e9 if name.endswith("_s") else v for name, v in zip(COUNTS, row)})
             for row in rank] for rank in every]


class NotingLink(Link):
    """A Link that notes its counts before each message it receives (noted[m]: after m
    messages), and what the arrays of the last forward it sent are: [(what, dtype, shape)]."""

    def __init__(self, group):
        super().__init__(group)
        self.noted, self.forward = [], None

    def send(self, message):
        if message.op == FORWARD:
            step = Step.of(message.fields)
            form = STREAM_FORMS[step.form]
            stream = [f"stream ({form.__name__}) {name}" for name in getattr(form, "_fields", ["h"])]
            names = ["tokens", *stream, "pre-mix", "features"] if step.form else ["tokens"]
            self.forward = [(name, str(a.dtype).removeprefix("mlx.core."), a.shape)
                            for name, a in zip(names, message.arrays)]
        super().send(message)

    def recv(self):
        self.noted.append(self.counts.copy())
        return super().recv()

    def arrived(self, m: int) -> LinkCounts:
        """The counts once m messages were handled and the next one's header came."""
        return replace(self.noted[m], wait_s=self.noted[m + 1].wait_s)


# ---------------------------------------------------------------- the table

def print_pipeline(env: dict, res: dict, model: str) -> None:
    print_heading(f"Pipeline: the layers split over N processes on one machine, {model}", env)
    one = res["one"]["runs"]
    print(f"a {res['prompt_tokens']}-token prompt, {res['tokens']} tokens greedy; prefill tok/s through the first "
          "token, decode tok/s after it; x 1: over one process in the same run\n")
    print("| processes | decode | tok/s | x 1 | prefill tok/s | x 1 | bytes / token across the ring | "
          "reply hash | = 1 process |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, run in one.items():
        print(f"| 1 | {label} | {run['decode_tok_s']:.1f} | 1.00 | {run['prefill_tok_s']:.0f} | 1.00 | - | "
              f"{run['hash']} | - |")
    for split in res["split"]:
        for label, run in split["runs"].items():
            base = one[label]
            crossing = sum(link["decode"]["sent_bytes"] for link in run["links"])
            print(f"| {split['ranks']} | {label} | {run['decode_tok_s']:.1f} | "
                  f"{run['decode_tok_s'] / base['decode_tok_s']:.2f} | {run['prefill_tok_s']:.0f} | "
                  f"{run['prefill_tok_s'] / base['prefill_tok_s']:.2f} | {crossing:.0f} | {run['hash']} | "
                  f"{'yes' if run['hash'] == base['hash'] else '**no**'} |")
    print(f"\neach rank's Link per decode token (the {res['tokens'] - 1} after the first; a reply's last token "
          "needs no forward): ms evaluating what it sends (its blocks), sending, waiting for the rank before (a "
          "message's header), receiving (its arrays), and outside the Link; the messages and bytes it sent\n")
    print("| processes | decode | rank | ms / token | evaluating | sending | waiting | receiving | outside | "
          "messages sent | bytes sent |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for split in res["split"]:
        for label, run in split["runs"].items():
            for rank, link in enumerate(run["links"]):
                d, ms = link["decode"], 1e3 / run["decode_tok_s"]
                parts = [d[name] * 1e3 for name in ("ready_s", "send_s", "wait_s", "recv_s")]
                print(f"| {split['ranks']} | {label} | {rank} | {ms:.2f} | "
                      + " | ".join(f"{v:.2f}" for v in parts)
                      + f" | {ms - sum(parts):.2f} | {d['sent']:.2f} | {d['sent_bytes']:.0f} |")
    forward = next((run["decode_forward"] for split in res["split"] for run in split["runs"].values()
                    if "decode_forward" in run), None)
    if forward:
        arrays = ", ".join(f"{name} {dtype}{list(shape)}" for name, dtype, shape in forward)
        print(f"\nrank 0's message of a plain decode forward: a header of int32 fields, then {arrays}\n")


def main(argv: list[str]) -> None:
    model, tokens, prompt_tokens = argv
    res = measure(model or None, int(tokens), int(prompt_tokens))
    if res is not None:
        print(RESULT + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
