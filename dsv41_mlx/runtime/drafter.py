"""The DSpark drafter at work: ingest the target's committed features into each stage's ring,
and propose a block of drafts from an anchor (reference `forward_spec`).

* `ingest`: for committed positions p, each stage writes
  `fp8q(rope_p(kv_norm(wkv(main_x_p))))` into ring slot `p % window`.
* `propose`: from the anchor a at position P+1 (the token the target just produced, not yet
  in its cache), the block `[a, noise x (block-1)]` at positions P+1..P+block runs through
  the stages (models/dspark.py); the target's head gives base logits U; the Markov stage
  then picks drafts one by one, `logits_k = U_k + W2 e_k` with `e_k = W1[x_{k-1}]`, x_0 = a
  (with the FP8 head, for the samplers' pick rules, in one launch: kernels.markov_drafts).

The propose pass is built on streams of its own, and on a GPU started stage by stage from a
thread of its own, beside the target's forwards.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from tqdm import tqdm

from ..cache import DraftCache
from ..kernels import fp8_rows_top64, markov_drafts
from ..models.dspark import DSparkStage
from ..models.hyper import hc_expand, hc_pre
from ..quant import Fp8Matrix, fp8_input, quantize_fp8_tiles_mx
from .evaluator import BlockEvaluator, switched

log = logging.getLogger(__name__)

F32, BF16 = mx.float32, mx.bfloat16


def _on(stream: mx.Stream | None):
    """mx.stream(stream), or no change when stream is None."""
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


class IngestAhead:
    """Drafter.ingest_ahead's rows, waiting for the number of positions to commit."""

    def __init__(self, drafter: Drafter, cache: DraftCache, rows: mx.array, n: int):
        self._drafter, self._cache, self._rows, self._n = drafter, cache, rows, n

    def commit(self, m: int) -> None:
        """Write the first m of the n positions into the rings (all n where n exceeds the
        window: only the newest rows were computed)."""
        n, window = self._n, self._drafter.window
        if not 0 < m <= n or (m < n and n > window):
            raise ValueError(f"cannot commit {m} of {n} positions (a ring holds {window})")
        with mx.stream(self._drafter.stream):
            self._cache.write(self._rows if m == n else self._rows[:, :m], m)


@dataclass
class Proposal:
    drafts: mx.array  # [block] int32: x_1 .. x_block
    logits: mx.array  # [block, n] fp32: Markov-biased draft logits (what each draft was picked from)
    confidence: mx.array  # [block] fp32: confidence-head logits (sigmoid -> P(draft k survives | prefix survived))
    candidates: mx.array | None = None  # [block, n] token ids of the logits' columns; None: n = vocab


# pick(logits [n] fp32, k, candidates [n] | None) -> token id [] int32: how draft k is
# chosen from its logits over the candidate tokens (the whole vocabulary when None)
Picker = Callable[[mx.array, int, "mx.array | None"], mx.array]


@dataclass(frozen=True)
class NoisyArgmax:
    """A picker's rule where the Markov pass can run in one launch (kernels.markov_drafts): draft
    k is the candidate with the largest logits / temperature + noise(k), noise(n) giving the
    first n positions' noise over the vocabulary [n, V] (None: no noise). A Picker that follows
    it says so in its `rule` attribute."""

    temperature: float = 1.0
    noise: Callable[[int], mx.array] | None = None


def argmax_picker(logits: mx.array, k: int, candidates: mx.array | None = None) -> mx.array:
    best = mx.argmax(logits, axis=-1)
    return (best if candidates is None else candidates[best]).astype(mx.int32)


argmax_picker.rule = NoisyArgmax()


HEADS = ("fp8", "bf16")


