import json
import random
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from dsv41_mlx import tokenizer as tokenizer_module
from dsv41_mlx.tokenizer import (
    StreamingDetokenizer,
    Tokenizer,
    build_compressed_token_map,
    cached_compressed_token_map,
    default_tokenizer_json,
    load_tokenizer,
)

FIXTURE = Path(__file__).parent / "fixtures" / "reference-v41-tiny"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  \n\n",
    "深度求索的模型支持中文，也支持日本語のテキスト。",
    "emoji: 😀👍🏽🇯🇵 and a family 👨‍👩‍👧‍👦",
    "def f(x):\n\treturn {'a': x ** 2}  # café\n",
    "Ünïcödé àccents, ﬁ ligature, ２０２５ full-width digits",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(FIXTURE)


def test_packaged_tokenizer_has_deepseek_v4_vocab(tok):
    assert Path(default_tokenizer_json()).is_file()
    assert tok.vocab_size == 129280
    assert tok.bos_token_id == 0 and tok.id_to_token(0) == BOS
    assert tok.eos_token_ids == frozenset({1}) and tok.token_to_id(EOS) == 1


def test_bos_eos_fall_back_to_tokenizer_config(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == frozenset({1})


def test_config_eos_list_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 7]}))
    assert load_tokenizer(tmp_path).eos_token_ids == frozenset({1, 7})


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text, add_bos=False)) == text
    assert tok.decode(tok.encode(text)) == BOS + text


@pytest.mark.parametrize("text", ["hi", BOS + "hi", ""])
def test_encode_puts_exactly_one_bos_first(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert tok.encode(text, add_bos=False).count(tok.bos_token_id) == text.count(BOS)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add_token(i) for i in ids]
    return pieces + [detok.finalize()]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_streaming_holds_back_partial_characters(tok):
    ids = tok.encode("a😀", add_bos=False)
    assert len(ids) > 2  # the emoji is split over byte tokens
    assert stream(tok, ids) == ["a"] + [""] * (len(ids) - 2) + ["😀", ""]


def test_streaming_random_ids_equals_full_decode(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_compressed_token_map_equals_reference_golden(tok):
    golden = load_file(str(FIXTURE / "golden.safetensors"))["engram.token_map"]
    lookup, n_compressed = build_compressed_token_map(tok)
    assert lookup.dtype == np.int32 and lookup.shape == (129280,)
    assert n_compressed == 99092
    np.testing.assert_array_equal(lookup, golden)


def test_compressed_token_map_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_MLX_CACHE", str(tmp_path))
    path = default_tokenizer_json()
    built, n_built = cached_compressed_token_map(path)
    assert len(list(tmp_path.glob("*.npy"))) == 1

    def must_not_rebuild(_):
        raise AssertionError("cache miss: the map was rebuilt")

    monkeypatch.setattr(tokenizer_module, "build_compressed_token_map", must_not_rebuild)
    cached, n_cached = cached_compressed_token_map(path)
    assert n_cached == n_built == 99092
    np.testing.assert_array_equal(cached, built)
