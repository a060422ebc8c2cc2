"""Keep the drafter resident: a wired-memory limit around generation. And on the CPU, keep a
decode step's freed buffers for the next step (cpu_buffer_cache).

On Apple silicon, memory the GPU uses can be paged out between rounds unless
it is wired. The drafter's weights, its FP8 head, its rings and the propose
pass's working buffers are wired first (every round touches them, and a page
fault in the propose pass costs more than the propose itself); the target
follows if it fits too. The total is capped by the device's
`max_recommended_working_set_size`. The previous limit comes back on exit,
exceptions included. Backends without wiring (CPU, CUDA) get one log line.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)
GB = 1e9
MLX_CPU_CACHE_LIMIT = 32 << 20  # the freed buffers MLX's CPU allocator keeps for reuse, unless told otherwise
CPU_CACHE_SHARE = 10  # cpu_buffer_cache: a tenth of MLX's memory limit
_said_no_wiring = False


@dataclass(frozen=True)
class ResidencyPlan:
    drafter_bytes: int  # weights + FP8 head + rings + propose buffers
    target_bytes: int
    cap: int  # max_recommended_working_set_size
    wired: int  # the limit to set
    target_wired: bool

    def describe(self) -> str:
        drafter = min(self.drafter_bytes, self.wired)
        parts = [f"wired {self.wired / GB:.2f} GB: drafter {drafter / GB:.2f} of {self.drafter_bytes / GB:.2f} GB"]
        parts.append(f"target {self.target_bytes / GB:.2f} GB " + ("wired" if self.target_wired else
                                                                   "not wired (does not fit)"))
        return "; ".join(parts) + f" (cap {self.cap / GB:.2f} GB)"


def plan(drafter_bytes: int, target_bytes: int, cap: int) -> ResidencyPlan:
    """Drafter first (as much of it as the cap allows), then the whole target if it fits beside it."""
    wired = min(drafter_bytes, cap)
    target_wired = drafter_bytes + target_bytes <= cap
    if target_wired:
        wired += target_bytes
    return ResidencyPlan(drafter_bytes, target_bytes, cap, wired, target_wired)


def _nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def drafter_bytes(model, drafter) -> int:
    """What every round touches: stage weights, the target embedding rows and head the
    drafter reads, its FP8 head, its rings, and the propose pass's largest buffers."""
    args = model.args
    weights = sum(_nbytes(stage.parameters()) for stage in model.mtp)
    head = drafter.fp8_head.nbytes if drafter.head == "fp8" else model.head.weight.nbytes
    rings = len(model.mtp) * args.sliding_window * args.head_dim * 2
    buffers = drafter.block * args.vocab_size * 4 * 3  # base logits, biased logits, noise (fp32)
    return weights + head + rings + buffers


def target_bytes(model) -> int:
    """The target's weights in MLX memory (engram tables are memory-mapped, not counted)."""
    mtp = {id(v) for stage in model.mtp for _, v in tree_flatten(stage.parameters())}
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array) and id(v) not in mtp)


def wiring_cap() -> int | None:
    """max_recommended_working_set_size where the backend can wire memory (Metal), else None."""
    if not (mx.metal.is_available() and mx.default_device() == mx.gpu):
        return None
    return int(mx.device_info().get("max_recommended_working_set_size", 0)) or None


@contextlib.contextmanager
def wired(model, drafter=None, enabled: bool = True):
    """Within the block, memory is wired as `plan` says; the previous limit is restored after."""
    global _said_no_wiring
    if not enabled:
        yield None
        return
    cap = wiring_cap()
    if cap is None:
        if not _said_no_wiring:
            log.info("residency: this backend (%s) has no wired memory; nothing to wire", mx.default_device())
            _said_no_wiring = True
        yield None
        return
    p = plan(drafter_bytes(model, drafter) if drafter is not None else 0, target_bytes(model), cap)
    previous = mx.set_wired_limit(p.wired)
    log.info("residency: %s", p.describe())
    try:
        yield p
    finally:
        mx.set_wired_limit(previous)


def cpu_buffer_cache(device: mx.Device | None = None) -> int | None:
    """On the CPU, let MLX keep up to a tenth of its memory limit in freed buffers for reuse,
    where the limit is still MLX's default (32 MB; a limit the user set is kept). Returns the
    limit set, or None where nothing changed.

    MLX's Metal allocator keeps up to its memory limit; its CPU allocator only 32 MB. A decode
    step of even the embedded default frees more than that, so each step handed its larger
    buffers back to the system and the next faulted fresh pages in: plain decoding of the
    embedded default on a 2-core EPYC ran at 18 tok/s, 29 tok/s with room for a step's
    buffers (about 100 MB held; the bound only caps what a change of shapes can leave)."""
    device = device if device is not None else mx.default_device()
    if device != mx.cpu:
        return None
    limit = mx.get_memory_limit() // CPU_CACHE_SHARE
    previous = mx.set_cache_limit(limit)
    if previous != MLX_CPU_CACHE_LIMIT or limit <= previous:
        mx.set_cache_limit(previous)
        return None
    return limit