class Drafter:
    """DSpark on top of a loaded target: the stages `model.mtp`, the target's embedding and head.

    head 'bf16': the target's own head over the whole vocabulary, exactly as the
    reference. head 'fp8' (the default): an FP8 copy of that head (release
    format, built once on first use) through the fused fp8_rows kernel, which
    keeps the 64 best tokens per position; the Markov bias, the pick and the
    draft distribution are then taken over those 64 candidates. Drafts may
    differ; replies cannot, since the target verifies every draft.
    """

    def __init__(self, model, head: str = "fp8", concurrent: bool = True):
        if not model.mtp:
            raise ValueError("this checkpoint has no DSpark stages (num_nextn_predict_layers / dspark_block_size)")
        if head not in HEADS:
            raise ValueError(f"unknown drafter head {head!r}; choose one of {', '.join(HEADS)}")
        args = model.args
        self.model = model
        self.head = head
        self._fp8_head: Fp8Matrix | None = None
        # The propose pass is built on its own stream; with `concurrent`, independent
        # branches (each stage's key path, the first Markov gather) on a second one.
        # Dependencies between them are carried by the arrays alone. MLX streams
        # belong to the thread that made them, so each thread gets its own pair.
        self.concurrent = concurrent
        self._streams = threading.local()
        self.block = args.dspark_block_size
        self.noise_id = args.dspark_noise_token_id
        self.window = args.sliding_window
        self.hc = args.hc_mult
        self.verify_costs: list[float] | None = None  # T_verify(1..block+1) in s, filled by speculative.py
        self.outlook = None  # whether drafting pays, as rounds have shown (speculative.Outlook), filled there
        self._evaluator: BlockEvaluator | None = None
        self.evaluate_on_thread = mx.default_device() == mx.gpu

    @property
    def stages(self) -> list[DSparkStage]:
        return self.model.mtp

    @property
    def stream(self) -> mx.Stream:
        """This thread's stream for the propose pass."""
        if not hasattr(self._streams, "main"):
            device = mx.default_device()
            self._streams.main = mx.new_stream(device)
            self._streams.side = mx.new_stream(device) if self.concurrent else None
        return self._streams.main

    @property
    def side_stream(self) -> mx.Stream | None:
        """This thread's second stream (None when proposing serially)."""
        self.stream
        return self._streams.side

    @property
    def evaluate_on_thread(self) -> bool:
        """Whether a propose pass hands each stage and the head, as soon as built, to a
        BlockEvaluator of the drafter's own (its thread encodes stage k while Python builds
        stage k + 1, as the target's forward does), the pass then built on that thread's
        stream and serially (no side stream: a thread-unsafe stream's work is evaluated by
        one thread). Otherwise the whole pass is built, then evaluated by the caller. The
        same operations in the same order: the same bits (tests/test_streams.py)."""
        return self._evaluator is not None

    @evaluate_on_thread.setter
    def evaluate_on_thread(self, on: bool) -> None:
        self._evaluator = switched(self._evaluator, on)

    @property
    def fp8_head(self) -> Fp8Matrix:
        """The drafter's FP8 copy of the target's BF16 head, built on first use."""
        if self._fp8_head is None:
            self.build_fp8_head()
        return self._fp8_head

    def build_fp8_head(self, progress: bool = False) -> None:
        """Quantise the target's head to the release FP8 format (in 32-row-aligned chunks, so a
        progress bar can follow and no fp32 copy of the whole head exists at once)."""
        tic = time.perf_counter()
        weight = self.model.head.weight
        rows = weight.shape[0]
        step = max(32, -(-rows // 16) // 32 * 32)
        parts = []
        for start in tqdm(range(0, rows, step), desc="drafter FP8 head", unit="chunk", disable=not progress):
            part = quantize_fp8_tiles_mx(weight[start: start + step])
            mx.eval(part.codes, part.scales)
            parts.append(part)
        self._fp8_head = Fp8Matrix(mx.concatenate([p.codes for p in parts]), mx.concatenate([p.scales for p in parts]))
        mx.eval(self._fp8_head.codes, self._fp8_head.scales)
        log.info("drafter FP8 head: %s, %.2f GB, built in %.2f s", "x".join(map(str, self._fp8_head.shape)),
                 self._fp8_head.nbytes / 1e9, time.perf_counter() - tic)

    def make_cache(self) -> DraftCache:
        return DraftCache(len(self.stages), self.window, self.model.args.head_dim)

    def ring_rows(self, features: mx.array, positions: mx.array) -> mx.array:
        """Target features [n, 3*dim] of positions [n] -> every stage's ring rows [stages, n, D] bf16."""
        first = self.stages[0]
        main_x = fp8_input(first.main_norm(first.main_proj(features.astype(BF16))))  # once for every stage
        return mx.stack([stage.attn.latent_kv(main_x, stage.attn.rope.tables(positions, stage.attn.head_dim))
                         for stage in self.stages])

    def ingest(self, cache: DraftCache, features: mx.array) -> None:
        """Write the committed positions cache.end .. cache.end+n-1 (features [n, 3*dim]) into the rings.

        Only the newest `window` rows can survive in a ring, so only those are computed. Built
        on the drafter's stream, which the next propose pass reads the rings on anyway: a
        round that starts its ingest without waiting for it (SpeculativeDecoder.round) leaves
        the default stream free, so the round's next small reads (the oracle drafter's
        confidences, the samples) do not queue behind it.
        """
        self.ingest_ahead(cache, features, start=False).commit(features.shape[0])

    def catch_up(self, cache: DraftCache, features: mx.array) -> None:
        """ingest of positions cache.end .. cache.end+n-1 (features [n, 3*dim]) that plain steps
        decoded, in pieces of at most block + 1 rows: the sizes rounds ingest (so no new shape
        is built). Positions older than the newest `window` are passed over: the newest window
        rows write every slot they would take."""
        skip = max(0, features.shape[0] - self.window)
        cache.end += skip
        for start in range(skip, features.shape[0], self.block + 1):
            self.ingest(cache, features[start: start + self.block + 1])

    def ingest_ahead(self, cache: DraftCache, features: mx.array, start: bool = True) -> IngestAhead:
        """ingest's work begun before the caller knows how many of the positions cache.end ..
        cache.end+n-1 (features [n, 3*dim]) it commits: every stage's ring rows of the newest
        `window` of them built on the drafter's stream and, with `start`, started on the device
        now (mx.async_eval); IngestAhead.commit(m) writes the first m. A round begins it while
        the device still runs its verify forward, so that once the verdict is read the host
        writes the rows the drafts accepted at once. Each row's ring rows are its own: an
        ingest of the m rows computes the same (on a GPU a kernel may sum a row in another
        order at another row count, as ingests of however many rows rounds accept do already:
        the drafts may move by a rounding, the reply never)."""
        n = features.shape[0]
        keep = min(n, self.window)
        with mx.stream(self.stream):
            positions = mx.arange(cache.end + n - keep, cache.end + n)
            rows = self.ring_rows(features[n - keep:], positions)
        if start:
            mx.async_eval(rows)
        return IngestAhead(self, cache, rows, n)

    def propose(self, cache: DraftCache, anchor: int | mx.array, pick: Picker = argmax_picker,
                built: Callable[..., None] | None = None) -> Proposal:
        """Draft `block` tokens after the anchor, which sits at position cache.end.

        Builds one lazy graph on the drafter's stream(s), evaluated by the caller; with
        evaluate_on_thread, started stage by stage on the evaluator's thread as it is built.
        built(*arrays): called with each stage's outputs, then the head's, as they are built
        (scripts/count_ops.py counts each part's launches so).
        """
        evaluator = self._evaluator
        side = self.side_stream if evaluator is None else None
        for stage in self.stages:
            stage.attn.side_stream = side
        if evaluator is None:
            with mx.stream(self.stream):
                return self._propose(cache, anchor, pick, side, built)
        if self.head == "fp8":
            self.fp8_head  # built (and evaluated) on this thread before the evaluator's runs
        mx.async_eval(cache.rings, *([anchor] if isinstance(anchor, mx.array) else []))  # this thread's work, started here
        def begin(*arrays: mx.array) -> None:
            evaluator.submit(*arrays)
            if built is not None:
                built(*arrays)

        try:
            with mx.stream(evaluator.stream):
                return self._propose(cache, anchor, pick, None, begin)
        finally:
            evaluator.drain()

    def _propose(self, cache: DraftCache, anchor: int | mx.array, pick: Picker, side: mx.Stream | None,
                 begin: Callable[..., None] | None = None) -> Proposal:
        B = self.block
        positions = mx.arange(cache.end, cache.end + B)
        anchor = mx.array(anchor, dtype=mx.int32).reshape(1)
        ids = mx.concatenate([anchor, mx.full((B - 1,), self.noise_id, dtype=mx.int32)])
        h, pre = hc_expand(self.model.embed(ids), self.hc)  # [B, hc, dim], [B, hc]
        valid = cache.valid()
        for k, stage in enumerate(self.stages):
            h, pre = stage(h, pre, positions, cache.rings[k], valid)
            if begin is not None:
                begin(h, pre)
        last = self.stages[-1]
        markov = last.markov_head
        rule = getattr(pick, "rule", None)
        in_one_launch = self.head == "fp8" and rule is not None  # the Markov pass: kernels.markov_drafts
        if not in_one_launch:
            with _on(side):  # e_1 = W1[anchor] (and over the whole vocabulary its bias) needs no head
                first_embed = markov.embed(anchor)
                first_bias = markov.bias(first_embed) if self.head == "bf16" else None
        hidden = hc_pre(h, pre)  # [B, dim] bf16, pre-norm (the confidence head reads this)
        if self.head == "fp8":
            base, candidates = fp8_rows_top64(last.norm(hidden), self.fp8_head)  # [B, 64] each
        else:
            base, candidates = self.model.head(last.norm(hidden)), None  # [B, vocab] fp32
        if begin is not None:  # the head too, before the Markov steps are built
            begin(base, *([] if candidates is None else [candidates]))
        if in_one_launch:
            noise = None if rule.noise is None else mx.take_along_axis(rule.noise(B), candidates, axis=-1)
            drafts, logits, embeds = markov_drafts(base, candidates, markov.head.weight, markov.embed.weight,
                                                    anchor, rule.temperature, noise)
            return Proposal(drafts, logits, last.confidence_head(hidden, embeds), candidates)
        # the candidates' Markov head rows, every position's in one gather; and each position's
        # rows by slices, not integer indices (each of which would be a gather of its own)
        head_rows = None if candidates is None else markov.head_rows(candidates)  # [B, 64, rank]
        prev = anchor
        drafts, logits, embeds = [], [], []
        for k in range(B):
            cand = None if candidates is None else candidates[k:k + 1]  # [1, 64]
            e = first_embed if k == 0 else markov.embed(prev)
            bias = first_bias if k == 0 and first_bias is not None else \
                markov.bias(e) if cand is None else markov.bias_at(e, head_rows[k:k + 1])
            row = (base[k:k + 1] + bias).reshape(-1)
            prev = pick(row, k, None if cand is None else cand.reshape(-1)).reshape(1)
            drafts.append(prev)
            logits.append(row)
            embeds.append(e)
        confidence = last.confidence_head(hidden, mx.concatenate(embeds))
        return Proposal(mx.concatenate(drafts), mx.stack(logits), confidence, candidates)
