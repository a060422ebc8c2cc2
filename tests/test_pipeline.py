"""Pipeline parallelism (runtime/pipeline.py): the split of the layers across ranks, each rank's
part of the checkpoint, and replies across ranks, launched with `mlx.launch --backend ring`
(local processes over loopback), equal to one process's."""

import dataclasses
import hashlib
import json
import random
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dsv41_mlx.config import ModelArgs
from dsv41_mlx.generate import generate_step, make_decoder, prefill
from dsv41_mlx.io.checkpoint import check_tensors, declared_floats, load_weights, resident_bytes, shard_headers
from dsv41_mlx.io.load import build_model, build_stage, load
from dsv41_mlx.io.tiny import build_checkpoint, default_checkpoint, tiny_config
from dsv41_mlx.runtime.pipeline import (FORWARD, TRIM, PipelineError, balance, check_split, cut_points, parse_split,
                                        read_before)
from dsv41_mlx.runtime.runner import Runner
from dsv41_mlx.sampling import SamplingParams
from dsv41_mlx.speculative import SpeculativeDecoder
from scripts.benchmarks.harness import mlx_launch

ROOT = Path(__file__).resolve().parent.parent
GENERATE = [sys.executable, "-m", "dsv41_mlx.generate"]


def tiny_args(**changes) -> ModelArgs:
    return dataclasses.replace(ModelArgs.from_dict(tiny_config()), **changes)


def release_args() -> ModelArgs:
    """The release's layer structure (DESIGN.md): 40 layers, its sources and engram layers."""
    return tiny_args(num_hidden_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
                     kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                     candidate_source_layer_id=20, engram_layer_ids=[1, 14], dspark_target_layer_ids=[37, 38, 39])


# ------------------------------------------------------------------ the split

def test_a_split_is_one_range_of_layers_per_rank():
    assert parse_split("0:4,4:8") == [range(0, 4), range(4, 8)]
    assert parse_split(" 0:2 , 2:8") == [range(0, 2), range(2, 8)]
    for bad in ("0-4,4-8", "0:4,x:8", "0:4:8", ""):
        with pytest.raises(PipelineError, match="expected ranges of layers like 0:20,20:40"):
            parse_split(bad)


@pytest.mark.parametrize("text, ranks, message", [
    ("0:4,4:8", 3, "the split 0:4,4:8 has 2 ranges for 3 ranks"),
    ("1:4,4:8", 2, "layers 0..0 are in no range"),
    ("0:4,5:8", 2, "layers 4..4 are in no range"),
    ("0:5,4:8", 2, "layers 4..4 are in two ranges"),
    ("0:4,4:7", 2, "layers 7..7 are in no range of the split (the model has 8 layers)"),
    ("0:4,4:9", 2, "the split reaches layer 8, but the model has 8 layers"),
    ("0:4,4:4,4:8", 3, "the range 4:4 holds no layer"),
    ("0:3,3:8", 2, "rank 1 starts at layer 3, but layer 3 reads the compressed KV cache of layer 2, which rank 0 "
                   "holds; a rank may start only at layers 1, 2, 4, 5"),
    ("0:2,2:6,6:8", 3, "rank 2 starts at layer 6, but layer 6 reads the compressed KV cache of layer 5, which rank 1"),
])
def test_a_bad_split_is_refused_naming_the_problem(text, ranks, message):
    with pytest.raises(PipelineError) as e:
        check_split(tiny_args(), parse_split(text), ranks)
    assert message in str(e.value)


def test_a_good_split_passes():
    for text, ranks in (("0:8", 1), ("0:4,4:8", 2), ("0:1,1:2,2:4,4:5,5:8", 5)):
        check_split(tiny_args(), parse_split(text), ranks)


