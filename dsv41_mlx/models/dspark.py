"""The DSpark drafter's modules, stored in the checkpoint as `mtp.0` .. `mtp.{n-1}`.

Each stage is a normal block (hyper-connections, attention, MoE with the drafter's expert
count) whose attention reads a private ring of keys instead of a growing cache. Stage 0 also
owns `main_proj`/`main_norm`, which turn the target's features into the rows the rings are
filled with; the last stage owns the final norm, the Markov head and the confidence head.
How they ingest and propose: runtime/drafter.py.
"""

from __future__ import annotations

import contextlib
import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..config import ModelArgs
from ..kernels import StreamOnto
from ..quant import Fp8Linear, fp8_input
from .attention import Attention, sparse_attention
from .deepseek_v41 import Block
from .layers import Linear, RMSNorm

F32, BF16 = mx.float32, mx.bfloat16


class MarkovHead(nn.Module):
    """Low-rank bigram correction: e_k = embed[x_{k-1}], bias_k = head @ e_k (fp32)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.embed.weight = self.embed.weight.astype(BF16)
        self.head = Linear(rank, vocab)

    def bias(self, e: mx.array, candidates: mx.array | None = None) -> mx.array:
        """Embeddings e [B, rank] -> logit bias [B, vocab] (or [B, n] at candidates [B, n]) in fp32."""
        if candidates is None:
            return e.astype(F32) @ self.head.weight.astype(F32).T
        return self.bias_at(e, self.head_rows(candidates))

    def head_rows(self, candidates: mx.array) -> mx.array:
        """The head's rows of the candidates [B, n] in fp32: [B, n, rank]."""
        return self.head.weight[candidates].astype(F32)

    def bias_at(self, e: mx.array, rows: mx.array) -> mx.array:
        """bias(e, candidates) from their head_rows [B, n, rank]: [B, n] fp32."""
        return (rows @ e.astype(F32)[:, :, None])[..., 0]


class ConfidenceHead(nn.Module):
    """w . [pre-norm hidden_k ; e_k] in fp32: a logit, sigmoid gives P(draft k survives | prefix survived)."""

    def __init__(self, dims: int):
        super().__init__()
        self.proj = Linear(dims, 1)

    def __call__(self, hidden: mx.array, markov_embed: mx.array) -> mx.array:
        x = mx.concatenate([hidden.astype(F32), markov_embed.astype(F32)], axis=-1)
        return (x @ self.proj.weight.astype(F32).T)[..., 0]


class DSparkAttention(Attention):
    """Window-only attention over the stage's ring plus the block's own rows."""

    side_stream: mx.Stream | None = None  # set by Drafter: where the key path runs beside the queries

    def __call__(self, x: mx.array, positions: mx.array, ring: mx.array, ring_valid: mx.array,
                 xq: mx.array | None = None,
                 onto: StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """x [S, dim] block rows at `positions`; ring [window, D] bf16, ring_valid [window] bool;
        xq: x through quant.fp8_input, where the caller has it; onto: the output goes into that
        stream (Attention.output's onto)."""
        S = x.shape[0]
        rope = self.rope.tables(positions, self.head_dim)
        xq = fp8_input(x) if xq is None else xq  # once, for both paths
        with _on(self.side_stream):  # the key path needs only xq: it runs beside the query path
            block_keys = self.latent_kv(xq, rope)
        keys = mx.concatenate([ring, block_keys])
        mask = mx.broadcast_to(mx.concatenate([ring_valid, mx.ones((S,), dtype=mx.bool_)])[None], (S, keys.shape[0]))
        # on a GPU, the target's attention kernel (one launch, the rotations in it), each row's
        # window every key: it takes q unrotated and rotates its output back
        kernel = kernels.attention_fits((S, self.n_heads, self.head_dim), BF16, keys.shape[0], 0)
        q, _ = self.queries(xq, rope, kernel)
        if kernel:
            return self.attention_and_output(q, keys, every_key(S, keys.shape[0]), mask, None, None, None,
                                             self.attn_sink, rope, None, onto)
        o = sparse_attention(q, keys, mask, None, None, self.attn_sink, self.scale)
        return self.output(o, rope, False, None, onto)


@functools.lru_cache(maxsize=None)
def every_key(rows: int, keys: int) -> mx.array:
    """The attention kernel's window index where every row sees every key: 0 .. keys - 1 in
    each of `rows` rows [rows, keys] int32, made once (from numpy: no launch, no stream)."""
    return mx.array(np.tile(np.arange(keys, dtype=np.int32), (rows, 1)))


class DSparkStage(Block):
    attention_cls = DSparkAttention

    def __init__(self, args: ModelArgs, stage: int):
        super().__init__(args, args.num_hidden_layers + stage)
        self.stage = stage
        dim = args.hidden_size
        if stage == 0:
            self.main_proj = Fp8Linear(args.dspark_feature_dim, dim)
            self.main_norm = RMSNorm(dim, args.rms_norm_eps)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(dim, args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(dim + args.dspark_markov_rank)


def _on(stream: mx.Stream | None):
    """mx.stream(stream), or no change when stream is None."""
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()
