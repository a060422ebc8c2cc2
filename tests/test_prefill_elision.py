"""Prefill past the last KV source: each layer after it computes only the rows that a later
read needs (runtime.runner.prefill_rows), and everything that matters is bit-identical to the
full computation: the last logits, the caches decode reads, the drafter's features, replies."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx.generate import generate_step, make_decoder, prefill
from dsv41_mlx.models.deepseek_v41 import Model
from dsv41_mlx.runtime.options import Options
from dsv41_mlx.runtime.runner import Runner, prefill_rows
from dsv41_mlx.sampling import SamplingParams


def _prompt(n: int) -> list[int]:
    return [(37 * i + 11) % 8000 + 50 for i in range(n)]


def _host(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def _prefilled(model, prompt, chunk, elide, decode_rows=None):
    with Runner(model, Options(decode_rows=decode_rows, elide_prefill=elide)) as runner:
        cache = runner.make_cache()
        logits, features = prefill(runner, prompt, cache, chunk, keep_features=model.args.sliding_window)
        return _host(logits), _host(features), [_host(a) for a in cache.snapshot()], cache


def test_prefill_rows_widen_by_a_window_per_layer_back_from_the_last(fixture_model):
    """The fixture: window 8, layers 0..7, KV sources up to 5 (engram layers 1 and 4), so layers
    6 and 7 are elided: the last computes the window (plus the padding after it), the one before
    it window - 1 more, each rounded up to 16 rows and never more than the forward has."""
    args = fixture_model.args
    assert prefill_rows(args, rows=64, pad=0, rows_after=0) == {6: 16, 7: 16}  # 15 and 8 rows, rounded
    assert prefill_rows(args, rows=64, pad=14, rows_after=0) == {6: 32, 7: 32}  # 29 and 22
    assert prefill_rows(args, rows=16, pad=0, rows_after=4) == {6: 16, 7: 16}  # 11 and 4
    assert prefill_rows(args, rows=16, pad=0, rows_after=12) == {6: 16, 7: 0}  # 3; none reach layer 7
    assert prefill_rows(args, rows=16, pad=0, rows_after=20) == {6: 0, 7: 0}
    # an engram layer past the last source is computed whole: the elision starts after it
    later_engram = dataclasses.replace(args, engram_layer_ids=[1, 6])
    assert prefill_rows(later_engram, rows=64, pad=0, rows_after=0) == {7: 16}


@pytest.mark.parametrize("n, chunk", [(5, 256), (8, 256), (16, 256), (23, 256), (60, 256), (60, 16), (63, 7),
                                      (40, 13), (33, 32)],
                         ids=lambda v: str(v))
def test_elided_prefill_is_bit_identical_where_it_matters(fixture_model, n, chunk):
    """Prompts shorter than, about and far longer than the cone (window 8: 15 rows at layer 6),
    in one chunk or many, with chunk boundaries inside it: the last logits, the drafter's
    features of the last window and every cache's snapshot (what decode reads) are equal."""
    full, elided = _prefilled(fixture_model, _prompt(n), chunk, False), _prefilled(fixture_model, _prompt(n), chunk, True)
    assert np.array_equal(full[0], elided[0])
    assert full[1].shape == elided[1].shape == (min(n, 8), fixture_model.args.dspark_feature_dim)
    assert np.array_equal(full[1], elided[1])
    assert len(full[2]) == len(elided[2]) and all(np.array_equal(a, b) for a, b in zip(full[2], elided[2]))
    assert full[3].offset == elided[3].offset == n
    assert all(a.window.end == b.window.end == n for a, b in zip(full[3].layers, elided[3].layers))


def test_elided_prefill_is_bit_identical_in_the_row_invariant_mode(fixture_model):
    """Where each row gathers its own window (the GPU's padded mode), a row whose window reaches
    before the first row a layer computes masks those keys: only rows nothing reads do."""
    full = _prefilled(fixture_model, _prompt(45), 16, False, decode_rows=8)
    elided = _prefilled(fixture_model, _prompt(45), 16, True, decode_rows=8)
    assert np.array_equal(full[0], elided[0]) and np.array_equal(full[1], elided[1])
    assert all(np.array_equal(a, b) for a, b in zip(full[2], elided[2]))


def test_layers_past_the_last_source_compute_fewer_rows(fixture_model, monkeypatch):
    """The elision happens: a 64-row chunk's layers 6 and 7 see 16 rows; of a 50-token prompt in
    chunks of 16, the first two chunks reach neither layer."""
    seen = []
    block = Model.block

    def spy(self, i, forward, cache, engram_rows=None):
        seen.append((i, forward.pre.shape[0]))
        return block(self, i, forward, cache, engram_rows)

    monkeypatch.setattr(Model, "block", spy)
    _prefilled(fixture_model, _prompt(64), 64, True)
    assert seen == [(i, 64) for i in range(6)] + [(6, 16), (7, 16)]
    seen.clear()
    _prefilled(fixture_model, _prompt(50), 16, True)
    assert sum(1 for i, _ in seen if i < 6) == 4 * 6  # every chunk through the sources
    assert [(i, rows) for i, rows in seen if i >= 6] == [(6, 16), (7, 16)] * 2  # only the last two past them


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "coupled"])
def test_replies_are_the_same_with_and_without_the_elision(fixture_model, params):
    """Plain and drafted, after a prompt longer than the cone in chunks that split it."""
    prompt = _prompt(45)
    replies = []
    for elide in (False, True):
        for draft in (False, True):
            with Runner(fixture_model, Options(elide_prefill=elide)) as runner:
                replies.append(list(generate_step(runner, prompt, params, 12, 16, make_decoder(runner, params, draft))))
    assert all(r == replies[0] for r in replies)
