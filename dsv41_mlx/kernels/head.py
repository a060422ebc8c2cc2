"""The model's fp32 logits from its bf16 head in one launch: head_logits."""

from __future__ import annotations

import mlx.core as mx

from . import tuning
from .build import DECODE_MAX_ROWS, KernelSpec, backend, compiled, computed_rows, int32s

HEAD_LOGITS = KernelSpec("head_logits", ("x", "w", "sizes"), ("y",), "head_logits.metal", "head_logits.cu",
                         header_files=(), twin_headers=("bf16_lane",))


def head_logits_fits(x: mx.array, w: mx.array, impl: str | None = None) -> bool:
    """Whether head_logits runs: a GPU, bf16 x [S, D] of at most DECODE_MAX_ROWS rows (a
    decode or verify step, or prefill's last row) and a bf16 head w [V, D], V a multiple of 32
    and D of 256 (the release's 129280 x 5120)."""
    return ((impl or backend()) != "mlx" and x.ndim == 2 and w.ndim == 2 and x.dtype == mx.bfloat16
            and w.dtype == mx.bfloat16 and 0 < x.shape[0] <= DECODE_MAX_ROWS and x.shape[1] == w.shape[1]
            and w.shape[0] % 32 == 0 and w.shape[1] % 256 == 0)


def head_logits(x: mx.array, w: mx.array, impl: str | None = None, real_rows: int | None = None,
                init_value: float | None = None) -> mx.array:
    """The model's fp32 logits from its bf16 head in one launch, each weight byte read once for
    all rows: x [S, D] bf16, w [V, D] bf16 -> [S, V] float32; the spec is
    head_logits_reference, equal up to the order of the float32 sums (each product is exact),
    each row summed in one order at any S. Reading the head as the release stores it reads
    half the bytes of the float32 copy a float32 matmul needs. real_rows: only those rows
    computed, the rest zeros (a padded forward); init_value poisons the output first (checks)."""
    impl = impl or backend()
    if not head_logits_fits(x, w, impl):
        raise ValueError(f"head_logits takes bf16 x [<= {DECODE_MAX_ROWS}, D] and a bf16 head [V, D], V a multiple "
                         f"of 32 and D of 256, on a GPU: got {x.dtype} {x.shape} and {w.dtype} {w.shape} on {impl}")
    S, V, D = x.shape[0], w.shape[0], w.shape[1]
    rows = computed_rows(real_rows, S)
    (y,) = compiled(HEAD_LOGITS, impl)(
        inputs=[x, w, int32s(rows, V, D, S)], template=[("R", tuning.current().head_row_bound(rows))],
        grid=(V // 32 * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, V)], output_dtypes=[mx.float32], init_value=init_value)
    return y
