"""Pipeline parallelism over mx.distributed: the target's layers split across ranks.

Rank r holds a contiguous range of the target's layers (a StageModel: the others are
placeholders with no parameters) and their caches. Rank 0 also holds the embedding, the
final norm, the head and the DSpark stages, and drives generation: generate_step and the
speculative round run there unchanged, through a PipelineRunner. The ranks form a ring
(mlx.launch's ring backend sends only to neighbours):

    rank 0: embed, its blocks -> rank 1: its blocks -> ... -> rank N-1: its blocks -> rank 0: norm, head

A forward's stream leaves a rank as the rank's last block left it (a whole stream, an
Expansion or a Folded, hyper.py), with its pre-mix and the DSpark features tapped so far, so
every block runs on what it would run on in one process: the same bits. The logits are made
on rank 0, where the token is sampled; the next command carries it to every rank. A
prompt's chunks follow one another: rank 0 runs its blocks of the next chunk while the
other ranks run the one before (PipelineRunner.prefill_chunks).

Commands (rank 0 -> 1 -> ... -> N-1, each rank acting on one before passing it on):
  NEW c       a sequence's cache c begins          DROP c      cache c is gone
  TRIM c n    forget cache c's newest n positions  STOP        leave the loop
  COPY c d r  cache d begins as a copy of cache c (r: with room to grow; a prefix cache's)
  FORWARD c   a forward's tokens, and the stream from the rank before; the last rank sends
              the stream on to rank 0 (the only message that returns)
Each message is a fixed header of int32 (the op, its fields, each array's dtype and shape),
then its arrays.

A rank may start only at a layer from which on no layer reads what a layer before it leaves
behind (cut_points): a KV source's compressed cache, an index source's top-k within a
forward, the candidate source's block mask. Such state is never sent: a split that would
need it is refused, naming the layer.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import LayerCache, ModelCache
from ..config import ModelArgs
from ..models.attention import SharedAttention
from ..models.deepseek_v41 import Forward, Model
from ..models.hyper import Expansion, Folded, HyperConnection
from ..models.layers import positions_of
from .options import Options, default_options
from .runner import Runner, padded_ids, prefill_rows, without_padding

log = logging.getLogger("dsv41_mlx")


class PipelineError(ValueError):
    """A split that does not fit the model, or ranks that cannot work together."""


# ------------------------------------------------------------------ the split

def parse_split(text: str) -> list[range]:
    """'0:20,20:40' -> [range(0, 20), range(20, 40)] (one range of layers per rank, in rank
    order); PipelineError where the text is not such a list."""
    ranges = []
    for part in text.split(","):
        bounds = part.strip().split(":")
        try:
            start, stop = (int(b) for b in bounds)
        except ValueError:
            raise PipelineError(f"expected ranges of layers like 0:20,20:40, got {text!r}") from None
        ranges.append(range(start, stop))
    return ranges


def format_split(ranges: list[range]) -> str:
    return ",".join(f"{r.start}:{r.stop}" for r in ranges)


def read_before(args: ModelArgs, start: int) -> tuple[int, int, str] | None:
    """The first layer at or after `start` that reads what a layer before `start` leaves for it
    within a forward or in the cache: (that layer, the layer it reads, what), else None.
    Compressed layers read their KV source's compressed cache (Attention.kv_source); those
    that are no index source reuse the last index source's top-k; index sources past the
    candidate source read its block mask (SharedAttention)."""
    for j in range(start, args.num_hidden_layers):
        if not args.compress_ratios[j]:
            continue
        source = args.kv_source_of(j)
        if source < start:
            return j, source, "the compressed KV cache"
        if j not in args.index_source_layer_ids:
            source = args.index_source_of(j)
            if source < start:
                return j, source, "the indexer's top-k"
        elif 0 <= args.candidate_source_layer_id < min(j, start):
            return j, args.candidate_source_layer_id, "the candidate blocks"
    return None


def cut_points(args: ModelArgs) -> list[int]:
    """The layers a rank after the first may start at (read_before finds nothing)."""
    return [s for s in range(1, args.num_hidden_layers) if read_before(args, s) is None]


def check_split(args: ModelArgs, ranges: list[range], ranks: int) -> None:
    """PipelineError, naming the problem, unless `ranges` gives each of `ranks` ranks one
    non-empty range of layers, in order, together every layer once, each starting where
    nothing it reads lies on a rank before (cut_points)."""
    n = args.num_hidden_layers
    if len(ranges) != ranks:
        raise PipelineError(f"the split {format_split(ranges)} has {len(ranges)} ranges for {ranks} ranks: "
                            "give one range of layers per rank")
    covered = 0
    for r in ranges:
        if len(r) == 0:
            raise PipelineError(f"the range {r.start}:{r.stop} holds no layer")
        if r.start > covered:
            raise PipelineError(f"layers {covered}..{r.start - 1} are in no range of the split")
        if r.start < covered:
            raise PipelineError(f"layers {r.start}..{min(covered, r.stop) - 1} are in two ranges of the split")
        covered = r.stop
    if covered < n:
        raise PipelineError(f"layers {covered}..{n - 1} are in no range of the split (the model has {n} layers)")
    if covered > n:
        raise PipelineError(f"the split reaches layer {covered - 1}, but the model has {n} layers (0..{n - 1})")
    for rank, r in enumerate(ranges[1:], start=1):
        found = read_before(args, r.start)
        if found is not None:
            layer, source, what = found
            holder = next(k for k, other in enumerate(ranges) if source in other)
            raise PipelineError(f"rank {rank} starts at layer {r.start}, but layer {layer} reads {what} of layer "
                                f"{source}, which rank {holder} holds; a rank may start only at layers "
                                f"{', '.join(map(str, cut_points(args)))}")


def balance(layer_bytes: list[int], first_extra: int, ranks: int, starts: list[int]) -> list[range]:
    """The split of layers 0..n-1 (layer_bytes [n]: each one's resident bytes) into `ranks`
    contiguous ranges, those after the first beginning at one of `starts`, whose largest
    rank in bytes is least, the first rank's counting `first_extra` too (embedding, head,
    drafter); of equal ones, the one with the earliest cuts."""
    n = len(layer_bytes)
    points = [0, *sorted({s for s in starts if 0 < s < n}), n]
    if len(points) - 2 < ranks - 1:
        raise PipelineError(f"this model's {n} layers split at most {len(points) - 1} ways (a rank may start only "
                            f"at layers {', '.join(map(str, points[1:-1]))}); {ranks} ranks were launched")
    total = [0, *itertools.accumulate(layer_bytes)]
    # best[k][j]: (the least largest rank of ranks 0..k-1 holding layers 0..points[j]-1, its k-1th cut)
    best: list[dict[int, tuple[int, int]]] = [{0: (0, -1)}]
    for k in range(1, ranks + 1):
        row = {}
        for j in range(1, len(points)):
            for i, (worst, _) in best[k - 1].items():
                if i >= j:
                    continue
                load = total[points[j]] - total[points[i]] + (first_extra if k == 1 else 0)
                cost = max(worst, load)
                if j not in row or cost < row[j][0]:
                    row[j] = (cost, i)
        best.append(row)
    ranges, j = [], len(points) - 1
    for k in range(ranks, 0, -1):
        i = best[k][j][1]
        ranges.append(range(points[i], points[j]))
        j = i
    return ranges[::-1]


def split_digest(ranges: list[range]) -> bytes:
    return hashlib.sha256(format_split(ranges).encode()).digest()


def agree(group: mx.distributed.Group, digest: bytes, what: str) -> None:
    """PipelineError on every rank unless every rank of the group gives the same digest (its
    first 8 bytes compared) of `what`."""
    mine = mx.array(np.frombuffer(digest[:8], dtype=np.uint32))[None]
    every = np.array(mx.distributed.all_gather(mine, group=group, stream=mx.cpu))
    differ = [r for r in range(group.size()) if not np.array_equal(every[r], every[0])]
    if differ:
        raise PipelineError(f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} of the pipeline "
                            f"{'do' if len(differ) > 1 else 'does'} not have the same {what} as rank 0")


# ------------------------------------------------------- one rank's part

class Absent(nn.Module):
    """A layer another rank holds: no parameters; or, for the layer right after this rank's
    range, only its attention's mix projection (hc_attn), through which this rank's last
    block may hand its output on with the next block's mixes begun (Model.block's folding),
    as one process does."""

    def __init__(self, args: ModelArgs | None = None):
        super().__init__()
        if args is not None:
            self.hc_attn = HyperConnection(args)


class StageModel(Model):
    """The part of the target rank `rank` of a pipeline holds: the blocks of its range of
    `ranges` (the rest Absent), and on rank 0 the embedding, final norm and head (the DSpark
    stages, `mtp`, are set beside them by io.load, as for a Model). Nothing of another rank's
    part is allocated: a Model's parameters exist only once evaluated."""

    def __init__(self, args: ModelArgs, ranges: list[range], rank: int):
        super().__init__(args)
        self.ranges, self.rank = ranges, rank
        self.held = ranges[rank]
        n = args.num_hidden_layers
        # the next rank's first block, where this rank's last block folds into it
        self.boundary = self.held.stop if self.held.stop < n and self._folds_into_next[self.held.stop - 1] else None
        self.layers = [layer if i in self.held else Absent(args if i == self.boundary else None)
                       for i, layer in enumerate(self.layers)]
        if rank > 0:
            self.embed = self.norm = self.head = None
        if not self.engram_layers:
            self.hasher = None

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == len(self.ranges) - 1

    @functools.cached_property
    def _folds_into_next(self) -> tuple[bool, ...]:
        """Model's, from the config (another rank's blocks have no modules to ask)."""
        n = self.args.num_hidden_layers
        return tuple(i + 1 < n and i + 1 not in self.args.engram_layer_ids for i in range(n))

    def holds(self, name: str) -> bool:
        """Whether the tensor or parameter `name` (a release name or its module path) is this rank's."""
        top, _, rest = name.partition(".")
        if top != "layers":
            return self.first
        layer, _, inside = rest.partition(".")
        return int(layer) in self.held or (int(layer) == self.boundary and inside.startswith("hc_attn"))

    def make_cache(self, cache_id: int = 0, owner: PipelineRunner | None = None) -> StageCache:
        """Model.make_cache's caches of the layers this rank holds (StageCache's id and owner)."""
        args = self.args
        return StageCache([LayerCache(args.sliding_window, args.compress_ratios[i] if layer.attn.is_kv_source else 0)
                           if i in self.held else None for i, layer in enumerate(self.layers)], cache_id, owner)

    def blocks(self, forward: Forward, cache: StageCache, keep: dict[int, int],
               engram_rows: dict[int, mx.array]) -> bool:
        """This rank's blocks of a forward (Runner._forward's loop over its range): False where no
        row of it reaches a layer (prefill_rows), its windows and the rest's passed over."""
        for i in self.held:
            if i in keep and not self.keep_last(forward, cache, i, keep[i]):
                return False
            self.block(i, forward, cache, engram_rows.get(i))
        return True

    def pass_over(self, cache: StageCache, rows: int) -> None:
        """This rank's layers let `rows` positions go by (a forward none of whose rows reach them)."""
        for i in self.held:
            cache.layers[i].window.pass_over(rows)


