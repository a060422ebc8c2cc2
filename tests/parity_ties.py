"""The end-to-end run with its bf16 rounding ties taken the reference's way.

A value the model rounds from fp32 to bf16 that lies within a few fp32 ulps of the midpoint
between two bf16 values rounds either way with a last-bit difference in the fp32 arithmetic
before it (a GEMM's summation order, an `exp`): which way is not the model's semantics but
the machine's. In this random-weight model one such rounding taken the other way is enough
to move everything after it (the FP8 activation quantisation turns one bf16 ulp into a
whole FP8 step, and the indexer's top-k then picks other positions).

`run` does the model's forward end to end (prefill, then each decode step fed the given
ids) as the same composition of the model's own pieces that `Block` makes on the CPU, and
compares every block's output with the reference's intermediates. Where the reference took
the other rounding of one of our near-midpoint values, it takes the reference's: in the
block's output (known from the intermediates), and in the stream after the attention
(not stored by the reference: a near-midpoint element is rounded the other way when that
brings the block's output closer to the reference's). Nothing else is taken from the
reference. With `tie_fp32_ulps=0` it is the model's plain forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from dsv41_mlx.models.attention import SharedAttention
from dsv41_mlx.models.hyper import hc_expand, hc_post, hc_pre

F32, BF16 = mx.float32, mx.bfloat16


def midpoint_distance(v32: np.ndarray) -> np.ndarray:
    """fp32 values -> their distance from the nearest bf16 rounding midpoint, in fp32 ulps
    (0: exactly halfway between two bf16 values)."""
    low = np.ascontiguousarray(v32, dtype=np.float32).view(np.uint32) & 0xFFFF
    return np.abs(low.astype(np.int64) - 0x8000)


def other_rounding(v32: np.ndarray) -> np.ndarray:
    """fp32 values -> the bf16 bits of the rounding round-to-nearest-even did not pick
    (of the two bf16 values around each)."""
    u = np.ascontiguousarray(v32, dtype=np.float32).view(np.uint32)
    toward_zero = (u >> 16).astype(np.uint16)
    nearest = np.array(mx.array(v32).astype(BF16).view(mx.uint16))
    return np.where(nearest == toward_zero, toward_zero + 1, toward_zero).astype(np.uint16)


def bf16_bits(x: mx.array | np.ndarray) -> np.ndarray:
    if isinstance(x, np.ndarray):  # a bf16 value widened to float32, as the goldens store them
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.array(x.astype(BF16).view(mx.uint16))


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bf16 bits -> how many bf16 values apart."""
    def ordered(bits):
        bits = bits.astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


@dataclass
class Tie:
    call: str
    layer: int
    where: str  # "after attention" (the stream the MoE runs on) or "block output"
    index: tuple[int, int, int]  # (row, copy, element)
    fp32_ulps: int  # its fp32 value's distance from the bf16 midpoint


@dataclass
class Run:
    logits: dict[str, np.ndarray] = field(default_factory=dict)  # call -> [rows, V] ('prefill') or [V]
    block_ulps: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # bf16 ulps off the reference
    block_error: dict[tuple[str, int], float] = field(default_factory=dict)  # max |error| / std(reference)
    ties: list[Tie] = field(default_factory=list)


def _expansion_fp32(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> np.ndarray:
    """hc_post before its bf16 rounding, summed in the same order."""
    mixed = None
    for i in range(residual.shape[1]):
        term = comb[:, i, :][:, :, None] * residual[:, i:i + 1, :].astype(F32)
        mixed = term if mixed is None else mixed + term
    return np.array(post[..., None] * y[:, None, :].astype(F32) + mixed)


def run(model, prompt_ids: list[int], decode_ids: list[int], intermediates: dict[str, np.ndarray],
        tie_fp32_ulps: int = 0) -> Run:
    """The forward of prompt_ids then of each decode id, against `intermediates` (the
    reference's, golden_intermediates*.safetensors), with the reference's rounding taken at
    values within tie_fp32_ulps of a bf16 midpoint."""
    out = Run()
    cache = model.make_cache()
    calls = [("prefill", list(prompt_ids))] + [(f"decode.{t:02d}", [i]) for t, i in enumerate(decode_ids)]
    for call, ids in calls:
        start, S = cache.offset, len(ids)
        positions = mx.arange(start, start + S)
        engram_rows = model.take_tokens(cache, ids)
        shared = SharedAttention()
        h, pre = hc_expand(model.embed(mx.array(ids)), model.args.hc_mult)
        for i, layer in enumerate(model.layers):
            ref = intermediates[f"{call}.layers.{i}.block_out"][0]
            ref_bits = bf16_bits(ref)
            if i in engram_rows:
                h = layer.engram(h, engram_rows[i], None)
            attn_mix = layer.hc_attn(h)
            x = layer.attn(layer.attn_norm(hc_pre(h, pre)), positions, cache.layers[i], cache.layers, shared)
            h2 = hc_post(x, h, attn_mix)

            def moe(h2):
                ffn_mix = layer.hc_ffn(h2)
                y = layer.ffn(layer.ffn_norm(hc_pre(h2, attn_mix.pre)))
                return ffn_mix, y, hc_post(y, h2, ffn_mix)

            ffn_mix, y, block_out = moe(h2)
            if tie_fp32_ulps:
                h2_32 = _expansion_fp32(x, h, attn_mix.post, attn_mix.comb)
                off = ulp_distance(bf16_bits(block_out), ref_bits).sum()
                for index in map(tuple, np.argwhere(midpoint_distance(h2_32) <= tie_fp32_ulps)):
                    bits = bf16_bits(h2)
                    bits[index] = other_rounding(h2_32[index][None])[0]
                    moved = mx.array(bits).view(BF16)
                    candidate = moe(moved)
                    moved_off = ulp_distance(bf16_bits(candidate[2]), ref_bits).sum()
                    if moved_off < off:
                        h2, (ffn_mix, y, block_out), off = moved, candidate, moved_off
                        out.ties.append(Tie(call, i, "after attention", tuple(map(int, index)),
                                            int(midpoint_distance(h2_32)[index])))
                out_32 = _expansion_fp32(y, h2, ffn_mix.post, ffn_mix.comb)
                near = midpoint_distance(out_32)
                ours = bf16_bits(block_out)
                take = (near <= tie_fp32_ulps) & (other_rounding(out_32) == ref_bits) & (ours != ref_bits)
                if take.any():
                    bits = np.where(take, ref_bits, ours)
                    block_out = mx.array(bits).view(BF16)
                    out.ties += [Tie(call, i, "block output", tuple(map(int, index)), int(near[tuple(index)]))
                                 for index in np.argwhere(take)]
            mx.eval(block_out, ffn_mix.pre, cache.state())
            out.block_ulps[call, i] = ulp_distance(bf16_bits(block_out), ref_bits)
            got = np.array(block_out.astype(F32))
            out.block_error[call, i] = float(np.abs(got - ref).max() / ref.std())
            h, pre = block_out, ffn_mix.pre
        logits = np.array(model.head(model.norm(hc_pre(h, pre))))
        out.logits[call] = logits if call == "prefill" else logits[-1]
    return out
