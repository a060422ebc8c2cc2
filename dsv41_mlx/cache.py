"""Per-sequence state of the target model, kept so that `trim` is exact.

Every layer keeps its sliding-window keys; KV-source layers also keep the
compressor's raw rows of unfinished groups, the pooled (compressed) KV and the
index keys. The engram keeps the compressed token history. Each store holds a
little more than decoding needs (`TRIM_SLACK` extra rows) so that rolling back
the last few positions (rejected drafts) restores exactly the state a plain
decode of the committed tokens would have, without recomputing anything.
"""

from __future__ import annotations

import mlx.core as mx

from .kernels import ring_write

# Rows beyond what attention needs, kept so trim(n <= TRIM_SLACK) is exact.
TRIM_SLACK = 16


class RowBuffer:
    """Rows appended at the end and dropped at either end, read as one slice of a buffer
    with room to grow: an append writes its rows after the last one (one slice update, in
    place when nothing else holds the buffer) where a concatenate would copy every row held
    (two copy launches on a GPU, each step). When the room runs out, the rows held move to
    a new buffer with as much room again as they take (at least `min_room` rows), its rows
    rounded up to a power of two: the attention kernel's compiled path takes the whole
    buffer (model.Attention.attention_and_output), and a compiled function is traced once
    for each shape it is given, so the shapes are few and the same in every sequence."""

    def __init__(self, min_room: int):
        self.min_room = min_room
        self._buffer: mx.array | None = None  # [capacity, width]
        self._lo = self._hi = 0  # the rows held are _buffer[_lo:_hi]

    @property
    def rows(self) -> mx.array | None:
        """The rows held, oldest first (a view of the buffer); None before the first append."""
        return None if self._buffer is None else self._buffer[self._lo:self._hi]

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def buffer(self) -> tuple[mx.array | None, int]:
        """(the whole buffer, the row of it that holds the oldest row held): a reader that
        indexes the buffer itself (the attention kernel) takes it without a view, and its shape
        changes only when the rows move to a new buffer."""
        return self._buffer, self._lo

    def append(self, new: mx.array) -> mx.array:
        """Write new rows [S, width] after the last; return every row held, them included."""
        S = new.shape[0]
        if self._buffer is None or self._hi + S > self._buffer.shape[0]:
            self._move(self._size(len(self) + S), new.shape[1], new.dtype)
        self._buffer[self._hi: self._hi + S] = new
        self._hi += S
        return self.rows

    def copy(self, room: bool = True) -> RowBuffer:
        """The same rows in a buffer of their own, so that appends to either leave the other as
        it was and still write in place: with room to grow, as a move gives, or (room=False)
        exactly as large as the rows (a copy that is kept, and only ever copied from)."""
        other = RowBuffer(self.min_room)
        if self._buffer is not None:
            other._buffer, other._lo, other._hi = self._buffer, self._lo, self._hi
            other._move(other._size(len(self)) if room else len(self), self._buffer.shape[1], self._buffer.dtype)
        return other

    def _size(self, rows: int) -> int:
        """The least power of two that holds `rows` rows and room for as many as are held (at
        least min_room)."""
        return 1 << (rows + max(self.min_room, len(self)) - 1).bit_length()

    def _move(self, capacity: int, width: int, dtype: mx.Dtype) -> None:
        """Move the rows held to the start of a new buffer of `capacity` rows."""
        held, n = self.rows, len(self)
        buffer = mx.zeros((capacity, width), dtype=dtype)
        if n:
            buffer[:n] = held
        self._buffer, self._lo, self._hi = buffer, 0, n

    def drop_front(self, n: int) -> None:
        self._lo += n

    def drop_back(self, n: int) -> None:
        self._hi -= n


