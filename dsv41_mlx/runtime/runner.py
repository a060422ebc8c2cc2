"""The runner: when a model's forwards reach the device.

`Model.__call__` is the whole forward, one block after another. A Runner drives the same
steps (Model.start, Model.block, Model.finish) and decides only when their work is started:
each block as soon as it is built, from a thread of its own (evaluator.BlockEvaluator); a
decode forward built, and on CUDA started, before its token is read back (decode_ahead);
decode and verify forwards padded to one row count (Options.decode_rows). The graphs are the
model's own, so every choice gives the same bits (tests/test_model.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Iterable, Iterator

import mlx.core as mx
import numpy as np

from ..cache import ModelCache
from ..config import ModelArgs
from ..models.deepseek_v41 import Model
from .drafter import Drafter
from .evaluator import BlockEvaluator
from .options import Options, default_options
from .residency import cpu_buffer_cache
from .staged import StagedRows


PLAIN_PACE_KEPT = 16


class Runner:
    """Runs a Model's forwards with these Options (default: the device's, options.default_options),
    and holds beside the model the checkpoint's drafter (`drafter`: built from the model's DSpark
    stages, None without them), so that its FP8 head and measured verify costs last as long as
    the runner: keep one runner across generations.

    A runner and the drafter it built hold threads where the options evaluate on a thread:
    `close` it (or use it as a context manager) when done."""

    def __init__(self, model: Model, options: Options | None = None, drafter: Drafter | None = None):
        self.model = model
        self.args = model.args
        self.options = options if options is not None else default_options(model.args)
        cpu_buffer_cache()  # on the CPU: a step's freed buffers kept for the next
        self._owns_drafter = drafter is None and bool(model.mtp)
        self.drafter = drafter if drafter is not None else Drafter(model) if model.mtp else None
        self._evaluator = BlockEvaluator() if self.options.evaluate_on_thread else None
        # seconds per token of the latest plain steps (generate.plain_steps), which the drafting
        # schedule weighs a round against
        self.plain_pace: deque[float] = deque(maxlen=PLAIN_PACE_KEPT)

    def close(self) -> None:
        if self._evaluator is not None:
            self._evaluator.close()
            self._evaluator = None
        if self._owns_drafter:
            self.drafter.evaluate_on_thread = False  # its thread stopped

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def make_cache(self) -> ModelCache:
        return self.model.make_cache()

    def __call__(self, ids: mx.array, cache: ModelCache | None = None, last_logits_only: bool = False,
                 real_rows: int | None = None, rows_after: int | None = None) -> tuple[mx.array, mx.array]:
        """The model's forward of ids [1, S] -> (logits [1, S, V], features [1, S, F]), its blocks
        started as Options say. rows_after: a prefill's chunk, this many positions of the prompt
        after it: where Options.elide_prefill, each layer past the last KV source computes only
        the rows later reads need (prefill_rows), so logits and features cover the last rows
        only (the same values there), or are None where no row reaches the head."""
        cache = cache if cache is not None else self.make_cache()
        # ids' values on the host (Model.start checks their shape): where ids was made from them, no device work
        return _result(self._forward(ids, cache, np.asarray(ids)[0].tolist(), last_logits_only, real_rows,
                                     rows_after=rows_after))

    def decode(self, ids: list[int], cache: ModelCache) -> tuple[mx.array, mx.array]:
        """A decode or verify forward of a few tokens: logits [1, n, V], features [1, n, F],
        padded to Options.decode_rows rows (the padding trimmed off the cache again)."""
        n = len(ids)
        rows = self.options.decode_rows or n
        if n > rows:
            raise ValueError(f"a decode forward takes at most {rows} rows, got {n}")
        return self.padded(ids, cache, rows)

    def padded(self, ids: list[int], cache: ModelCache, rows: int, last_logits_only: bool = False,
               rows_after: int | None = None) -> tuple[mx.array, mx.array]:
        """A forward of ids padded to `rows` rows (the last token repeated), the padding
        trimmed off the cache again (rows - len(ids) <= cache.TRIM_SLACK): logits [1, n, V]
        (or the last real row's [1, 1, V]) and features [1, n, F] of the n real rows."""
        logits, features = self(padded_ids(ids, rows), cache, last_logits_only, real_rows=len(ids),
                                rows_after=rows_after)
        return without_padding(logits, features, cache, rows - len(ids), last_logits_only)

    def prefill_chunks(self, chunks: Iterable[tuple[list[int], int, int]],
                       cache: ModelCache) -> Iterator[tuple[mx.array | None, mx.array | None]]:
        """A prompt's chunks, each (ids, rows, rows_after), run into the cache in order: yields
        padded(ids, cache, rows, last_logits_only=True, rows_after=rows_after) of each in turn
        (where Options.elide_prefill, only the last chunk may have padding: prefill_rows keeps
        its rows for the trim only at the prompt's end). The caller evaluates what it keeps of
        a chunk before it asks for the next (generate.prefill); a runner may begin the next
        chunk before this one is back (PipelineRunner)."""
        for ids, rows, rows_after in chunks:
            yield self.padded(ids, cache, rows, last_logits_only=True, rows_after=rows_after)

    def decode_ahead(self, token: mx.array, cache: ModelCache, on_forward_stream: bool = False) -> DecodeAhead:
        """decode([t], cache) begun while the token t (int [1], as sampling.sample makes it) is
        still being computed: the forward's first block, which reads no engram, is built and
        started on the device at once, and the rest waits for t on the host
        (DecodeAhead.finish). So the device runs block 0 straight after the work that makes t,
        where decode would leave it idle while the host reads t back and builds block 0. The
        same graph, the same bits as decode.

        Where build_ahead, the rest is built now as well, every block and the head, and only
        started by finish, once t's engram rows are written into the buffer the graph reads
        (StagedRows, one per cache): the host builds a forward while the device runs the one
        before, and at the step's boundary only reads t, hashes it, writes its rows and starts
        the blocks built. Where gate_rows as well, the blocks are started now, the engram rows
        read through a gate on the device that the host opens once it has written them
        (kernels.rows_gate): at the boundary the device waits only for the host to read t, hash
        it and write its rows. finish(t, settle=False) then returns while the evaluator's
        thread still starts them, for a caller whose next call is decode_ahead (which settles
        it) or settle: generate_step's loop. on_forward_stream: the token was drawn under
        forward_stream(), so the evaluator's thread starts its work straight after the forward
        before's blocks, before the host builds this forward."""
        rows = self.options.decode_rows or 1
        # the forward reads t through a node of its own (same buffer): the caller waits for
        # `token` while the evaluator's thread may still be starting block 0 (evaluator.py: why
        # the two must not share an array)
        queued = self.options.build_ahead and on_forward_stream and self._building_evaluator is not None
        with self.forward_stream() if queued else contextlib.nullcontext():
            feed = mx.stop_gradient(token)
        if not self.options.build_ahead:
            mx.async_eval(token, feed)  # t's work started from this thread, before the evaluator's may read it
            forward = self._forward(feed, cache, None, False, 1, rows)
            next(forward)  # up to where it waits for the token
            return DecodeAhead(forward, cache, rows, self._blocks_before_tokens)
        if queued:
            self._evaluator.submit(token, feed)  # after the forward before's blocks, on its thread
            token_started = self._evaluator.mark()
        return self._begin_built_ahead(feed, cache, rows, 1, None if queued else (token, feed),
                                       token_started if queued else None)

    def verify_ahead(self, ids: mx.array, real_rows: int, cache: ModelCache, blocks: int | None = None) -> DecodeAhead:
        """decode(tokens, cache) of a verify forward begun while its tokens are still being
        computed (Options.build_ahead): ids int32 [rows], rows = Options.decode_rows or
        real_rows, the anchor and drafts of a proposal as the device makes them, padded as
        Runner.padded pads (the last real token repeated). Its first `blocks` blocks (None:
        all, and the head) are built now, their engram rows read from the cache's StagedRows,
        and started as decode_ahead's are (where gate_rows, behind the gate), so that the host
        builds them while the device still proposes the drafts. DecodeAhead.finish_rows(tokens),
        with the real rows' values read back, writes their engram rows, starts what waited for
        them and builds the rest, each block started as it is built (the device runs the
        first blocks meanwhile), and returns decode's (logits [1, n, V], features [1, n, F]):
        the same graph, the same bits. The caller must not wait for ids itself (it waits for
        what ids is made of: the drafts)."""
        if not self.options.build_ahead:
            raise ValueError("verify_ahead builds a forward ahead of its tokens: it needs Options.build_ahead")
        rows = self.options.decode_rows or real_rows
        if ids.shape != (rows,) or not 0 < real_rows <= rows:
            raise ValueError(f"verify_ahead takes ids of shape ({rows},) with 1..{rows} real rows; "
                             f"got {ids.shape} with {real_rows}")
        return self._begin_built_ahead(ids, cache, rows, real_rows, (ids,), None, blocks)

    def _begin_built_ahead(self, ids: mx.array, cache: ModelCache, rows: int, real_rows: int,
                           own: tuple[mx.array, ...] | None, started, blocks: int | None = None) -> DecodeAhead:
        """_forward_built_ahead's forward of ids (a token [1] on every row, or [rows]) built and
        its first blocks started: `own`, the arrays the ids are made of that this thread starts
        (once the forward before is started whole), or None where the evaluator's thread
        starts them (`started`: its mark after them, which the caller's next wait needs)."""
        forward = self._forward_built_ahead(ids, cache, rows, real_rows, blocks)
        layers = len(self.model.layers)
        begun = DecodeAhead(forward, cache, rows, layers if blocks is None else min(blocks, layers), self.settle,
                            self.forward_stream, real_rows)
        try:
            next(forward)  # its blocks built ahead (all, for a decode), none started
            if own is not None:
                self.settle()  # the forward before started whole: this thread may start the ids' work
                mx.async_eval(*own)
            forward.send(None)  # the blocks that need no tokens started (all of them, where gated)
            if started is not None:  # the caller then waits for t: the thread must be done with t's work
                self._evaluator.drain(started)
        except BaseException:  # (the evaluator drained; the cache, as after any failed forward, not to be reused)
            forward.close()
            raise
        return begun

    def forward_stream(self):
        """A context manager: the stream forwards build their graphs on (the evaluator's, where
        overlap_build starts their blocks on its thread; else the caller's own). What is built
        under it from a forward's outputs may be handed to that thread: decode_ahead's
        on_forward_stream."""
        evaluator = self._building_evaluator
        return mx.stream(evaluator.stream) if evaluator is not None else contextlib.nullcontext()

    def settle(self) -> None:
        """Wait until the evaluator's thread has started everything handed to it (nothing to wait
        for without one): before this thread evaluates, or waits for, anything a forward built
        (DecodeAhead.finish(t, settle=False) returns without it)."""
        if self._evaluator is not None:
            self._evaluator.drain()

    @property
    def _building_evaluator(self) -> BlockEvaluator | None:
        """The evaluator forwards hand their blocks to as they are built, where overlap_build."""
        return self._evaluator if self.options.overlap_build else None

    @functools.cached_property
    def _blocks_before_tokens(self) -> int:
        """The blocks a forward builds before it needs its tokens on the host (decode_ahead):
        block 0, unless it has an engram (whose table rows the tokens pick)."""
        return 0 if 0 in self.model.engram_layers else 1

    def _starting(self):
        """How a forward starts its blocks: (the evaluator or None, a context manager for the
        stream its graph is built on, begin(*arrays): start them on the device now, where
        overlap_build)."""
        evaluator = self._building_evaluator
        overlap = self.options.overlap_build

        def begin(*arrays: mx.array) -> None:
            if evaluator is not None:
                evaluator.submit(*arrays)
            elif overlap:
                mx.async_eval(*arrays)

        return evaluator, self.forward_stream, begin

    def _forward(self, ids: mx.array, cache: ModelCache, tokens: list[int] | None, last_logits_only: bool,
                 real_rows: int | None, rows: int = 1, rows_after: int | None = None):
        """A forward of positions cache.offset.., as a generator that returns (logits, features).
        tokens: ids' values on the host; or None, where ids is a token [1] still being computed on
        the device (decode_ahead; a forward of `rows` rows, the token on each): then it builds its
        first _blocks_before_tokens blocks from ids alone and waits for the tokens (`tokens =
        yield`) before the rest. Each block is started as it is built where overlap_build (on
        the evaluator's thread, with the graph built on its stream: only while building, so that
        the caller's own work while the forward waits stays on the caller's stream); the
        evaluator is drained on the way out, also where the generator is closed at its wait."""
        model = self.model
        evaluator, building, begin = self._starting()
        row_invariant = self.options.decode_rows is not None
        keep = {}
        if rows_after is not None and self.options.elide_prefill:
            S = ids.shape[1]
            keep = prefill_rows(self.args, S, S - (real_rows or S), rows_after)

        def blocks(first: int, last: int, engram_rows: dict[int, mx.array]) -> bool:
            for i in range(first, last):
                if i in keep and not model.keep_last(forward, cache, i, keep[i]):
                    return False  # no row of this forward reaches layer i or any after it
                model.block(i, forward, cache, engram_rows.get(i))
                begin(forward.h, forward.pre)
            return True

        try:
            with building():
                if tokens is None:  # the token on each row: a view, made on the stream the forward is built on
                    ids = mx.broadcast_to(ids.astype(mx.int32).reshape(1, 1), (1, rows))
                forward = model.start(ids, cache, real_rows, row_invariant)
                ahead = self._blocks_before_tokens if tokens is None else 0
                blocks(0, ahead, {})
            if tokens is None:
                tokens = yield
            with building():
                engram_rows = model.take_tokens(cache, tokens, real_rows)
                if engram_rows:  # they read host memory: started as early as the tokens are known
                    begin(*engram_rows.values())
                if not blocks(ahead, len(model.layers), engram_rows):
                    return None, None
                logits, feats = model.finish(forward, last_logits_only)
                if evaluator is not None:
                    evaluator.submit(logits, feats)
        finally:
            if evaluator is not None:
                evaluator.drain()  # before the caller evaluates anything itself
        return logits, feats

    def _forward_built_ahead(self, ids: mx.array, cache: ModelCache, rows: int, real_rows: int = 1,
                             blocks: int | None = None):
        """decode_ahead's and verify_ahead's forward where build_ahead, as a generator: it
        builds its first `blocks` blocks (None: every block and the head) from the ids still
        being computed (a token [1], on every one of the `rows` rows; or [rows]), the first
        real_rows real, the engram layers reading the cache's StagedRows, and starts nothing
        (next); then starts the blocks that need no tokens (send(None)); then, sent the tokens,
        writes the real rows' engram rows into the StagedRows, appends the tokens to the
        cache, starts the rest, builds the blocks not built yet, each started as it is built,
        and returns (logits, features) without draining the evaluator (the caller settles it).
        Closed or failing, it drains the evaluator on the way out.

        Gated (gate_rows): the engram rows are read through a gate (StagedRows.values(gated=True)),
        and send(None) starts every block: the device waits at the gate until the host, sent
        the tokens, has written the rows and released it, and the evaluator's thread has queued
        the forward's launches meanwhile. A gate begun is released however the generator ends
        (closed: the forward runs on the rows before, its results dropped)."""
        model = self.model
        evaluator, building, begin = self._starting()
        settled = gate_begun = False
        try:
            with building():
                ids = mx.broadcast_to(ids.astype(mx.int32).reshape(1, -1), (1, rows))
                forward = model.start(ids, cache, real_rows, self.options.decode_rows is not None)
                staged = self._staged_rows(cache, rows)
                gated = staged is not None and self.options.gate_rows
                values = dict(zip(model.engram_layers, staged.values(gated))) if staged is not None else {}
                built, whole = [], blocks is None or blocks >= len(model.layers)
                for i in range(len(model.layers) if whole else blocks):
                    model.block(i, forward, cache, values.get(i))
                    built.append((forward.h, forward.pre))
                logits, feats = model.finish(forward) if whole else (None, None)
            yield
            ahead = self._blocks_before_tokens
            for arrays in built[:ahead]:
                begin(*arrays)
            begin(*forward.shared.early)
            rest = ([tuple(values.values())] if values else []) + built[ahead:]  # the rows first
            rest += [(logits, feats)] if whole else []
            if gated:  # queued on the device now, behind the gate, rather than after the rows' write
                gate_begun = True
                for arrays in rest:
                    begin(*arrays)
                rest = []
            tokens = yield
            if staged is not None:
                staged.write(model.engram_reads(cache.tokens, tokens[:real_rows]))
            cache.tokens.extend(tokens)
            if gate_begun:
                gate_begun = False
                staged.release()
            for arrays in rest:
                begin(*arrays)
            if not whole:  # the blocks not built yet, each started as soon as it is built
                with building():
                    for i in range(len(built), len(model.layers)):
                        model.block(i, forward, cache, values.get(i))
                        begin(forward.h, forward.pre)
                    logits, feats = model.finish(forward)
                begin(logits, feats)
            settled = True
        finally:
            if gate_begun:  # abandoned, or failed, with its gate begun: the device goes on (on the rows before)
                staged.release(check=False)
            if evaluator is not None and not settled:
                evaluator.drain()
        return logits, feats

    def _staged_rows(self, cache: ModelCache, rows: int) -> StagedRows | None:
        """The cache's StagedRows for forwards of `rows` rows (made on first use, with a gate
        where gate_rows), None without engram layers."""
        model = self.model
        if not model.engram_layers:
            return None
        gate = self.options.gate_rows
        staged = cache.staged_rows.get(rows)
        if staged is None or (gate and staged.flag is None):
            n_cols = (self.args.engram_max_ngram_size - 1) * self.args.engram_n_heads
            shapes = []
            for i in model.engram_layers:
                table = model.layers[i].engram.table
                shapes += [(rows, n_cols, table.codes.shape[1]), (rows, n_cols, table.scales.shape[1])]
            staged = cache.staged_rows[rows] = StagedRows(shapes, gated=gate)
        return staged


PREFILL_ROWS_STEP = 16  # prefill_rows rounds up to it: a prompt's forwards then take few shapes


def prefill_rows(args: ModelArgs, rows: int, pad: int, rows_after: int) -> dict[int, int]:
    """How many of a prefill forward's last rows each layer past the last KV source (and the
    last engram) must compute: {layer: rows}, for a forward of `rows` rows (its last `pad`
    padding) with `rows_after` positions of the prompt after it.

    Such a layer keeps only its own window of keys. The last layer's outputs are read at the
    prompt's last position (the logits), and its keys at the last `window` positions (the
    window decode reads, and the padding trimmed after it): it computes those rows. Each layer
    before it must give correct outputs wherever the next one computes, and a row's output
    reads the keys of the window - 1 rows before it: window - 1 rows more (which cover the
    DSpark features of the last window too). Rounded up to PREFILL_ROWS_STEP: the extra leading
    rows only feed rows whose outputs nothing reads."""
    last = args.num_hidden_layers - 1
    first = max([*args.kv_source_layer_ids, *args.engram_layer_ids], default=-1) + 1
    w = args.sliding_window
    out = {}
    for i in range(first, last + 1):
        need = w + (last - i) * (w - 1) + pad - rows_after
        out[i] = min(rows, max(0, -(-need // PREFILL_ROWS_STEP) * PREFILL_ROWS_STEP))
    return out


def padded_ids(ids: list[int], rows: int) -> mx.array:
    """ids padded to `rows` rows, the last token repeated: int32 [1, rows]."""
    return mx.array([ids + [ids[-1]] * (rows - len(ids))], dtype=mx.int32)


def without_padding(logits: mx.array | None, features: mx.array | None, cache: ModelCache, pad: int,
                    last_logits_only: bool) -> tuple[mx.array | None, mx.array | None]:
    """A padded forward's (logits, features) with its last `pad` rows, the padding, trimmed off
    the cache and cut off the outputs (Runner.padded)."""
    cache.trim(pad)
    if features is None:  # an elided prefill chunk that reached no head
        return None, None
    kept = features.shape[1] - pad  # (an elided prefill's features cover its last rows)
    return (logits if last_logits_only else logits[:, :kept]), features[:, :kept]


def _result(forward, tokens: list[int] | None = None) -> tuple[mx.array, mx.array]:
    """A Runner._forward generator run on to its (logits, features): started, or sent the tokens
    it waits for. It has its tokens then, so it must not wait again."""
    try:
        forward.send(tokens)
    except StopIteration as done:
        return done.value
    raise AssertionError("a forward waited for tokens it had been given")


class DecodeAhead:
    """A decode forward begun before its token is on the host (Runner.decode_ahead), or a verify
    forward before its drafts are (Runner.verify_ahead): its first blocks built and started,
    the rest waiting for the tokens (or built and waiting to be started, where build_ahead).
    `finish(t)` (`finish_rows(tokens)`) builds or starts the rest with the tokens' values and
    returns decode's (logits [1, n, V], features [1, n, F]); `cancel()` abandons it (a caller
    that stops before the next token) and leaves the cache as it was before."""

    def __init__(self, forward, cache: ModelCache, rows: int, blocks_built: int, settle=None,
                 stream=contextlib.nullcontext, real_rows: int = 1):
        self._forward, self._cache, self._rows, self._built = forward, cache, rows, blocks_built
        self.real_rows = real_rows
        self._settle = settle  # (where the forward returns without draining the evaluator)
        self._stream = stream  # the stream its outputs' first rows are taken on (the forward's)

    def finish(self, token: int, settle: bool = True) -> tuple[mx.array, mx.array]:
        """The forward for the token's value t (read back from the token decode_ahead was given:
        a forward built ahead reads its engram rows from a buffer the forward before read, so t
        must come after it). settle=False: return while the evaluator's thread may still be
        starting the forward's blocks, for a caller that builds on the result and then calls
        decode_ahead or Runner.settle before evaluating or waiting for anything."""
        return self.finish_rows([token], settle)

    def finish_rows(self, tokens: list[int], settle: bool = True) -> tuple[mx.array, mx.array]:
        """finish, for the values of the forward's real rows (verify_ahead's anchor and drafts)."""
        if len(tokens) != self.real_rows:
            raise ValueError(f"this forward was begun for {self.real_rows} tokens, got {len(tokens)}")
        forward, self._forward = self._forward, None  # (nothing left to cancel, even if this fails)
        padded = tokens + [tokens[-1]] * (self._rows - len(tokens))  # as Runner.padded pads
        logits, features = _result(forward, padded)
        if settle and self._settle is not None:
            self._settle()
        n = len(tokens)
        self._cache.trim(self._rows - n)
        with self._stream():
            return logits[:, :n], features[:, :n]

    def cancel(self) -> None:
        if self._forward is None:  # finished (or failed finishing)
            return
        self._forward.close()  # the evaluator drained (_forward's finally)
        self._forward = None
        for layer in self._cache.layers[:self._built]:  # the blocks built wrote their layers' caches
            layer.trim(self._rows)
