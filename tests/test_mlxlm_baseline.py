"""scripts/mlxlm_baseline.py: mlx-lm's own port loads our checkpoints, engram removed, and is the same model;
`bench.py context` runs it a process per context."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dsv41_mlx
from dsv41_mlx.io.tiny import build_checkpoint, tiny_config
from scripts.benchmarks import context
from scripts.benchmarks.harness import prompt_of, reply_hash

from .scripts import load_script


baseline = load_script("mlxlm_baseline")
VOCAB = tiny_config()["text_config"]["vocab_size"]


def _without_engram() -> dict:
    config = tiny_config()
    config["text_config"].update(engram_layer_ids=[], engram_num_embeddings=[])
    return config


@pytest.fixture(scope="module")
def engram_checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("engram"))


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("plain"), config=_without_engram())


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 129000, size=n).tolist()


def test_mlxlm_loads_a_checkpoint_with_engram_strictly_and_keeps_it_quantized(engram_checkpoint):
    model = baseline.load_mlxlm(engram_checkpoint)  # strict: a missing or left-over tensor raises
    assert len(model.layers) == tiny_config()["text_config"]["num_hidden_layers"]
    modes = {(type(m).__name__, m.mode) for _, m in model.named_modules() if hasattr(m, "mode")}
    # FP8 dense (o_a_proj's groups too) as mxfp8, FP4 routed experts as mxfp4, bits as stored
    assert modes == {("QuantizedLinear", "mxfp8"), ("QuantizedSwitchLinear", "mxfp8"),
                     ("QuantizedSwitchLinear", "mxfp4")}
    assert not any(".engram." in name for name, _ in tree_flatten(model.parameters()))


def test_bench_returns_rates_and_greedy_replies_per_prompt(engram_checkpoint):
    run = baseline.bench_mlxlm(engram_checkpoint, [_prompt(12), _prompt(5, seed=1)], 3)
    assert run.prefill_tok_s > 0 and run.decode_tok_s > 0 and run.peak_memory_gb >= 0
    assert [len(r) for r in run.replies] == [3, 3]


def test_mlxlm_logits_match_ours_on_a_checkpoint_without_engram(plain_checkpoint):
    """Same weights, different rounding (no FP8 activation quantisation in mlx-lm): the
    logits point the same way (an unrelated model gives a cosine near 0)."""
    ids = mx.array([_prompt(16)], dtype=mx.int32)
    theirs = np.array(baseline.load_mlxlm(plain_checkpoint)(ids).astype(mx.float32))[0]
    model, _ = dsv41_mlx.load(plain_checkpoint)
    ours = np.array(model(ids, cache=model.make_cache())[0])[0]
    cosine = (theirs * ours).sum(-1) / np.linalg.norm(theirs, axis=-1) / np.linalg.norm(ours, axis=-1)
    assert np.median(cosine) > 0.8


def test_a_missing_mlxlm_is_one_line_to_print(monkeypatch):
    def not_installed(name):
        raise baseline.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(baseline.metadata, "version", not_installed)
    with pytest.raises(baseline.MlxLmUnavailable, match="^mlx-lm: not installed"):
        baseline.require_mlxlm()


def _failing_at(n: int, code: str):
    """context.mlxlm_command, but `python -c code` for the context of n tokens."""
    command = context.mlxlm_command

    def failing(model_path, prompt_file, tokens, json_file):
        if len(json.loads(prompt_file.read_text())) == n:
            return [sys.executable, "-c", code]
        return command(model_path, prompt_file, tokens, json_file)

    return failing


def test_each_context_runs_in_a_process_of_its_own_and_replies_as_in_this_one(engram_checkpoint):
    res = context.bench_mlxlm_contexts(str(engram_checkpoint), [12], 3, VOCAB)
    here = baseline.bench_mlxlm(engram_checkpoint, prompt_of(12, VOCAB), 3)
    assert res[12]["prefill_tok_s"] > 0 and res[12]["decode_tok_s"] > 0 and res[12]["peak_GB"] > 0
    assert res[12]["hash"] == reply_hash(here.replies)  # the same prompt, the same 3 greedy tokens


@pytest.mark.parametrize("code, stopped", [
    ("import sys; sys.exit('RuntimeError: an illegal memory access was encountered')",
     "exit status 1: RuntimeError: an illegal memory access was encountered"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9 (Killed): no output"),
    ("print('loaded')", "exit status 0, no result written: loaded"),
])
def test_a_context_whose_process_fails_is_stopped_and_the_next_one_runs(engram_checkpoint, monkeypatch, code,
                                                                        stopped):
    monkeypatch.setattr(context, "mlxlm_command", _failing_at(12, code))
    res = context.bench_mlxlm_contexts(str(engram_checkpoint), [12, 30], 3, VOCAB)
    assert res[12] == {"stopped": stopped}
    assert res[30]["decode_tok_s"] > 0


def test_a_context_whose_process_hangs_is_stopped_at_the_timeout(engram_checkpoint, monkeypatch):
    monkeypatch.setattr(context, "mlxlm_command", _failing_at(12, "import time; time.sleep(60)"))
    res = context.bench_mlxlm_contexts(str(engram_checkpoint), [12], 3, VOCAB, timeout=0.5)
    assert res == {12: {"stopped": "no result after 0.5 s (killed)"}}


def test_mlxlm_of_another_version_in_the_process_leaves_the_column_unavailable(engram_checkpoint, monkeypatch):
    """The child is the real script, run with importlib.metadata saying mlx-lm 0.31.0; the
    later context is not tried."""
    command = context.mlxlm_command
    old_mlxlm = ("import runpy, sys; from importlib import metadata; metadata.version = lambda name: '0.31.0'; "
                 "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    tried = []

    def with_old_mlxlm(*args):
        tried.append(args)
        return [sys.executable, "-c", old_mlxlm, *command(*args)[1:]]

    monkeypatch.setattr(context, "mlxlm_command", with_old_mlxlm)
    res = context.bench_mlxlm_contexts(str(engram_checkpoint), [12, 30], 3, VOCAB)
    assert res == {"unavailable": "mlx-lm: version 0.31.0 is installed; the baseline needs 0.32.x"}
    assert len(tried) == 1