class WindowCache:
    """Sliding-window keys (= values) of one layer: the newest rows, oldest first, in a
    RowBuffer (the oldest dropped past window + TRIM_SLACK)."""

    def __init__(self, window: int):
        self.window = window
        self.end = 0  # absolute position one past the newest row
        self._rows = RowBuffer(window + TRIM_SLACK)

    @property
    def keys(self) -> mx.array | None:
        """The kept rows [n, head_dim], oldest first."""
        return self._rows.rows

    @property
    def start(self) -> int:
        return self.end - len(self._rows)

    def buffer(self, first: int) -> tuple[mx.array, int]:
        """The keys' whole buffer and its row that holds position `first` (the first position
        update returned: the rows before the kept ones stay in the buffer until it moves)."""
        buffer, row = self._rows.buffer
        return buffer, row - (self.start - first)

    def update(self, rows: mx.array) -> tuple[mx.array, int]:
        """Append rows [S, D]; return every row a query of this chunk can see and its first position."""
        first = self.start
        keys = self._rows.append(rows)
        self.end += rows.shape[0]
        self._rows.drop_front(max(0, len(self._rows) - (self.window + TRIM_SLACK)))
        return keys, first

    def pass_over(self, n: int) -> None:
        """Positions end .. end+n-1 go by without their rows (a prefill that computes only the
        positions something later reads): every row held is dropped, since the rows appended
        next are the only ones a query that matters sees."""
        self._rows.drop_front(len(self._rows))
        self.end += n

    def copy(self, room: bool = True) -> WindowCache:
        other = WindowCache(self.window)
        other.end, other._rows = self.end, self._rows.copy(room)
        return other

    def trim(self, n: int) -> None:
        held = len(self._rows)
        if n > held - min(self.window, self.end - n):
            raise ValueError(f"cannot trim {n} rows from a window cache holding {held}")
        self._rows.drop_back(n)
        self.end -= n


