"""Speculative decoding is lossless: drafted replies equal undrafted ones (greedy, coupled),
rejection sampling keeps the target distribution, and trimming after a verify is exact.

Runs on the fixture checkpoint (vocabulary 8192, DSpark stages). Its random
weights make the drafter accept almost nothing, so an oracle drafter that
proposes the target's own continuation exercises the accepting paths.
"""

from __future__ import annotations

import math
import statistics
import types

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from dsv41_mlx.runtime.drafter import Drafter, Proposal
from dsv41_mlx.runtime.options import Options
from dsv41_mlx.runtime.runner import Runner
from scripts.benchmarks.harness import OracleDrafter, WrappedDrafter
from dsv41_mlx.generate import generate_step, make_decoder, prefill
from dsv41_mlx.sampling import DRAFT, SamplingParams, accept_or_resample, filtered_log_probs, gumbel_noise
from dsv41_mlx.speculative import (ConfidencePolicy, DraftStats, Outlook, SpeculativeDecoder, measure_verify_costs,
                                   resolve_verify, sigmoid, verify_cost_tokens)

from .test_model import _assert_same_state

MAX_TOKENS = 64
PROMPTS = [[(97 * i + 31 * j) % 8000 + 100 for j in range(n)] for i, n in enumerate([3, 9, 17, 30, 41])]
GREEDY = SamplingParams()
COUPLED = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.0, top_p=0.9, seed=12),
           SamplingParams(temperature=0.6, top_k=20, seed=13), SamplingParams(temperature=1.2, seed=14),
           SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=15)]


def _reply(runner, prompt, params, decoder=None, max_tokens=MAX_TOKENS):
    return list(generate_step(runner, prompt, params, max_tokens, decoder=decoder))


@pytest.fixture(scope="module")
def plain_replies(fixture_model):
    runner = Runner(fixture_model)
    greedy = [_reply(runner, p, GREEDY) for p in PROMPTS]
    coupled = [_reply(runner, p, params) for p, params in zip(PROMPTS, COUPLED)]
    return greedy, coupled


# ------------------------------------------------------------- lossless replies

@pytest.mark.parametrize("confidence", ["off", "schedule"])
def test_drafted_greedy_reply_equals_undrafted_reply(fixture_model, runner, plain_replies, confidence):
    for prompt, expected in zip(PROMPTS, plain_replies[0]):
        decoder = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence=confidence)
        assert _reply(runner, prompt, GREEDY, decoder) == expected
        # rounds; under the schedule, after a reply where this (random) drafter did not pay, plain steps
        assert decoder.stats.rounds > 0 or (confidence == "schedule" and decoder.stats.plain_steps > 0)


@pytest.mark.parametrize("confidence", ["off", "schedule"])
def test_drafted_coupled_reply_equals_undrafted_reply_for_the_same_seed(fixture_model, runner, plain_replies, confidence):
    for prompt, params, expected in zip(PROMPTS, COUPLED, plain_replies[1]):
        decoder = SpeculativeDecoder(runner, runner.drafter, params, confidence=confidence)
        assert decoder.verify == "coupled"
        assert _reply(runner, prompt, params, decoder) == expected


def test_bf16_drafter_head_gives_the_same_replies_as_the_fp8_one(fixture_model, runner, plain_replies):
    """The tests above draft with the default FP8 head (top-64 candidates); the reference's
    BF16 head over the whole vocabulary proposes other drafts but the replies cannot change."""
    bf16 = Drafter(fixture_model, head="bf16")
    for i in (0, 3):
        for params, expected in ((GREEDY, plain_replies[0][i]), (COUPLED[i], plain_replies[1][i])):
            decoder = SpeculativeDecoder(runner, bf16, params, confidence="off")
            assert _reply(runner, PROMPTS[i], params, decoder, max_tokens=24) == expected[:24]


def test_drafted_reply_equals_undrafted_in_the_row_invariant_mode(padded_runner, plain_replies):
    """The GPU's decode path (every forward padded to 8 rows) on the CPU: replies unchanged.
    (On a GPU, scripts/check_lossless.py: 0 of 8 replies diverge padded, 8 of 8 unpadded.)"""
    runner = padded_runner
    for i in (1, 2):
        for params, expected in ((GREEDY, plain_replies[0][i]), (COUPLED[i], plain_replies[1][i])):
            assert list(generate_step(runner, PROMPTS[i], params, 24)) == expected[:24]
            decoder = SpeculativeDecoder(runner, runner.drafter, params, confidence="off")
            assert _reply(runner, PROMPTS[i], params, decoder, max_tokens=24) == expected[:24]


def test_drafted_reply_equals_undrafted_with_blocks_evaluated_on_a_thread(fixture_model, plain_replies):
    """The GPU's decode path in full on the CPU: every forward padded to 8 rows and each of
    its blocks started by the evaluator's thread while the next is built (a GPU's options):
    plain and drafted replies unchanged."""
    with Runner(fixture_model, Options(decode_rows=8, overlap_build=True, evaluate_on_thread=True)) as runner:
        for i in (3,):
            for params, expected in ((GREEDY, plain_replies[0][i]), (COUPLED[i], plain_replies[1][i])):
                assert list(generate_step(runner, PROMPTS[i], params, 24)) == expected[:24]
                decoder = SpeculativeDecoder(runner, runner.drafter, params, confidence="off")
                assert _reply(runner, PROMPTS[i], params, decoder, max_tokens=24) == expected[:24]


BUILT_AHEAD = Options(decode_rows=8, overlap_build=True, evaluate_on_thread=True, build_ahead=True, verify_ahead=True)


