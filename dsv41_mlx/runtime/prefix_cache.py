"""The prefix cache: sequences' states kept by the tokens that made them, so that a prompt which
starts with a kept sequence resumes from its state and prefills only the rest.

An entry holds a copy of a sequence's ModelCache (every row each layer holds, the compressors'
raw rows, pooled groups and index keys, the token history), the DSpark features of its newest
`window` positions (a drafted reply ingests them before its first round: with a short rest of
the prompt, most come from the entry) and, where known, its last position's logits. A prompt P
matches an entry of tokens T where P starts with T and is longer, or equals T and the entry has
its logits (nothing left to prefill). Lookups take the longest match.

Where a sequence's state is worth keeping (generate.prefill_cached, generate.generate_step): at
the end of each prompt; before a prompt's last token where it is one of `split_before` (a chat
prompt in thinking mode ends in `<think>`, which the next turn renders `</think>`); and at the
end of a reply, the prompt and the reply but its last token (not fed yet): the next chat turn's
prompt is this one, the reply, its end-of-sentence token and the new turn, so it prefills only
the new turn. Each is where a prefill ends or decoding left off: inside a prompt's prefill, the
layers past the last KV source have passed over rows (runner.prefill_rows).

Entries are kept least recently used first out, within `max_bytes`. One cache serves one model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Sequence

import mlx.core as mx

from ..cache import ModelCache
from ..chat import THINK_OPEN


@dataclass(frozen=True)
class PrefixEntry:
    """A sequence's state, kept: never appended to nor trimmed, only copied from."""

    tokens: tuple[int, ...]  # the sequence (the cache's token history)
    cache: ModelCache  # its own buffers, each exactly as large as its rows
    features: mx.array | None  # [min(window, len(tokens)), F] bf16: the newest positions' (None: no drafter)
    logits: mx.array | None  # [V] fp32: the last position's (None: a prompt must add a token at least)
    nbytes: int  # of the arrays above

    def resume(self) -> ModelCache:
        """A cache to decode on from this state: a copy, with room to grow, evaluated here (a
        forward may be evaluated from the runner's evaluator thread, which can run only the
        work of its own stream, not a copy built on the caller's: runtime/evaluator.py)."""
        cache = self.cache.copy()
        mx.eval(cache.state())
        return cache


def entry_nbytes(cache: ModelCache, features: mx.array | None, logits: mx.array | None) -> int:
    return cache.nbytes + sum(a.nbytes for a in (features, logits) if a is not None)


def owned(a: mx.array | None) -> mx.array | None:
    """A copy of `a` in a buffer of its own: a view would keep the whole array it views alive."""
    if a is None:
        return None
    out = mx.zeros(a.shape, dtype=a.dtype)
    out[...] = a
    return out


class PrefixCache:
    """Sequences' states by their tokens, least recently used first out within max_bytes (an
    entry larger than that is not kept). Thread-safe: a server's health report may read it while
    its generation thread looks up and stores."""

    def __init__(self, max_bytes: int, split_before: Collection[int] = ()):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.split_before = frozenset(split_before)
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()  # least recently used first
        self._nbytes = 0
        self._lock = threading.Lock()

    @classmethod
    def for_chat(cls, max_bytes: int, tokenizer) -> PrefixCache:
        """A cache for prompts rendered by chat.encode_chat with this tokenizer: a prompt that
        ends in `<think>` also keeps the state before it, which the next turn's prompt shares."""
        think = tokenizer.token_to_id(THINK_OPEN)
        return cls(max_bytes, () if think is None else (think,))

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> PrefixEntry | None:
        """The entry of the longest prefix of `prompt` kept (see the module's docstring), made the
        most recently used; None where none matches."""
        with self._lock:
            entry = self._longest(prompt)
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(entry.tokens)
            return entry

    def cached_length(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens a lookup would take from the cache (0: none); changes
        nothing."""
        with self._lock:
            entry = self._longest(prompt)
        return 0 if entry is None else len(entry.tokens)

    def store_points(self, prompt: Sequence[int], start: int) -> list[int]:
        """Where a prefill of prompt[start:] stops to store the state: before the prompt's last
        token where it is one of split_before, and at the end (nothing where start is the end)."""
        n = len(prompt)
        split = n - 1 if prompt[-1] in self.split_before and n - 1 > start else None
        return [p for p in (split, n) if p is not None and p > start]

    def store(self, cache: ModelCache, features: mx.array | None = None,
              logits: mx.array | None = None) -> PrefixEntry | None:
        """Keep a copy of the state of `cache` (evaluated, nothing of the model's left running on
        it), with the DSpark features of its newest positions [n, F] and its last logits [V] where
        known. A sequence kept already is only made the most recently used (unless it gains its
        logits). Returns the entry, or None where it is larger than max_bytes."""
        tokens = tuple(cache.tokens)
        with self._lock:
            kept = self._entries.get(tokens)
            if kept is not None and (logits is None or kept.logits is not None):
                self._entries.move_to_end(tokens)
                return kept
        nbytes = entry_nbytes(cache, features, logits)
        if nbytes > self.max_bytes:
            return None
        entry = PrefixEntry(tokens, cache.copy(room=False), owned(features), owned(logits), nbytes)
        mx.eval(entry.cache.state(), *(a for a in (entry.features, entry.logits) if a is not None))
        with self._lock:
            replaced = self._entries.pop(tokens, None)
            self._nbytes += nbytes - (replaced.nbytes if replaced is not None else 0)
            self._entries[tokens] = entry
            while self._nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._nbytes -= dropped.nbytes
        return entry

    def entries(self) -> list[dict]:
        """Each entry's length in tokens, its bytes and whether it holds its last logits, least
        recently used first (for a health report)."""
        with self._lock:
            return [{"tokens": len(e.tokens), "bytes": e.nbytes, "logits": e.logits is not None}
                    for e in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    def _longest(self, prompt: Sequence[int]) -> PrefixEntry | None:
        prompt = tuple(prompt)
        best = None
        for tokens, entry in self._entries.items():
            n = len(tokens)
            if best is not None and n <= len(best.tokens):
                continue
            if (n < len(prompt) or (n == len(prompt) and entry.logits is not None)) and prompt[:n] == tokens:
                best = entry
        return best
