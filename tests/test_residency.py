"""Wired-memory residency: the sizing, the restore, and that it changes no output."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dsv41_mlx.runtime import residency
from dsv41_mlx.generate import stream_generate
from dsv41_mlx.runtime.residency import drafter_bytes, plan, target_bytes, wired


def test_plan_wires_the_drafter_first_then_the_target_if_it_fits():
    both = plan(drafter_bytes=10, target_bytes=50, cap=100)
    assert (both.wired, both.target_wired) == (60, True)
    drafter_only = plan(10, 95, 100)
    assert (drafter_only.wired, drafter_only.target_wired) == (10, False)
    capped = plan(120, 50, 100)
    assert (capped.wired, capped.target_wired) == (100, False)
    assert "not wired" in drafter_only.describe() and "cap 0.00 GB" in capped.describe()


def test_sizes_split_the_model_between_drafter_and_target(fixture_model, drafter):
    model = fixture_model
    drafter = drafter
    everything = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    stages = sum(v.nbytes for stage in model.mtp for _, v in tree_flatten(stage.parameters()))
    assert target_bytes(model) == everything - stages
    args = model.args
    rings = len(model.mtp) * args.sliding_window * args.head_dim * 2
    assert drafter_bytes(model, drafter) >= stages + drafter.fp8_head.nbytes + rings


@pytest.fixture
def fake_wiring(monkeypatch):
    """A backend that can wire: cap 1 GB, and a record of every limit set."""
    calls = []
    state = {"limit": 123}

    def set_wired_limit(n):
        calls.append(n)
        previous, state["limit"] = state["limit"], n
        return previous

    monkeypatch.setattr(residency, "wiring_cap", lambda: 10**9)
    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    return calls


def test_previous_limit_is_restored_even_when_generation_fails(fixture_model, fake_wiring, drafter):
    model = fixture_model
    with pytest.raises(RuntimeError, match="boom"):
        with wired(model, drafter) as p:
            assert p.target_wired and p.wired == drafter_bytes(model, drafter) + target_bytes(model)
            raise RuntimeError("boom")
    assert fake_wiring == [p.wired, 123]


def test_generation_is_the_same_with_residency_on_and_off(fixture_model, fake_wiring):
    class Ids:  # the fixture has no tokenizer of its own: feed ids, read tokens
        eos_token_ids = ()

        def decode(self, ids, skip_special_tokens=False):
            return ""

    prompt = [(11 * j) % 8000 + 50 for j in range(19)]
    runs = {}
    for wire in (True, False):
        responses = list(stream_generate(fixture_model, Ids(), prompt, max_tokens=12, temperature=0.7, seed=2,
                                         confidence="off", wire=wire))
        runs[wire] = [r.token for r in responses]
    assert runs[True] == runs[False]
    assert len(fake_wiring) == 2  # set once and restored once, by the wired run only


def test_backends_without_wiring_say_so_once(fixture_model, caplog, monkeypatch, drafter):
    monkeypatch.setattr(residency, "_said_no_wiring", False)
    with caplog.at_level(logging.INFO, logger="dsv41_mlx.runtime.residency"):
        for _ in range(2):
            with wired(fixture_model, drafter) as p:
                assert p is None
    assert sum("nothing to wire" in r.message for r in caplog.records) == 1


@pytest.fixture
def cache_limit():
    """MLX's buffer-cache limit put back as it was after the test (a process-wide setting)."""
    before = mx.set_cache_limit(residency.MLX_CPU_CACHE_LIMIT)
    yield
    mx.set_cache_limit(before)


def test_cpu_runner_keeps_a_steps_freed_buffers(fixture_model, cache_limit):
    from dsv41_mlx.runtime.runner import Runner

    with Runner(fixture_model, drafter=None):
        pass
    expected = mx.get_memory_limit() // residency.CPU_CACHE_SHARE
    assert mx.set_cache_limit(residency.MLX_CPU_CACHE_LIMIT) == expected  # raised from MLX's default
    mx.set_cache_limit(1 << 20)  # the user's own
    with Runner(fixture_model, drafter=None):
        pass
    assert mx.set_cache_limit(1 << 20) == 1 << 20  # kept
    assert residency.cpu_buffer_cache(mx.gpu) is None  # other devices keep their allocator's own


def test_cpu_buffer_cache_leaves_a_larger_limit(cache_limit):
    mx.set_cache_limit(mx.get_memory_limit())
    assert residency.cpu_buffer_cache(mx.cpu) is None
    assert mx.set_cache_limit(residency.MLX_CPU_CACHE_LIMIT) == mx.get_memory_limit()
