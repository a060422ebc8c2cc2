"""How the runtime schedules forwards on this device, chosen in one place."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .. import kernels
from ..config import ModelArgs


@dataclass(frozen=True)
class Options:
    """How a Runner schedules a model's forwards. Every choice gives the same bits; only when
    the device's work is started, or which rows no later read needs are left out, changes
    (tests compare each against the plain path)."""

    # rows every decode and verify forward is padded to, each row attending over its own
    # gathered window (SharedAttention.row_invariant); None: no padding. A GPU kernel picks
    # its summation order by shape, so a 1-row decode and a 6-row verify could round a
    # position's logits apart and pick different tokens: one row count for both keeps drafted
    # replies equal to plain ones. The CPU's kernels are row-invariant already.
    decode_rows: int | None = None
    # start each block on the device as soon as its graph is built (mx.async_eval), so that
    # Python builds block i + 1 while the device runs block i
    overlap_build: bool = False
    # ... from a thread of its own (evaluator.BlockEvaluator), so that MLX encodes block i
    # while Python builds block i + 1
    evaluate_on_thread: bool = False
    # decode_ahead builds the whole next forward while the device still runs the one before,
    # its engram rows read from a buffer the host writes once the token is known (StagedRows)
    build_ahead: bool = False
    # ... and starts all of it before the token is known, the engram rows read behind a gate
    # on the device that the host opens once it has written them (kernels.rows_gate)
    gate_rows: bool = False
    # a drafted round builds the first blocks of the next round's verify forward while the
    # device still proposes its drafts (SpeculativeDecoder.blocks_ahead), its engram rows read
    # as build_ahead's are; needs build_ahead. Off by default: on an H100 it did not pay
    # (rounds wait on the verify forward's device time, not on the host; the host found the
    # drafts ready after one block built ahead)
    verify_ahead: bool = False
    # a prefill computes, at each layer past the last KV source, only the positions whose
    # outputs something later reads (runner.prefill_rows); the same bits where it matters
    elide_prefill: bool = True


def default_options(args: ModelArgs, device: mx.Device | None = None) -> Options:
    """What this device runs fastest: on a GPU every overlap (rows padded to a multiple of 8
    that holds a drafted round's anchor and drafts); on the CPU none (nothing to overlap)."""
    device = device if device is not None else mx.default_device()
    if device != mx.gpu:
        return Options()
    return Options(decode_rows=-(-(args.dspark_block_size + 1) // 8) * 8, overlap_build=True,
                   evaluate_on_thread=True, build_ahead=True, gate_rows=kernels.rows_gate_fits())