def test_a_rank_starts_only_where_nothing_it_reads_lies_on_a_rank_before():
    assert cut_points(tiny_args()) == [1, 2, 4, 5]
    # the release: every layer past 20 reads layer 20's compressed KV
    assert cut_points(release_args()) == [1, 2, 8, 14, 20]
    # a compressed layer that is no index source reuses the last source's top-k
    assert read_before(tiny_args(index_source_layer_ids=[2, 4, 7], candidate_source_layer_id=4), 5) == (
        5, 4, "the indexer's top-k")
    # an index source past the candidate source reads its block mask
    assert read_before(tiny_args(candidate_source_layer_id=4), 5) == (5, 4, "the candidate blocks")


def test_the_balanced_split_has_the_least_largest_rank():
    assert balance([1] * 8, 0, 2, list(range(1, 8))) == [range(0, 4), range(4, 8)]
    assert balance([1] * 8, 2, 2, list(range(1, 8))) == [range(0, 3), range(3, 8)]  # rank 0's embedding and head
    assert balance([1] * 8, 0, 2, [1, 2, 5]) == [range(0, 5), range(5, 8)]  # of equal ones, the earliest cut
    assert balance([1] * 40, 0, 2, cut_points(release_args())) == [range(0, 20), range(20, 40)]
    rng = random.Random(0)
    for _ in range(200):
        n, ranks = rng.randint(2, 9), rng.randint(1, 4)
        sizes, extra = [rng.randint(1, 9) for _ in range(n)], rng.randint(0, 9)
        starts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        if len(starts) < ranks - 1:
            with pytest.raises(PipelineError, match="split at most"):
                balance(sizes, extra, ranks, starts)
            continue

        def largest(cuts):
            bounds = [0, *cuts, n]
            return max(sum(sizes[a:b]) + (extra if a == 0 else 0) for a, b in zip(bounds, bounds[1:]))

        best = min(largest(c) for c in combinations(starts, ranks - 1))
        split = balance(sizes, extra, ranks, starts)
        assert [r.start for r in split[1:]] == sorted(r.start for r in split[1:])
        assert split[0].start == 0 and split[-1].stop == n and all(r.start in starts for r in split[1:])
        assert largest([r.start for r in split[1:]]) == best


# ------------------------------------------------------------ a rank's part

@pytest.fixture(scope="module")
def tiny():
    """The embedded default: (its directory, model, tokenizer)."""
    model, tokenizer = load()
    return default_checkpoint(), model, tokenizer


def test_a_rank_reads_and_holds_only_its_part(tiny):
    model_dir, full, _ = tiny
    args = full.args
    headers = shard_headers(model_dir)
    where = check_tensors(args, headers)
    declared = declared_floats(build_model(args))
    ranges = [range(0, 2), range(2, 8)]
    parts, resident = [], 0
    for rank in (0, 1):
        part = build_stage(args, ranges, rank)
        mine = {n: p for n, p in where.items() if part.holds(n)}
        load_weights(part, model_dir, mine)
        parts.append(part)
        resident += resident_bytes(headers, mine, declared)
        names = [n for n, _ in tree_flatten(part.parameters())]
        layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
        if rank == 0:  # its layers, the next rank's first mix projection, embedding, head, DSpark stages
            assert layers == {0, 1, 2} and all(n.startswith("layers.2.hc_attn.") for n in names
                                               if n.startswith("layers.2."))
            assert {n.split(".")[0] for n in names} == {"embed", "layers", "norm", "head", "mtp"}
        else:
            assert layers == set(range(2, 8)) and {n.split(".")[0] for n in names} == {"layers"}
            assert part.embed is None and part.head is None and part.mtp == []
        assert all(part.layers[i].parameters() == {} for i in range(8) if i not in ranges[rank] and i != 2)
        assert list(part.engram_layers) == [i for i in args.engram_layer_ids if i in ranges[rank]]
        for i in ranges[rank]:
            pairs = zip(tree_flatten(part.layers[i].parameters()), tree_flatten(full.layers[i].parameters()))
            assert all(mx.array_equal(a, b) for (_, a), (_, b) in pairs), i
    hc_attn = sum(a.nbytes for _, a in tree_flatten(parts[0].layers[2].hc_attn.parameters()))
    assert resident == resident_bytes(headers, where, declared) + hc_attn  # every tensor once, the boundary's twice
    # no boundary before an engram layer: the engram adds to the stream before the block's mixes
    assert build_stage(args, [range(0, 4), range(4, 8)], 0).boundary is None


