"""The engram rows of a forward built before its tokens are known, in one buffer the host
writes once they are (Runner.decode_ahead)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels import rows_gate
from ..models.engram import rows_layout, unpack_rows, write_rows


class StagedRows:
    """One sequence's buffer for the engram rows of its forwards built before their tokens are
    known (Runner.decode_ahead, where build_ahead): an MLX array made once, which each such
    forward's graph reads (`values`), and the host writes the rows into (`write`) once the
    tokens are known, before it starts the forward. So the whole graph can be built while the
    device still runs the forward before, and no host-made array is allocated at the step's
    boundary (pack_rows says what that may cost).

    The host writes into memory the device reads: a write must come after every earlier
    forward that read the buffer has run, which holds where the tokens written were read back
    from the forward before (each depends on all of it). Its cache keeps it, so two sequences
    never share one.

    gated (where kernels.rows_gate_fits): a forward's rows may also be read through a gate
    (values(gated=True), kernels.rows_gate), so that it can be started before its token is known:
    the device waits at the gate until the host has written the rows and `release`d it. Each
    gate begun on the device is released once, in order (a forward abandoned releases its
    gate unwritten: it runs on the rows before and its results are dropped)."""

    def __init__(self, shapes: list[tuple[int, ...]], gated: bool = False):
        self.layout, size = rows_layout(shapes)
        self.packed = mx.array(np.zeros(size, np.uint8))
        self._host = _host_view(self.packed)
        self.flag = self._flag = None
        if gated:  # [host's releases, releases the gates took, gates that gave up] (rows_gate.cu)
            self.flag = mx.array(np.zeros(3, np.uint32))
            self._flag = _host_view(self.flag)
        self._released = 0

    def values(self, gated: bool = False) -> list[mx.array]:
        """unpack_rows' values of the buffer: new graph nodes each call, one forward's. gated:
        of the rows a gate passes on once the host has released it (kernels.rows_gate), so
        that the forward may be started before they are written."""
        if not gated:
            return unpack_rows(self.packed, self.layout)
        if self.flag is None:
            raise RuntimeError("these StagedRows were made without a gate")
        _, passed = rows_gate(self.flag, self.packed)
        return unpack_rows(passed, self.layout)

    def write(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> None:
        write_rows(self._host, self.layout, rows)

    def release(self, check: bool = True) -> None:
        """Let the device past the oldest gate not yet released (after `write`, or for a forward
        abandoned). check: then raise if a gate gave up waiting (a forward then ran on rows the
        host had not written yet: the sequence's replies cannot be trusted)."""
        if self._flag is None:
            raise RuntimeError("these StagedRows were made without a gate")
        self._released = (self._released + 1) & 0xFFFFFFFF
        self._flag[0] = self._released
        if check and self._flag[2]:
            raise RuntimeError(f"the device stopped waiting for the host's engram rows ({int(self._flag[2])} "
                               "times): a forward ran on stale rows, so this reply is void; was the host "
                               "stalled for seconds between reading a token and writing its rows?")


def _host_view(a: mx.array) -> np.ndarray:
    """An evaluated MLX array's memory as a writable numpy array (unified on a Mac, managed on
    CUDA)."""
    host = np.array(a, copy=False)
    if not host.flags.writeable:
        raise RuntimeError("this MLX does not give a writable view of an array's memory")
    return host
