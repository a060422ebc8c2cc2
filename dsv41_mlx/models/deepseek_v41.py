"""DeepSeek-V4.1, the target model: embed -> hc copies -> blocks -> collapse -> norm -> head.

Semantics follow DeepSeek's reference `inference/model.py` (rev dba1be0a), including where it
rounds to bf16, so that on the CPU this file reproduces the reference's outputs
(tests/test_parity.py). Shapes in comments use S for the rows of a forward, hc for the
hyper-connection copies.

`Model.__call__` is the whole forward. The runtime (dsv41_mlx/runtime) drives the same three
steps, `start`, `block` and `finish`, to schedule a forward's work on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..cache import LayerCache, ModelCache
from ..config import ModelArgs
from .attention import Attention, SharedAttention
from .engram import Engram, NgramHasher, pack_rows, unpack_rows
from .hyper import Expansion, Folded, HcMixes, HyperConnection, copies_mean, hc_expand, hc_pre, stream_value
from .layers import RMSNorm, fused, positions_of
from .moe import MoE

F32, BF16 = mx.float32, mx.bfloat16


class Block(nn.Module):
    """Engram (some layers) -> hc attention -> hc MoE. Returns the stream and the next pre-mix."""

    attention_cls = Attention

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn = self.attention_cls(args, layer_id)
        self.ffn = MoE(args, layer_id)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hc_attn = HyperConnection(args)
        self.hc_ffn = HyperConnection(args)
        if layer_id in args.engram_layer_ids:
            self.engram = Engram(args, layer_id)

    def __call__(self, h: mx.array | Expansion | Folded, pre: mx.array, positions: mx.array, *attn_args,
                 rows: int | None = None, expand: bool = True,
                 next_fn: mx.array | None = None) -> tuple[mx.array | Expansion | Folded, mx.array]:
        """h [S, hc, dim] bf16 (or the previous block's output left unexpanded), pre [S, hc] ->
        (the stream after this block, the pre-mix the next block collapses it with).
        attn_args: the attention's caches (the target's) or ring (a DSpark stage's). rows: how
        many of the S rows are real (the rest pad the forward). expand=False: the stream is
        handed on unexpanded (an Expansion, or with the next block's mix projection next_fn a
        Folded), for the next block's first kernel to expand (hyper.py)."""
        h, x, xq, mix = self._attention_input(h, pre)
        y = self.attn(x, positions, *attn_args, xq=xq, onto=self._onto(self.attn.wo_b, h, mix, self.hc_ffn.fn))
        h, x, xq, mix = self._ffn_input(y, h, mix)
        y = self._ffn(x, rows, xq, None if expand else self._onto(self.ffn.shared_experts.w2, h, mix, next_fn))
        return self._output(y, h, mix, expand), mix.pre

    # Below: how a sub-layer's input and output meet the stream. Where the kernels fit (a GPU's
    # decode and verify rows), a sub-layer's last GEMM writes its output into the stream itself
    # and begins the next sub-layer's mixes (kernels.fp8_into_stream, a Folded), or the next
    # sub-layer's first kernel expands it as it reads it (an Expansion): either way the values
    # of hc_post, then hc_pre and the norm, as the reference writes them.

    def _attention_input(self, h, pre: mx.array) -> tuple[mx.array, mx.array, mx.array, HcMixes]:
        """(the stream h whole, the attention's normed input x, x through fp8_input, this
        sub-layer's mixes) from the stream in whichever form the block before left it."""
        if isinstance(h, Folded):
            x, xq, *mix = self.folded_attn_input(*h, pre)
            return h.h, x, xq, HcMixes(*mix)
        if isinstance(h, Expansion):
            h, x, xq, *mix = self.expanded_attn_input(*h, pre)
            return h, x, xq, HcMixes(*mix)
        x, xq, *mix = self.attn_input(h, pre)
        return h, x, xq, HcMixes(*mix)

    def _onto(self, last: nn.Module, h: mx.array, mix: HcMixes,
              next_fn: mx.array | None) -> kernels.StreamOnto | None:
        """Where the sub-layer's last GEMM `last` writes its output into the stream h itself,
        with the next sub-layer's mix projection next_fn begun (kernels.fp8_into_stream): the
        stream and this sub-layer's post and comb mixes; else None."""
        if next_fn is None or not kernels.fp8_into_stream_fits(last.weight, h):
            return None
        return kernels.StreamOnto(h, mix.post, mix.comb, next_fn)

    def _ffn_input(self, y, h: mx.array, mix: HcMixes) -> tuple[mx.array, mx.array, mx.array, HcMixes]:
        """The attention's output y expanded into the stream (where y is the stream already, with
        the MoE's mix parts: the attention wrote it there), and the MoE's input from it:
        (h, x, xq, mixes)."""
        if isinstance(y, tuple):
            h, parts = y
            x, xq, *ffn_mix = self.folded_ffn_input(h, parts, mix.pre)
            return h, x, xq, HcMixes(*ffn_mix)
        h, x, xq, *ffn_mix = self.ffn_input(y, h, mix.pre, mix.post, mix.comb)
        return h, x, xq, HcMixes(*ffn_mix)

    def _ffn(self, x: mx.array, rows: int | None, xq: mx.array, onto: kernels.StreamOnto | None):
        """The MoE of x (xq: x through fp8_input), into the stream where onto says so."""
        return self.ffn(x, rows, xq) if onto is None else self.ffn(x, rows, xq, onto)

    @staticmethod
    def _output(y, h: mx.array, mix: HcMixes, expand: bool) -> mx.array | Expansion | Folded:
        """The block's output: the stream the MoE wrote y into (a Folded), or y to expand onto
        h (an Expansion), expanded now where expand."""
        if isinstance(y, tuple):
            return Folded(*y)
        out = Expansion(y, h, mix.post, mix.comb)
        return out.value() if expand else out

    @fused("hc_attn", "attn_norm")
    def attn_input(self, h: mx.array, pre: mx.array) -> tuple[mx.array, ...]:
        """The attention's normed input, that through fp8_input, and this sub-layer's mixes
        (pre, post, comb)."""
        x, xq, mix = self.hc_attn.sublayer_input(h, pre, self.attn_norm)
        return x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_attn", "attn_norm")
    def expanded_attn_input(self, y: mx.array, residual: mx.array, post: mx.array, comb: mx.array,
                            pre: mx.array) -> tuple[mx.array, ...]:
        """attn_input of the previous block's Expansion (y, residual, post, comb), collapsed by
        pre: (h, x, xq, pre, post, comb), h the expanded stream."""
        h, x, xq, mix = self.hc_attn.expanded_input(y, residual, HcMixes(pre, post, comb), self.attn_norm)
        return h, x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_attn", "attn_norm")
    def folded_attn_input(self, h: mx.array, parts: mx.array, pre: mx.array) -> tuple[mx.array, ...]:
        """attn_input of the previous block's Folded stream h and mix parts: (x, xq, pre, post,
        comb)."""
        x, xq, mix = self.hc_attn.input_from_parts(h, parts, pre, self.attn_norm)
        return x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_ffn", "ffn_norm")
    def folded_ffn_input(self, h: mx.array, parts: mx.array, pre: mx.array) -> tuple[mx.array, ...]:
        """The MoE's input from the stream h that the attention's wo_b made with this sub-layer's
        mix parts (Attention.output's onto): (x, xq, pre, post, comb)."""
        x, xq, mix = self.hc_ffn.input_from_parts(h, parts, pre, self.ffn_norm)
        return x, xq, mix.pre, mix.post, mix.comb

    @fused("hc_ffn", "ffn_norm")
    def ffn_input(self, x: mx.array, h: mx.array, *attn_mix: mx.array) -> tuple[mx.array, ...]:
        """The attention's output expanded into the stream, then the MoE's normed input, that
        through fp8_input, and its sub-layer's mixes: (h, x, xq, pre, post, comb)."""
        h, x, xq, mix = self.hc_ffn.expanded_input(x, h, HcMixes(*attn_mix), self.ffn_norm)
        return h, x, xq, mix.pre, mix.post, mix.comb


class Head(nn.Module):
    """Vocabulary projection: fp32 logits, as the reference computes them (x and the weight
    widened to float32, then a float32 matmul: kernels.head_logits_reference).

    The weight stays BF16, as the release stores it. A decode or verify forward on a GPU
    (up to 16 rows, or prefill's last row) runs kernels.head_logits, which reads those bytes
    once for all rows and sums each row in one order at any row count; elsewhere the spec
    widens the weight a slice at a time."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = mx.zeros((vocab, dim), dtype=BF16)

    def __call__(self, x: mx.array, real_rows: int | None = None) -> mx.array:
        if kernels.head_logits_fits(x, self.weight):
            return kernels.head_logits(x, self.weight, real_rows=real_rows)
        return kernels.head_logits_reference(x, self.weight)


@dataclass
class Forward:
    """One forward between its blocks: what `Model.start` makes, each `Model.block` advances
    and `Model.finish` reads."""
    positions: mx.array  # [S]
    h: mx.array | Expansion | Folded  # the stream [S, hc, dim] (a block may hand it on unexpanded)
    pre: mx.array  # [S, hc]: the pre-mix the next block collapses the stream with
    shared: SharedAttention
    real_rows: int | None  # only the first real_rows rows matter (the rest pad the forward)
    features: list[mx.array] = field(default_factory=list)  # the DSpark taps, [S, dim] each
    dropped: int = 0  # leading rows a prefill no longer computes (Model.keep_last)


class Model(nn.Module):
    """DeepSeek-V4.1: embed -> hc copies -> blocks -> collapse -> norm -> head.

    `model(ids, cache)` runs any number of new positions (a prompt's chunk, one decode step,
    or a verify block) and returns fp32 logits [1, S, vocab] and the DSpark features
    [1, S, len(dspark_target_layer_ids) * dim]: the mean over hc copies of the stream
    entering each target layer. `mtp` holds the DSpark stages the checkpoint stores beside
    the target (io.load.build_model); the target's forward never runs them.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed.weight = self.embed.weight.astype(BF16)
        self.layers = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Head(args.vocab_size, args.hidden_size)
        self.hasher = NgramHasher(args) if args.engram_layer_ids else None
        self.mtp = []

    def __call__(self, ids: mx.array, cache: ModelCache | None = None, last_logits_only: bool = False,
                 real_rows: int | None = None, row_invariant: bool = False) -> tuple[mx.array, mx.array]:
        """ids [1, S] -> (logits [1, S, V], or the last real row's [1, 1, V]; features [1, S, F]).
        real_rows: only the first real_rows positions matter (the rest pad the forward).
        row_invariant: each row attends over its own gathered window (Attention)."""
        cache = cache if cache is not None else self.make_cache()
        forward = self.start(ids, cache, real_rows, row_invariant)
        # ids' values on the host: where ids was made from them, no device work
        engram_rows = self.take_tokens(cache, np.asarray(ids)[0].tolist(), real_rows)
        for i in range(len(self.layers)):
            self.block(i, forward, cache, engram_rows.get(i))
        return self.finish(forward, last_logits_only)

    def make_cache(self) -> ModelCache:
        return ModelCache([LayerCache(self.args.sliding_window,
                                      self.args.compress_ratios[i] if layer.attn.is_kv_source else 0)
                           for i, layer in enumerate(self.layers)])

    def start(self, ids: mx.array, cache: ModelCache, real_rows: int | None = None,
              row_invariant: bool = False) -> Forward:
        """A forward of ids [1, S] at positions cache.offset..: the embeddings as the stream's hc
        copies and the one-hot pre-mix, ready for block 0."""
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"ids must have shape [1, n]; got {ids.shape}")
        start, S = cache.offset, ids.shape[1]
        h, pre = hc_expand(self.embed(ids.reshape(-1)), self.args.hc_mult)
        shared = SharedAttention(real_rows, np.arange(start, start + S), row_invariant)
        return Forward(positions_of(start, S), h, pre, shared, real_rows)

    def take_tokens(self, cache: ModelCache, tokens: list[int], real_rows: int | None = None) -> dict[int, mx.array]:
        """A forward's tokens taken in: appended to the cache's history, and every engram layer's
        table rows for their n-grams read (only the real rows': a padding row's are zeros, its
        outputs dropped anyway) -> {engram layer: its rows' values}."""
        layers = self.engram_layers
        if not layers:
            cache.tokens.extend(tokens)
            return {}
        real = tokens if real_rows is None else tokens[:real_rows]
        packed, layout = pack_rows(self.engram_reads(cache.tokens, real), len(tokens))
        cache.tokens.extend(tokens)
        return dict(zip(layers, unpack_rows(packed, layout)))

    def engram_reads(self, history: list[int], tokens: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every engram layer's table rows (EngramTable.read) for the n-grams ending at each of
        `tokens`, after `history`, read on the host, in layer order."""
        hashes = self.hasher(history, tokens)
        return [self.layers[i].engram.table.read(hashes[:, self.hasher.layer_index(i)]) for i in self.engram_layers]

    def block(self, i: int, forward: Forward, cache: ModelCache, engram_rows: mx.array | None = None) -> None:
        """Block i of the forward: the engram's table rows added (an engram layer's, from
        take_tokens), the DSpark features tapped, then the block. A block hands the next one its
        output unexpanded (Expansion) or put into the stream with the next block's mixes begun
        (Folded), where the next block takes it so; the last block expands it."""
        layer, f = self.layers[i], forward
        h = f.h
        if i in self._whole_stream_layers and isinstance(h, Expansion):
            h = h.value()
        if engram_rows is not None:
            h = layer.engram(stream_value(h), engram_rows, f.real_rows)
        if i in self.args.dspark_target_layer_ids:
            f.features.append(copies_mean(stream_value(h)))
        next_fn = self.layers[i + 1].hc_attn.fn if self._folds_into_next[i] else None
        f.h, f.pre = layer(h, f.pre, f.positions, cache.layers[i], cache.layers, f.shared, rows=f.real_rows,
                           expand=i == len(self.layers) - 1, next_fn=next_fn)

    def keep_last(self, forward: Forward, cache: ModelCache, i: int, rows: int) -> bool:
        """Before block i (past the last KV source): the forward goes on with its last `rows` rows
        only, and block i's window cache passes over the positions dropped so far. Exact for the
        rows whose outputs later reads need (runtime.runner.prefill_rows says which): a layer past
        the last source keeps no compressed state, only the window of its own keys
        (reference `Attention._window_kv`), and reads the sources' shared caches per row.
        rows 0: no row reaches block i or any after it; their window caches (those the cache
        holds) pass over every position of the forward, and False says the forward ends here."""
        f = forward
        if rows == 0:
            for layer in cache.layers[i:]:
                if layer is not None:
                    layer.window.pass_over(f.pre.shape[0] + f.dropped)
            return False
        dropped = f.pre.shape[0] - rows
        if dropped > 0:
            f.h, f.pre = stream_value(f.h)[dropped:], f.pre[dropped:]
            f.positions, f.shared = f.positions[dropped:], f.shared.last_rows(rows)
            f.real_rows = None if f.real_rows is None else f.real_rows - dropped
            f.features = [x[dropped:] for x in f.features]
            f.dropped += dropped
        if f.dropped:
            cache.layers[i].window.pass_over(f.dropped)
        return True

    def finish(self, forward: Forward, last_logits_only: bool = False) -> tuple[mx.array, mx.array]:
        """The last block's stream -> (logits [1, S or 1, V], features [1, S, F])."""
        S, real_rows = forward.pre.shape[0], forward.real_rows
        x = self.norm(hc_pre(forward.h, forward.pre))
        if last_logits_only:
            last = S if real_rows is None else real_rows
            x, real_rows = x[last - 1: last], None
        logits = self.head(x, real_rows)[None]
        features = forward.features
        feats = mx.concatenate(features, axis=-1)[None] if features else mx.zeros((1, S, 0), dtype=BF16)
        return logits, feats

    @functools.cached_property
    def engram_layers(self) -> tuple[int, ...]:
        """The blocks with an engram, found once (asking each block costs a caught AttributeError)."""
        return tuple(i for i, layer in enumerate(self.layers) if hasattr(layer, "engram"))

    @functools.cached_property
    def _whole_stream_layers(self) -> frozenset[int]:
        """Blocks that need the stream whole before they run: an engram adds to it, a DSpark
        target layer taps it."""
        return frozenset(self.args.engram_layer_ids) | frozenset(self.args.dspark_target_layer_ids)

    @functools.cached_property
    def _folds_into_next(self) -> tuple[bool, ...]:
        """Whether block i may put its output into the next block's stream: there is a next
        block and it has no engram (which adds to the stream first)."""
        return tuple(i + 1 < len(self.layers) and i + 1 not in self.engram_layers for i in range(len(self.layers)))
