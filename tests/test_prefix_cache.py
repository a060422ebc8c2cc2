"""The prefix cache: a kept state is an exact, independent copy; a prompt resumes from its
longest kept prefix with the same logits, features and state as a prefill of the whole prompt;
replies are the same with the cache on and off; entries go least recently used first within
the byte budget; a chat's second turn finds the first turn's state."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx.cache import LayerCache, ModelCache
from dsv41_mlx.generate import generate_step, make_decoder, prefill, prefill_cached, stats_line, stream_generate
from dsv41_mlx.runtime.prefix_cache import PrefixCache
from dsv41_mlx.sampling import SamplingParams
from dsv41_mlx.speculative import SpeculativeDecoder
from scripts.benchmarks.harness import OracleDrafter

GREEDY = SamplingParams()
COUPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=21)
BIG = 1 << 40  # bytes: a budget nothing here fills


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(97 * i + 31 * salt) % 8000 + 100 for i in range(n)]


def _equal(a: mx.array | None, b: mx.array | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def _ends(cache: ModelCache, raw: bool = True) -> list:
    """Every position counter of the cache: where each layer's window and compressor end, how
    many groups it holds and (raw) where its raw rows start."""
    out = []
    for layer in cache.layers:
        c = layer.compressor
        out.append((layer.window.end, None if c is None else (c.end, c.n_groups) + ((c.raw_start,) if raw else ())))
    return out


def _host(cache: ModelCache) -> list[np.ndarray]:
    """The cache's arrays as numpy copies (bf16 widened exactly to fp32)."""
    return [np.array(a.astype(mx.float32)) for a in cache.state()]


def _assert_same_sequence(a: ModelCache, b: ModelCache) -> None:
    """Two caches that decide the same future: the same tokens, ends, and arrays every later read
    sees (ModelCache.snapshot; the rows kept beyond them for trims, and where the raw rows
    start, depend on the padding of a prefill's last chunk, and no read reaches them)."""
    assert a.tokens == b.tokens and _ends(a, raw=False) == _ends(b, raw=False)
    snap_a, snap_b = a.snapshot(), b.snapshot()
    assert len(snap_a) == len(snap_b)
    assert all(_equal(x, y) for x, y in zip(snap_a, snap_b))


def _reply(runner, prompt, params, draft, prompt_cache=None, max_tokens=16, stop=()):
    decoder = make_decoder(runner, params, draft, confidence="off") if draft else None
    return list(generate_step(runner, prompt, params, max_tokens, decoder=decoder, stop=stop,
                              prompt_cache=prompt_cache))


# ------------------------------------------------------------------ copies


def test_a_copy_holds_every_array_ending_and_token_of_the_cache(fixture_model, runner):
    cache = runner.make_cache()
    prefill(runner, _prompt(45), cache, chunk=32)
    cache.staged_rows[1] = "this sequence's own"
    for room in (True, False):
        copy = cache.copy(room)
        assert copy.tokens == cache.tokens and copy.tokens is not cache.tokens
        assert _ends(copy) == _ends(cache) and not copy.staged_rows
        assert len(copy.state()) == len(cache.state())
        assert all(_equal(a, b) for a, b in zip(copy.state(), cache.state()))
        assert copy.nbytes == cache.nbytes
    kept = cache.copy(room=False)  # a kept copy's buffers are exactly its rows
    buffers = [rows.buffer[0] for layer in kept.layers
               for rows in [layer.window._rows] + ([] if layer.compressor is None else
                                                   [layer.compressor._raw, layer.compressor._kv,
                                                    layer.compressor._index_keys])]
    assert sum(b.nbytes for b in buffers if b is not None) == kept.nbytes


def test_a_copy_and_its_cache_go_on_without_touching_each_other(fixture_model, runner):
    """Decoding and trimming the cache leaves its copies as they were (a RowBuffer writes its
    appends into its buffer in place: a copy has buffers of its own), and the other way round."""
    cache = runner.make_cache()
    prefill(runner, _prompt(37), cache, chunk=32)
    kept, resumed = cache.copy(room=False), cache.copy()
    kept_before, resumed_before, cache_before = _host(kept), _host(resumed), _host(cache)
    runner.decode([11, 12, 13], cache)
    cache.trim(2)
    runner.decode([14], cache)
    mx.eval(cache.state())
    assert cache.offset == 39 and kept.offset == resumed.offset == 37
    for before, copy in ((kept_before, kept), (resumed_before, resumed)):
        assert all(np.array_equal(x, y) for x, y in zip(before, _host(copy)))
    cache_after = _host(cache)
    runner.decode([15, 16], resumed)
    mx.eval(resumed.state())
    assert all(np.array_equal(x, y) for x, y in zip(cache_after, _host(cache)))
    assert all(np.array_equal(x, y) for x, y in zip(kept_before, _host(kept)))
    assert any(x.shape != y.shape or not np.array_equal(x, y) for x, y in zip(cache_before, cache_after))