class StageCache(ModelCache):
    """One sequence's state on one rank: the caches of the layers it holds (None for the
    others'), and the whole token history, which every rank keeps alike (the engram reads
    it). On rank 0 its owner, the PipelineRunner, has every rank trim or copy its part too."""

    def __init__(self, layers: list[LayerCache | None], cache_id: int = 0, owner: PipelineRunner | None = None):
        super().__init__(layers)
        self.id = cache_id  # what the commands name it by
        self._owner = owner

    def _held(self) -> ModelCache:
        """A ModelCache of the layers held, sharing this one's token history."""
        held = ModelCache([layer for layer in self.layers if layer is not None])
        held.tokens = self.tokens
        return held

    def trim(self, n: int) -> None:
        self._held().trim(n)
        if self._owner is not None and n:
            self._owner.tell_trim(self.id, n)

    def state(self) -> list[mx.array]:
        return self._held().state()

    def snapshot(self) -> list[mx.array]:
        return self._held().snapshot()

    def copy(self, room: bool = True) -> StageCache:
        """ModelCache.copy on every rank (a prefix cache's entries and resumes): each rank copies
        its part under a new id."""
        if self._owner is not None:
            return self._owner.copy_cache(self, room)
        return self.copy_here(self.id, room)

    def copy_here(self, cache_id: int, room: bool, owner: PipelineRunner | None = None) -> StageCache:
        """This rank's part of a copy, named cache_id: the layers held, and the token history."""
        other = StageCache([layer.copy(room) if layer is not None else None for layer in self.layers], cache_id, owner)
        other.tokens = list(self.tokens)
        return other