@pytest.mark.parametrize("confidence", ["off", "schedule"])
@pytest.mark.parametrize("which", ["greedy", "coupled"])
def test_a_round_builds_the_next_rounds_verify_forward_ahead(fixture_model, plain_replies, confidence, which):
    """Where the runner builds forwards ahead (a GPU's options), each round after the first
    verifies on a forward the round before built and began on the drafts as the device makes
    them (Runner.verify_ahead): the replies are the undrafted ones, with the real drafter and
    with an oracle (drafts made on the host)."""
    i = 2
    params = GREEDY if which == "greedy" else COUPLED[i]
    expected = plain_replies[0 if which == "greedy" else 1][i][:32]
    with Runner(fixture_model, BUILT_AHEAD) as runner:
        for drafter in (runner.drafter, OracleDrafter(runner.drafter, PROMPTS[i] + expected, wrong_every=4)):
            decoder = SpeculativeDecoder(runner, drafter, params, confidence=confidence,
                                         verify_costs=VERIFY_COSTS, plain_cost=10.0)
            assert _reply(runner, PROMPTS[i], params, decoder, max_tokens=len(expected)) == expected
            stats = decoder.stats
            # every round proposed ahead was verified ahead (off and schedule both know the length
            # then); where no plain stretch came between (the schedule's, where the random drafter
            # does not pay), every round but the first
            assert stats.rounds >= 4 and stats.verified_ahead == stats.proposed_ahead >= 2
            assert stats.stretches or stats.proposed_ahead == stats.rounds - 1
            # the same runner with the decoder's verify_ahead off: proposals ahead, no verify forward
            decoder = SpeculativeDecoder(runner, drafter, params, confidence=confidence,
                                         verify_costs=VERIFY_COSTS, plain_cost=10.0, verify_ahead=False)
            assert _reply(runner, PROMPTS[i], params, decoder, max_tokens=len(expected)) == expected
            assert decoder.stats.verified_ahead == 0 and (decoder.stats.stretches or decoder.stats.proposed_ahead >= 2)