def test_resuming_an_entry_never_changes_it(fixture_model, runner):
    prompt_cache = PrefixCache(BIG)
    cache = runner.make_cache()
    logits, features = prefill(runner, _prompt(30), cache, chunk=32, keep_features=8)
    entry = prompt_cache.store(cache, features, logits)
    before = _host(entry.cache)
    for _ in range(2):
        resumed = entry.resume()
        resumed.trim(2)  # its next rows then go where the entry's last two are
        runner.decode([5, 6, 7], resumed)
        mx.eval(resumed.state())
    assert all(np.array_equal(x, y) for x, y in zip(before, _host(entry.cache)))
    assert entry.cache.offset == 30 and _equal(entry.logits, logits) and _equal(entry.features, features)


# ------------------------------------------------------------------ exact resumption


# every padding a resumed chunk can take, the chunk edges (32) and either side of them
SPLITS = sorted({1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 59, 60} | set(range(3, 60, 7)))


@pytest.mark.parametrize("split", SPLITS)
def test_a_resumed_prefill_equals_a_prefill_of_the_whole_prompt(fixture_model, runner, split):
    """A prompt of 61 tokens (chunks of 32, the last padded to a multiple of 16) resumed from
    the state kept at any of its positions: logits, the drafter's features of the newest window
    and every array a later read sees are bit-identical to a prefill of the whole prompt."""
    prompt, window = _prompt(61), fixture_model.args.sliding_window
    cold = runner.make_cache()
    want_logits, want_features = prefill(runner, prompt, cold, chunk=32, keep_features=window)

    prompt_cache = PrefixCache(BIG)
    prefill_cached(runner, prompt[:split], prompt_cache, chunk=32, keep_features=window)
    assert prompt_cache.cached_length(prompt) == split
    cache, logits, features = prefill_cached(runner, prompt, prompt_cache, chunk=32, keep_features=window)
    assert _equal(logits, want_logits) and _equal(features, want_features)
    _assert_same_sequence(cache, cold)
    assert prompt_cache.hits == 1 and prompt_cache.misses == 1


def test_an_equal_prompt_resumes_with_nothing_to_prefill(fixture_model, runner, monkeypatch):
    prompt, window = _prompt(20), fixture_model.args.sliding_window
    prompt_cache = PrefixCache(BIG)
    _, want_logits, want_features = prefill_cached(runner, prompt, prompt_cache, keep_features=window)
    monkeypatch.setattr(runner, "padded", lambda *a, **k: pytest.fail("prefilled a kept prompt"))
    cache, logits, features = prefill_cached(runner, prompt, prompt_cache, keep_features=window)
    assert cache.offset == len(prompt) and _equal(logits, want_logits) and _equal(features, want_features)


@pytest.mark.parametrize("draft", [False, True])
def test_the_state_kept_after_a_reply_equals_a_prefill_of_it(fixture_model, runner, draft):
    """After a reply (stopped by a stop token: a drafted round commits drafts past it, which
    are trimmed off), the state kept holds the prompt and the reply but its last token, equal
    to a prefill of those tokens, with their newest features."""
    prompt, window = _prompt(23, salt=3), fixture_model.args.sliding_window
    whole = _reply(runner, prompt, GREEDY, False, max_tokens=30)
    k = next(i for i in range(12, len(whole)) if whole[i] not in whole[:i])
    prompt_cache = PrefixCache(BIG)
    decoder = None
    if draft:  # drafts that are mostly right: rounds accept several, past the stop token too
        decoder = SpeculativeDecoder(runner, OracleDrafter(runner.drafter, prompt + whole, wrong_every=9), GREEDY,
                                     confidence="off")
    reply = list(generate_step(runner, prompt, GREEDY, 30, decoder=decoder, stop={whole[k]},
                               prompt_cache=prompt_cache))
    assert reply == whole[:k + 1]
    if draft:
        assert decoder.stats.mean_accepted > 2
    entry = prompt_cache.lookup(prompt + reply + [1])
    assert entry.tokens == tuple(prompt + reply[:-1]) and entry.logits is None
    cold = runner.make_cache()
    _, features = prefill(runner, list(entry.tokens), cold, keep_features=window)
    _assert_same_sequence(entry.cache, cold)
    assert _equal(entry.features, features)


