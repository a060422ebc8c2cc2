"""Engram: hashed n-gram lookups written into the residual stream.

Each position is hashed with the n-grams (2 .. max_ngram_size tokens) that end
there, over a compressed token vocabulary (tokens that normalise alike share an
id; see tokenizer.build_compressed_token_map). Every (n-gram size, head) pair
owns a prime-sized range of the layer's FP8 table. The release tables are
~200 GB, so they are memory-mapped from the safetensors file and only the rows
a position needs are read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ModelArgs
from ..quant import Fp8Linear

F32, BF16 = mx.float32, mx.bfloat16


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def bucket_primes(args: ModelArgs) -> list[list[list[int]]]:
    """[layer][n-gram size - 2][head] bucket moduli.

    For each (layer, n-gram size) the search restarts just below
    `engram_vocab_size`, and each head takes the next prime not handed out yet.
    """
    seen: set[int] = set()
    layers = []
    for _ in args.engram_layer_ids:
        per_size = []
        for _ in range(args.engram_max_ngram_size - 1):
            current, heads = args.engram_vocab_size - 1, []
            for _ in range(args.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                heads.append(current)
            per_size.append(heads)
        layers.append(per_size)
    return layers


def hash_multipliers(args: ModelArgs) -> np.ndarray:
    """[layers, max_ngram_size] odd int64 multipliers from a per-layer numpy RNG (seed 10007*layer).

    Bounded so that compressed_id * multiplier cannot overflow int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // args.engram_compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(args.engram_max_ngram_size,),
                                                           dtype=np.int64) * 2 + 1
            for layer in args.engram_layer_ids]
    return np.stack(rows)


class NgramHasher:
    """Token ids -> table rows of every engram layer, for the positions of one forward."""

    def __init__(self, args: ModelArgs, token_map: np.ndarray | None = None):
        self.layer_ids = list(args.engram_layer_ids)
        self.max_n = args.engram_max_ngram_size
        self.pad_token_id = args.engram_pad_token_id
        primes = bucket_primes(args)
        self.primes = np.array(primes, dtype=np.int64)  # [layers, n-1, heads]
        flat = self.primes.reshape(len(self.layer_ids), -1)
        self.offsets = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1)
        self.multipliers = hash_multipliers(args)  # [layers, max_n]
        self.token_map = token_map

    def layer_index(self, layer_id: int) -> int:
        return self.layer_ids.index(layer_id)

    def __call__(self, history: list[int], new: list[int]) -> np.ndarray:
        """Row ids [S, layers, (max_n-1)*heads] for the positions of `new`, given earlier tokens.

        Look-back stops at the start of the sequence: missing tokens are the
        pad token's compressed id.
        """
        if self.token_map is None:
            raise RuntimeError("engram needs the compressed token map; load the model with dsv41_mlx.load")
        lookback = self.max_n - 1
        context = history[-lookback:] if lookback else []
        seq = self.token_map[np.asarray(context + list(new), dtype=np.int64)].astype(np.int64)
        pad = np.int64(self.token_map[self.pad_token_id])
        S, n_ctx = len(new), len(context)
        # tokens[s, shift] = compressed id `shift` positions back, pad before the sequence start
        idx = n_ctx + np.arange(S)[:, None] - np.arange(self.max_n)[None, :]
        absolute = len(history) + np.arange(S)[:, None] - np.arange(self.max_n)[None, :]
        tokens = np.where(absolute >= 0, seq[np.clip(idx, 0, None)], pad)  # [S, max_n]
        products = tokens[:, None, :] * self.multipliers[None]  # [S, layers, max_n]
        rolling = products[..., 0]
        hashes = []
        for n in range(1, self.max_n):
            rolling = np.bitwise_xor(rolling, products[..., n])
            hashes.append(rolling[..., None] % self.primes[None, :, n - 1])  # [S, layers, heads]
        return np.concatenate(hashes, axis=-1) + self.offsets[None]