def test_a_gated_verify_forward_is_started_before_its_drafts_are_read(fixture_model, plain_replies, monkeypatch):
    """gate_rows (CUDA's): the verify forward built ahead is handed to the evaluator whole,
    its engram rows behind a gate (here a stand-in, and an evaluator that only records, so that
    nothing runs before the rows are written), before its drafts are read back; the round then
    writes the rows and releases the gate, once per forward, writes before releases. The
    reply is the undrafted one."""
    from dsv41_mlx.runtime import staged as staged_module

    from .test_model import _RecordingEvaluator

    events = []
    monkeypatch.setattr(staged_module, "rows_gate", lambda flag, rows: (mx.zeros((2,), mx.uint32), rows))
    for name in ("write", "release"):
        method = getattr(staged_module.StagedRows, name)
        monkeypatch.setattr(staged_module.StagedRows, name,
                            lambda self, *a, _m=method, _n=name, **k: (events.append(_n), _m(self, *a, **k))[1])
    i = 3
    expected = plain_replies[0][i][:24]
    runner = Runner(fixture_model, Options(decode_rows=8, overlap_build=True, build_ahead=True, gate_rows=True,
                                           verify_ahead=True))
    runner._evaluator = _RecordingEvaluator([])
    oracle = OracleDrafter(runner.drafter, PROMPTS[i] + expected, wrong_every=3)
    decoder = SpeculativeDecoder(runner, oracle, GREEDY, confidence="off")
    assert _reply(runner, PROMPTS[i], GREEDY, decoder, max_tokens=len(expected)) == expected
    assert decoder.stats.rounds >= 4 and decoder.stats.verified_ahead == decoder.stats.rounds - 1
    assert events[:2] == ["write", "release"] and events == ["write", "release"] * (len(events) // 2)
    assert len(events) // 2 >= decoder.stats.verified_ahead


def test_the_blocks_built_ahead_follow_the_hosts_wait_for_the_drafts(fixture_model, runner):
    """The verify forward's blocks built before the drafts are read (SpeculativeDecoder.
    blocks_ahead): where the host then waited for the drafts, as many more as would have
    filled the wait, one short; where it found them ready, one fewer; within 1 .. the layers."""
    decoder = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="off")
    layers = len(fixture_model.layers)
    assert decoder.blocks_ahead == max(1, layers // 4)
    for blocks, build_s, waited_s, then in [(2, 0.002, 0.0031, 4), (4, 0.004, 0.0, 3), (4, 0.004, 0.0009, 3),
                                           (1, 0.001, 0.0, 1), (6, 0.006, 0.01, layers)]:
        decoder.blocks_ahead = blocks
        decoder._fit_blocks_ahead(build_s, waited_s)
        assert decoder.blocks_ahead == then, (blocks, build_s, waited_s)


def test_a_verify_forward_begun_ahead_and_abandoned_leaves_the_cache_as_it_was(fixture_model, plain_replies):
    """A round begins the next round's verify forward; where no round takes it up (the caller
    stopped), cancel_ahead leaves the target cache as the committed tokens left it, and a
    round from there is exact."""
    prompt, reply = PROMPTS[1], plain_replies[0][1]
    with Runner(fixture_model, BUILT_AHEAD) as runner:
        oracle = OracleDrafter(runner.drafter, prompt + reply, wrong_every=3)
        decoder = SpeculativeDecoder(runner, oracle, GREEDY, confidence="off")
        cache, plain = runner.make_cache(), runner.make_cache()
        logits, features = prefill(runner, prompt, cache, keep_features=runner.drafter.window)
        prefill(runner, prompt, plain)
        rings = decoder.begin(cache, features)
        anchor = reply[0]
        tokens = decoder.round(cache, rings, anchor, budget=16)
        assert tokens == reply[1:1 + len(tokens)] and decoder._ahead.verify is not None
        decoder.cancel_ahead()
        runner.decode([anchor] + tokens[:-1], plain)
        _assert_same_state(plain, cache)
        more = decoder.round(cache, rings, tokens[-1], budget=16)  # proposed afresh, verified exactly
        assert more == reply[1 + len(tokens): 1 + len(tokens) + len(more)]
        decoder.cancel_ahead()


@pytest.mark.parametrize("which", ["greedy", "coupled"])
def test_oracle_drafts_are_mostly_accepted_and_the_reply_is_unchanged(fixture_model, runner, plain_replies, which):
    for i in (1, 4):
        params = GREEDY if which == "greedy" else COUPLED[i]
        expected = plain_replies[0 if which == "greedy" else 1][i]
        oracle = OracleDrafter(runner.drafter, PROMPTS[i] + expected)
        decoder = SpeculativeDecoder(runner, oracle, params)
        assert _reply(runner, PROMPTS[i], params, decoder) == expected
        stats = decoder.stats
        assert stats.mean_accepted > 2, stats.as_dict()
        assert stats.accepted < stats.verified  # the wrong drafts were rejected
        assert stats.rounds < MAX_TOKENS / 3


def test_drafter_rings_hold_only_committed_positions(fixture_model, runner, plain_replies):
    prompt, reply = PROMPTS[2], plain_replies[0][2][:40]
    oracle = OracleDrafter(runner.drafter, prompt + reply, wrong_every=5)
    decoder = SpeculativeDecoder(runner, oracle, GREEDY)
    assert _reply(runner, prompt, GREEDY, decoder, max_tokens=len(reply)) == reply
    rings = decoder.draft_cache
    committed = (prompt + reply)[: rings.end]
    assert rings.end == len(prompt) + len(reply) - 1  # everything but the last token, not yet fed
    _, features = fixture_model(mx.array([committed], dtype=mx.int32))
    expected = runner.drafter.make_cache()
    runner.drafter.ingest(expected, features[0])
    assert mx.array_equal(rings.rings, expected.rings).item()


def test_a_round_starts_its_ingest_on_the_drafter_stream_without_waiting(fixture_model, runner, plain_replies,
                                                                          monkeypatch):
    """The ring writes are built on the drafter's stream and started (mx.async_eval), never
    waited for by the round that made them (the next propose reads them); the reply and the
    rings stay exact (the test above)."""
    import dsv41_mlx.cache as cache_module

    prompt, reply = PROMPTS[1], plain_replies[0][1][:24]
    drafter = runner.drafter
    oracle = OracleDrafter(drafter, prompt + reply)
    decoder = SpeculativeDecoder(runner, oracle, GREEDY)
    streams, waited, started = [], [], []
    write = cache_module.ring_write
    monkeypatch.setattr(cache_module, "ring_write",
                        lambda *a: streams.append(mx.default_stream(mx.default_device())) or write(*a))
    monkeypatch.setattr(mx, "eval", lambda *a, e=mx.eval: waited.extend(a) or e(*a))
    monkeypatch.setattr(mx, "async_eval", lambda *a, e=mx.async_eval: started.extend(a) or e(*a))
    assert _reply(runner, prompt, GREEDY, decoder, max_tokens=len(reply)) == reply
    assert decoder.stats.rounds >= 3 and len(streams) == decoder.stats.rounds + 1  # + the prompt's ingest
    assert all(s == drafter.stream for s in streams)
    rings = decoder.draft_cache.rings  # the last round's ingest
    assert any(a is rings for a in started) and not any(a is rings for a in waited)


class Counted(WrappedDrafter):
    """A drafter that proposes its inner one's drafts and notes, at each proposal, how many
    tokens the generation had handed out by then (`handed`, counted by the test's loop)."""

    def __init__(self, drafter, handed: list[int]):
        super().__init__(drafter)
        self.handed, self.asked = handed, []

    def propose(self, cache, anchor, pick):
        self.asked.append((self.handed[0], cache.end, anchor))
        return self.inner.propose(cache, anchor, pick)


def _counted_reply(runner, drafter, prompt, params, max_tokens, stop=(), confidence="off", **kwargs):
    handed = [0]
    counted = Counted(drafter, handed)
    decoder = SpeculativeDecoder(runner, counted, params, confidence=confidence, **kwargs)
    reply = []
    for token in generate_step(runner, prompt, params, max_tokens, decoder=decoder, stop=stop):
        reply.append(token)
        handed[0] += 1
    return reply, decoder.stats, counted.asked


@pytest.mark.parametrize("which", ["greedy", "coupled"])
def test_a_round_starts_the_next_rounds_proposal_before_it_hands_out_its_tokens(fixture_model, runner,
                                                                                   plain_replies, which):
    """Each round after the first drafts from a proposal the round before started, before that
    round's tokens reached the caller, from the anchor and ring position the round starts at;
    the last round (at the token budget) starts none, and the reply is the undrafted one."""
    params = GREEDY if which == "greedy" else COUPLED[2]
    prompt, reply = PROMPTS[2], plain_replies[0 if which == "greedy" else 1][2][:40]
    oracle = OracleDrafter(runner.drafter, prompt + reply, wrong_every=4)
    got, stats, asked = _counted_reply(runner, oracle, prompt, params, len(reply))
    assert got == reply
    assert stats.rounds >= 5 and len(asked) == stats.rounds and stats.proposed_ahead == stats.rounds - 1
    handed, ends, anchors = zip(*asked)
    assert [reply[end - len(prompt)] for end in ends] == list(anchors)  # each from the token at its position
    assert handed[0] == 1 and ends[0] == len(prompt)  # the first round's, once its anchor is out
    # each later one asked for while the round before still held its tokens: only up to its anchor handed out
    assert list(handed[1:]) == [end - len(prompt) + 1 for end in ends[:-1]]
    assert all(a < b for a, b in zip(ends, ends[1:]))


def test_no_proposal_is_started_after_a_stop_token_or_before_a_plain_stretch(fixture_model, runner,
                                                                             plain_replies):
    """A round that hands out a stop token, and one the schedule follows with plain steps,
    start no proposal: every proposal made is a round's."""
    prompt, reply = PROMPTS[1], plain_replies[0][1]
    stop_at = 17
    oracle = OracleDrafter(runner.drafter, prompt + reply)
    got, stats, asked = _counted_reply(runner, oracle, prompt, GREEDY, MAX_TOKENS, stop={reply[stop_at]})
    assert got == reply[:reply.index(reply[stop_at]) + 1]
    assert len(asked) == stats.rounds and stats.proposed_ahead == stats.rounds - 1

    wrong = TurnsRight(runner.drafter, prompt + reply + [0] * 8, turn=10**9)
    got, stats, asked = _counted_reply(runner, wrong, prompt, GREEDY, 60, confidence="schedule",
                                       verify_costs=VERIFY_COSTS, plain_cost=1.0)
    assert got == reply[:60]
    assert stats.rounds == 3 and stats.stretches == 3 and len(asked) == 3 and stats.proposed_ahead == 0


# ------------------------------------------------------------------- exact trim

@pytest.mark.parametrize("accepted", range(6))
def test_verify_then_trim_equals_plain_decode_of_the_committed_tokens(fixture_model, golden, accepted):
    """A verify forward of anchor + 5 drafts, trimmed to `accepted` drafts, leaves the cache a
    plain decode of the committed tokens leaves, and its rows' logits equal the plain ones.
    A second verify on top of the trimmed cache must stay exact too."""
    model = fixture_model
    prompt = golden["prompt_ids"][0].astype(np.int32).tolist()  # 41 tokens: window and groups wrap
    cont = golden["decode.input_ids"][:, 0, 0].astype(np.int32).tolist()
    block = model.args.dspark_block_size

    drafted = model.make_cache()
    prefill(Runner(model), prompt, drafted)
    verify_logits, _ = model(mx.array([cont[: block + 1]]), drafted)
    drafted.trim(block - accepted)
    second = cont[accepted + 1: accepted + 2 + block]
    model(mx.array([second]), drafted)
    drafted.trim(block - 2)

    plain = model.make_cache()
    prefill(Runner(model), prompt, plain)
    committed = cont[: accepted + 1] + second[:3]
    plain_logits = [model(mx.array([[t]]), plain)[0][0, 0] for t in committed]
    _assert_same_state(plain, drafted)
    for j in range(accepted + 1):
        assert mx.array_equal(verify_logits[0, j], plain_logits[j]).item(), f"row {j}"


# ------------------------------------------------------------------- rejection

def _sample_q(q: np.ndarray, n: int, rng) -> np.ndarray:
    return rng.choice(len(q), size=n, p=q)


def _rejection_outcomes(p, q_true, q_claimed, n, seed):
    """n independent draws through accept_or_resample: drafts from q_true, the rule told q_claimed."""
    rng = np.random.default_rng(seed)
    drafts = _sample_q(q_true, n, rng)
    P = mx.broadcast_to(mx.array(p, dtype=mx.float32), (n, len(p)))
    Q = mx.broadcast_to(mx.array(q_claimed, dtype=mx.float32), (n, len(p)))
    u = mx.array(rng.random(n), dtype=mx.float32)
    g = mx.array(rng.gumbel(size=(n, len(p))), dtype=mx.float32)
    accepted, token = accept_or_resample(P, Q, mx.array(drafts, dtype=mx.int32), u, g)
    return np.array(token), np.array(accepted)


P_TARGET = np.array([0.30, 0.05, 0.20, 0.0, 0.25, 0.10, 0.06, 0.04])
Q_DRAFT = np.array([0.10, 0.30, 0.20, 0.15, 0.05, 0.10, 0.0, 0.10])


def test_rejection_rule_preserves_the_target_distribution():
    tokens, accepted = _rejection_outcomes(P_TARGET, Q_DRAFT, Q_DRAFT, 40_000, seed=0)
    assert 0.2 < accepted.mean() < 0.9  # both branches taken
    counts = np.bincount(tokens, minlength=len(P_TARGET))
    keep = P_TARGET > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep], P_TARGET[keep] * len(tokens)).pvalue > 0.01