# ------------------------------------------------------------------ replies on and off


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "drafted"])
@pytest.mark.parametrize("params", [GREEDY, COUPLED], ids=["greedy", "coupled"])
def test_replies_are_the_same_with_the_prompt_cache_on_and_off(fixture_model, runner, params, draft):
    """A conversation of three turns, each prompt the last one, its reply and a new turn; then
    the first prompt again and one that leaves the conversation early: every reply equals the
    reply without the cache, and each later turn resumes from the state after the reply before."""
    prompt_cache = PrefixCache(BIG)
    prompt = _prompt(19, salt=1)
    for turn in range(3):
        want = _reply(runner, prompt, params, draft)
        assert _reply(runner, prompt, params, draft, prompt_cache) == want
        prompt = prompt + want + _prompt(5, salt=turn + 7)
        if turn < 2:
            assert prompt_cache.cached_length(prompt) == len(prompt) - 6  # all but the reply's last and the new 5
    for again in (_prompt(19, salt=1), _prompt(19, salt=1)[:12] + [42, 43]):
        assert _reply(runner, again, params, draft, prompt_cache) == _reply(runner, again, params, draft)
    assert (prompt_cache.hits, prompt_cache.misses) == (3, 2)


def test_replies_are_the_same_with_the_prompt_cache_in_the_row_invariant_mode(padded_runner):
    """The GPU's decode path (every decode and verify forward padded to 8 rows) on the CPU."""
    prompt_cache = PrefixCache(BIG)
    prompt = _prompt(26, salt=5)
    for draft in (False, True):
        first = _reply(padded_runner, prompt, COUPLED, draft, prompt_cache)
        assert first == _reply(padded_runner, prompt, COUPLED, draft)
        second = prompt + first + [77, 78]
        assert _reply(padded_runner, second, COUPLED, draft, prompt_cache) == _reply(padded_runner, second, COUPLED,
                                                                                        draft)


def test_replies_are_the_same_with_the_prompt_cache_on_the_gpus_schedule(fixture_model, runner):
    """The GPU's whole schedule on the CPU: rows padded to 8, each block started from the
    evaluator's thread, the next forward built ahead. A resumed cache is evaluated before a
    forward hands it to that thread (which runs only its own stream's work)."""
    from dsv41_mlx.runtime.options import Options
    from dsv41_mlx.runtime.runner import Runner

    options = Options(decode_rows=8, overlap_build=True, evaluate_on_thread=True, build_ahead=True)
    prompt = _prompt(26, salt=9)
    with Runner(fixture_model, options) as scheduled:
        for draft in (False, True):
            prompt_cache = PrefixCache(BIG)
            first = _reply(scheduled, prompt, COUPLED, draft, prompt_cache)
            second = prompt + first + [77, 78]
            assert _reply(scheduled, second, COUPLED, draft, prompt_cache) == _reply(runner, second, COUPLED, draft)
            assert prompt_cache.hits == 1


# ------------------------------------------------------------------ the cache itself


def _state(tokens: list[int], rows: int = 4, width: int = 8) -> ModelCache:
    """A one-layer cache of `tokens` whose window holds `rows` rows of `width` fp32 values."""
    cache = ModelCache([LayerCache(16)])
    cache.layers[0].window.update(mx.full((rows, width), float(len(tokens))))
    cache.tokens = list(tokens)
    return cache


