"""head_logits: the model's head from its bf16 weight at the release's 129280 x 5120 and a
small one, 1..16 rows, outputs poisoned: within the bound of another fp32 summation order
of the spec's (the products are exact); a row alone equals the row among 8 and 16; with
fewer real rows, the real rows the same bits and the padding zeros.
"""

from __future__ import annotations

import mlx.core as mx

from dsv41_mlx.kernels import head_logits, head_logits_reference

from . import harness
from .harness import POISON


def check_head_logits(impl: str, seed: int) -> list[str]:
    """The model's head from its bf16 weight (kernels.head_logits) at the release's 129280 x
    5120 and a small one, 1..16 rows, outputs poisoned: each fp32 logit within k * 2**-24
    times the sum of its products' absolute values of the spec's (another float32 summation
    order of the same exact products); a row alone the same bits as among 8 and 16; with fewer
    real rows, those the same bits and the padding zeros."""
    mx.random.seed(seed)
    problems = []
    for v, d in [(129280, 5120), (96, 256)]:
        w = (mx.random.normal((v, d)) * 0.02).astype(mx.bfloat16)
        for rows in harness.CHECK_ROWS:
            x = mx.random.normal((rows, d)).astype(mx.bfloat16)
            name = f"head_logits {v}x{d} rows={rows}"
            got = head_logits(x, w, impl=impl, init_value=POISON)
            want = head_logits_reference(x, w)
            size = head_logits_reference(mx.abs(x), mx.abs(w))
            far = mx.abs(got - want) > 2 * d * 2.0 ** -24 * size
            if far.any().item():
                problems.append(f"{name}: {int(far.sum().item())} logits beyond the fp32 summation-order bound")
            if rows in (8, 16):
                if not mx.array_equal(head_logits(x[:1], w, impl=impl), got[:1]).item():
                    problems.append(f"{name}: row 0 alone differs from row 0 of {rows}")
                padded = head_logits(x, w, impl=impl, init_value=POISON, real_rows=rows - 2)
                if not (mx.array_equal(padded[: rows - 2], got[: rows - 2]).item() and not padded[rows - 2:].any().item()):
                    problems.append(f"{name}: with {rows - 2} real rows, not the same real rows and zeros after them")
    return problems