# -------------------------------------------------------------- messages

NEW, DROP, TRIM, STOP, FORWARD, COPY = range(1, 7)
MAX_FIELDS, MAX_ARRAYS, MAX_DIMS = 12, 10, 4
HEADER = 2 + MAX_FIELDS + 1 + MAX_ARRAYS * (2 + MAX_DIMS)
DTYPES = [mx.bool_, mx.uint8, mx.int32, mx.uint32, mx.int64, mx.float16, mx.bfloat16, mx.float32]


@dataclass
class Message:
    op: int
    fields: list[int]
    arrays: list[mx.array]


@dataclass
class LinkCounts:
    """What a Link has moved and the seconds it spent (bench.py pipeline reads them)."""
    sent: int = 0  # messages
    sent_bytes: int = 0  # their headers and arrays
    ready_s: float = 0.0  # evaluating the arrays of a message before sending it (the work that made them)
    send_s: float = 0.0  # sending it
    received: int = 0
    received_bytes: int = 0
    wait_s: float = 0.0  # until a message's header came: waiting for the rank before
    recv_s: float = 0.0  # its arrays after the header: moving bytes (they were ready before it was sent)

    def copy(self) -> LinkCounts:
        return replace(self)


class Link:
    """This rank's place in the ring: it sends to the next rank, (rank + 1) % size, and
    receives from the one before (the only peers mlx.launch's ring backend connects).
    Distributed ops run on the CPU stream (the GPU backends have none). `counts` adds up
    the messages, bytes and seconds of each way."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.counts = LinkCounts()

    def send(self, message: Message) -> None:
        header = np.zeros(HEADER, dtype=np.int32)
        header[0], header[1] = message.op, len(message.fields)
        header[2: 2 + len(message.fields)] = message.fields
        at = 2 + MAX_FIELDS
        header[at] = len(message.arrays)
        for k, a in enumerate(message.arrays):
            meta = at + 1 + k * (2 + MAX_DIMS)
            header[meta], header[meta + 1] = DTYPES.index(a.dtype), a.ndim
            header[meta + 2: meta + 2 + a.ndim] = a.shape
        tic = time.perf_counter()
        mx.eval(message.arrays)  # all of it computed before the header goes: the receiver then waits for bytes only
        ready = time.perf_counter()
        for a in [mx.array(header), *message.arrays]:  # one at a time: each arrives in the order sent
            mx.eval(mx.distributed.send(a, self.next, group=self.group, stream=mx.cpu))
        counts = self.counts
        counts.sent += 1
        counts.sent_bytes += header.nbytes + sum(a.nbytes for a in message.arrays)
        counts.ready_s += ready - tic
        counts.send_s += time.perf_counter() - ready

    def recv(self) -> Message:
        tic = time.perf_counter()
        head = self._recv((HEADER,), mx.int32)
        came = time.perf_counter()
        header = head.tolist()
        op, n_fields = header[0], header[1]
        at = 2 + MAX_FIELDS
        arrays = []
        for k in range(header[at]):
            meta = at + 1 + k * (2 + MAX_DIMS)
            dtype, ndim = DTYPES[header[meta]], header[meta + 1]
            arrays.append(self._recv(tuple(header[meta + 2: meta + 2 + ndim]), dtype))
        counts = self.counts
        counts.received += 1
        counts.received_bytes += head.nbytes + sum(a.nbytes for a in arrays)
        counts.wait_s += came - tic
        counts.recv_s += time.perf_counter() - came
        return Message(op, header[2: 2 + n_fields], arrays)

    def _recv(self, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        a = mx.distributed.recv(shape, dtype, self.prev, group=self.group, stream=mx.cpu)
        mx.eval(a)
        return a


STREAM_FORMS = (type(None), mx.array, Expansion, Folded)  # a form's index is its code (0: no row left)


@dataclass
class Step:
    """What each rank needs of a forward besides its stream: FORWARD's fields (None sent as -1)."""
    cache: int
    start: int  # the forward's first position
    rows: int  # its rows, padding included
    real_rows: int | None  # the forward's real rows (Model.start's)
    rows_after: int | None  # a prefill chunk's positions of the prompt after it (prefill_rows); None: all rows
    row_invariant: bool
    dropped: int = 0  # leading rows no longer computed (Forward.dropped)
    form: int = 0  # the stream's form (STREAM_FORMS)
    features: int = 0  # whether the DSpark features tapped so far travel with it

    def values(self) -> list[int]:
        return [-1 if v is None else int(v) for v in (getattr(self, f.name) for f in fields(self))]

    @classmethod
    def of(cls, values: list[int]) -> Step:
        step = cls(*values)
        step.real_rows = None if step.real_rows < 0 else step.real_rows
        step.rows_after = None if step.rows_after < 0 else step.rows_after
        step.row_invariant = bool(step.row_invariant)
        return step

    def keep(self, args: ModelArgs) -> dict[int, int]:
        """Runner._forward's prefill elision: {layer: rows it computes}."""
        if self.rows_after is None:
            return {}
        return prefill_rows(args, self.rows, self.rows - (self.real_rows or self.rows), self.rows_after)