# ------------------------------------------------------------ across ranks

PROMPT = [(7 * i + 3) % 8000 for i in range(80)]
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0, seed=5)
N = 8


def _digest(a: mx.array) -> str:
    return hashlib.sha256(np.array(a.astype(mx.float32)).tobytes()).hexdigest()


def replies(runner) -> dict:
    """What a pipeline must reproduce bit for bit: a chunked prefill's logits and features
    (chunks that skip the layers past the last KV source, and drop rows), and N tokens
    greedy, sampled, drafted by an oracle (drafts accepted, the rest trimmed on every rank) and
    by the checkpoint's drafter (coupled, every draft verified)."""
    from scripts.benchmarks.harness import OracleDrafter

    logits, features = prefill(runner, PROMPT, runner.make_cache(), chunk=32, keep_features=16)
    out = {"prefill": [_digest(logits), _digest(features)]}
    out["greedy"] = list(generate_step(runner, PROMPT, GREEDY, N))
    out["sampled"] = list(generate_step(runner, PROMPT, SAMPLED, N))
    oracle = SpeculativeDecoder(runner, OracleDrafter(runner.drafter, PROMPT + out["greedy"], wrong_every=3), GREEDY)
    out["oracle"] = list(generate_step(runner, PROMPT, GREEDY, N, decoder=oracle))
    out["oracle accepted"] = oracle.stats.accepted
    drafted = make_decoder(runner, SAMPLED, True, confidence="off")
    out["drafted"] = list(generate_step(runner, PROMPT, SAMPLED, N, decoder=drafted))
    return out


# argv: the checkpoint (or one per rank, comma-separated), the function of this module whose
# result on rank 0's PipelineRunner it prints, and the split (else balanced)
LAUNCHED = """
import json, sys
import mlx.core as mx
import tests.test_pipeline as tests
from dsv41_mlx.io.load import load_stage
from dsv41_mlx.runtime.pipeline import Link, PipelineRunner, serve
group = mx.distributed.init(strict=True)
dirs = sys.argv[1].split(",")
model, _ = load_stage(dirs[min(group.rank(), len(dirs) - 1)], group, sys.argv[3] if len(sys.argv) > 3 else None)
if group.rank() > 0:
    serve(model, Link(group))
else:
    with PipelineRunner(model, Link(group)) as runner:
        print(json.dumps(getattr(tests, sys.argv[2])(runner)))
"""


