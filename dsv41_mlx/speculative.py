"""Exact speculative decoding with the DSpark drafter: one round at a time.

    propose -> confidence trim -> verify [anchor, drafts] in ONE target forward
    -> accept -> bonus token -> trim the target cache -> ingest -> next anchor

Under the `schedule` policy the decoder also decides whether to draft at all: where the
acceptance seen so far makes a round yield fewer tokens per second than plain decoding,
the loop (generate.drafted_steps) decodes a stretch of tokens plainly, then probes again.

The anchor is the token the target produced last; it sits at position P+1,
one past the target cache. Row j of the verify forward predicts the token at
position P+2+j, the slot of draft j+1.

Verification (the losslessness contract, DESIGN.md):
* `greedy` (temperature 0): accept while draft == target argmax.
* `coupled`: the token at position t is argmax(log p_t + G(seed, t)); the
  drafter picks its drafts with the same G, so accepting while equal gives
  exactly the undrafted reply for the same seed.
* `rejection`: drafts are sampled from q, kept with probability
  min(1, p/q), the first rejected one replaced by a draw from norm(max(0, p-q)):
  the reply is distributed as the target's, not identical to an undrafted one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

import mlx.core as mx

from .cache import DraftCache, ModelCache
from .runtime.drafter import Drafter, NoisyArgmax, Proposal, argmax_picker
from .runtime.runner import DecodeAhead, Runner
from .sampling import (ACCEPT, DRAFT, RESAMPLE, TARGET, SamplingParams, accept_or_resample, filtered_log_probs,
                       gumbel_noise, sample, uniform_noise)

VERIFY_MODES = ("greedy", "coupled", "rejection")


def check_drafting_arguments(draft: bool | None, verify: str | None, confidence: str | None) -> None:
    """verify and confidence are refused where drafting is off (draft False)."""
    if draft is False and (verify is not None or confidence is not None):
        raise ValueError("verify and confidence apply to drafting, which is off")


def resolve_verify(verify: str | None, params: SamplingParams) -> str:
    """The verification mode for these sampling parameters (None: greedy at T=0, else coupled)."""
    if verify is None:
        return "greedy" if params.greedy else "coupled"
    if verify not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {verify!r}; choose one of {', '.join(VERIFY_MODES)}")
    if (verify == "greedy") != params.greedy:
        need = "temperature 0" if verify == "greedy" else "a temperature > 0"
        raise ValueError(f"verify={verify!r} needs {need} (got temperature {params.temperature})")
    return verify


# ------------------------------------------------------------------ confidence

@dataclass(frozen=True)
class ConfidencePolicy:
    """How many drafts to verify, from the drafter's confidences c_k = P(draft k survives | prefix survived).

    * `off`: all of them.
    * `threshold`: the leading drafts whose survival probability prod_{i<=k} c_i is >= `threshold`.
    * `schedule`: the length l maximising (1 + sum_{j<=l} prod_{i<=j} c_i) / T_round(l+1)
      (the decoder passes confidences calibrated by the acceptance seen: Outlook),
      tokens expected per round over what a round verifying l+1 rows costs, growing l
      while the ratio improves (stops at the first non-improving l). T_round is the
      measured verify forward T_verify plus the round's other work (SpeculativeDecoder.
      round_costs): a round also proposes, reads the result back and ingests, whatever
      it verifies, and that fixed part makes longer verifies relatively cheaper.
    """

    mode: str = "off"
    threshold: float = 0.0

    @classmethod
    def parse(cls, spec: str | ConfidencePolicy) -> ConfidencePolicy:
        if isinstance(spec, ConfidencePolicy):
            return spec
        if spec in ("off", "schedule"):
            return cls(spec)
        if isinstance(spec, str) and spec.startswith("threshold:"):
            try:
                x = float(spec.split(":", 1)[1])
            except ValueError:
                x = -1.0
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"confidence {spec!r}: the threshold must be a number in [0, 1]")
            return cls("threshold", x)
        raise ValueError(f"unknown confidence policy {spec!r}; use off, threshold:X (0 <= X <= 1) or schedule")

    def verify_length(self, confidence: list[float], costs: list[float] | None) -> int:
        """How many of the drafts (confidence probabilities [block]) to verify."""
        if self.mode == "off":
            return len(confidence)
        survive, lengths = 1.0, []
        for c in confidence:
            survive *= c
            lengths.append(survive)
        if self.mode == "threshold":
            return next((k for k, s in enumerate(lengths) if s < self.threshold), len(lengths))
        expected, best = 1.0, 1.0 / costs[0]
        for ell, s in enumerate(lengths, start=1):
            expected += s
            rate = expected / costs[ell]
            if rate <= best:
                return ell - 1
            best = rate
        return len(lengths)


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x) of a confidence logit, on the host (no overflow at either end)."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class Outlook:
    """Whether drafting pays, from what the drafter's rounds have shown (the `schedule`
    policy). It keeps, per draft position k, decayed counts of the rounds that verified draft
    k after drafts 1..k-1 were accepted (`reached`), of those that accepted it, and of the
    confidence the drafter gave it there (`predicted`); the decay lets a drafter that starts
    matching (code, repeated text) win again.

    * `calibrated(c)`: this round's confidences scaled by how well they have predicted
      acceptance so far, for the round's verify length.
    * `pays(round_costs, plain_s)`: whether a round verifying l drafts, at the acceptance seen
      so far, yields more tokens per second than plain decoding, for the best l >= 1. When it
      does not, the loop decodes `stretch()` tokens plainly (no propose, no verify), then
      probes with one round; each probe that fails doubles the stretch, up to MAX_STRETCH,
      and makes it at least as long as keeps such a probe's cost beyond a plain step within
      PROBE_SHARE of the stretch's time (where proposing costs several plain steps, as on a
      CPU, probing then costs drafting that never pays at most that share).
    The drafter keeps its outlook across generations (a server's requests, a runner's
    replies), the stretch under way included (`plain_left`): a generation that ends inside a
    stretch leaves the rest of it to the next, which then probes when it is done, so that
    replies shorter than a stretch still probe now and then. Which drafts are verified never
    changes the reply, only its speed."""

    DECAY = 0.8  # per round: about the last five rounds count
    FIRST_STRETCH, MAX_STRETCH = 8, 64
    PROBE_SHARE = 0.03  # at most this share of a stretch's time goes to the failed probe after it
    ROUNDS_TIMED = 16  # the latest rounds whose seconds are kept (SpeculativeDecoder.round_costs)

    def __init__(self, block: int):
        self.reached, self.accepted, self.predicted = [0.0] * block, [0.0] * block, [0.0] * block
        # the latest rounds as (drafts verified, seconds the round took), for the drafter's
        # round costs (SpeculativeDecoder.round_costs)
        self.timed_rounds: deque[tuple[int, float]] = deque(maxlen=self.ROUNDS_TIMED)
        self.paying: bool | None = None  # the last round's verdict (None: no round yet)
        self.next_stretch = self.FIRST_STRETCH
        self.least_stretch = 0  # what the last failed probe's cost asks of a stretch (probe_stretch)
        self.plain_left = 0  # tokens of the stretch under way still to decode plainly before a round

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        """A round that verified `verified` drafts of confidences `confidence` and accepted the
        first `accepted` of them. One that verified none counts as one whose first draft
        failed: it proposed and gained nothing over a plain step."""
        for k in range(min(accepted + 1, max(verified, 1))):
            self.reached[k] = self.DECAY * self.reached[k] + 1.0
            self.accepted[k] = self.DECAY * self.accepted[k] + (1.0 if k < accepted else 0.0)
            self.predicted[k] = self.DECAY * self.predicted[k] + confidence[k]

    def acceptance(self) -> list[float]:
        """P(draft k accepted | 1..k-1 accepted) per position, as seen: one even guess until rounds show more."""
        return [(a + 0.5) / (r + 1.0) for a, r in zip(self.accepted, self.reached)]

    def calibrated(self, confidence: list[float]) -> list[float]:
        """The drafter's confidences scaled by accepted / predicted at each position so far."""
        return [min(1.0, c * (a + 1.0) / (p + 1.0)) for c, a, p in zip(confidence, self.accepted, self.predicted)]

    def pays(self, round_costs: list[float], plain_s: float) -> bool:
        """Whether the best round verifying l >= 1 drafts (round_costs[l]: its seconds) beats
        plain decoding's 1 / plain_s tokens per second."""
        expected, survive, best = 1.0, 1.0, 0.0
        for ell, a in enumerate(self.acceptance(), start=1):
            survive *= a
            expected += survive
            best = max(best, expected / round_costs[ell])
        return best > 1.0 / plain_s

    def stretch(self) -> int:
        """The plain tokens before the next probe: the doubling schedule's (each call doubles the
        next, up to MAX_STRETCH), or least_stretch where that is more."""
        n, self.next_stretch = self.next_stretch, min(2 * self.next_stretch, self.MAX_STRETCH)
        return max(n, self.least_stretch)

    def probe_stretch(self, round_s: float, tokens: int, plain_s: float) -> None:
        """A round that did not pay took round_s seconds for `tokens` tokens, where plain steps take
        plain_s each: the stretches after it are long enough that such a probe costs beyond
        plain decoding at most PROBE_SHARE of a stretch's time."""
        extra = round_s - tokens * plain_s
        self.least_stretch = math.ceil(extra / (self.PROBE_SHARE * plain_s)) if extra > 0 else 0

    def paid(self) -> None:
        """Drafting paid again: the next stretch starts short."""
        self.next_stretch, self.least_stretch = self.FIRST_STRETCH, 0