def test_rejection_rule_with_a_wrong_q_fails_the_same_check():
    wrong = np.array([0.20, 0.20, 0.10, 0.15, 0.15, 0.10, 0.0, 0.10])
    tokens, _ = _rejection_outcomes(P_TARGET, Q_DRAFT, wrong, 40_000, seed=0)
    counts = np.bincount(tokens, minlength=len(P_TARGET))
    expected = P_TARGET * len(tokens)
    keep = P_TARGET > 0
    assert chisquare(counts[keep], expected[keep]).pvalue < 0.01


class FlattenedOracle(WrappedDrafter):
    """Drafts the first position from a sharpened copy of the target's own logits (so that
    q overlaps p without equalling it), through the round's picker."""

    def __init__(self, drafter, target_logits: mx.array):
        super().__init__(drafter)
        self.target_logits, self.verify_costs = target_logits, None

    def propose(self, cache, anchor, pick) -> Proposal:
        logits = mx.broadcast_to(3.0 * self.target_logits, (self.block, self.target_logits.shape[0]))
        drafts = mx.stack([pick(logits[k], k) for k in range(self.block)])
        return Proposal(drafts, logits, mx.full((self.block,), 5.0))


def test_rejection_round_samples_the_target_distribution(fixture_model, drafter):
    """End to end: the token after a fixed anchor, over 300 seeds, follows the target's p."""
    model, prompt, anchor = fixture_model, PROMPTS[3], 1234
    params = SamplingParams(temperature=1.0, top_k=3)
    cache = model.make_cache()
    _, features = prefill(Runner(model), prompt, cache, keep_features=model.args.sliding_window)
    rows, _ = model(mx.array([[anchor]]), cache)
    cache.trim(1)
    target = rows[0, 0]
    p = np.exp(np.array(filtered_log_probs(target[None], params)[0]))
    assert abs(p.sum() - 1) < 1e-5
    oracle = FlattenedOracle(drafter, target)
    rings = oracle.make_cache()
    rings.end = cache.offset - features.shape[0]
    oracle.ingest(rings, features)
    saved_rings, saved_end = mx.array(rings.rings), rings.end

    outcomes, accepted = [], 0
    for seed in range(300):
        params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        decoder = SpeculativeDecoder(Runner(model), oracle, params, verify="rejection")
        tokens = decoder.round(cache, rings, anchor, budget=2)
        outcomes.append(tokens[0])
        accepted += decoder.stats.accepted
        cache.trim(decoder.stats.accepted + 1)
        rings.rings, rings.end = mx.array(saved_rings), saved_end
    assert 30 < accepted < 270  # drafts kept and rejected both happen
    support = np.flatnonzero(p)
    counts = np.array([outcomes.count(int(t)) for t in support])
    assert counts.sum() == len(outcomes)
    kept = p[support].astype(np.float64)
    expected = kept / kept.sum() * len(outcomes)
    assert chisquare(counts, expected).pvalue > 0.01


def test_rejection_drafts_are_sampled_with_their_own_noise(fixture_model, runner):
    """The rejection-mode picker draws from q with the DRAFT stream, not the target's noise."""
    decoder = SpeculativeDecoder(runner, runner.drafter, SamplingParams(1.0, seed=5),
                                 verify="rejection")
    logits = mx.zeros((8192,))
    pick = decoder.pick(100)
    g = gumbel_noise(5, mx.array([102]), 8192, DRAFT)[0]
    assert pick(logits, 2).item() == mx.argmax(g).item()