class CompressorCache:
    """State of one KV-source layer: raw rows of recent positions, pooled groups, index keys,
    each in a RowBuffer.

    Group g covers positions [g*ratio, (g+1)*ratio). The raw rows hold the fp32
    projections of positions [raw_start, end), kv and score side by side (the compressor's
    two GEMMs' outputs joined), enough to re-form any group that a trim reopens.
    """

    GROUP_ROOM = 256  # rows of room a new buffer of groups gets, at least

    def __init__(self, ratio: int):
        self.ratio = ratio
        self.end = 0
        self.raw_start = 0
        self._raw = RowBuffer(TRIM_SLACK)  # [n, 2 * head_dim] fp32, kv | score (ratio > 1 only)
        self._kv = RowBuffer(self.GROUP_ROOM)  # [groups, head_dim] bf16: RoPE'd, FP4 fake-quantised
        self._index_keys = RowBuffer(self.GROUP_ROOM)  # [groups, index_head_dim] bf16

    raw = property(lambda self: self._raw.rows)
    kv = property(lambda self: self._kv.rows)
    index_keys = property(lambda self: self._index_keys.rows)
    # the pooled groups' whole buffer: group g at row g (groups are never dropped at the front)
    kv_buffer = property(lambda self: self._kv.buffer[0])

    @property
    def n_groups(self) -> int:
        return len(self._kv)

    def pending(self) -> mx.array | None:
        """Raw rows of the unfinished group (positions [groups*ratio, end)), kv | score."""
        if self.raw is None:
            return None
        return self.raw[self.n_groups * self.ratio - self.raw_start:]

    def append_raw(self, rows: mx.array) -> mx.array:
        """Append the raw rows [S, 2 * head_dim] of the next S positions; return the raw rows
        of every position not yet in a group, them included (a view of the buffer they are
        written into: no copy to join them to the pending ones)."""
        self._raw.append(rows)
        unpooled = self.pending()  # (before the rows a trim no longer needs are dropped)
        self.end += rows.shape[0]
        # keep every row of the groups that a trim of TRIM_SLACK positions could reopen
        keep_from = max(0, (self.end - TRIM_SLACK) // self.ratio * self.ratio)
        if keep_from > self.raw_start:
            self._raw.drop_front(keep_from - self.raw_start)
            self.raw_start = keep_from
        return unpooled

    def append_groups(self, kv: mx.array, index_keys: mx.array) -> None:
        """Append new groups' kv and index keys. The kv is written depending on the keys'
        write (mx.depends: no launch), so that whatever reads the groups (the attention, in
        the forward that made them) computes and writes the keys too: left alone, they would
        wait until the indexer first reads them, past index_topk groups, and that forward
        would compute every key made before it at once."""
        [kv] = mx.depends([kv], [self._index_keys.append(index_keys)])
        self._kv.append(kv)

    def copy(self, room: bool = True) -> CompressorCache:
        other = CompressorCache(self.ratio)
        other.end, other.raw_start = self.end, self.raw_start
        other._raw, other._kv, other._index_keys = (b.copy(room) for b in (self._raw, self._kv, self._index_keys))
        return other

    def trim(self, n: int) -> None:
        end = self.end - n
        groups = end // self.ratio
        if self.ratio > 1:
            if end < self.raw_start:
                raise ValueError(f"cannot trim {n} positions: raw rows start at {self.raw_start}")
            self._raw.drop_back(len(self._raw) - (end - self.raw_start))
        reopened = max(0, self.n_groups - groups)  # groups and their index keys are appended together
        self._kv.drop_back(reopened)
        self._index_keys.drop_back(reopened)
        self.end = end


class LayerCache:
    def __init__(self, window: int, compress_ratio: int = 0):
        self.window = WindowCache(window)
        self.compressor = CompressorCache(compress_ratio) if compress_ratio else None

    def trim(self, n: int) -> None:
        self.window.trim(n)
        if self.compressor is not None:
            self.compressor.trim(n)

    def copy(self, room: bool = True) -> LayerCache:
        other = LayerCache(self.window.window)
        other.window = self.window.copy(room)
        other.compressor = None if self.compressor is None else self.compressor.copy(room)
        return other


class ModelCache:
    """Everything the target remembers about one sequence."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers
        self.tokens: list[int] = []  # every token id fed so far (engram n-grams read the tail)
        # the engram rows' buffers of this sequence's forwards built before their tokens are
        # known, by row count (engram.StagedRows, Model.decode_ahead)
        self.staged_rows: dict = {}

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def trim(self, n: int) -> None:
        """Forget the newest n positions; the state then equals a decode that never saw them."""
        if not 0 <= n <= min(TRIM_SLACK, self.offset):
            raise ValueError(f"trim({n}) outside 0..{min(TRIM_SLACK, self.offset)}")
        if n == 0:
            return
        for layer in self.layers:
            layer.trim(n)
        del self.tokens[-n:]

    def copy(self, room: bool = True) -> ModelCache:
        """A copy of everything the cache remembers (every row it holds, the token history, the
        ends), in buffers of its own: appends and trims of either leave the other as it was.
        room=False: each buffer exactly as large as its rows (a copy that is kept, and only ever
        copied from); else with room to grow, as a buffer that moved has. The staged engram
        rows' buffers belong to a sequence's forwards, and are made again on first use."""
        other = ModelCache([layer.copy(room) for layer in self.layers])
        other.tokens = list(self.tokens)
        return other

    @property
    def nbytes(self) -> int:
        """The bytes of the rows the cache holds (its buffers' room beyond them not counted)."""
        return sum(a.nbytes for a in self.state())

    def snapshot(self) -> list[mx.array]:
        """What decides every future output: the last `window` window rows, the pooled
        groups and index keys, the unfinished group's raw rows. Two caches with equal
        snapshots (and tokens) behave identically; extra rows kept for trimming are left out."""
        arrays = []
        for layer in self.layers:
            w = layer.window
            arrays.append(w.keys[-min(w.window, w.end):])
            c = layer.compressor
            if c is not None:
                arrays += [a for a in (c.kv, c.index_keys, c.pending()) if a is not None]
        return arrays

    def state(self) -> list[mx.array]:
        """Every array the cache holds (for mx.eval and equality tests)."""
        arrays = []
        for layer in self.layers:
            arrays.append(layer.window.keys)
            c = layer.compressor
            if c is not None:
                arrays += [a for a in (c.raw, c.kv, c.index_keys) if a is not None]
        return [a for a in arrays if a is not None]


class DraftCache:
    """The DSpark drafter's rings: per stage, `window` slots; slot p % window holds committed position p.

    Only committed positions are ever written (the round ingests after
    acceptance), so the rings never need a trim.
    """

    def __init__(self, n_stages: int, window: int, head_dim: int):
        self.window = window
        self.rings = mx.zeros((n_stages, window, head_dim), dtype=mx.bfloat16)
        self.end = 0  # committed positions ingested so far

    def write(self, rows: mx.array, n: int) -> None:
        """Commit positions end .. end+n-1; rows [stages, m, D] are the newest m = min(n, window) of them."""
        m = rows.shape[1]
        if m != min(n, self.window):
            raise ValueError(f"expected {min(n, self.window)} ring rows for {n} positions, got {m}")
        self.rings = ring_write(self.rings, rows, self.end + n - m)  # one launch for all stages
        self.end += n

    def valid(self) -> mx.array:
        """[window] bool: slots that hold a position (all of them once `window` positions are in)."""
        return mx.arange(self.window) < min(self.end, self.window)