def forward_message(step: Step, tokens: list[int], forward: Forward | None) -> Message:
    """A forward's tokens and, where some row is left (forward not None), its stream as this
    rank's blocks left it, pre-mix and features."""
    arrays = [mx.array(tokens, dtype=mx.int32)]
    step = replace(step, form=0, features=0, dropped=0)
    if forward is not None:
        h = forward.h
        step.form, step.dropped, step.features = STREAM_FORMS.index(type(h)), forward.dropped, bool(forward.features)
        arrays += [*(h if isinstance(h, tuple) else [h]), forward.pre]
        if forward.features:
            arrays.append(mx.concatenate(forward.features, axis=-1))
    return Message(FORWARD, step.values(), arrays)


def received_forward(step: Step, arrays: list[mx.array]) -> Forward | None:
    """The Forward a FORWARD message carries on (arrays after its tokens), for the blocks of
    this rank, as Model.start and the blocks before left it: None where no row is left."""
    if step.form == 0:
        return None
    form = STREAM_FORMS[step.form]
    parts = len(form._fields) if form is not mx.array else 1
    h = form(*arrays[:parts]) if parts > 1 else arrays[0]
    pre, features = arrays[parts], arrays[parts + 1:]
    first, rows = step.start + step.dropped, step.rows - step.dropped
    real = None if step.real_rows is None else step.real_rows - step.dropped
    shared = SharedAttention(real, np.arange(first, first + rows), step.row_invariant)
    return Forward(positions_of(first, rows), h, pre, shared, real, list(features), step.dropped)


