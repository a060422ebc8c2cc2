"""A forward's launches held on the device until the host has written their rows: rows_gate
(CUDA only)."""

from __future__ import annotations

import mlx.core as mx

from .build import KernelSpec, backend, compiled

ROWS_GATE = KernelSpec("rows_gate", ("flag", "rows"), ("status", "out"), None, "rows_gate.cu", header_files=())

# How many times rows_gate reads the host's flag before it gives up: on CUDA a read and a
# 256 ns sleep, so some seconds; the host releases a gate within a fraction of a millisecond of
# reading the token (Runner._forward_built_ahead), and a gate that gives up is reported.
GATE_SPINS = 1 << 24


def rows_gate_fits() -> bool:
    """Whether a forward's launches may be queued behind rows_gate, waiting on the device for
    the host's engram rows: on CUDA, where one-row steps run shorter with the same replies. The
    gate has no Metal twin: elsewhere the forward's blocks are started once the rows are
    written, as without it."""
    return backend() == "cuda"


def rows_gate(flag: mx.array, rows: mx.array) -> tuple[mx.array, mx.array]:
    """One launch on CUDA (where rows_gate_fits) that waits on the device until the host
    releases it through flag (uint32 [3], runtime.staged.StagedRows; rows_gate.cu says how),
    then copies rows (uint8 [N], the host-written buffer) -> (status uint32 [2]: 1 if it gave
    up waiting, else 0, and the release count it saw; the rows as they were at the release).
    What reads the copy runs after the release."""
    if flag.dtype != mx.uint32 or flag.shape != (3,):
        raise ValueError(f"rows_gate: the flag must be uint32 [3]; got {flag.dtype} {flag.shape}")
    if rows.dtype != mx.uint8 or rows.ndim != 1:
        raise ValueError(f"rows_gate: the rows must be uint8 [N]; got {rows.dtype} {rows.shape}")
    kernel = compiled(ROWS_GATE, "cuda")
    status, out = kernel(inputs=[flag, rows], template=[("SPINS", GATE_SPINS), ("N", rows.size)],
                         grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(2,), rows.shape],
                         output_dtypes=[mx.uint32, mx.uint8])
    return status, out