class EngramTable:
    """Read-only view of one layer's FP8 table (E4M3 codes + an E8M0 scale per 32 columns),
    memory-mapped from its safetensors file so that only looked-up rows are read."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray):
        self.codes, self.scales = codes, scales  # [rows, dim] uint8, [rows, dim/32] uint8

    @classmethod
    def from_safetensors(cls, path: str | Path, weight_name: str, scale_name: str) -> "EngramTable":
        path = Path(path)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        base = 8 + header_len

        def view(name):
            entry = header[name]
            begin, end = entry["data_offsets"]
            return np.memmap(path, dtype=np.uint8, mode="r", offset=base + begin,
                             shape=tuple(entry["shape"]))

        return cls(view(weight_name), view(scale_name))

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored rows for ids [...] on the host: (codes [..., dim], scales [..., dim/32])
        uint8 (a forward packs every engram layer's into one MLX array: pack_rows)."""
        return np.asarray(self.codes[ids]), np.asarray(self.scales[ids])


def pack_rows(rows: list[tuple[np.ndarray, np.ndarray]], total: int | None = None) -> tuple[mx.array, list]:
    """Several layers' EngramTable.read rows as one MLX array (uint8) and where each part lies.
    total: each part's rows (its first axis) made up to this many with zeros, where the reads
    cover only a padded forward's real rows (Model.take_tokens).

    A forward makes them on the host, where MLX on CUDA keeps such an array in managed memory:
    the first kernel to read one pulls its pages to the GPU (a stall even in the middle of a
    step), and its buffer may first be moved out of MLX's cache of device buffers with a copy
    that waits for the device. One array a forward pays that once; Model.__call__ makes it
    before any of the forward's GPU work is queued, and unpack_rows' values are dequantised at
    the start of the forward."""
    parts = [a for pair in rows for a in pair]
    layout, size = rows_layout([a.shape if total is None else (total, *a.shape[1:]) for a in parts])
    flat = np.zeros(size, np.uint8)
    write_rows(flat, layout, rows)
    return mx.array(flat), layout


def rows_layout(shapes: list[tuple[int, ...]]) -> tuple[list, int]:
    """Where parts of these shapes lie one after another in one flat uint8 buffer, row-major:
    [(offset, shape)], and the buffer's size."""
    layout, offset = [], 0
    for shape in shapes:
        layout.append((offset, tuple(shape)))
        offset += int(np.prod(shape))
    return layout, offset