def launch(ranks: int, *command: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`mlx.launch -n ranks --backend ring -- command` on this machine, from the repository root."""
    return subprocess.run(mlx_launch(ranks, list(command)), capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def tapped_across(tmp_path_factory):
    """A tiny checkpoint whose DSpark features come from layers 1, 4 and 7, so that split 0:4,4:8
    taps them on both ranks, and one process's replies on it."""
    config = tiny_config()
    config["text_config"]["dspark_target_layer_ids"] = [1, 4, 7]
    model_dir = build_checkpoint(tmp_path_factory.mktemp("tapped"), config=config)
    model, _ = load(model_dir)
    with Runner(model) as runner:
        return model_dir, replies(runner)


def test_two_ranks_reply_exactly_as_one_process(tapped_across):
    model_dir, expected = tapped_across
    run = launch(2, sys.executable, "-c", LAUNCHED, str(model_dir), "replies", "0:4,4:8")
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == expected
    assert expected["oracle accepted"] > 0


def test_the_command_line_runs_across_ranks_and_only_rank_0_prints(tiny):
    argv = ["--prompt", "Hello there", "--max-tokens", "6", "--no-draft"]
    one = subprocess.run(GENERATE + argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert one.returncode == 0, one.stderr
    three = launch(3, *GENERATE, *argv, "--pipeline-split", "0:2,2:5,5:8")
    assert three.returncode == 0, three.stderr[-3000:]
    assert three.stdout == one.stdout  # the reply, printed once
    err = three.stderr.splitlines()
    assert [line[:7] for line in err if line.startswith(("prompt:", "drafts:"))] == ["prompt:"]
    held = [line.split(",")[0] for line in err if line.startswith("pipeline rank")]
    assert held == ["pipeline rank 0: layers 0..1 + embedding", "pipeline rank 1: layers 2..4",
                    "pipeline rank 2: layers 5..7"]


def test_a_split_that_does_not_fit_is_an_error_on_every_rank(tiny):
    run = launch(2, *GENERATE, "--max-tokens", "2", "--pipeline-split", "0:4,5:8", timeout=60)
    # (mlx.launch exits 0 whatever its ranks do, and stops the others when one fails)
    assert "error: layers 4..4 are in no range of the split" in run.stderr and "exited with code 2" in run.stderr
    assert run.stdout == ""


def test_ranks_with_different_checkpoints_refuse_to_start(tiny, tapped_across):
    run = launch(2, sys.executable, "-c", LAUNCHED, f"{tiny[0]},{tapped_across[0]}", "replies", timeout=60)
    assert "rank 1 of the pipeline does not have the same checkpoint (config.json and safetensors index) as rank 0" \
        in run.stderr


@pytest.mark.parametrize("split, message", [
    ("0-4,4-8", "argument --pipeline-split: expected ranges of layers like 0:20,20:40, got '0-4,4-8'"),
    ("0:4,4:8", "argument --pipeline-split: splits the model across the processes mlx.launch starts"),
])
def test_a_split_is_checked_before_any_model_loads(monkeypatch, capsys, split, message):
    import importlib

    from dsv41_mlx.io import load as loader

    cli = importlib.import_module("dsv41_mlx.generate")
    for name in ("load", "load_stage"):
        monkeypatch.setattr(loader, name, lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--pipeline-split", split])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------ prefill across ranks

def prefills(runner) -> dict:
    """What a pipeline's chunked prefill must reproduce bit for bit: the prompt's logits and
    features in chunks of 32, 16 (the first ones reaching no head where elided) and 13 (the
    last padded), elided and whole, each followed by a few greedy tokens (which read every
    rank's caches); and chunks given to prefill_chunks with padding before the last (whole: an
    elided chunk's padding is trimmable only at the prompt's end), then a decode."""
    out, options = {}, runner.options
    for elide in (True, False):
        runner.options = dataclasses.replace(options, elide_prefill=elide)
        for chunk in (32, 16, 13):
            name = f"chunks of {chunk}" + ("" if elide else ", whole")
            logits, features = prefill(runner, PROMPT, runner.make_cache(), chunk=chunk, keep_features=16)
            out[name] = [_digest(logits), _digest(features),
                         list(generate_step(runner, PROMPT, GREEDY, 3, prefill_chunk=chunk))]
    runner.options = dataclasses.replace(options, elide_prefill=False)
    cache = runner.make_cache()
    chunks = [(PROMPT[:5], 16, 75), (PROMPT[5:37], 32, 43), (PROMPT[37:], 48, 0)]
    out["padded first"] = [[_digest(a) for a in outputs] for outputs in runner.prefill_chunks(chunks, cache)]
    out["padded first"].append(_digest(runner.decode([PROMPT[-1]], cache)[0]))
    runner.options = options
    return out


def prefill_order(runner) -> dict:
    """Rank 0's work and messages in the order they happen during a prefill in chunks of 32, and
    in chunks given to prefill_chunks with padding in the first (whole, as in prefills):
    ["blocks", p] its blocks of the chunk at position p, ["send", p] and ["back", p] that
    chunk's FORWARD sent and back, ["trim", n] a TRIM of n positions sent."""
    events, link, blocks = [], runner.link, runner.model.blocks

    class Recording:
        def send(self, message):
            if message.op in (FORWARD, TRIM):
                events.append(["send" if message.op == FORWARD else "trim", message.fields[1]])
            link.send(message)

        def recv(self):
            message = link.recv()
            events.append(["back", message.fields[1]])
            return message

    def recorded_blocks(forward, cache, keep, engram_rows):
        events.append(["blocks", forward.positions[0].item()])
        return blocks(forward, cache, keep, engram_rows)

    out = {}
    runner.link, runner.model.blocks = Recording(), recorded_blocks
    prefill(runner, PROMPT, runner.make_cache(), chunk=32)
    out["chunks of 32"], events[:] = list(events), []
    options, runner.options = runner.options, dataclasses.replace(runner.options, elide_prefill=False)
    list(runner.prefill_chunks([(PROMPT[:5], 16, 32), (PROMPT[5:37], 32, 0)], runner.make_cache()))
    out["padded first"] = events
    runner.link, runner.model.blocks, runner.options = link, blocks, options
    return out


def on_rank_0(model_dir: Path, split: str, what: str):
    """What the function `what` of this module returns, run on rank 0 of a pipeline split so."""
    run = launch(split.count(",") + 1, sys.executable, "-c", LAUNCHED, str(model_dir), what, split)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def prefilled_in_one_process(tapped_across):
    model, _ = load(tapped_across[0])
    with Runner(model) as runner:
        return prefills(runner)


@pytest.mark.parametrize("split", ["0:4,4:8", "0:2,2:5,5:8"])
def test_a_prompt_prefilled_in_chunks_across_ranks_equals_one_process(tapped_across, prefilled_in_one_process,
                                                                      split):
    assert on_rank_0(tapped_across[0], split, "prefills") == prefilled_in_one_process


def test_rank_0_runs_the_next_chunk_while_the_others_run_the_one_before(tapped_across):
    order = on_rank_0(tapped_across[0], "0:4,4:8", "prefill_order")
    # each chunk's blocks on rank 0 before the chunk before is back, and sent only after it is
    assert order["chunks of 32"] == [["blocks", 0], ["send", 0], ["blocks", 32], ["back", 0], ["send", 32],
                                     ["blocks", 64], ["back", 32], ["send", 64], ["back", 64]]
    # a chunk with padding is back, and its padding trimmed, before the next one begins
    assert order["padded first"] == [["blocks", 0], ["send", 0], ["back", 0], ["trim", 11], ["blocks", 5],
                                     ["send", 5], ["back", 5]]


# ------------------------------------------------------ a prefix cache across ranks

def cached_turns(runner) -> dict:
    """A prefix cache on a pipeline: a first turn stored, a second turn (the first, its reply and
    more) resumed from it, greedy and drafted, its logits after resuming, and an entry evicted
    (its copies dropped on every rank) and the turn run again cold: what one process gives."""
    from dsv41_mlx.generate import prefill_cached
    from dsv41_mlx.runtime.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 30)
    out = {"first": list(generate_step(runner, PROMPT, GREEDY, N, prompt_cache=cache))}
    second = PROMPT + out["first"] + [11, 12, 13]
    out["second"] = list(generate_step(runner, second, GREEDY, N, prompt_cache=cache))
    drafted = make_decoder(runner, SAMPLED, True, confidence="off")
    out["second, drafted"] = list(generate_step(runner, second, SAMPLED, N, decoder=drafted, prompt_cache=cache))
    _, logits, _ = prefill_cached(runner, second + [14], cache)
    out["resumed logits"] = _digest(logits)
    out["hits"] = cache.hits
    small = PrefixCache(cache.nbytes // len(cache) + 1)  # room for about one entry: the older ones evicted
    for prompt in (PROMPT, second, PROMPT):
        out.setdefault("evicting", []).append(list(generate_step(runner, prompt, GREEDY, 3, prompt_cache=small)))
    return out


def test_a_prefix_cache_across_ranks_resumes_as_one_process(tapped_across):
    model, _ = load(tapped_across[0])
    with Runner(model) as runner:
        expected = cached_turns(runner)
    assert expected["hits"] >= 3
    assert on_rank_0(tapped_across[0], "0:4,4:8", "cached_turns") == expected