# --------------------------------------------------------------- policies, stats

def test_confidence_policies_choose_the_verify_length():
    c = [0.9, 0.8, 0.5, 0.2, 0.1]
    assert ConfidencePolicy.parse("off").verify_length(c, None) == 5
    assert ConfidencePolicy.parse("threshold:0.5").verify_length(c, None) == 2  # 0.9, 0.72 | 0.36
    assert ConfidencePolicy.parse("threshold:0").verify_length(c, None) == 5
    costs = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25]
    # expected tokens 1, 1.9, 2.62, 2.98, 3.052, 3.0592 over costs: rates rise until l=3, fall at l=4
    assert ConfidencePolicy.parse("schedule").verify_length(c, costs) == 3
    flat_costly = [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    assert ConfidencePolicy.parse("schedule").verify_length(c, flat_costly) == 0


def test_confidences_are_taken_on_the_host_as_mlx_takes_them():
    """A round reads the drafter's confidence logits and takes their sigmoid on the host (no
    launch, no wait for the device): the values MLX gives, and no overflow far out."""
    logits = [-800.0, -30.0, -2.5, 0.0, 1e-7, 3.25, 40.0, 800.0]
    with np.errstate(over="ignore"):
        exact = 1.0 / (1.0 + np.exp(-np.array(logits, dtype=np.float64)))
    assert [sigmoid(x) for x in logits] == pytest.approx(exact.tolist(), rel=1e-15, abs=0)
    # MLX's float32 values (what a round used before), to float32's few units in the last place
    assert [sigmoid(x) for x in logits] == pytest.approx(mx.sigmoid(mx.array(logits)).tolist(), rel=2e-5, abs=1e-30)
    assert sigmoid(-800.0) == 0.0 and sigmoid(800.0) == 1.0 and sigmoid(0.0) == 0.5


def test_schedule_counts_a_rounds_work_beyond_its_verify_forward(fixture_model, runner):
    """The schedule weighs a round's whole cost: the measured verify forwards plus the median
    of what the decoder's recent rounds took beyond them (a round that traced a new shape
    does not move it). A fixed part makes verifying more drafts relatively cheaper, so the
    schedule verifies more of them than on the forwards alone."""
    c = [0.9, 0.8, 0.5, 0.2, 0.1]
    forwards = [1.0, 1.6, 2.4, 3.2, 4.0, 4.8]
    decoder = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="schedule",
                                 verify_costs=forwards)
    assert decoder.round_costs() == forwards  # no round yet
    schedule = ConfidencePolicy.parse("schedule")
    assert schedule.verify_length(c, decoder.round_costs()) == 1  # 1.9 / 1.6 > 2.62 / 2.4
    # three rounds of one draft, 1.5, 2 and 9 s beyond its forward: the median counts
    decoder.timed_rounds.extend([(1, forwards[1] + beyond) for beyond in (1.5, 2.0, 9.0)])
    assert decoder.round_costs() == pytest.approx([f + 2.0 for f in forwards])
    assert schedule.verify_length(c, decoder.round_costs()) == 2  # 2.62 / 4.4 > 2.98 / 5.2
    off = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="off")
    assert off.round_costs() is None


def test_schedule_rounds_record_their_time_beyond_the_forward(fixture_model, runner):
    """Each round of a scheduled decoder adds its time beyond its verify forward's measured
    cost; a decoder without costs records nothing."""
    decoder = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="schedule",
                                 verify_costs=[1e-6] * (runner.drafter.block + 1), plain_cost=1.0)
    _reply(runner, PROMPTS[0], GREEDY, decoder, max_tokens=12)  # (a plain token's 1 s: probes cost nothing)
    assert 2 <= decoder.stats.rounds <= Outlook.ROUNDS_TIMED and len(decoder.timed_rounds) == decoder.stats.rounds
    assert sum(v for v, _ in decoder.timed_rounds) == decoder.stats.verified
    assert all(s > 0 for _, s in decoder.timed_rounds)
    unscheduled = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="off")
    _reply(runner, PROMPTS[0], GREEDY, unscheduled, max_tokens=12)
    assert unscheduled.stats.rounds >= 2 and not unscheduled.timed_rounds


class TurnsRight(WrappedDrafter):
    """A drafter sure of every draft (confidence logit 30), whose drafts are wrong (the
    continuation's token + 1) before absolute position `turn` and right from there on."""

    def __init__(self, drafter, sequence: list[int], turn: int):
        super().__init__(drafter)
        self.sequence, self.turn, self.vocab = sequence, turn, drafter.model.args.vocab_size

    def propose(self, cache, anchor, pick):
        positions = range(cache.end + 1, cache.end + 1 + self.block)
        drafts = mx.array([self.sequence[p] if p >= self.turn else (self.sequence[p] + 1) % self.vocab
                           for p in positions], dtype=mx.int32)
        return Proposal(drafts, mx.zeros((self.block, 1)), mx.full((self.block,), 30.0), candidates=drafts[:, None])


# a verify forward of n rows costs 1 + (n - 1) / 2 plain steps of 1 s
VERIFY_COSTS = [1.0 + n / 2 for n in range(6)]


def _scheduled(runner, drafter, params=GREEDY):
    return SpeculativeDecoder(runner, drafter, params, confidence="schedule", verify_costs=VERIFY_COSTS,
                              plain_cost=1.0)