def write_rows(flat: np.ndarray, layout: list, rows: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """EngramTable.read rows written into flat (uint8, rows_layout's buffer): each part's rows
    first (row 0 first), the rest of its place zeros."""
    parts = [a for pair in rows for a in pair]
    if len(parts) != len(layout):
        raise ValueError(f"{len(parts)} parts for a layout of {len(layout)}")
    for (start, shape), a in zip(layout, parts):
        if a.shape[1:] != shape[1:] or a.shape[0] > shape[0]:
            raise ValueError(f"{a.shape[0]} rows read for a forward of {shape[0]}"
                             if a.shape[1:] == shape[1:] else f"rows of shape {a.shape} for a place of {shape}")
        end = start + int(np.prod(shape))
        flat[start: start + a.size] = a.reshape(-1)
        flat[start + a.size: end] = 0


def unpack_rows(packed: mx.array, layout: list) -> list[mx.array]:
    """pack_rows' layers' rows dequantised (dequantize_rows), each [..., dim] bf16, in order."""
    views = [packed[o: o + int(np.prod(shape))].reshape(shape) for o, shape in layout]
    return [dequantize_rows(views[k], views[k + 1]) for k in range(0, len(views), 2)]


@mx.compile
def dequantize_rows(codes: mx.array, scales: mx.array) -> mx.array:
    """EngramTable.read's (codes, scales) as MLX arrays -> the rows' values, bf16 [..., dim]: each E4M3
    code times 2^(its block's E8M0 scale - 127). Each code is decoded from its bits, as
    mx.from_fp8 decodes it (a launch of its own: tests/test_model.py), so that all of it is one
    launch: sign s, exponent field e, mantissa m give (-1)^s (8 + m) 2^(e - 10), or
    (-1)^s m 2^(1 - 10) where e = 0, the scale's power of two folded into that one; the two
    codes E4M3 leaves for NaN give NaN."""
    c, s = codes.reshape(*scales.shape, -1), scales[..., None]  # views: [..., blocks, 32], [..., blocks, 1]
    exponent8 = c & 120  # the exponent field, times 8
    significand = ((c & 7) + mx.where(exponent8 == 0, 0, 8)).astype(F32)
    significand = mx.where(c >= 128, -significand, significand)
    power = mx.maximum(exponent8, 8).astype(F32) * 0.125 + (s.astype(F32) - (7 + 3 + 127))
    values = mx.where((c & 127) == 127, mx.nan, significand * mx.power(2.0, power))
    return values.astype(BF16).reshape(codes.shape)


class Engram(nn.Module):
    """Gated n-gram memory: the looked-up rows give one key per hc copy and a shared value;
    each copy adds the value scaled by a gate from its normalised dot product with its key."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        n_cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
        self.wkv = Fp8Linear(n_cols * args.engram_head_dim, args.hidden_size * (args.hc_mult + 1))
        self.q_weight = mx.ones((args.hc_mult, args.hidden_size), dtype=BF16)
        self.k_weight = mx.ones((args.hc_mult, args.hidden_size), dtype=BF16)
        self.eps = args.rms_norm_eps
        self.table: EngramTable | None = None  # attached by the checkpoint loader

    def __call__(self, h: mx.array, rows: mx.array, real: int | None = None) -> mx.array:
        """h [S, hc, dim] bf16 and this layer's table rows for the forward's hashes, dequantised
        [S, n_cols, dim] bf16 (Model.take_tokens reads every layer's at once: pack_rows, unpack_rows)
        -> h with the gated value added (bf16). real: the rows that matter, the first `real` (a
        padded forward's); on a GPU the others' projection comes out zeros, which leaves their h
        as it was."""
        kv = self.wkv(rows.reshape(h.shape[0], -1), real)  # [S, (hc+1)*dim]
        return gated_add(h, kv, self.q_weight, self.k_weight, self.eps)


# which of gated_add's three sums a term belongs to, broadcast against the terms [3, S, hc, dim]
_SUMS = mx.array(np.arange(3, dtype=np.int32).reshape(3, 1, 1, 1))


@mx.compile
def gated_add(h: mx.array, kv: mx.array, q_weight: mx.array, k_weight: mx.array, eps: float) -> mx.array:
    """Engram's write into the stream h [S, hc, dim]: kv [S, (hc+1)*dim] holds a key per hc
    copy and then the value; each copy adds the value times a gate from its RMS-normed dot
    product with its key. One compiled function, its element-wise steps fused between the
    reductions: six launches where the steps as written (mean, mean, sum) make thirteen. Its
    three sums over dim (the copy's squares and the key's, for their RMS, and their weighted
    products) are one reduction of the three terms laid side by side, which one fused
    launch makes; each sum still runs over its own row of dim terms, as it would alone, so
    the values are the same bits (tests/test_model.py holds the steps as written)."""
    S, hc, dim = h.shape
    parts = kv.reshape(S, hc + 1, dim)
    key, value = parts[:, :hc], parts[:, hc:]  # views [S, hc, dim], [S, 1, dim]: cast where read
    weight = q_weight.astype(F32) * k_weight.astype(F32)
    hf, kf = h.astype(F32), key.astype(F32)
    terms = mx.where(_SUMS == 0, hf * hf, mx.where(_SUMS == 1, kf * kf, hf * weight * kf))
    sums = terms.sum(axis=-1, keepdims=True)  # [3, S, hc, 1]
    inv_rms = mx.rsqrt(sums[:2] * (1.0 / dim) + eps)  # (a mean is its sum times 1 / dim)
    dot = sums[2:] * (inv_rms[:1] * inv_rms[1:]) * dim ** -0.5  # [1, S, hc, 1]
    root = mx.sqrt(mx.maximum(mx.abs(dot), 1e-6))
    gate = mx.sigmoid(mx.where(dot < 0, -root, root))  # signed square root, as in training
    return (hf + gate.reshape(S, hc, 1) * value.astype(F32)).astype(BF16)
