"""The DSpark drafter stored in the checkpoint as `mtp.0` .. `mtp.{n-1}`.

Each stage is a normal block (window-only attention, MoE with the drafter's
expert count). Stage 0 also owns `main_proj`/`main_norm`, which turn the
target's features into the rows the stages' rings are filled with; the last
stage owns the final norm, the Markov head and the confidence head.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .model import Block, Linear, RMSNorm
from .quant import Fp8Linear

F32, BF16 = mx.float32, mx.bfloat16


class MarkovHead(nn.Module):
    """Low-rank bigram correction: e_k = embed[x_{k-1}], bias_k = head @ e_k (fp32)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.embed.weight = self.embed.weight.astype(BF16)
        self.head = Linear(rank, vocab)

    def __call__(self, prev_ids: mx.array) -> tuple[mx.array, mx.array]:
        """prev_ids [B] -> (logit bias [B, vocab] fp32, embedding [B, rank] bf16)."""
        e = self.embed(prev_ids)
        return e.astype(F32) @ self.head.weight.astype(F32).T, e


class ConfidenceHead(nn.Module):
    """c_k = w . [pre-norm hidden_k ; e_k] in fp32 (a logit; sigmoid gives P(draft k survives))."""

    def __init__(self, dims: int):
        super().__init__()
        self.proj = Linear(dims, 1)

    def __call__(self, hidden: mx.array, markov_embed: mx.array) -> mx.array:
        x = mx.concatenate([hidden.astype(F32), markov_embed.astype(F32)], axis=-1)
        return (x @ self.proj.weight.astype(F32).T)[..., 0]


class DSparkStage(Block):
    def __init__(self, args: ModelArgs, stage: int):
        super().__init__(args, args.num_hidden_layers + stage)
        self.stage = stage
        dim = args.hidden_size
        if stage == 0:
            self.main_proj = Fp8Linear(dim * len(args.dspark_target_layer_ids), dim)
            self.main_norm = RMSNorm(dim, args.rms_norm_eps)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(dim, args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(dim + args.dspark_markov_rank)