# ------------------------------------------------------------ the ranks

class PipelineRunner(Runner):
    """Rank 0's Runner of a pipeline: each forward runs rank 0's blocks, goes round the ring
    (every other rank runs its own, following the same commands: serve) and comes back for
    the norm and head here. The model's drafter, with the DSpark stages, runs here too, so
    generate_step and the speculative round use it as they use a Runner; a trim of any of its
    caches is sent to every rank. A prompt's chunks follow one another round the ring, this
    rank running its blocks of the next while the others run the one before (prefill_chunks);
    decode and verify forwards run one at a time, none begun ahead (decode_ahead's plain
    fallback). `close` (or the context manager) stops the other ranks."""

    def __init__(self, model: StageModel, link: Link, options: Options | None = None):
        options = options if options is not None else default_options(model.args)
        super().__init__(model, replace(options, overlap_build=False, evaluate_on_thread=False, build_ahead=False,
                                        gate_rows=False))
        self.link = link
        self._ids = itertools.count(1)
        self._dropped: list[int] = []  # caches gone since the last command (weakref.finalize)
        self._stopped = False

    def close(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._command(STOP)
        super().close()

    def _command(self, op: int, *values: int) -> None:
        self._send_drops()
        self.link.send(Message(op, list(values), []))

    def _send_drops(self) -> None:
        """DROP the caches gone since the last command (before the next, from this thread)."""
        while self._dropped:
            self.link.send(Message(DROP, [self._dropped.pop()], []))

    def tell_trim(self, cache_id: int, n: int) -> None:
        self._command(TRIM, cache_id, n)

    def copy_cache(self, cache: StageCache, room: bool) -> StageCache:
        """StageCache.copy: this rank's part copied here, every other rank's there (COPY)."""
        copy = cache.copy_here(next(self._ids), room, self)
        self._command(COPY, cache.id, copy.id, int(room))
        weakref.finalize(copy, self._dropped.append, copy.id)
        return copy

    def make_cache(self) -> StageCache:
        cache = self.model.make_cache(next(self._ids), self)
        self._command(NEW, cache.id)
        weakref.finalize(cache, self._dropped.append, cache.id)
        return cache

    def __call__(self, ids: mx.array, cache: StageCache | None = None, last_logits_only: bool = False,
                 real_rows: int | None = None, rows_after: int | None = None) -> tuple[mx.array, mx.array]:
        """Runner's forward, across the ranks."""
        cache = cache if cache is not None else self.make_cache()
        self._send_drops()
        self.link.send(self._begin(ids, cache, real_rows, rows_after))
        return self._returned(cache, last_logits_only)

    def prefill_chunks(self, chunks: Iterable[tuple[list[int], int, int]],
                       cache: StageCache) -> Iterator[tuple[mx.array | None, mx.array | None]]:
        """Runner's, the chunks following one another round the ring: while the other ranks run
        chunk k, this rank runs its blocks of chunk k + 1 (they read only its own layers'
        caches, which chunk k's blocks here have written; the stream coming back feeds only the
        head), and sends it once chunk k is back (a send may block until it is received: no
        second forward goes to a rank that may be waiting to send the first back). A chunk
        with padding comes back, and the padding is trimmed, before the next one begins (its
        positions follow the real rows). The same graphs, the same bits as Runner's."""
        pad = None  # the padding rows of the chunk round the ring; None while none is
        done = None  # the chunk before's outputs, yielded once the next one is sent
        try:
            for chunk in itertools.chain(chunks, [None]):
                message = None
                if chunk is not None and pad == 0:
                    message = self._chunk_message(chunk, cache)
                    mx.eval(message.arrays, cache.state())  # this rank's part, while the others run the chunk before
                if pad is not None:
                    pad, trimmed = None, pad  # (none round the ring any more, even where taking it back fails)
                    done = without_padding(*self._returned(cache, True), cache, trimmed, True)
                if chunk is not None:
                    if message is None:
                        message = self._chunk_message(chunk, cache)
                    self._send_drops()
                    self.link.send(message)
                    pad = chunk[1] - len(chunk[0])
                if done is not None:
                    yield done
                    done = None
        finally:
            if pad is not None:  # stopped with a chunk round the ring: the next message back must be the next forward's
                self.link.recv()

    def _chunk_message(self, chunk: tuple[list[int], int, int], cache: StageCache) -> Message:
        ids, rows, rows_after = chunk
        return self._begin(padded_ids(ids, rows), cache, len(ids), rows_after)

    def _begin(self, ids: mx.array, cache: StageCache, real_rows: int | None, rows_after: int | None) -> Message:
        """This rank's part of a forward of ids [1, S] (the embedding and its blocks) -> the
        FORWARD message that takes it on round the ring."""
        model = self.model
        tokens = np.asarray(ids)[0].tolist()
        step = Step(cache.id, cache.offset, len(tokens), real_rows, rows_after if self.options.elide_prefill else None,
                    self.options.decode_rows is not None)
        forward = model.start(ids, cache, real_rows, step.row_invariant)
        engram_rows = model.take_tokens(cache, tokens, real_rows)
        reached = model.blocks(forward, cache, step.keep(self.args), engram_rows)
        return forward_message(step, tokens, forward if reached else None)

    def _returned(self, cache: StageCache, last_logits_only: bool) -> tuple[mx.array | None, mx.array | None]:
        """The forward sent round the ring, back from the last rank -> Model.finish's (logits,
        features), or (None, None) where no row of it is left."""
        reply = self.link.recv()
        if reply.op != FORWARD or reply.fields[0] != cache.id:
            raise PipelineError(f"rank 0 expected cache {cache.id}'s forward back, got op {reply.op} {reply.fields}")
        forward = received_forward(Step.of(reply.fields), reply.arrays[1:])
        if forward is None:
            return None, None
        return self.model.finish(forward, last_logits_only)

    def decode_ahead(self, token: mx.array, cache: StageCache, on_forward_stream: bool = False) -> Deferred:
        return Deferred(self, cache)


class Deferred:
    """decode_ahead's plain fallback: nothing begun; finish(t) is decode([t])."""

    def __init__(self, runner: PipelineRunner, cache: StageCache):
        self._runner, self._cache = runner, cache

    def finish(self, token: int, settle: bool = True) -> tuple[mx.array, mx.array]:
        return self._runner.decode([token], self._cache)

    def cancel(self) -> None:
        pass


def serve(model: StageModel, link: Link) -> None:
    """Every rank but the first: follow rank 0's commands (passed on round the ring) until STOP."""
    caches: dict[int, StageCache] = {}
    while True:
        message = link.recv()
        if message.op == FORWARD:
            link.send(_forward_here(model, caches[message.fields[0]], message))
            continue
        if not model.last:
            link.send(message)
        if message.op == NEW:
            caches[message.fields[0]] = model.make_cache(message.fields[0])
        elif message.op == DROP:
            caches.pop(message.fields[0], None)
        elif message.op == TRIM:
            caches[message.fields[0]].trim(message.fields[1])
        elif message.op == COPY:
            source, copy, room = message.fields
            caches[copy] = caches[source].copy_here(copy, bool(room))
            mx.eval(caches[copy].state())  # its own buffers now, as rank 0's prefix cache evaluates its part
        elif message.op == STOP:
            return
        else:
            raise PipelineError(f"rank {link.rank} got an unknown command {message.op}")


def _forward_here(model: StageModel, cache: StageCache, message: Message) -> Message:
    """This rank's blocks of the forward a FORWARD message carries -> the message to send on."""
    step = Step.of(message.fields)
    if step.start != cache.offset:
        raise PipelineError(f"rank {model.rank} is out of step: a forward at position {step.start}, "
                            f"its cache at {cache.offset}")
    tokens = message.arrays[0].tolist()
    engram_rows = model.take_tokens(cache, tokens, step.real_rows)
    forward = received_forward(step, message.arrays[1:])
    if forward is None:
        model.pass_over(cache, step.rows)
    elif not model.blocks(forward, cache, step.keep(model.args), engram_rows):
        forward = None
    return forward_message(step, tokens, forward)


# ------------------------------------------------------- the command lines

def add_split_argument(parser) -> None:
    """--pipeline-split, on the (argparse) parser of a command line that runs as ranks of mlx.launch."""
    parser.add_argument("--pipeline-split", metavar="A:B,C:D,...",
                        help="under mlx.launch, the layers each process (rank) holds, one range per rank "
                             "(default: balanced by resident bytes)")


def launched_runner(model: Model, group: mx.distributed.Group) -> Runner:
    """Rank 0's runner of the model load_launched gave: a PipelineRunner where several ranks
    hold its layers, else a Runner."""
    return PipelineRunner(model, Link(group)) if group.size() > 1 else Runner(model)


def launched_group(parser, split: str | None) -> mx.distributed.Group:
    """The processes mlx.launch started (mx.distributed.init: a group of one where it did not), with
    `split` (--pipeline-split) checked before any model loads: one that is no list of ranges, or
    one for a single process, exits (2) through the parser's error. Its fit to the model is
    checked once that is read (io.load.load_stage)."""
    if split is not None:
        try:
            parse_split(split)
        except PipelineError as e:
            parser.error(f"argument --pipeline-split: {e}")
    group = mx.distributed.init()
    if split is not None and group.size() == 1:
        parser.error("argument --pipeline-split: splits the model across the processes mlx.launch starts "
                     f"(mlx.launch -n 2 -- {parser.prog} ...)")
    return group