def test_lookup_takes_the_longest_kept_prefix():
    prompt_cache = PrefixCache(BIG)
    logits = mx.zeros((10,))
    prompt_cache.store(_state([1, 2]))
    prompt_cache.store(_state([1, 2, 3, 4]), logits=logits)
    prompt_cache.store(_state([1, 2, 3, 4, 5, 6]))
    prompt_cache.store(_state([1, 7, 8]), logits=logits)

    def found(prompt):
        entry = prompt_cache.lookup(prompt)
        return None if entry is None else list(entry.tokens)

    assert found([1, 2, 3, 4, 5, 6, 7]) == [1, 2, 3, 4, 5, 6]
    assert found([1, 2, 3, 4, 5]) == [1, 2, 3, 4]
    assert found([1, 2, 3, 4]) == [1, 2, 3, 4]  # equal, and its logits kept: nothing left to prefill
    assert found([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4]  # equal without logits: a token must be left
    assert found([1, 7, 8]) == [1, 7, 8]
    assert found([1, 2, 9]) == [1, 2]
    assert found([1, 2]) is None and found([2, 1, 2, 3]) is None and found([1]) is None
    assert prompt_cache.cached_length([1, 2, 3, 4, 5]) == 4 and prompt_cache.cached_length([5]) == 0
    assert (prompt_cache.hits, prompt_cache.misses) == (6, 3)
    prompt_cache.store(_state([1, 2, 3, 4, 5, 6]), logits=logits)  # kept already, now with its logits
    assert found([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5, 6] and len(prompt_cache) == 4


def test_entries_go_least_recently_used_first_within_the_byte_budget():
    one = _state([1, 2, 3]).nbytes  # every entry below holds as many bytes
    prompt_cache = PrefixCache(3 * one)
    for first in (1, 2, 3):
        prompt_cache.store(_state([first, 2, 3]))
    assert [e["bytes"] for e in prompt_cache.entries()] == [one] * 3 and prompt_cache.nbytes == 3 * one
    assert prompt_cache.lookup([1, 2, 3, 4]) is not None  # 1 is now the most recently used
    prompt_cache.store(_state([2, 2, 3]))  # kept already: made the most recently used, nothing added
    prompt_cache.store(_state([4, 2, 3]))
    assert prompt_cache.lookup([3, 2, 3, 9]) is None  # the least recently used went
    assert {e.tokens[0] for e in prompt_cache._entries.values()} == {1, 2, 4}
    assert prompt_cache.store(_state([5, 2, 3], rows=64)) is None  # larger than the whole budget
    assert len(prompt_cache) == 3 and prompt_cache.nbytes == 3 * one
    big = _state([6, 2, 3], rows=8)  # twice one: two entries go
    prompt_cache.store(big)
    assert [e["tokens"] for e in prompt_cache.entries()] == [3, 3] and prompt_cache.nbytes == one + big.nbytes
    prompt_cache.clear()
    assert len(prompt_cache) == 0 and prompt_cache.nbytes == 0 and prompt_cache.entries() == []


def test_an_entry_counts_the_bytes_of_everything_it_holds(fixture_model, runner):
    cache = runner.make_cache()
    logits, features = prefill(runner, _prompt(40), cache, chunk=32, keep_features=8)
    entry = PrefixCache(BIG).store(cache, features, logits)
    assert entry.nbytes == sum(a.nbytes for a in cache.state()) + features.nbytes + logits.nbytes
    assert features.shape == (8, fixture_model.args.dspark_feature_dim) and logits.shape == (8192,)


def test_a_prompt_ending_in_a_split_token_also_keeps_the_state_before_it():
    prompt_cache = PrefixCache(BIG, split_before={9})
    assert prompt_cache.store_points([1, 2, 9], 0) == [2, 3]
    assert prompt_cache.store_points([1, 2, 9], 2) == [3]  # resumed there already
    assert prompt_cache.store_points([1, 2, 3], 0) == [3]
    assert prompt_cache.store_points([1, 2, 3], 3) == []


# ------------------------------------------------------------------ chat turns


@pytest.fixture(scope="module")
def default_model():
    import dsv41_mlx

    return dsv41_mlx.load()


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_a_chats_second_turn_resumes_from_the_first(default_model, thinking):
    """Chat mode: the second turn's prompt is the first, the reply, <｜end▁of▁sentence｜> and the
    new turn, so it resumes from the state kept after the reply. Thinking mode: the first prompt
    ends in <think>, which the second renders as </think> (its reasoning dropped): it resumes
    from the state kept before <think>. Replies equal those without the cache."""
    from dsv41_mlx.chat import encode_chat
    from dsv41_mlx.runtime.runner import Runner

    model, tokenizer = default_model
    prompt_cache = PrefixCache.for_chat(BIG, tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with Runner(model) as runner:
        def chat(ids, cache=None):
            return list(stream_generate(model, tokenizer, ids, max_tokens=8, runner=runner, prompt_cache=cache))

        first = tokenizer.encode(encode_chat(messages, thinking=thinking))
        replies = chat(first, prompt_cache)
        assert [r.token for r in replies] == [r.token for r in chat(first)] and replies[-1].cached_tokens == 0
        text = "".join(r.text for r in replies)
        reply = [r.token for r in replies if r.token not in tokenizer.eos_token_ids]
        assert tokenizer.encode(text, add_bos=False) == reply  # (the reply's text gives back its tokens)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Spain?"}]
        second = tokenizer.encode(encode_chat(messages, thinking=thinking))
        resumed = chat(second, prompt_cache)
        assert [r.token for r in resumed] == [r.token for r in chat(second)]
    want = len(first) - 1 if thinking else len(first) + len(replies) - 1
    assert resumed[-1].cached_tokens == want
    assert f"prompt: {len(second)} tokens ({want} cached)" in stats_line(resumed[-1])