def verify_cost_tokens(rows: int, vocab: int) -> list[int]:
    """`rows` distinct token ids spread over the vocabulary (a fixed stride prime to any
    vocabulary size of the model's), for measure_verify_costs."""
    stride = 7919  # a prime: distinct ids for any vocab of at least `rows` that it does not divide
    if vocab % stride == 0:
        stride = 1
    return [(1 + stride * j) % vocab for j in range(rows)]


def measure_verify_costs(runner: Runner, rows: int, repeats: int = 3) -> list[float]:
    """Seconds for a target forward of 1..rows rows on a cache holding one window of
    positions: T_verify(n) = costs[n-1]. Measured on a scratch cache, the least of
    `repeats` rounds that each time every row count once: a stretch of slow host (the lent
    H200's host slows for seconds at a time) then slows every row count alike, where
    repeats of one count after another let it skew one count against the others.

    The rows are distinct tokens, as a round's drafts are: rows of one repeated token route
    to nearly the same experts, whose weights are then read once for all of them, so they
    cost less and the schedule would verify too many drafts."""
    cache = runner.make_cache()
    vocab = runner.args.vocab_size
    warm = mx.arange(runner.args.sliding_window, dtype=mx.int32)[None] % vocab
    logits, _ = runner(warm, cache, last_logits_only=True)
    mx.eval(logits, cache.state())
    tokens = verify_cost_tokens(rows, vocab)
    costs = [float("inf")] * rows
    for _ in range(repeats):
        for n in range(1, rows + 1):
            tic = time.perf_counter()
            logits, feats = runner.decode(tokens[:n], cache)
            mx.eval(logits, feats, cache.state())
            costs[n - 1] = min(costs[n - 1], time.perf_counter() - tic)
            cache.trim(n)
    return costs


