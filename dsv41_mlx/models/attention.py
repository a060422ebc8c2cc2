"""Attention: the sliding window plus, on compressed layers, the indexer's top-k of the
compressed KV, over one shared 512-d latent that is both key and value (MQA), with a
per-head sink logit (reference `Attention`, `Compressor`, `Indexer`, `sparse_attn`).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..cache import LayerCache
from ..config import ModelArgs
from ..kernels import rms_norm
from ..quant import Fp8Linear, fp4_fake_quant, fp8_fake_quant, fp8_input, gemm_input_dtype
from .layers import Linear, RMSNorm, Rope, fused, index_range, key_ids, shared_rope

F32, BF16 = mx.float32, mx.bfloat16


@mx.compile
def sparse_attention(q: mx.array, window_keys: mx.array, window_mask: mx.array,
                     picked_keys: mx.array | None, picked_mask: mx.array | None,
                     sink: mx.array, scale: float) -> mx.array:
    """Single-latent attention with a per-head sink logit (reference `sparse_attn`).

    q [S, H, D] bf16; window_keys [N, D] shared by every row (or [S, N, D],
    each row's own), window_mask [S, N]; picked_keys [S, K, D] per-row
    compressed keys, picked_mask [S, K].
    Keys are also the values. Scores and the softmax denominator are fp32; the
    probabilities are rounded to bf16 before they weight the values, relative
    to the row max (the reference does this per 64-key block; one block covers
    every row at the fixture's sizes). Rows with no visible key give zeros.
    """
    qf = q.astype(F32)
    wk = window_keys.astype(F32)
    per_row = wk.ndim == 3
    window_scores = qf @ (wk.swapaxes(1, 2) if per_row else wk.T)
    scores = mx.where(window_mask[:, None, :], window_scores * scale, -mx.inf)  # [S, H, N]
    if picked_keys is not None:
        pk = picked_keys.astype(F32)
        picked = mx.where(picked_mask[:, None, :], (qf @ pk.swapaxes(1, 2)) * scale, -mx.inf)
        scores = mx.concatenate([scores, picked], axis=-1)
    row_max = mx.maximum(scores.max(axis=-1, keepdims=True), -1e30)
    p = mx.exp(scores - row_max)
    denom = p.sum(axis=-1, keepdims=True) + mx.exp(sink.astype(F32)[:, None] - row_max)
    pb = p.astype(BF16).astype(F32)
    n = wk.shape[-2]
    out = pb[..., :n] @ wk
    if picked_keys is not None:
        out = out + pb[..., n:] @ pk
    return (out / denom).astype(BF16)


class Compressor(nn.Module):
    """Pools each full group of `ratio` positions into one latent (softmax gate over the group).

    Ratio 1 is a plain bf16 projection. Ratio > 1 projects in fp32 (its BF16
    weights held in fp32, as the reference holds them) and keeps the rows of an
    unfinished group in the cache until the group completes.
    Returns the new latents (bf16, normed, before RoPE) and their group ids.
    """

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.hidden_size, args.head_dim)
        if ratio > 1:
            self.wgate = Linear(args.hidden_size, args.head_dim)
            for proj in (self.wkv, self.wgate):
                proj.weight = proj.weight.astype(F32)  # widened at load
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def __call__(self, x: mx.array, state) -> tuple[mx.array | None, int]:
        first_group = state.n_groups
        if self.ratio == 1:
            state.end += x.shape[0]
            return self.norm(self.wkv(x)), first_group
        # kv | score of the new positions (two GEMMs: as one of twice the outputs cuBLAS ran a
        # slow split-K kernel, where the two run concurrently), then of every position not in
        # a group yet, the unfinished group's before them, read where the cache has written them
        xf = x.astype(F32)
        rows = state.append_raw(mx.concatenate([xf @ self.wkv.weight.T, xf @ self.wgate.weight.T], axis=1))
        n_full = rows.shape[0] // self.ratio
        if n_full == 0:
            return None, first_group
        groups = rows[: n_full * self.ratio].reshape(n_full, self.ratio, -1)
        width = groups.shape[2] // 2
        return self.norm(pooled(groups[..., :width], groups[..., width:])), first_group


@mx.compile
def pooled(kv: mx.array, score: mx.array) -> mx.array:
    """Each full group's rows kv [G, ratio, D] weighted by the softmax of their scores over the
    group (fp32) and summed, in bf16. Compiled: the softmax over a middle axis is several
    operations, whose element-wise steps fuse.

    Groups of two (the release's ratio) take the same steps written out per row: the group's
    max, each row's exp(score - max) over their sum, the weighted rows added. Element-wise
    only, so all of it is one launch (the spec's reductions over the group axis make it six),
    and the same values: a reduction of two terms is their one addition (tests/test_model.py)."""
    if kv.shape[1] != 2:  # (compiled per shape: a branch of the trace)
        return (kv * mx.softmax(score, axis=1, precise=True)).sum(axis=1).astype(BF16)
    first, second = score[:, 0], score[:, 1]
    top = mx.maximum(first, second)
    e_first, e_second = mx.exp(first - top), mx.exp(second - top)
    total = e_first + e_second
    return (kv[:, 0] * (e_first / total) + kv[:, 1] * (e_second / total)).astype(BF16)


@mx.compile
def head_weights(proj: mx.array, scale: float) -> mx.array:
    """The indexer's per-head weights: the projection [S, H] times scale in fp32, in bf16."""
    return (proj.astype(F32) * scale).astype(BF16)


# The indexer's key count grows as a sequence does: shapeless, so that no length retraces
@functools.partial(mx.compile, shapeless=True)
def weighted_relu(dots: mx.array, w: mx.array) -> mx.array:
    """relu(q . k) [S, H, T] (bf16) times each head's weight w [S, H], rounded to bf16 as the
    reference does, then widened to fp32 for the sum over heads."""
    return (mx.maximum(dots, 0) * w[:, :, None]).astype(F32)


@functools.partial(mx.compile, shapeless=True)
def negated_scores(summed: mx.array, key_ids: mx.array, visible: mx.array) -> mx.array:
    """The index scores negated, as the top-k's argpartition takes them (one launch with the
    rest): the head sum [S, T] rounded to bf16 (as the reference), fp32, negated; +inf at
    the key ids [T] a row may not see yet (id >= visible [S])."""
    return mx.where(key_ids[None, :] < visible[:, None], -summed.astype(BF16).astype(F32), mx.inf)


@functools.partial(mx.compile, shapeless=True)
def negated_candidate_scores(summed: mx.array, key_ids: mx.array, visible: mx.array,
                             candidates: mx.array) -> mx.array:
    """negated_scores, +inf also outside a row's candidate blocks (candidates [S, T])."""
    return mx.where(candidates, negated_scores(summed, key_ids, visible), mx.inf)


# The most bytes one array of an indexer's scoring may hold ([rows, heads, keys] fp32, its
# largest). MLX keeps every array an evaluation reads until the device has run it, and runs up
# to ten evaluations ahead, so a long prompt's chunk, scored whole, piles up its scores: rows
# are scored in slices within this bound instead (each row's picks are its own: the same ids).
SCORE_BYTES = 256 << 20


def score_rows(rows: int, heads: int, keys: int) -> int:
    """How many rows one slice of an indexer's scoring takes: all of them where their scores
    fit SCORE_BYTES, else as many as do (at least one)."""
    return max(1, min(rows, SCORE_BYTES // (4 * heads * max(keys, 1))))


def indexer_scoring_length(args: ModelArgs) -> int:
    """Tokens of context past which every index layer has more compressed groups than its
    index_topk picks, so that each decode step scores them (Indexer.picks_everything: before
    that, an indexer hands on every position unscored), with a margin."""
    ratios = [args.compress_ratios[i] for i in args.index_source_layer_ids] or [1]
    return args.index_topk * max(ratios) + 64


@functools.partial(mx.compile, shapeless=True)
def every_pick_arrays(ids: mx.array, last: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
    """SharedAttention.every_pick's arrays from ids 0 .. k - 1 [k] (uint32), last = n - 1 [1]
    and visible [S]: (min(ids, last), id < visible and id <= last), both [S, k]."""
    last_rows = (visible[:, None] * 0 + last).astype(mx.uint32)  # n - 1 in each row: [S, 1], so [S, k] out
    return mx.minimum(ids[None, :], last_rows), (ids[None, :] < visible[:, None]) & (ids[None, :] <= last_rows)


class Indexer(nn.Module):
    """Scores compressed positions per query and keeps the best `index_topk`.

    score[s, t] = sum_h relu(q_sh . k_t) * w_sh with FP4 fake-quantised q and k,
    rounded to bf16 after the dot, after the weighting and after the head sum,
    as in the reference. Index-key owners (KV sources) also build the keys.
    """

    def __init__(self, args: ModelArgs, layer_id: int, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk = args.index_topk
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        self.is_candidate_source = layer_id == args.candidate_source_layer_id
        self.uses_candidates = 0 <= args.candidate_source_layer_id < layer_id
        self.candidate_blocks = args.candidate_topk_blocks
        self.candidate_block_size = args.candidate_block_size
        self._pick_ids = index_range(self.topk)  # 0 .. topk - 1 (SharedAttention.every_pick)
        self.wq_b = Fp8Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(args.hidden_size, self.n_heads)
        if owns_keys:
            self.wk = Linear(args.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latent: mx.array, positions: mx.array, rope: Rope) -> mx.array:
        """Index keys of new compressed latents [G, D] at their group positions."""
        k = rope(self.k_norm(self.wk(latent)), positions)
        return fp4_fake_quant(k, 32, "e8m0")

    def __call__(self, x, qr, positions, index_keys, visible, rope, shared) -> tuple[mx.array, mx.array]:
        """Top-k compressed ids per row [S, k] and their validity mask.

        qr: the attention's normed low-rank query, through fp8_input (Attention.queries).

        visible [S]: how many groups each row may see (groups finished at or
        before its position).

        Where the k picks hold every compressed position (n <= k) and no candidate mask
        restricts them, the scores cannot change the picks: every position a row sees is
        valid, the rest padding (SharedAttention.every_pick, the same arrays as the scored
        path's). So a context of up to k groups runs no scoring at all; past it, every step
        does.
        """
        n = index_keys.shape[0]
        # the candidate source's mask restricts something only past its blocks' worth of positions
        masks = self.is_candidate_source and n > self.candidate_blocks * self.candidate_block_size
        if self.is_candidate_source and not masks:
            shared.candidates = None  # every block kept: the later layers score unrestricted, the same
        if self.picks_everything(n, masks, shared):
            return shared.every_pick(n, self._pick_ids, visible)
        S = x.shape[0]
        q = self.wq_b.quantized(qr, shared.real_rows).reshape(S, self.n_heads, self.head_dim)
        q = fp4_fake_quant(rope(q, positions), 32, "e8m0").astype(BF16)
        w = head_weights(self.weights_proj(x), self.weight_scale)  # [S, Hi] bf16
        keys = index_keys.astype(BF16)
        candidates = shared.candidates if self.uses_candidates else None
        step = score_rows(S, self.n_heads, n)
        if step == S:
            picks = [self._picks(q, w, keys, visible, candidates, masks)]
        else:
            picks = [self._picks(q[a:a + step], w[a:a + step], keys, visible[a:a + step],
                                 None if candidates is None else candidates[a:a + step], masks)
                     for a in range(0, S, step)]
        if masks:
            shared.candidates = picks[0][2] if len(picks) == 1 else mx.concatenate([p[2] for p in picks])
        if len(picks) == 1:
            return picks[0][:2]
        return mx.concatenate([p[0] for p in picks]), mx.concatenate([p[1] for p in picks])

    def _picks(self, q: mx.array, w: mx.array, keys: mx.array, visible: mx.array,
               candidates: mx.array | None, masks: bool) -> tuple[mx.array, mx.array, mx.array | None]:
        """__call__'s top-k for some rows: q [S, Hi, D] and w [S, Hi] (bf16), keys [T, D] (bf16),
        visible [S], the candidate mask's rows [S, T] (None: unrestricted); masks: make this
        layer's candidate mask too. -> (ids, valid, the candidate mask's rows or None)."""
        S, n = q.shape[0], keys.shape[0]
        dots = q @ keys.T  # [S, Hi, T] bf16
        summed = weighted_relu(dots, w).sum(axis=1)  # [S, T]
        # the scores negated (+inf: masked), so that the top-k is argpartition's k smallest
        if candidates is not None:
            negated = negated_candidate_scores(summed, key_ids(n), visible, candidates)
        else:
            negated = negated_scores(summed, key_ids(n), visible)
        made = self._candidate_mask(negated, visible) if masks else None
        if n < self.topk:
            # Fewer compressed positions than picks: pad with masked columns, so that every
            # forward picks `topk` (the same shapes each step: no retrace of the compiled
            # attention, whose result the masked picks do not change; tests/test_model.py)
            negated = mx.concatenate([negated, mx.full((S, self.topk - n), mx.inf)], axis=1)
        ids = mx.sort(mx.argpartition(negated, kth=self.topk - 1, axis=-1)[:, : self.topk], axis=-1)
        valid = mx.take_along_axis(negated, ids, axis=-1) < mx.inf
        return mx.minimum(ids, n - 1), valid, made  # a padding pick reads the last position, masked

    def picks_everything(self, n: int, masks: bool, shared: SharedAttention) -> bool:
        """Whether the top-k of n compressed positions is all of them, whatever their scores:
        n <= k, and no candidate mask to make (masks) or to apply."""
        return n <= self.topk and not masks and (not self.uses_candidates or shared.candidates is None)

    def _candidate_mask(self, negated: mx.array, visible: mx.array) -> mx.array:
        """Level one of the two-level top-k: each row keeps its best blocks of positions,
        the block holding its newest position always included. negated: the scores negated
        (negated_scores), as the top-k takes them. [S, T] bool."""
        S, n = negated.shape
        bs = self.candidate_block_size
        n_blocks = -(-n // bs)
        padded = mx.concatenate([negated, mx.full((S, n_blocks * bs - n), mx.inf)], axis=1)
        blocks = padded.reshape(S, n_blocks, bs).min(axis=-1)  # each block's best score, negated
        newest = (visible - 1) // bs
        blocks = mx.where(key_ids(n_blocks)[None, :] == newest[:, None], -mx.inf, blocks)
        k = min(self.candidate_blocks, n_blocks)
        top = mx.argpartition(blocks, kth=k - 1, axis=-1)[:, :k]
        keep_top = mx.take_along_axis(blocks, top, axis=-1) < mx.inf
        keep = mx.zeros((S, n_blocks), dtype=mx.bool_)
        keep = mx.put_along_axis(keep, top, keep_top, axis=-1)
        return mx.repeat(keep, bs, axis=1)[:, :n]


class SharedAttention:
    """What one forward hands down the layer stack (the reference's module-global
    `shared_attn`, made explicit): the index sources' top-k and the candidate mask, how
    many rows are real, and whether each row gathers its own window.

    row_invariant: each row attends over its own window, gathered oldest first, so that a
    position's attention is the same array, reduced in the same order, in a forward of any
    row count (a GPU kernel picks its summation order by shape: the runtime pads decode and
    verify forwards to one row count and sets this, so that drafted replies equal plain ones).
    """

    def __init__(self, real_rows: int | None = None, positions: np.ndarray | None = None,
                 row_invariant: bool = False):
        self.real_rows = real_rows  # rows before a padded forward's padding (None: all are real)
        self.row_invariant = row_invariant
        # the forward's positions on the host (Model.start's), read instead of the positions
        # window and visible are given (positions_of says why); None: those, read back
        self.positions = positions
        self.topk: tuple[mx.array, mx.array] | None = None  # ids [S, k], valid [S, k]
        self.candidates: mx.array | None = None  # [S, T] bool
        self._window: tuple | None = None
        self._visible: dict[int, mx.array] = {}
        self._groups: dict[tuple[int, int, int], mx.array] = {}
        self._picks: dict[tuple[int, int, int], tuple[mx.array, mx.array]] = {}
        # what the forward's positions alone decide and its layers compute (RoPE tables, the
        # unscored picks): a forward built ahead starts them before its token is read
        # (runtime.Runner.decode_ahead), while the device would wait for the token anyway,
        # rather than in the blocks that read them, after it
        self.early: list[mx.array] = []

    def last_rows(self, n: int) -> SharedAttention:
        """The same for the forward's last n rows only (the rows before them dropped between two
        layers): the per-row top-k and candidate mask cut to them, the rest made again."""
        S = len(self.positions)
        shared = SharedAttention(None if self.real_rows is None else self.real_rows - (S - n),
                                 self.positions[S - n:], self.row_invariant)
        if self.topk is not None:
            shared.topk = tuple(a[S - n:] for a in self.topk)
        if self.candidates is not None:
            shared.candidates = self.candidates[S - n:]
        return shared

    def rope_tables(self, rope: Rope, positions: mx.array, width: int) -> tuple[mx.array, ...]:
        """rope.tables(positions, width), its cos and sin (what every rotation with them reads)
        noted in `early` the first time."""
        tables = rope.tables(positions, width)
        if not any(a is tables[0] for a in self.early):
            self.early += tables[:2]
        return tables

    def visible(self, positions: mx.array, ratio: int) -> mx.array:
        """How many compressed groups of `ratio` positions each row may see [S] int32 (the
        groups finished at or before its position): the same for every index layer of that
        ratio in a forward, so computed once, on the host (from self.positions where given)."""
        if ratio not in self._visible:
            self._visible[ratio] = mx.array((self._on_host(positions) + 1) // ratio, dtype=mx.int32)
        return self._visible[ratio]

    def every_pick(self, n: int, pick_ids: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
        """An indexer's top-k where its k picks (pick_ids: 0 .. k - 1, uint32) hold all n <= k
        compressed positions: ids 0 .. n - 1 then n - 1 again (as argpartition's picks sorted
        and clamped), valid where a row sees the position (id < visible [S]) and it exists
        (id < n): the arrays the scored path gives. The same for every index layer of the
        forward with this n and visible (one ratio), so made once, in one launch."""
        key = (n, pick_ids.size, id(visible))
        if key not in self._picks:
            self._picks[key] = every_pick_arrays(pick_ids, key_ids(n)[n - 1:], visible)
            self.early += self._picks[key]
        return self._picks[key]

    def group_positions(self, first: int, n: int, ratio: int) -> mx.array:
        """Where compressed groups first .. first + n - 1 of `ratio` positions sit (a group at
        its first position) [n]: the same for every KV-source layer of that ratio in a
        forward, so made once, and so are their RoPE tables (Rope.tables keeps them by
        array)."""
        key = (first, n, ratio)
        if key not in self._groups:  # every ratio-th id from first * ratio on: a view, no launch
            self._groups[key] = key_ids((first + n) * ratio)[first * ratio::ratio]
        return self._groups[key]

    def _on_host(self, positions: mx.array) -> np.ndarray:
        return np.asarray(positions if self.positions is None else self.positions)

    def window(self, positions: mx.array, first: int, n_keys: int, window: int,
               row_invariant: bool, row0: int = 0) -> tuple[mx.array | None, mx.array]:
        """Which window keys each row sees, the same for every layer of a forward (their
        windows hold the same positions in the same rows of their buffers), so computed once:
        (gather index [S, W] of each row's own window, oldest first, or None where rows share
        the keys [n_keys]; mask). row0: the index counts from there (the buffer row of the
        oldest key, where the keys are read from their whole buffer: WindowCache.buffer)."""
        key = (first, n_keys, window, row_invariant, row0)
        if self._window is None or self._window[0] != key:
            pos = self._on_host(positions).astype(np.int64)  # on the host: no launches
            if row_invariant:
                key_pos = pos[:, None] - window + 1 + np.arange(window)[None, :]  # [S, W]
                # buffer rows row0 .. row0 + n_keys - 1 hold positions first .. first + n_keys - 1
                index = mx.array(np.clip(key_pos - (first - row0), row0, row0 + n_keys - 1), dtype=mx.int32)
                mask = mx.array(key_pos >= max(first, 0))
            else:
                key_pos = first + np.arange(n_keys)
                index = None
                mask = mx.array((key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window))
            self._window = (key, index, mask)
        return self._window[1], self._window[2]


class Attention(nn.Module):
    """Sliding-window attention plus, on compressed layers, the indexer's top-k compressed keys.

    One shared 512-d latent serves as key and value for all heads (MQA). The
    output loses the query RoPE again (inverse rotation) before the grouped
    low-rank output projection.
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.window = args.sliding_window
        self.ratio = args.compress_ratios[layer_id]
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.scale = self.head_dim ** -0.5
        self.eps = args.rms_norm_eps
        dim = args.hidden_size

        self.attn_sink = mx.zeros((self.n_heads,), dtype=F32)
        # wq_a and wkv, both fed the layer's quantised input, stacked at load (wq_a's rows
        # first: checkpoint.stack_wq_a_wkv), so that a GPU makes both in one launch
        self.q_lora_rank = args.q_lora_rank
        self.wq_a_wkv = Fp8Linear(dim, args.q_lora_rank + self.head_dim)
        self.q_norm = RMSNorm(args.q_lora_rank, self.eps)
        self.wq_b = Fp8Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = Fp8Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank)
        self.wo_b = Fp8Linear(self.n_groups * self.o_lora_rank, dim)
        self._pair_ids = index_range(MAX_CONSTANT_ROWS * self.n_groups)  # wo_a's (row, group) pairs

        is_backbone = layer_id < args.num_hidden_layers
        self.is_kv_source = is_backbone and layer_id in args.kv_source_layer_ids
        self.is_index_source = is_backbone and layer_id in args.index_source_layer_ids
        self.kv_source = args.kv_source_of(layer_id) if self.ratio and is_backbone else None
        self.n_picks = args.index_topk if self.ratio else 0  # the indexer pads its picks to index_topk
        if self.is_kv_source:
            self.compressor = Compressor(args, self.ratio)
        if self.is_index_source:
            self.indexer = Indexer(args, layer_id, owns_keys=self.is_kv_source)

        rd = args.qk_rope_head_dim
        if self.ratio:
            self.rope = shared_rope(rd, args.compress_rope_theta, args.original_max_position_embeddings,
                                    args.rope_factor, args.beta_fast, args.beta_slow)
        else:  # window-only layers and DSpark stages: plain RoPE, no YaRN
            self.rope = shared_rope(rd, args.rope_theta)

    # rope: self.rope.tables(positions, self.head_dim), computed outside these compiled
    # methods so that every layer of a forward shares them
    # xq: the attention input through quant.fp8_input, once for both wq_a and wkv
    # rope_in_kernel: the attention kernel rotates q, and its output back, itself
    # (kernels.sparse_attention_rows), so queries leaves q unrotated and output skips the
    # inverse rotation: two launches fewer per layer
    # real: only the first `real` rows matter (a padded forward's, SharedAttention.real_rows):
    # on a GPU the FP8 GEMMs compute those alone (Fp8Linear)
    @fused("wq_a_wkv", "q_norm", "wq_b")
    def queries(self, xq: mx.array, rope: tuple, rope_in_kernel: bool = False,
                real: int | None = None) -> tuple[mx.array, mx.array]:
        """q [S, H, D] with RoPE (with rope_in_kernel unrotated, as wq_b gives it: [S, H * D]),
        and the normed low-rank qr [S, q_lora] through fp8_input, as wq_b takes it and the
        indexer's wq_b reuses it."""
        qr = self.q_norm.quantized(self.wq_a_wkv.quantized_rows(xq, 0, self.q_lora_rank, real))
        return self._queries(qr, rope, rope_in_kernel, real), qr

    @fused("wq_a_wkv", "kv_norm")
    def latent_kv(self, xq: mx.array, rope: tuple, real: int | None = None) -> mx.array:
        """Window keys [S, D]: normed, RoPE'd, FP8 fake-quantised over the whole latent."""
        return self.latent_kv_of(self.wq_a_wkv.quantized_rows(xq, self.q_lora_rank, None, real), rope)

    @fused("wq_a_wkv", "q_norm", "wq_b", "kv_norm")
    def queries_and_latent_kv(self, xq: mx.array, rope: tuple, rope_in_kernel: bool = False,
                              real: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """queries' (q, qr) and latent_kv's keys from one input, the same bits as the two
        methods. On a GPU wq_a and wkv run in one launch (kernels.fp8_gemv_pair), and q_norm
        and kv_norm in one more, which reads the two products where that launch put them
        (kernels.rms_norm_halves: no views of them)."""
        pair, split = self.wq_a_wkv, self.q_lora_rank
        one_eps = self.q_norm.eps == self.kv_norm.eps  # (the pair launches take one)
        if one_eps and kernels.fp8_gemv_pair_fits(xq, pair.weight, split):
            both = kernels.fp8_gemv_pair(xq, pair.weight, pair.scales, split, real_rows=real)
            qr, keys = kernels.rms_norm_halves(both, xq.shape[0], split, self.q_norm.weight, self.kv_norm.weight,
                                               self.kv_norm.eps, gemm_input_dtype(), both.dtype,
                                               self._latent_rope(rope))
            return self._queries(qr, rope, rope_in_kernel, real), qr, keys
        a, kv = pair.quantized_pair(xq, split, real)
        if not (one_eps and kernels.rms_norm_pair_fits(a, kv)):
            qr = self.q_norm.quantized(a)
            return self._queries(qr, rope, rope_in_kernel, real), qr, self.latent_kv_of(kv, rope)
        qr, keys = kernels.rms_norm_pair(a, self.q_norm.weight, kv, self.kv_norm.weight, self.kv_norm.eps,
                                         gemm_input_dtype(), kv.dtype, self._latent_rope(rope))
        return self._queries(qr, rope, rope_in_kernel, real), qr, keys

    def _queries(self, qr: mx.array, rope: tuple, rope_in_kernel: bool, real: int | None) -> mx.array:
        """queries' q from the normed qr: [S, H, D], or as wq_b gives it, [S, H * D], where the
        attention kernel rotates it (it reads either; no view to reshape it)."""
        q = self.wq_b.quantized(qr, real)
        return q if rope_in_kernel else Rope.apply(q.reshape(qr.shape[0], self.n_heads, self.head_dim), rope)

    def latent_kv_of(self, kv: mx.array, rope: tuple) -> mx.array:
        """latent_kv from wkv's product kv [S, D]. On a GPU the norm, the rotation and the
        fake-quant are one kernel (kernels.rms_norm)."""
        if kernels.rms_norm_fits(kv, quantized=True, rotated=True):
            return rms_norm(kv, self.kv_norm.weight, self.kv_norm.eps, quantize_to=kv.dtype,
                            rope=self._latent_rope(rope))
        return fp8_fake_quant(Rope.apply(self.kv_norm(kv), rope))

    def _latent_rope(self, rope: tuple) -> tuple[mx.array, mx.array, int]:
        """The RoPE tables as the RMSNorm kernel rotates the latent [S, D] with them: cos and sin
        [S, D / 2, 2] as they are (the kernel reads them as [S, D]: the same values in the
        same order, no view), and how many features rotate."""
        return rope[0], rope[1], self.rope.dims

    @fused("wo_a", "wo_b")
    def output(self, o: mx.array, rope: tuple, rope_in_kernel: bool = False, real: int | None = None,
               onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """Undo the query RoPE (unless rope_in_kernel: undone already), then the grouped wo_a
        (block-diagonal) and wo_b. onto: wo_b puts its output into that stream
        (Fp8Linear.into_stream) and this returns its (h, mix_parts)."""
        S = o.shape[0]
        o = o if rope_in_kernel else Rope.apply(o, rope, inverse=True)
        # wo_a is applied to bf16 activations as stored (the reference dequantises it, no act-quant)
        if kernels.fp8_gemv_fits(o, self.wo_a.weight, groups=self.n_groups):  # a decode or verify step on a GPU
            # o [S, H, D] read as [S, groups, in], wo_a's rows as its groups' matrices: no views
            o = kernels.fp8_gemv(o, self.wo_a.weight, self.wo_a.scales, real_rows=real, groups=self.n_groups)
            return self.wo_b(o, real) if onto is None else self.wo_b.into_stream(o, onto, real)
        w = self.wo_a.weight.reshape(self.n_groups, self.o_lora_rank, -1)
        s = self.wo_a.scales.reshape(self.n_groups, self.o_lora_rank, -1)
        groups = self._pair_ids[: self.n_groups]
        if S <= MAX_CONSTANT_ROWS:  # each (row, group) pair a product of one row
            o = o.reshape(S, self.n_groups, 1, -1)  # [S, groups, 1, in]
            pairs = self._pair_ids[: S * self.n_groups].reshape(S, -1)
            o = mx.gather_qmm(o.astype(gemm_input_dtype()), w, s, lhs_indices=pairs, rhs_indices=groups,
                              transpose=True, mode="mxfp8").reshape(S, -1)
        else:  # a prompt's chunk: the rows sorted by group, so that MLX runs each group's as one GEMM
            # (as (row, group) pairs it ran a matrix-vector product each, several times as long)
            o = o.reshape(S, self.n_groups, -1).astype(gemm_input_dtype()).transpose(1, 0, 2)  # [groups, S, in]
            o = mx.gather_qmm(o.reshape(self.n_groups * S, 1, -1), w, s, rhs_indices=mx.repeat(groups, S),
                              transpose=True, mode="mxfp8", sorted_indices=True)
            o = o.reshape(self.n_groups, S, -1).transpose(1, 0, 2).reshape(S, -1)
        o = o.astype(BF16)
        return self.wo_b(o) if onto is None else self.wo_b.into_stream(o, onto, real)

    def __call__(self, x: mx.array, positions: mx.array, cache: LayerCache, caches: list[LayerCache],
                 shared: SharedAttention, xq: mx.array | None = None,
                 onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """xq: x through quant.fp8_input, where the caller has it already. onto: the output goes
        into that stream (output's onto)."""
        S = x.shape[0]
        rope = shared.rope_tables(self.rope, positions, self.head_dim)
        xq = fp8_input(x) if xq is None else xq
        # the attention kernel (rows that gather their own windows, on a GPU) takes q unrotated:
        # decided from the shapes it will have, before q exists
        kernel = shared.row_invariant and kernels.attention_fits((S, self.n_heads, self.head_dim), BF16,
                                                               self.window, self.n_picks)
        real = shared.real_rows
        q, qr, kv = self.queries_and_latent_kv(xq, rope, kernel, real)
        keys, first = cache.window.update(kv)
        # row_invariant: each row gathers its own window, oldest first: the same array for a
        # position whichever forward it is computed in, so its reductions run in the same order.
        # It gathers from the keys' whole buffer, which keeps its shape across forwards where
        # the kept keys' view grows and slides (and is no view to make)
        ring, row0 = cache.window.buffer(first) if shared.row_invariant else (keys, 0)
        index, window_mask = shared.window(positions, first, keys.shape[0], self.window, shared.row_invariant, row0)

        kv = ids = picked_mask = None
        if self.ratio:
            if self.is_kv_source:
                self._compress(x, positions, cache, shared)
            source = caches[self.kv_source].compressor
            if self.is_index_source:
                shared.topk = None
                visible = shared.visible(positions, self.ratio)
                if source.n_groups:
                    shared.topk = self.indexer(x, qr, positions, source.index_keys, visible, self.rope, shared)
            if shared.topk is not None:
                # the pooled groups' whole buffer (group g at row g), which the picks index
                kv, (ids, picked_mask) = source.kv_buffer, shared.topk
        if kernel:
            return self.attention_and_output(q, ring, index, window_mask, kv, ids, picked_mask, self.attn_sink, rope,
                                             real, onto)
        window_keys = keys if index is None else ring[index]  # [N, D] shared, or [S, W, D] per row
        picked = None if ids is None else kv[ids]  # [S, k, D]
        o = sparse_attention(q, window_keys, window_mask, picked, picked_mask, self.attn_sink, self.scale)
        return self.output(o, rope, kernel, real, onto)

    @fused("wo_a", "wo_b")
    def attention_and_output(self, q: mx.array, ring: mx.array, index: mx.array, window_mask: mx.array,
                             kv: mx.array | None, ids: mx.array | None, picked_mask: mx.array | None,
                             sink: mx.array, rope: tuple, real: int | None,
                             onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """The attention kernel's path (rows that gather their own windows, on a GPU): one launch
        that rotates q, gathers each row's keys from the buffers as they are (ring [R, D] by
        index, kv [T, D] by ids) and rotates its output back (spec: the rotations in queries
        and output around sparse_attention), then output's projections. Compiled with them:
        its arguments keep their shapes from forward to forward (the buffers change theirs
        only when they move), so a forward replays the trace. sink: attn_sink (an argument: a
        compiled method takes its own arrays through their modules, and this one has none)."""
        o = kernels.sparse_attention_rows(q, ring, index, window_mask, kv, ids, picked_mask, sink, self.scale, rope,
                                          self.rope.dims, real)
        return self.output(o, rope, True, real, onto)

    def _compress(self, x: mx.array, positions: mx.array, cache: LayerCache, shared: SharedAttention) -> None:
        """Pool finished groups; store their index keys and RoPE'd FP4 compressed KV."""
        state = cache.compressor
        latent, first_group = self.compressor(x, state)
        if latent is None:
            return
        if self.ratio == 1:  # a group per position, this forward's: their RoPE tables are the layer's
            group_pos = positions
        else:
            group_pos = shared.group_positions(first_group, latent.shape[0], self.ratio)
        # the latent's rotation first: the index keys' narrower one then takes a view of its tables
        tables = shared.rope_tables(self.rope, group_pos, latent.shape[-1])
        kv = fp4_fake_quant(Rope.apply(latent, tables), 16, "e4m3")
        state.append_groups(kv, self.indexer.keys(latent, group_pos, self.rope))


MAX_CONSTANT_ROWS = kernels.DECODE_MAX_ROWS  # forwards up to this many rows (decode, verify) take index constants
