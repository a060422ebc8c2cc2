"""scripts/mlxlm_baseline.py: mlx-lm's own port loads our checkpoints, engram removed, and is the same model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dsv41_mlx
from dsv41_mlx.io.tiny import build_checkpoint, tiny_config

from .scripts import load_script


baseline = load_script("mlxlm_baseline")


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