# ----------------------------------------------------------------------- stats

@dataclass
class DraftStats:
    """What drafting did over one generation."""

    block: int
    rounds: int = 0
    proposed: int = 0
    verified: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)  # rounds where draft k was verified after k-1 accepted
    accepted_at: list[int] = field(default_factory=list)
    propose_s: float = 0.0
    verify_s: float = 0.0
    ingest_s: float = 0.0  # the host's, writing the accepted rows and starting it (their ring rows: in verify_s)
    plain_steps: int = 0  # tokens decoded plainly because drafting did not pay (schedule)
    stretches: int = 0  # runs of such tokens, each followed by a probing round
    proposed_ahead: int = 0  # rounds whose proposal the round before started (SpeculativeDecoder.round)
    verified_ahead: int = 0  # rounds whose verify forward the round before built and began, too

    def __post_init__(self):
        self.reached = self.reached or [0] * self.block
        self.accepted_at = self.accepted_at or [0] * self.block

    def add_round(self, verified: int, accepted: int) -> None:
        self.rounds += 1
        self.proposed += self.block
        self.verified += verified
        self.accepted += accepted
        for k in range(min(accepted + 1, verified)):
            self.reached[k] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """P(draft k accepted | drafts 1..k-1 accepted and k verified), per draft position."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    def as_dict(self) -> dict:
        ms = 1e3 / max(self.rounds, 1)
        return {"rounds": self.rounds, "proposed": self.proposed, "verified": self.verified,
                "accepted": self.accepted, "mean_accepted_per_round": self.mean_accepted,
                "acceptance_by_position": self.acceptance_by_position,
                "propose_ms_per_round": self.propose_s * ms, "verify_ms_per_round": self.verify_s * ms,
                "ingest_ms_per_round": self.ingest_s * ms, "plain_steps": self.plain_steps,
                "plain_stretches": self.stretches, "proposed_ahead": self.proposed_ahead,
                "verified_ahead": self.verified_ahead}

    def summary(self) -> str:
        d = self.as_dict()
        by_pos = " ".join("-" if a is None else f"{a:.2f}" for a in d["acceptance_by_position"])
        return (f"drafts: {d['rounds']} rounds, {d['proposed']} proposed, {d['verified']} verified, "
                f"{d['accepted']} accepted ({d['mean_accepted_per_round']:.2f}/round; by position {by_pos}) | "
                f"propose {d['propose_ms_per_round']:.1f} ms, verify {d['verify_ms_per_round']:.1f} ms, "
                f"ingest {d['ingest_ms_per_round']:.1f} ms per round"
                + (f" | {self.plain_steps} tokens decoded plainly in {self.stretches} stretches, where drafting "
                   "did not pay" if self.stretches else ""))


# ----------------------------------------------------------------------- round

@dataclass
class Ahead:
    """A round's proposal, started by the round before (SpeculativeDecoder.round), and where the
    runner builds forwards ahead, its verify forward of `verified` drafts, begun."""

    anchor: int
    position: int  # the anchor's
    proposal: Proposal
    build_s: float  # the host's seconds building the proposal, in the round before
    verify: DecodeAhead | None = None
    verified: int = 0  # the drafts the verify forward takes
    verify_build_s: float = 0.0  # the host's seconds building its first blocks (blocks_ahead of them)

    def cancel(self) -> None:
        """The verify forward abandoned (the cache as it was before it)."""
        if self.verify is not None:
            self.verify.cancel()
            self.verify = None


def verify_ids(anchor: int, drafts: mx.array, ell: int, rows: int) -> mx.array:
    """A verify forward's tokens as the device makes them: the anchor, then the first ell drafts,
    padded to `rows` with the last (Runner.padded's padding): int32 [rows]."""
    real = mx.concatenate([mx.array([anchor], dtype=mx.int32), drafts[:ell].astype(mx.int32)])
    return mx.concatenate([real, mx.broadcast_to(real[-1:], (rows - ell - 1,))]) if rows > ell + 1 else real


class SpeculativeDecoder:
    """Runs rounds for one sequence: the target cache, the drafter's rings, the mode."""

    def __init__(self, runner: Runner, drafter: Drafter, params: SamplingParams, verify: str | None = None,
                 confidence: str | ConfidencePolicy = "off", verify_costs: list[float] | None = None,
                 plain_cost: float | None = None, verify_ahead: bool | None = None):
        self.runner, self.drafter, self.params = runner, drafter, params
        self.verify = resolve_verify(verify, params)
        self.policy = ConfidencePolicy.parse(confidence)
        # costs given are taken as stated; measured ones are of one moment, which the rounds'
        # own times correct (round_costs)
        self.costs_measured = verify_costs is None
        if self.policy.mode == "schedule" and verify_costs is None:
            if drafter.verify_costs is None:  # measured once per loaded model
                drafter.verify_costs = measure_verify_costs(runner, drafter.block + 1)
            verify_costs = drafter.verify_costs
        self.costs = verify_costs
        self.stats = DraftStats(drafter.block)
        self.draft_cache: DraftCache | None = None  # set by begin
        # [1, n, F]: the DSpark features of the positions the last round committed (its anchor
        # and accepted drafts), for a caller that keeps a sequence's newest features
        self.committed_features: mx.array | None = None
        self.plain_cost = plain_cost  # seconds per plain token; None: the runner's plain steps' pace
        # what the drafter's rounds have shown, kept with it across generations: one that did not
        # pay before starts with plain steps, one that paid with rounds
        if self.policy.mode == "schedule" and drafter.outlook is None:
            drafter.outlook = Outlook(drafter.block)
        self.outlook = drafter.outlook if self.policy.mode == "schedule" else Outlook(drafter.block)
        self._ahead: Ahead | None = None  # the next round's proposal, started by the round before
        # whether a round begins the next round's verify forward (None: as the runner's options
        # say; it needs the runner to build ahead), and the blocks of it built before its drafts
        # are read back, adjusted to the proposal's time (_fit_blocks_ahead)
        wanted = runner.options.verify_ahead if verify_ahead is None else verify_ahead
        self.verify_ahead = wanted and runner.options.build_ahead
        self.blocks_ahead = max(1, len(runner.model.layers) // 4)

    @property
    def timed_rounds(self) -> deque[tuple[int, float]]:
        """The latest rounds' (drafts verified, seconds): the outlook's, kept with the drafter
        across generations, as its verify costs are."""
        return self.outlook.timed_rounds

    def begin(self, cache: ModelCache, features: mx.array) -> DraftCache:
        """The drafter's rings for a prefilled prompt: its newest n rows' features [n, 3*dim]
        (n >= min(window, prompt length)) ingested."""
        draft_cache = self.draft_cache = self.drafter.make_cache()
        self.cancel_ahead()
        draft_cache.end = cache.offset - features.shape[0]
        self.drafter.ingest(draft_cache, features)
        return draft_cache

    def plain_tokens(self, budget: int) -> int:
        """How many of the next `budget` tokens to decode plainly before the next round (0: a
        round now): what is left of the outlook's stretch (Outlook.plain_left, the rest kept
        for the next generation), counted as a stretch in the stats; else the one token a
        budget of one leaves (a round there could verify no draft: its proposal is wasted)."""
        n = min(self.outlook.plain_left, budget)
        self.outlook.plain_left -= n
        self.stats.stretches += n > 0
        return n or int(budget == 1)

    def plain_unused(self, n: int) -> None:
        """A reply ended (a stop token, or its caller stopped reading) with n tokens of a plain
        stretch not decoded: they go back to the stretch under way, the next generation's."""
        self.outlook.plain_left += n

    def after_plain(self, features: mx.array) -> None:
        """Plain steps decoded the positions draft_cache.end .. (features [n, 3*dim]): the rings
        catch up on them."""
        self.drafter.catch_up(self.draft_cache, features)

    def plain_pace(self) -> float:
        """Seconds per plain token: plain_cost where given, else the median of the runner's last
        plain steps (any generation's: a round is weighed against the plain loop as it runs,
        overlap and all), else a one-row verify forward's."""
        if self.plain_cost is not None:
            return self.plain_cost
        pace = self.runner.plain_pace
        return statistics.median(pace) if pace else self.costs[0]

    def round_costs(self) -> list[float] | None:
        """What a round verifying 1, 2, .. rows costs, for the schedule: the measured verify
        forwards (self.costs, on a short scratch cache) plus the median of what the drafter's
        latest rounds took beyond them (propose, read-backs, ingest, a longer cache; the
        median, because a round that traces a new shape takes far longer). Without that part
        the schedule verifies too few drafts.

        Where the forwards were measured here (once per drafter) and the rounds now take less
        than them, the machine ran slower when they were measured (a lent GPU's host ran a
        forward in half the time minutes later): the forwards are scaled by the median of the
        rounds' seconds over their forward's, so that a round is weighed at the pace plain
        steps are timed at now, not as dear as it was then. Costs the caller gave are taken
        as stated."""
        if self.costs is None:
            return None
        if not self.timed_rounds:
            return list(self.costs)
        extra = statistics.median(s - self.costs[v] for v, s in self.timed_rounds)
        if extra >= 0 or not self.costs_measured:
            return [c + max(extra, 0.0) for c in self.costs]
        scale = statistics.median(s / self.costs[v] for v, s in self.timed_rounds)
        return [c * scale for c in self.costs]

    def pick(self, position: int):
        """The drafter's picker for a block whose first draft sits at `position`."""
        params = self.params
        if self.verify == "greedy":
            return argmax_picker
        stream = TARGET if self.verify == "coupled" else DRAFT  # coupled: the very noise the target uses
        vocab = self.runner.args.vocab_size

        def pick(logits: mx.array, k: int, candidates: mx.array | None = None) -> mx.array:
            logq = filtered_log_probs(logits[None], params)[0]
            g = gumbel_noise(params.seed, mx.array([position + k]), vocab, stream)[0]
            if candidates is None:
                return mx.argmax(logq + g).astype(mx.int32)
            return candidates[mx.argmax(logq + g[candidates])].astype(mx.int32)  # the same noise, per token id

        if not params.filters:  # logq is logits / T less a constant: the one-launch rule
            pick.rule = NoisyArgmax(params.temperature,
                                    lambda n: gumbel_noise(params.seed, mx.arange(position, position + n), vocab, stream))
        return pick

    def round(self, cache: ModelCache, draft_cache, anchor: int, budget: int, stop: Container[int] = ()) -> list[int]:
        """One round from `anchor` (at position cache.offset): returns the new committed
        tokens after the anchor (accepted drafts, then the bonus token). Verifies at most
        budget-1 drafts, so the round returns at most `budget` tokens.

        Where another round follows (the tokens end neither the budget nor in a `stop` token,
        and the policy goes on drafting), the round starts that round's proposal before it
        returns: the device drafts from the new anchor while the caller handles the tokens."""
        anchor_pos = cache.offset
        tic = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        begun, built_s = None, 0.0  # the verify forward the round before began; its seconds on this round
        if ahead is not None and (ahead.anchor, ahead.position) == (anchor, anchor_pos):
            proposal, built_s = ahead.proposal, ahead.build_s
            self.stats.proposed_ahead += 1
            self.stats.propose_s += ahead.build_s
            if ahead.verify is not None and ahead.verified < budget:
                begun, ell, ahead.verify = ahead.verify, ahead.verified, None
                built_s += ahead.verify_build_s
                self.stats.verify_s += ahead.verify_build_s
        else:
            proposal = self.drafter.propose(draft_cache, anchor, self.pick(anchor_pos + 1))
        if ahead is not None:
            ahead.cancel()  # (a verify forward not taken up)
        start = tic - built_s  # the round's cost counts what the round before built for it
        mx.eval(proposal.drafts, proposal.logits, proposal.confidence)
        toc = time.perf_counter()
        self.stats.propose_s += toc - tic
        if begun is not None:
            self._fit_blocks_ahead(ahead.verify_build_s, toc - tic)

        confidence = [sigmoid(c) for c in proposal.confidence.tolist()]  # on the host: no launch, no wait
        if begun is None:
            ell = min(self.verify_length(confidence), budget - 1)
        drafts = proposal.drafts[:ell]
        if begun is not None:  # its engram rows written and the rest started: the drafts are known now
            logits, features = begun.finish_rows([anchor] + drafts.tolist())
            self.stats.verified_ahead += 1
        else:
            logits, features = self.runner.decode([anchor] + drafts.tolist(), cache)
        # the rows' ring rows built and started while the device still runs the forward (the
        # host waits for it next anyway): once the verdict is read, only their write is left
        ahead = self.drafter.ingest_ahead(draft_cache, features[0])
        accepted, next_token = self.accept(logits[0], proposal, ell, anchor_pos + 1, features)
        tic = time.perf_counter()
        self.stats.verify_s += tic - toc

        cache.trim(ell - accepted)
        ahead.commit(accepted + 1)
        self.committed_features = features[:, :accepted + 1]
        # started, not waited for: the device writes the rings while the host returns the
        # tokens and builds the next round's proposal and verify forward (the next propose
        # waits for them on the drafter's stream; a verify forward does not read them)
        mx.async_eval(draft_cache.rings)
        done = time.perf_counter()
        self.stats.ingest_s += done - tic
        self.stats.add_round(ell, accepted)
        if self.costs is not None:
            self.timed_rounds.append((ell, done - start))
        if self.policy.mode == "schedule":
            self.outlook.observe(confidence, ell, accepted)
            self.decide(ell, accepted)
        tokens = drafts[:accepted].tolist() + [next_token]
        if len(tokens) < budget - 1 and not any(t in stop for t in tokens) and not self.outlook.plain_left:
            self._propose_ahead(draft_cache, next_token, cache, budget - len(tokens))
        return tokens

    def _propose_ahead(self, draft_cache: DraftCache, anchor: int, cache: ModelCache, budget: int) -> None:
        """Start the next round's proposal, from `anchor` at cache.offset (on rings whose writes
        are started): its graph built now and its evaluation begun. Where the decoder begins
        verify forwards ahead (verify_ahead) and the verify length can be decided now
        (length_ahead), that round's verify forward too, on the drafts as the device makes them
        (Runner.verify_ahead): the host builds its first blocks_ahead blocks while the device
        proposes, and the round reads the drafts back and writes their engram rows before it
        builds the rest, the device running the first blocks meanwhile."""
        tic = time.perf_counter()
        position = cache.offset
        proposal = self.drafter.propose(draft_cache, anchor, self.pick(position + 1))
        mx.async_eval(proposal.drafts, proposal.logits, proposal.confidence)
        toc = time.perf_counter()
        ahead = self._ahead = Ahead(anchor, position, proposal, toc - tic)
        ell = self.length_ahead() if self.verify_ahead else None
        if ell is not None:
            ell = min(ell, budget - 1)
            ids = verify_ids(anchor, proposal.drafts, ell, self.runner.options.decode_rows or ell + 1)
            ahead.verify = self.runner.verify_ahead(ids, ell + 1, cache, self.blocks_ahead)
            ahead.verified, ahead.verify_build_s = ell, time.perf_counter() - toc

    def _fit_blocks_ahead(self, build_s: float, waited_s: float) -> None:
        """After a round whose verify forward had its first blocks_ahead blocks built ahead in
        build_s seconds, and whose host then waited waited_s for the drafts: the blocks to
        build ahead of the next. The device waits for the host's engram rows until the drafts
        are read back, so the host should build as many blocks as the proposal leaves it time
        for, not more: where it waited, as many more as would have filled that wait (one
        short); where it found the drafts ready, one fewer (they may have waited for it)."""
        blocks = self.blocks_ahead
        per_block = build_s / blocks
        if waited_s > per_block:
            blocks += int(waited_s / per_block) - 1
        else:
            blocks -= 1
        self.blocks_ahead = max(1, min(blocks, len(self.runner.model.layers)))

    def cancel_ahead(self) -> None:
        """Abandon the next round's proposal and verify forward, begun by the round before (a
        caller that stops drafting): the cache as it was before the verify forward."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()

    def length_ahead(self) -> int | None:
        """How many drafts the next round verifies, where that can be decided before its
        proposal is read back (so that its verify forward is built ahead): every one under
        `off`; under `schedule` the length that pays best at the acceptance seen so far
        (Outlook.acceptance, in place of the round's own calibrated confidences), and one while
        probing; None under `threshold`, whose length is the round's confidences'."""
        if self.policy.mode == "threshold":
            return None
        if self.policy.mode == "off":
            return self.drafter.block
        if not self.outlook.paying:
            return 1
        return self.policy.verify_length(self.outlook.acceptance(), self.round_costs())

    def verify_length(self, confidence: list[float]) -> int:
        """How many of the proposed drafts (confidences [block]) to verify: the policy's count,
        on confidences calibrated by the acceptance seen so far where the policy is the
        schedule. There, until a round has found that drafting pays, a probe verifies exactly
        one: the cheapest round that shows whether it does."""
        if self.policy.mode != "schedule":
            return self.policy.verify_length(confidence, self.round_costs())
        if not self.outlook.paying:
            return 1
        return self.policy.verify_length(self.outlook.calibrated(confidence), self.round_costs())

    def decide(self, verified: int, accepted: int) -> None:
        """After a round that verified `verified` drafts and accepted `accepted`: rounds go on
        where drafting pays (Outlook.pays); else a round that accepted every draft it verified
        is followed by another probe (a drafter that starts matching is taken up at once), and
        any other by plain steps (Outlook.stretch), among them a round that found no draft
        worth verifying (its propose gained nothing): as many as keep what such a round
        costs (round_costs: robust to one that traced a new shape) within
        Outlook.PROBE_SHARE of theirs."""
        costs, plain_s = self.round_costs(), self.plain_pace()
        self.outlook.paying = bool(verified) and self.outlook.pays(costs, plain_s)
        if self.outlook.paying:
            self.outlook.paid()
        elif not (verified and accepted == verified):
            self.outlook.probe_stretch(costs[verified], accepted + 1, plain_s)
            self.outlook.plain_left = self.outlook.stretch()

    def accept(self, logits: mx.array, proposal: Proposal, ell: int, first_pos: int,
               features: mx.array) -> tuple[int, int]:
        """Verify rows logits [ell+1, V] (row j predicts position first_pos + j) against the
        first ell drafts; returns (drafts accepted, the token after them). features (the
        verify forward's, for the drafter) are evaluated with the verdict: one wait for the
        device, whose values are then read on the host."""
        positions = mx.arange(first_pos, first_pos + ell + 1)
        if self.verify in ("greedy", "coupled"):
            target = sample(logits, positions, self.params)  # what plain decoding picks at each position
            mx.eval(target, features)
            drafts, picks = proposal.drafts[:ell].tolist(), target.tolist()  # the drafts evaluated before the forward
            accepted = next((j for j in range(ell) if drafts[j] != picks[j]), ell)
            return accepted, picks[accepted]
        # rejection: each row either keeps its draft or resamples; the bonus row samples p
        vocab = logits.shape[-1]
        p = mx.exp(filtered_log_probs(logits, self.params))
        g = gumbel_noise(self.params.seed, positions, vocab, RESAMPLE)
        bonus = mx.argmax(mx.log(p[ell]) + g[ell])
        if ell == 0:
            mx.eval(bonus, features)
            return 0, int(bonus.item())
        q = mx.exp(filtered_log_probs(proposal.logits[:ell], self.params))
        if proposal.candidates is not None:  # q lives on the candidates: zero elsewhere
            q = mx.put_along_axis(mx.zeros((ell, vocab), dtype=q.dtype), proposal.candidates[:ell], q, axis=-1)
        keep, token = accept_or_resample(p[:ell], q, proposal.drafts[:ell],
                                         uniform_noise(self.params.seed, positions[:ell], ACCEPT), g[:ell])
        mx.eval(keep, token, bonus, features)
        keep = keep.tolist()
        accepted = next((j for j, ok in enumerate(keep) if not ok), ell)
        return accepted, int(token.tolist()[accepted] if accepted < ell else bonus.item())
