"""The embedded default end to end: build, load, generate, CLI."""

import os
import subprocess
import sys

import mlx.core as mx
import pytest

import dsv41_mlx
from dsv41_mlx.generate import stream_generate
from dsv41_mlx.io.tiny import build_checkpoint
from dsv41_mlx.runtime.options import Options
from dsv41_mlx.runtime.runner import Runner

from .processes import run_all


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def default_model(cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("DSV41_MLX_CACHE", str(cache_dir))
    return dsv41_mlx.load()


@pytest.fixture(scope="module")
def cli_env(cache_dir, default_model):
    """Environment for CLI runs that share the module's built embedded default."""
    return {**os.environ, "DSV41_MLX_CACHE": str(cache_dir)}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a, b = build_checkpoint(tmp_path / "a"), build_checkpoint(tmp_path / "b")
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_default_generates_and_round_trips_text(default_model):
    model, tokenizer = default_model
    assert model.args.vocab_size == tokenizer.vocab_size == 129280
    assert model.args.has_dspark
    responses = list(stream_generate(model, tokenizer, "Hello, world", max_tokens=8))
    assert len(responses) == 8 and responses[-1].finish_reason == "length"
    tokens = [r.token for r in responses]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens)
    assert responses[-1].prompt_tokens == len(tokenizer.encode("Hello, world"))


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(default_model):
    model, tokenizer = default_model
    greedy = [dsv41_mlx.generate(model, tokenizer, "abc", max_tokens=6) for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = [dsv41_mlx.generate(model, tokenizer, "abc", max_tokens=6, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_bad_sampling_arguments_are_rejected(default_model, kwargs, message):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match=message):
        list(stream_generate(model, tokenizer, "x", **kwargs))


def test_token_ids_outside_the_vocabulary_are_rejected(default_model):
    """An id past the embedding table would be gathered silently as garbage: the prompt is refused."""
    model, tokenizer = default_model
    vocab = model.args.vocab_size
    for bad in (vocab, vocab + 7, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary of {vocab}"):
            list(stream_generate(model, tokenizer, [5, bad, 6], max_tokens=2))


def test_the_context_length_bounds_prompt_and_reply(default_model, monkeypatch):
    """A prompt that fills the model's context is refused, naming both lengths; a reply stops
    where the context ends, with finish reason "length" (as the server does)."""
    model, tokenizer = default_model
    monkeypatch.setattr(model.args, "max_position_embeddings", 12)
    with pytest.raises(ValueError, match="the prompt is 12 tokens; this model's context is 12 tokens"):
        list(stream_generate(model, tokenizer, list(range(5, 17)), max_tokens=2))
    replies = list(stream_generate(model, tokenizer, list(range(5, 15)), max_tokens=8))
    assert len(replies) <= 2 and replies[-1].finish_reason in ("length", "stop")  # 2 positions were left


def test_warm_up_runs_every_chunk_shape_then_plain_and_drafted_tokens(default_model, monkeypatch):
    """generate.warm_up (server --warm-up, bench.py e2e) forwards a chunk of every padded row
    count a prompt can end in, on an empty cache and on one holding a chunk, then generates a
    few tokens greedy and sampled, plain and drafted (measuring the verify costs), ingests
    every size a round can commit into a scratch draft cache, runs a decode or verify forward
    of every size past the context where the indexers start scoring, and clears MLX's buffer
    cache; and leaves the drafting schedule nothing of what its made-up prompts showed."""
    from dsv41_mlx.models.attention import indexer_scoring_length

    import importlib

    generate = importlib.import_module("dsv41_mlx.generate")  # the module (the package exports a function so named)
    model, _ = default_model
    runner = Runner(model)
    seen, runs = set(), []
    padded, step = runner.padded, generate.generate_step

    def record(ids, cache, rows, last_logits_only=False, rows_after=None):
        seen.add((rows, cache.offset > 0))
        return padded(ids, cache, rows, last_logits_only, rows_after)

    def generation(model_, prompt, params, max_tokens, chunk, decoder):
        runs.append((params.greedy, decoder is not None))
        return step(model_, prompt, params, max_tokens, chunk, decoder)

    ingested, ingest = [], runner.drafter.ingest

    def record_ingest(cache, features):
        ingested.append(features.shape[0])
        return ingest(cache, features)

    decoded, decode = [], runner.decode

    def record_decode(ids, cache):
        decoded.append((len(ids), cache.offset >= indexer_scoring_length(model.args)))
        return decode(ids, cache)

    monkeypatch.setattr(runner, "padded", record)
    monkeypatch.setattr(runner, "decode", record_decode)
    monkeypatch.setattr(generate, "generate_step", generation)
    monkeypatch.setattr(runner.drafter, "ingest", record_ingest)
    runner.drafter.verify_costs = None
    runner.drafter.outlook = None
    assert generate.warm_up(runner, chunk=40) > 0
    assert generate.PREFILL_ROUND == 16
    assert {(r, o) for r in (16, 32, 40) for o in (False, True)} <= seen  # 16, 32: the rounds; 40: the chunk
    assert not any(r % 16 and r != 40 for r, o in seen if r > 8)  # nothing else but decode / verify rows
    assert sorted(runs) == [(False, False), (False, True), (True, False), (True, True)]
    assert runner.drafter.verify_costs is not None
    assert set(range(1, runner.drafter.block + 2)) <= set(ingested)
    assert {(n, True) for n in range(1, runner.drafter.block + 2)} <= set(decoded)  # where the indexers score
    assert mx.get_cache_memory() == 0  # the buffer cache started afresh
    # its made-up prompts leave the schedule no verdict on the drafter, nor a plain pace
    assert runner.drafter.outlook is None and not runner.plain_pace


def test_cli_prints_text_and_one_stats_line(cli_env):
    env = cli_env
    out = subprocess.run([sys.executable, "-m", "dsv41_mlx.generate", "--prompt", "Hello", "--max-tokens", "5"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = [line for line in out.stderr.splitlines() if line.startswith("prompt:")]
    assert len(stats) == 1 and "generation: 5 tokens" in stats[0] and "peak memory" in stats[0]
    assert out.stdout.strip()


@pytest.mark.parametrize("preset, want", [(None, "0"), ("1", "1")])
def test_import_asks_mlx_for_full_float32_products_unless_told_otherwise(preset, want):
    """MLX runs float32 matmuls at TF32 precision on CUDA and newer Apple GPUs unless
    MLX_ENABLE_TF32=0; importing the package sets that (the reference's fp32 head, routers
    and mixes), and keeps a value the user set."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if preset is not None:
        env["MLX_ENABLE_TF32"] = preset
    out = subprocess.run([sys.executable, "-c", "import os, dsv41_mlx; print(os.environ['MLX_ENABLE_TF32'])"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_cli_reports_a_bad_model_path_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dsv41_mlx.generate", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "nope" in out.stderr


def test_cli_drafts_by_default_and_prints_drafting_stats(cli_env):
    env = cli_env
    base = [sys.executable, "-m", "dsv41_mlx.generate", "--prompt", "Hello", "--max-tokens", "6"]
    drafted, plain = run_all([base + ["--temp", "0.9", "--seed", "4", "--confidence", "threshold:0.1"],
                              base + ["--temp", "0.9", "--seed", "4", "--no-draft"]], env=env, timeout=300)
    assert drafted.returncode == plain.returncode == 0, drafted.stderr + plain.stderr
    assert drafted.stdout == plain.stdout
    assert any(line.startswith("drafts:") and "accepted" in line for line in drafted.stderr.splitlines())
    assert not any(line.startswith("drafts:") for line in plain.stderr.splitlines())


@pytest.mark.parametrize("flags, message", [
    (["--confidence", "sometimes"], "unknown confidence policy 'sometimes'"),
    (["--verify", "rejection"], "needs a temperature > 0"),
    (["--no-draft", "--verify", "greedy"], "drafting, which is off"),
])
def test_cli_rejects_bad_drafting_flags_with_a_clear_error(cli_env, flags, message):
    out = subprocess.run([sys.executable, "-m", "dsv41_mlx.generate", "--max-tokens", "2"] + flags,
                         capture_output=True, text=True, env=cli_env, timeout=300)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_cli_shows_progress_bars_and_quiet_keeps_only_the_text_and_stats(cli_env):
    base = [sys.executable, "-m", "dsv41_mlx.generate", "--prompt", "Hello", "--max-tokens", "3"]
    loud, quiet = run_all([base, base + ["--quiet"]], env=cli_env, timeout=300)
    assert loud.returncode == quiet.returncode == 0
    assert "loading weights" in loud.stderr and "drafter FP8 head" in loud.stderr
    lines = quiet.stderr.splitlines()
    assert lines[0].startswith("prompt:") and all(line.startswith(("prompt:", "drafts:")) for line in lines)
    assert quiet.stdout.strip() == loud.stdout.strip()


def test_prefill_pads_its_last_chunk_without_changing_a_bit(fixture_model):
    """A prompt whose last chunk is short runs it padded to a multiple of 16 rows: prompts
    of 59 and 61 tokens (chunks of 32, then 27 or 29 padded to 32) share their shapes, and
    the logits and cache equal one unpadded forward's."""
    import sys

    from dsv41_mlx.generate import prefill

    prompt = [(37 * i) % 900 + 50 for i in range(61)]
    runner = Runner(fixture_model)
    prefill(runner, prompt[:59], fixture_model.make_cache(), chunk=32)  # traces the 32-row shape
    traces = []
    sys.setprofile(lambda frame, event, arg: traces.append(frame.f_code.co_name)
                   if event == "call" and frame.f_code.co_name in ("sparse_attention", "attn_input") else None)
    padded = fixture_model.make_cache()
    try:
        got, _ = prefill(runner, prompt, padded, chunk=32)
    finally:
        sys.setprofile(None)
    assert traces == []

    plain = fixture_model.make_cache()
    want, _ = fixture_model(mx.array([prompt], dtype=mx.int32), plain)
    assert mx.array_equal(want[0, -1], got).item()
    assert padded.offset == len(prompt) and padded.tokens == plain.tokens
    for a, b in zip(plain.snapshot(), padded.snapshot()):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("built", [False, True])
def test_sampled_replies_are_the_same_with_the_blocks_on_the_evaluators_thread(default_model, built):
    """A sampled reply with each forward's blocks started on the evaluator's thread (each next
    forward begun before the token is read back; built: built whole before it, Options.build_ahead,
    each finished forward left unsettled until the next begins) draws the same tokens as one
    without."""
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.sampling import SamplingParams

    model, tokenizer = default_model
    prompt = tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    want = list(generate_step(Runner(model), prompt, params, 8))
    with Runner(model, Options(overlap_build=True, evaluate_on_thread=True, build_ahead=built)) as runner:
        got = list(generate_step(runner, prompt, params, 8))
    assert got == want and len(set(got)) > 1


@pytest.mark.parametrize("built", [False, True])
def test_a_reply_stopped_early_abandons_its_begun_forward(default_model, built):
    """Plain decoding begins each next forward before it hands the caller the token
    (Runner.decode_ahead; built: the whole forward built then, Options.build_ahead): a caller that
    stops after three tokens leaves nothing running, and the model then replies as before, with
    the blocks on the evaluator's thread or not."""
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.sampling import SamplingParams

    model, tokenizer = default_model
    prompt = tokenizer.encode("The quick brown fox")
    whole = list(generate_step(Runner(model), prompt, SamplingParams(), 6))
    with Runner(model, Options(overlap_build=True, evaluate_on_thread=True, build_ahead=built)) as runner:
        steps = generate_step(runner, prompt, SamplingParams(), 6)
        first = [next(steps) for _ in range(3)]
        steps.close()
        again = list(generate_step(runner, prompt, SamplingParams(), 6))
    assert first == whole[:3] and again == whole


@pytest.mark.parametrize("built", [False, True])
def test_plain_decoding_starts_a_tokens_forward_before_handing_the_token_out(default_model, monkeypatch, built):
    """Each token's forward is started (DecodeAhead.finish) before the caller gets the token, so
    what the caller does with it overlaps the device's work; the last token starts none."""
    from dsv41_mlx.generate import generate_step
    from dsv41_mlx.runtime import runner as model_module
    from dsv41_mlx.sampling import SamplingParams

    finished, real = [], model_module.DecodeAhead.finish

    def finish(self, token, settle=True):
        finished.append(token)
        return real(self, token, settle)

    monkeypatch.setattr(model_module.DecodeAhead, "finish", finish)
    model, tokenizer = default_model
    with Runner(model, Options(overlap_build=True, evaluate_on_thread=True, build_ahead=built)) as runner:
        seen = [(t, list(finished)) for t in generate_step(runner, tokenizer.encode("The quick brown fox"),
                                                            SamplingParams(), 6)]
    tokens = [t for t, _ in seen]
    assert [started for _, started in seen] == [tokens[:k + 1] for k in range(5)] + [tokens[:5]]


def test_a_stop_token_is_the_last_and_nothing_is_computed_after_it(default_model, monkeypatch):
    """generate_step(stop=...) yields the first stop token and ends there, plain (no forward
    started for it) and drafted alike."""
    from dsv41_mlx.generate import generate_step, make_decoder
    from dsv41_mlx.runtime import runner as model_module
    from dsv41_mlx.sampling import SamplingParams

    model, tokenizer = default_model
    model = Runner(model)
    prompt, params = tokenizer.encode("The quick brown fox"), SamplingParams()
    whole = list(generate_step(model, prompt, params, 10))
    k = next(i for i in range(2, len(whole)) if whole[i] not in whole[:i])  # the stop token's first place
    finished, real = [], model_module.DecodeAhead.finish

    def finish(self, token, settle=True):
        finished.append(token)
        return real(self, token, settle)

    monkeypatch.setattr(model_module.DecodeAhead, "finish", finish)
    assert list(generate_step(model, prompt, params, 10, stop={whole[k]})) == whole[:k + 1]
    assert finished == whole[:k]
    decoder = make_decoder(model, params, draft=True)
    assert decoder is not None
    assert list(generate_step(model, prompt, params, 10, decoder=decoder, stop={whole[k]})) == whole[:k + 1]
