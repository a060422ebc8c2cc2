"""The sparse attention of a decode or verify step's rows, each over its own window and picks,
in one launch: sparse_attention_rows."""

from __future__ import annotations

import mlx.core as mx

from . import tuning
from .build import DECODE_MAX_ROWS, KernelSpec, backend, compiled, computed_rows, constant, float32s, int32s

SPARSE_ATTENTION = KernelSpec("sparse_attention", ("q", "ring", "index", "wmask", "kv", "ids", "pmask", "sink",
                                                  "rope_cos", "rope_sin", "params", "rows"),
                              ("out",), "sparse_attention.metal", "sparse_attention.cu", header_files=(),
                              twin_headers=("bf16_lane",))
ATTENTION_THREADGROUP_BYTES = 32 * 1024  # Apple GPUs' threadgroup memory


def attention_threadgroup_bytes(heads: int, dim: int, keys: int) -> int:
    """The kernel's threadgroup memory for a group of `heads` heads of width dim over `keys`
    keys: the queries, the scores, the key rows, the subsets' sums (2048 floats a head: 256 /
    (dim / 8) subsets of dim features) and a few more."""
    return 4 * (heads * dim + (heads + 1) * keys + 2048 * heads + 8 + heads)


def attention_fits(q_shape: tuple[int, ...], q_dtype: mx.Dtype, n_window: int, n_picked: int,
                   impl: str | None = None) -> bool:
    """Whether sparse_attention_rows runs for queries of this shape and dtype: a GPU, at most
    DECODE_MAX_ROWS rows of bfloat16 queries [S, H, D], heads a multiple of the group, D / 8
    dividing 256 (a thread's 16-byte chunks), and the threadgroup's memory within 32 KB (the
    group: Layout.attention's heads).
    Shapes only, so that a caller can decide before it makes the queries (the kernel takes
    them unrotated)."""
    impl = impl or backend()
    if impl == "mlx" or len(q_shape) != 3 or q_dtype != mx.bfloat16 or q_shape[0] > DECODE_MAX_ROWS:
        return False
    layout = tuning.current()
    G = max(layout.attention(impl, rows)[0] for rows in (1, q_shape[0]))  # (any real rows may be computed)
    D = q_shape[2]
    return (q_shape[1] % G == 0 and D % 8 == 0 and 256 % (D // 8) == 0
            and attention_threadgroup_bytes(G, D, n_window + n_picked) <= ATTENTION_THREADGROUP_BYTES)


def sparse_attention_rows(q: mx.array, ring: mx.array, index: mx.array, window_mask: mx.array,
                          kv: mx.array | None, ids: mx.array | None, picked_mask: mx.array | None,
                          sink: mx.array, scale: float, rope: tuple[mx.array, ...], rope_dims: int,
                          real_rows: int | None = None, impl: str | None = None) -> mx.array:
    """attention.Attention between its query and output projections, for rows that each gather
    their own window, in one launch, without gathering the keys first: q rotated by
    Rope.apply, attention.sparse_attention, and its output rotated back (Rope.apply inverse);
    that composition is the spec (scripts/check_kernels.py). q [S, H, D] bf16, not rotated
    ([S, H * D] reads as [S, H, D], H from sink); ring [R, D] and index [S, W] (each row's
    window slots), window_mask [S, W]; kv [T, D], ids [S, K], picked_mask [S, K], or None
    for none; rope: Rope.tables(positions, D) of the
    S rows, whose last rope_dims features rotate (a model's constant: one build per value);
    real_rows: only the first real_rows rows are computed (default all), the rest, a padded
    forward's padding (Runner.padded), come out zeros. -> [S, H, D] bf16. Only where
    attention_fits."""
    impl = impl or backend()
    S, H = q.shape[0], sink.shape[0]
    D = q.shape[-1] if q.ndim == 3 else q.shape[1] // H
    W = index.shape[1]
    K = 0 if ids is None else ids.shape[1]
    if q.size != S * H * D or not attention_fits((S, H, D), q.dtype, W, K, impl):
        raise ValueError(f"sparse_attention_rows takes bfloat16 queries [<= {DECODE_MAX_ROWS}, H, D] on a GPU "
                         f"within its threadgroup memory, got {q.dtype} {q.shape} with {W} + {K} keys on {impl}")
    cos, sin = rope[:2]
    if cos.shape != (S, D // 2, 2) or sin.shape != cos.shape or rope_dims % 2 or not 0 < rope_dims <= D:
        raise ValueError(f"sparse_attention_rows takes Rope.tables of its {S} rows at width {D} and an even "
                         f"rope_dims <= {D}, got {cos.shape} and {rope_dims}")
    if K == 0:  # placeholders the kernel does not read
        kv, ids, picked_mask = constant(mx.bfloat16, 0.0), constant(mx.uint32, 0), constant(mx.bool_, False)
    kernel = compiled(SPARSE_ATTENTION, impl)
    rows = computed_rows(real_rows, S)
    G, warps = tuning.current().attention(impl, rows)
    (out,) = kernel(inputs=[q, ring.astype(mx.bfloat16), index.astype(mx.int32), window_mask.astype(mx.bool_),
                            kv.astype(mx.bfloat16), ids.astype(mx.uint32), picked_mask.astype(mx.bool_),
                            sink.astype(mx.float32), cos.astype(mx.float32), sin.astype(mx.float32),
                            float32s(scale), int32s(rows)],
                    template=[("D", D), ("H", H), ("G", G), ("W", W), ("K", K), ("RD", rope_dims),
                              ("WARPS", warps)],
                    grid=(S * (H // G) * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                    output_shapes=[(S, H, D)], output_dtypes=[mx.bfloat16])
    return out