@pytest.mark.parametrize("params", [GREEDY, COUPLED[0]], ids=["greedy", "coupled"])
def test_schedule_decodes_plainly_where_a_drafter_is_always_wrong(fixture_model, runner, params):
    """A drafter that is sure of every draft and never right: the first round probes with one
    draft, then plain stretches, each followed by a one-draft probe (3 rounds, 3 drafts
    verified for 60 tokens): of 17, 17 and 22 tokens (a probe costs half a plain step beyond
    one at these costs, so a stretch takes at least 17; the doubling schedule's 32 last,
    cut at the budget); the reply is the undrafted one."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, params, max_tokens=60)
    decoder = _scheduled(runner, TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=10**9), params)
    assert _reply(runner, prompt, params, decoder, max_tokens=60) == plain
    st = decoder.stats
    assert (st.rounds, st.verified, st.accepted, st.stretches, st.plain_steps) == (3, 3, 0, 3, 8 + 16 + 32)
    assert "56 tokens decoded plainly in 3 stretches" in st.summary()


def test_a_drafter_that_did_not_pay_starts_the_next_generation_with_plain_steps(fixture_model, runner):
    """The outlook stays with the drafter, the stretch under way included: after a reply where
    it never paid (stretches of 17, 17 and 22, the doubling schedule's 32 cut at the budget),
    the next reply decodes the 10 tokens left of that stretch plainly, probes once (a miss:
    the next stretch is 64), and decodes plainly to its end, 16 of the 64 left for the reply
    after; it is still the undrafted reply."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=60)
    wrong = TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=10**9)
    first = _scheduled(runner, wrong)
    _reply(runner, prompt, GREEDY, first, max_tokens=60)
    assert first.stats.plain_steps == 17 + 17 + 22 and wrong.outlook.plain_left == 10
    second = _scheduled(runner, wrong)
    assert _reply(runner, prompt, GREEDY, second, max_tokens=60) == plain
    assert (second.stats.rounds, second.stats.stretches, second.stats.plain_steps) == (1, 2, 10 + 48)
    assert wrong.outlook.plain_left == 16


def test_a_reply_that_ends_inside_a_stretch_hands_back_what_it_did_not_decode(fixture_model, runner):
    """A reply that ends inside a plain stretch, at a stop token or where its caller stops
    reading, leaves the tokens it did not decode to the stretch under way: the stretch counts
    plain tokens decoded, not replies begun."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=60)
    wrong = TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=10**9)
    _reply(runner, prompt, GREEDY, _scheduled(runner, wrong), max_tokens=60)
    assert wrong.outlook.plain_left == 10  # (the test above: 22 of a 32-token stretch decoded)
    stop_at = next(i for i in range(3, 8) if plain[i] not in plain[:i])
    decoder = _scheduled(runner, wrong)
    reply = list(generate_step(runner, prompt, GREEDY, 60, decoder=decoder, stop={plain[stop_at]}))
    assert reply == plain[:stop_at + 1] and decoder.stats.plain_steps == stop_at
    assert wrong.outlook.plain_left == 10 - stop_at
    steps = generate_step(runner, prompt, GREEDY, 60, decoder=_scheduled(runner, wrong))
    assert [next(steps) for _ in range(3)] == plain[:3]  # the anchor, then 2 of the stretch's tokens
    steps.close()
    assert wrong.outlook.plain_left == 10 - stop_at - 2


def test_replies_shorter_than_a_stretch_still_probe(fixture_model, runner):
    """A drafter that is wrong until some position of the text and right after, asked for
    replies of 12 tokens, each shorter than the stretches its misses earn: the stretch carries
    from reply to reply, so probes keep coming (a generation does not start a fresh stretch
    of its own), and once the drafter is right the replies are drafted. Every reply is the
    undrafted one."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=12)
    drafter = TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=10**9)
    rounds = []
    for n in range(12):
        if n == 6:
            drafter.turn = 0  # right from here on
        decoder = _scheduled(runner, drafter)
        assert _reply(runner, prompt, GREEDY, decoder, max_tokens=12) == plain
        rounds.append(decoder.stats.rounds)
    assert sum(rounds[1:6]) > 0  # probes while it is wrong, after the first reply's
    assert rounds[-1] > 0 and decoder.stats.accepted > decoder.stats.rounds  # taken up once right


def test_schedule_takes_up_a_drafter_that_starts_matching(fixture_model, runner):
    """Wrong before absolute position turn, right after: the probes that follow the plain
    stretches find it right, drafting resumes with rounds of several drafts, and no stretch
    starts after the turn."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=100)
    turn = len(prompt) + 20
    decoder = _scheduled(runner, TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn))
    assert _reply(runner, prompt, GREEDY, decoder, max_tokens=100) == plain
    st = decoder.stats
    # the probes 2 and 20 tokens in miss, the one 38 tokens in is right; each miss is followed by
    # 17 plain tokens (a probe costs half a plain step beyond one here: 0.5 / (17 * 1.0) < PROBE_SHARE)
    assert st.stretches == 2 and st.plain_steps == 17 + 17
    assert st.accepted >= 30 and st.accepted_at[1] > 0  # rounds past the first probe verify more than one


def test_schedule_never_stretches_for_a_drafter_that_is_always_right(fixture_model, runner):
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=40)
    decoder = _scheduled(runner, TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=0))
    assert _reply(runner, prompt, GREEDY, decoder, max_tokens=40) == plain
    assert decoder.stats.stretches == 0 and decoder.stats.accepted > decoder.stats.rounds


def test_round_costs_follow_the_rounds_where_the_forwards_were_measured_slower(fixture_model, runner):
    """Verify forwards measured while the machine ran twice as slow (2.0 s for a one-draft
    forward) and rounds that now take 1.4 s: the rounds' time short of the forwards counts
    too, so the schedule weighs a round at what it takes now. A draft accepted in about
    three of five rounds then pays against a plain step of 1 s (1.6 tokens in 1.4 s); with
    the rounds' time counted only where it exceeds the forwards, it would not have."""
    block = runner.drafter.block
    slow = [2.0 * (1.0 + n / 2) for n in range(block + 1)]  # VERIFY_COSTS as measured at half speed
    runner.drafter.verify_costs = slow  # (as measure_verify_costs leaves them)
    decoder = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="schedule", plain_cost=1.0)
    decoder.timed_rounds.extend([(1, 1.4)] * 5)  # five rounds of one draft, 1.4 s each
    assert decoder.round_costs()[1] == pytest.approx(1.4)
    for accepted in (1, 0, 1, 1, 0):
        decoder.outlook.observe([0.9] * block, verified=1, accepted=accepted)
    decoder.decide(verified=1, accepted=0)
    assert decoder.outlook.paying is True and decoder.plain_tokens(100) == 0


