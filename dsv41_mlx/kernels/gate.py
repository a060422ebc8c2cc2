"""The MoE router (sqrt-softplus scores, biased top-k) in two launches: moe_gate."""

from __future__ import annotations

import mlx.core as mx

from . import tuning
from .build import DECODE_MAX_ROWS, KernelSpec, backend, compiled, float32s, int32s
from .specs import moe_gate_reference

MOE_GATE_SCORES = KernelSpec("moe_gate_scores", ("x", "w", "params", "sizes"), ("scores",),
                             "moe_gate_scores.metal", "moe_gate_scores.cu", header_files=())
MOE_GATE_TOPK = KernelSpec("moe_gate_topk", ("scores", "bias", "params", "rows"), ("weights", "ids"),
                           "moe_gate_topk.metal", "moe_gate_topk.cu", header_files=())

MOE_GATE_MAX_EXPERTS = 3072  # the top-k kernel keeps a float per expert in threadgroup memory (Metal: 32 KB)


def moe_gate(x: mx.array, w: mx.array, bias: mx.array, k: int, temp: float, route_scale: float,
             normalize: bool, impl: str | None = None) -> tuple[mx.array, mx.array]:
    """The router in two launches on a GPU for up to DECODE_MAX_ROWS rows: the scores (a
    threadgroup per expert, its weights read once for all rows), then each row's top-k (a
    simdgroup per row); the spec otherwise. The fp32 dot products are summed in another
    order than the spec's matmul, so a near-tie between two experts may fall the other way;
    each row is computed alone, the same bits in any forward (scripts/check_kernels.py
    compares the two)."""
    impl = impl or backend()
    N, D = x.shape
    E = w.shape[0]
    if (impl == "mlx" or N > DECODE_MAX_ROWS or E > MOE_GATE_MAX_EXPERTS
            or x.dtype not in (mx.bfloat16, mx.float32)):
        return moe_gate_reference(x, w, bias, k, temp, route_scale, normalize)
    (scores,) = compiled(MOE_GATE_SCORES, impl)(
        inputs=[x, w.astype(mx.float32), float32s(temp), int32s(N, E, D)],
        template=[("T", x.dtype), ("RB", tuning.current().gate_row_bound(N)), ("D", D)], grid=(E * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(N, E)], output_dtypes=[mx.float32])
    weights, ids = compiled(MOE_GATE_TOPK, impl)(
        inputs=[scores, bias.astype(mx.float32), float32s(route_scale),
                int32s(N)],
        template=[("E", E), ("K", k), ("NORMALIZE", int(normalize))], grid=(N * 32, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(N, k), (N, k)], output_dtypes=[mx.float32, mx.uint32])
    return weights, ids
