"""The propose pass on its own MLX streams: concurrent == serial, byte for byte."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv41_mlx.cache import DraftCache
from dsv41_mlx.runtime.drafter import Drafter
from dsv41_mlx.runtime.runner import Runner
from dsv41_mlx.generate import generate_step
from dsv41_mlx.sampling import SamplingParams
from dsv41_mlx.speculative import SpeculativeDecoder
from scripts.benchmarks.harness import WrappedDrafter

PROMPT = [(37 * j) % 8000 + 100 for j in range(23)]


class Recording(WrappedDrafter):
    """A drafter that remembers every proposal it made (evaluated)."""

    def __init__(self, drafter: Drafter):
        super().__init__(drafter)
        self.proposals = []

    def propose(self, cache, anchor, pick):
        p = super().propose(cache, anchor, pick)
        mx.eval(p.drafts, p.logits, p.confidence)
        self.proposals.append(p)
        return p


def _run(model, drafter, params):
    rec = Recording(drafter)
    runner = Runner(model)
    decoder = SpeculativeDecoder(runner, rec, params, confidence="off")
    tokens = list(generate_step(runner, PROMPT, params, 40, decoder=decoder))
    return tokens, rec.proposals


@pytest.fixture(scope="module")
def concurrent_run(fixture_model):
    """run(head, params) -> (drafter, tokens, proposals): a fresh default drafter (concurrent,
    evaluated on the drafter's streams) of that head, run by _run, once a module for each."""
    runs = {}

    def run(head: str, params: SamplingParams):
        if (head, params) not in runs:
            drafter = Drafter(fixture_model, head=head, concurrent=True)
            runs[head, params] = (drafter, *_run(fixture_model, drafter, params))
        return runs[head, params]

    return run


def _same(a, b) -> bool:
    return all(mx.array_equal(x, y).item() for x, y in ((a.drafts, b.drafts), (a.logits, b.logits),
                                                         (a.confidence, b.confidence)))


def test_concurrent_propose_equals_serial_propose_byte_for_byte(fixture_model, concurrent_run):
    for head in ("fp8", "bf16"):
        for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
            concurrent, tokens_c, props_c = concurrent_run(head, params)
            serial = Drafter(fixture_model, head=head, concurrent=False)
            assert concurrent.side_stream is not None and serial.side_stream is None
            assert concurrent.stream != serial.stream
            tokens_s, props_s = _run(fixture_model, serial, params)
            assert tokens_c == tokens_s
            assert len(props_c) == len(props_s) > 30  # many rounds of a real generation
            assert all(_same(a, b) for a, b in zip(props_c, props_s)), (head, params)


def test_reading_a_ring_before_its_write_fails_the_check(fixture_model):
    """The equality check has teeth: a propose that reads the rings as they were before
    the newest ingest (what a missing dependency between the two would do) differs."""
    drafter = Drafter(fixture_model, concurrent=True)
    _, features = fixture_model(mx.array([PROMPT], dtype=mx.int32))
    cache = drafter.make_cache()
    drafter.ingest(cache, features[0, :-1])
    before_write = mx.array(cache.rings)
    drafter.ingest(cache, features[0, -1:])
    right = drafter.propose(cache, 77)
    stale = DraftCache(len(drafter.stages), drafter.window, fixture_model.args.head_dim)
    stale.rings, stale.end = before_write, cache.end
    wrong = drafter.propose(stale, 77)
    mx.eval(right.logits, wrong.logits)
    assert not _same(right, wrong)


def test_propose_started_on_the_evaluators_thread_proposes_the_same_bytes(fixture_model, concurrent_run):
    """Drafter.evaluate_on_thread hands each stage and the head to a thread of its own as they
    are built: the same operations in the same order, so the same proposals and replies as the
    pass evaluated whole on the drafter's streams."""
    for head in ("fp8", "bf16"):
        params = SamplingParams(temperature=0.8, seed=3)
        threaded = Drafter(fixture_model, head=head)
        assert not threaded.evaluate_on_thread  # the default off a GPU
        threaded.evaluate_on_thread = True
        try:
            tokens_a, props_a = _run(fixture_model, threaded, params)
            anchor = mx.array(77)  # an anchor still being computed, as a round may hand it
            cache = threaded.make_cache()
            _, features = fixture_model(mx.array([PROMPT], dtype=mx.int32))
            threaded.ingest(cache, features[0])  # not evaluated: the propose starts it on this thread
            lazy = threaded.propose(cache, anchor * 1)
        finally:
            threaded.evaluate_on_thread = False
        whole, tokens_b, props_b = concurrent_run(head, params)  # Drafter's defaults
        assert not whole.evaluate_on_thread
        assert tokens_a == tokens_b and len(props_a) == len(props_b) > 30
        assert all(_same(a, b) for a, b in zip(props_a, props_b)), head
        cache = whole.make_cache()
        whole.ingest(cache, features[0])
        assert _same(lazy, whole.propose(cache, 77))