def test_the_rounds_time_stays_with_the_drafter_across_generations(fixture_model, runner):
    """What a reply's rounds took is the drafter's, as its outlook is: the next reply's first
    round is weighed with it, not as a bare forward."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=20)
    right = TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=0)
    right.verify_costs = [1e-6] * (right.block + 1)  # (as measure_verify_costs leaves them)
    first = SpeculativeDecoder(runner, right, GREEDY, confidence="schedule", plain_cost=1.0)
    _reply(runner, prompt, GREEDY, first, max_tokens=20)
    timed = list(first.timed_rounds)
    assert len(timed) == first.stats.rounds > 0
    second = SpeculativeDecoder(runner, right, GREEDY, confidence="schedule", plain_cost=1.0)
    assert list(second.timed_rounds) == timed
    beyond = statistics.median(s - 1e-6 for _, s in timed)
    assert second.round_costs() == pytest.approx([1e-6 + beyond] * (right.block + 1))


def test_schedule_drafts_where_its_forwards_were_measured_on_a_slower_machine(fixture_model, runner):
    """Verify forwards measured at ten times what a round takes now (10 s and more, where this
    machine's rounds take well under a second) and a plain step of 1 s: a drafter that is
    always right is taken up with rounds of several drafts, as the rounds show, and the reply
    is the undrafted one. The same costs given by the caller are taken as stated."""
    prompt = PROMPTS[1]
    plain = _reply(runner, prompt, GREEDY, max_tokens=40)
    right = TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=0)
    right.verify_costs = [10 * c for c in VERIFY_COSTS]  # (as measure_verify_costs leaves them)
    decoder = SpeculativeDecoder(runner, right, GREEDY, confidence="schedule", plain_cost=1.0)
    assert _reply(runner, prompt, GREEDY, decoder, max_tokens=40) == plain
    assert decoder.stats.stretches == 0 and decoder.stats.accepted_at[1] > 0
    # the same costs given by the caller are taken as stated: every round a probe of one draft
    stated = SpeculativeDecoder(runner, TurnsRight(runner.drafter, prompt + plain + [0] * 8, turn=0), GREEDY,
                                confidence="schedule", verify_costs=[10 * c for c in VERIFY_COSTS], plain_cost=1.0)
    assert _reply(runner, prompt, GREEDY, stated, max_tokens=40) == plain
    assert stated.stats.rounds > 10 and stated.stats.reached[1] == 0  # (no round verified a second draft)


def test_the_schedule_weighs_a_round_against_the_runners_plain_steps(fixture_model):
    """A round is weighed against the plain loop as the runner last ran it (any generation's
    plain steps), a one-row verify forward until there is one; the verdict follows the pace:
    one draft accepted in four (the first round's guess) pays against 3 s a plain token, not
    against 0.5 s."""
    with Runner(fixture_model) as fresh:
        decoder = SpeculativeDecoder(fresh, fresh.drafter, GREEDY, confidence="schedule", verify_costs=VERIFY_COSTS)
        assert decoder.plain_pace() == VERIFY_COSTS[0]
        _reply(fresh, PROMPTS[1], GREEDY, max_tokens=20)
        assert len(fresh.plain_pace) == 16 and decoder.plain_pace() == statistics.median(fresh.plain_pace)
        for pace, pays in ((3.0, True), (0.5, False)):
            fresh.plain_pace.extend([pace] * 16)
            decoder.outlook = Outlook(fresh.drafter.block)
            decoder.outlook.observe([0.9] * fresh.drafter.block, verified=1, accepted=0)
            decoder.decide(verified=1, accepted=0)
            assert decoder.outlook.paying is pays


def test_verify_all_and_threshold_decode_plainly_only_a_last_token(fixture_model, runner):
    """The policy's plain stretches belong to the schedule: `off` and `threshold` verify as told,
    in a round at every step but the last, where a round could verify no draft (a plain
    step then: the same token without a proposal)."""
    prompt = PROMPTS[1]
    wrong = TurnsRight(runner.drafter, prompt + _reply(runner, prompt, GREEDY, max_tokens=20) + [0] * 8, 10**9)
    for confidence in ("off", "threshold:0.5"):
        decoder = SpeculativeDecoder(runner, wrong, GREEDY, confidence=confidence)
        _reply(runner, prompt, GREEDY, decoder, max_tokens=20)
        # the anchor, then a round per token (every draft wrong), then the last token plainly
        assert (decoder.stats.rounds, decoder.stats.stretches, decoder.stats.plain_steps) == (18, 0, 1)


def test_outlook_weighs_seen_acceptance_against_a_plain_step():
    outlook = Outlook(block=3)
    assert outlook.acceptance() == [0.5, 0.5, 0.5]  # nothing seen: an even guess
    costs = [1.0, 1.5, 2.0, 2.5]  # a round verifying 0..3 drafts
    assert outlook.pays(costs, plain_s=1.2)  # one draft: 1.5 tokens in 1.5 s, over 1 in 1.2 s
    assert not outlook.pays(costs, plain_s=1.0)  # 1.5 tokens in 1.5 s: no better than plain
    outlook.observe([0.9, 0.9, 0.9], verified=3, accepted=0)  # the first draft rejected
    assert outlook.reached == [1.0, 0.0, 0.0] and outlook.accepted == [0.0, 0.0, 0.0]
    assert outlook.acceptance()[0] == 0.25
    assert not outlook.pays(costs, plain_s=1.0)  # best: 1.25 tokens in 1.5 s
    assert outlook.pays(costs, plain_s=2.0)  # a slow plain step: verifying one draft pays
    # calibration: the confidence scaled by (accepted + 1) / (predicted + 1) at each position
    assert outlook.calibrated([0.9, 0.9, 0.9]) == pytest.approx([0.9 / 1.9, 0.9, 0.9])
    outlook.observe([0.9, 0.9, 0.9], verified=0, accepted=0)  # nothing verified: a failed first draft
    assert outlook.reached[0] == pytest.approx(1.8) and outlook.accepted[0] == 0.0
    assert [outlook.stretch() for _ in range(5)] == [8, 16, 32, 64, 64]
    outlook.paid()
    assert outlook.stretch() == 8


def test_a_costly_probe_is_followed_by_a_stretch_that_bounds_its_share():
    """A failed probe that took 0.5 s for one token where a plain step takes 0.1 s (0.4 s beyond
    plain, as proposing on a CPU costs several plain steps): the stretches after it take at
    least 0.4 / (PROBE_SHARE * 0.1) tokens, so probing costs drafting that never pays at most
    that share; the doubling schedule's longer stretches stand, and a round that paid
    forgets the bound."""
    outlook = Outlook(block=3)
    outlook.probe_stretch(round_s=0.5, tokens=1, plain_s=0.1)
    least = math.ceil(0.4 / (Outlook.PROBE_SHARE * 0.1))
    assert least > Outlook.MAX_STRETCH
    assert [outlook.stretch() for _ in range(3)] == [least] * 3
    outlook.probe_stretch(round_s=0.15, tokens=1, plain_s=0.1)  # a cheap probe: the schedule's own
    assert outlook.stretch() == max(64, math.ceil(0.05 / (Outlook.PROBE_SHARE * 0.1)))
    outlook.probe_stretch(round_s=0.5, tokens=1, plain_s=0.1)
    outlook.paid()
    assert outlook.stretch() == Outlook.FIRST_STRETCH
    outlook.probe_stretch(round_s=0.18, tokens=2, plain_s=0.1)  # no slower than plain: no bound
    assert outlook.least_stretch == 0


def test_the_decoder_bounds_the_stretch_by_its_probes_cost(fixture_model, runner):
    """decide() weighs what such a round costs (round_costs: a one-draft verify forward's
    0.115 s plus the median of what rounds took beyond their forwards) against a plain step's
    0.1 s: 2 s beyond stretches for at least 2.015 / (PROBE_SHARE * 0.1) tokens; with nothing
    beyond (0.015 s over plain) the doubling schedule's 8 stand."""
    block = runner.drafter.block
    costs = [0.1, 0.115] + [0.1 * n for n in range(2, block + 1)]
    for beyond, expected in (([2.0, 2.0, 50.0], math.ceil(2.015 / (Outlook.PROBE_SHARE * 0.1))),
                             ([], Outlook.FIRST_STRETCH)):
        decoder = SpeculativeDecoder(runner, runner.drafter, GREEDY, confidence="schedule",
                                     verify_costs=costs, plain_cost=0.1)
        decoder.outlook = Outlook(block)
        # (50 s: a round that traced a new shape, not counted)
        decoder.timed_rounds.extend([(1, costs[1] + b) for b in beyond])
        for _ in range(5):
            decoder.outlook.observe([0.9] * block, verified=1, accepted=0)
        decoder.decide(verified=1, accepted=0)
        assert decoder.outlook.paying is False and decoder.plain_tokens(10**6) == expected


def test_verify_costs_are_measured_in_rounds_over_every_row_count():
    """measure_verify_costs times each round's row counts one after another (a slow stretch of
    host then slows all of them alike) and keeps each count's least time; every forward's
    rows are trimmed off again, and they are distinct tokens (as a round's drafts are: one
    repeated token routes its rows to the same experts, a cheaper forward)."""
    class Cache:
        trimmed = []

        def state(self):
            return []

        def trim(self, n):
            self.trimmed.append(n)

    class Model:
        args = types.SimpleNamespace(sliding_window=4, vocab_size=10)
        forwards = []

        def make_cache(self):
            return Cache()

        def __call__(self, ids, cache, last_logits_only=False):
            return mx.zeros((1,)), None

        def decode(self, ids, cache):
            self.forwards.append(list(ids))
            return mx.zeros((1,)), mx.zeros((1,))

    costs = measure_verify_costs(Model(), 3, repeats=2)
    assert [len(ids) for ids in Model.forwards] == [1, 2, 3, 1, 2, 3] and Cache.trimmed == [1, 2, 3, 1, 2, 3]
    three = Model.forwards[2]
    assert len(set(three)) == 3 and all(0 <= t < 10 for t in three)
    assert all(ids == three[: len(ids)] for ids in Model.forwards)
    assert len(costs) == 3 and all(0 <= c < 1 for c in costs)


@pytest.mark.parametrize("vocab", [8, 129280, 7919, 2 * 7919])
def test_verify_cost_tokens_are_distinct(vocab):
    tokens = verify_cost_tokens(8, vocab)
    assert len(set(tokens)) == 8 and all(0 <= t < vocab for t in tokens)


@pytest.mark.parametrize("spec", ["sometimes", "threshold:", "threshold:1.5", "threshold:x", ""])
def test_bad_confidence_policy_is_rejected(spec):
    with pytest.raises(ValueError, match="confidence"):
        ConfidencePolicy.parse(spec)


def test_verify_mode_is_checked_against_the_temperature():
    assert resolve_verify(None, GREEDY) == "greedy"
    assert resolve_verify(None, SamplingParams(temperature=0.7)) == "coupled"
    with pytest.raises(ValueError, match="unknown verify mode 'typical'"):
        resolve_verify("typical", GREEDY)
    with pytest.raises(ValueError, match="needs temperature 0"):
        resolve_verify("greedy", SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="needs a temperature > 0"):
        resolve_verify("rejection", GREEDY)


def test_drafting_arguments_without_a_drafter_are_rejected():
    no_drafter = types.SimpleNamespace(drafter=None)
    assert make_decoder(no_drafter, GREEDY) is None
    with pytest.raises(ValueError, match="needs DSpark stages"):
        make_decoder(no_drafter, GREEDY, draft=True)
    with pytest.raises(ValueError, match="drafting, which is off"):
        make_decoder(no_drafter, GREEDY, draft=False, verify="greedy")


def test_stats_count_conditional_acceptance_per_position():
    stats = DraftStats(block=5)
    stats.add_round(verified=5, accepted=2)  # drafts 1, 2 accepted, 3 rejected
    stats.add_round(verified=1, accepted=1)  # only draft 1 verified, accepted
    stats.add_round(verified=3, accepted=0)
    assert (stats.rounds, stats.proposed, stats.verified, stats.accepted) == (3, 15, 9, 3)
    assert stats.mean_accepted == 1.0
    assert stats.acceptance_by_position == [2 / 3, 1 / 1, 0 / 1, None, None]
