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


class WindowCache:
    """Sliding-window keys (= values) of one layer: the newest rows, oldest first.

    The rows live in a buffer with room to grow: an update writes its rows after the
    last one (one slice update, in place when nothing else holds the buffer) and the
    kept rows are a slice of it. A concatenate would copy every kept row at each
    step (two copy launches a layer on a GPU). When the room runs out, the kept rows
    move to the front of a new buffer (once every ~window steps of a decode)."""

    def __init__(self, window: int):
        self.window = window
        self.end = 0  # absolute position one past the newest row
        self._buffer: mx.array | None = None  # [capacity, head_dim] bf16
        self._lo = self._hi = 0  # the kept rows are _buffer[_lo:_hi]

    @property
    def keys(self) -> mx.array | None:
        """The kept rows [n, head_dim], oldest first (a view of the buffer)."""
        return None if self._buffer is None else self._buffer[self._lo:self._hi]

    @property
    def start(self) -> int:
        return self.end - (self._hi - self._lo)

    def update(self, rows: mx.array) -> tuple[mx.array, int]:
        """Append rows [S, D]; return every row a query of this chunk can see and its first position."""
        S, keep = rows.shape[0], self.window + TRIM_SLACK
        first = self.start
        if self._buffer is None or self._hi + S > self._buffer.shape[0]:
            kept = self.keys
            buffer = mx.zeros((2 * keep + S, rows.shape[1]), dtype=rows.dtype)
            if kept is not None and kept.shape[0]:
                buffer[: kept.shape[0]] = kept
            self._buffer, self._lo, self._hi = buffer, 0, 0 if kept is None else kept.shape[0]
        self._buffer[self._hi: self._hi + S] = rows
        keys = self._buffer[self._lo: self._hi + S]
        self._hi += S
        self._lo = max(self._lo, self._hi - keep)
        self.end += S
        return keys, first

    def trim(self, n: int) -> None:
        held = self._hi - self._lo
        if n > held - min(self.window, self.end - n):
            raise ValueError(f"cannot trim {n} rows from a window cache holding {held}")
        self._hi -= n
        self.end -= n


class CompressorCache:
    """State of one KV-source layer: raw rows of recent positions, pooled groups, index keys.

    Group g covers positions [g*ratio, (g+1)*ratio). `raw_kv`/`raw_score` hold
    the fp32 projections of positions [raw_start, end), enough to re-form any
    group that a trim reopens.
    """

    def __init__(self, ratio: int):
        self.ratio = ratio
        self.end = 0
        self.raw_start = 0
        self.raw_kv: mx.array | None = None  # [n, head_dim] fp32 (ratio > 1 only)
        self.raw_score: mx.array | None = None
        self.kv: mx.array | None = None  # [groups, head_dim] bf16: RoPE'd, FP4 fake-quantised
        self.index_keys: mx.array | None = None  # [groups, index_head_dim] bf16

    @property
    def n_groups(self) -> int:
        return 0 if self.kv is None else self.kv.shape[0]

    def pending(self) -> tuple[mx.array | None, mx.array | None]:
        """Raw rows of the unfinished group (positions [groups*ratio, end))."""
        if self.raw_kv is None:
            return None, None
        first = self.n_groups * self.ratio - self.raw_start
        return self.raw_kv[first:], self.raw_score[first:]

    def append_raw(self, kv: mx.array, score: mx.array) -> None:
        self.raw_kv = kv if self.raw_kv is None else mx.concatenate([self.raw_kv, kv])
        self.raw_score = score if self.raw_score is None else mx.concatenate([self.raw_score, score])
        self.end += kv.shape[0]
        # keep every row of the groups that a trim of TRIM_SLACK positions could reopen
        keep_from = max(0, (self.end - TRIM_SLACK) // self.ratio * self.ratio)
        if keep_from > self.raw_start:
            self.raw_kv = self.raw_kv[keep_from - self.raw_start:]
            self.raw_score = self.raw_score[keep_from - self.raw_start:]
            self.raw_start = keep_from

    def append_groups(self, kv: mx.array, index_keys: mx.array) -> None:
        self.kv = kv if self.kv is None else mx.concatenate([self.kv, kv])
        self.index_keys = index_keys if self.index_keys is None else mx.concatenate([self.index_keys, index_keys])

    def trim(self, n: int) -> None:
        end = self.end - n
        groups = end // self.ratio
        if self.ratio > 1:
            if end < self.raw_start:
                raise ValueError(f"cannot trim {n} positions: raw rows start at {self.raw_start}")
            self.raw_kv = self.raw_kv[: end - self.raw_start]
            self.raw_score = self.raw_score[: end - self.raw_start]
        if self.kv is not None:
            self.kv = self.kv[:groups]
            self.index_keys = self.index_keys[:groups]
        self.end = end


class LayerCache:
    def __init__(self, window: int, compress_ratio: int = 0):
        self.window = WindowCache(window)
        self.compressor = CompressorCache(compress_ratio) if compress_ratio else None

    def trim(self, n: int) -> None:
        self.window.trim(n)
        if self.compressor is not None:
            self.compressor.trim(n)


class ModelCache:
    """Everything the target remembers about one sequence."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers
        self.tokens: list[int] = []  # every token id fed so far (engram n-grams read the tail)

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
                arrays += [a for a in (c.kv, c.index_keys, *c.pending()) if a is not None]
        return arrays

    def state(self) -> list[mx.array]:
        """Every array the cache holds (for mx.eval and equality tests)."""
        arrays = []
        for layer in self.layers:
            arrays.append(layer.window.keys)
            c = layer.compressor
            if c is not None:
                arrays += [a for a in (c.raw_kv, c.raw_score, c.kv, c.index_keys) if a is not None]
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
