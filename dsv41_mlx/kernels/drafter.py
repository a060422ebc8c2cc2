"""The drafter's kernels: its FP8 head's best candidates (fp8_rows_top64, the matrix unit then
a bitonic sort), the Markov pass that picks a block's drafts among them (markov_drafts) and the
write of its rings (ring_write)."""

from __future__ import annotations

import mlx.core as mx

from .build import KernelSpec, backend, compiled
from .specs import TOP_K, Fp8Matrix, fp8_rows_reference, markov_drafts_reference, ring_write_reference, top_k_best

TILE = 256  # outputs per threadgroup in fp8_rows (fixed in the kernel text)
MAX_ROWS = 16

FP8_ROWS = KernelSpec("fp8_rows_top64", ("x", "w", "scales"), ("top_vals", "top_ids"),
                      "fp8_rows.metal", "fp8_rows.cu")
# Sizes that change from call to call (rows, counts) are int32 inputs, not template
# constants: each template combination is a separate build (seconds on CUDA).
RING_WRITE = KernelSpec("ring_write", ("rings", "rows", "span"), ("out",), "ring_write.metal", "ring_write.cu",
                        header_files=())
MARKOV_DRAFTS = KernelSpec("markov_drafts", ("base", "cand", "head", "embed", "anchor", "temp", "noise"),
                           ("drafts", "logits", "embeds"), "markov_drafts.metal", "markov_drafts.cu", header_files=())
MARKOV_MAX = 256  # candidates: the threads of its one threadgroup


def fp8_rows_tiles(x: mx.array, w: Fp8Matrix, language: str,
                   init_value: float | None = None) -> tuple[mx.array, mx.array]:
    """The kernel alone: per 256-output tile, each row's 64 best (values, ids) [R, tiles, 64].
    init_value poisons the outputs before the launch (for checks)."""
    R, K = x.shape
    N = w.shape[0]
    tiles = -(-N // TILE)
    xb = x if x.dtype == mx.bfloat16 else x.astype(mx.bfloat16)  # the drafter's activations are bf16 already
    kernel = compiled(FP8_ROWS, language)
    vals, ids = kernel(inputs=[xb.view(mx.uint16), w.codes, w.scales],
                       template=[("R", R), ("K", K), ("N", N), ("TILES", tiles)],
                       grid=(tiles * TILE, 1, 1), threadgroup=(TILE, 1, 1),
                       output_shapes=[(R, tiles, TOP_K), (R, tiles, TOP_K)],
                       output_dtypes=[mx.float32, mx.int32], init_value=init_value)
    return vals, ids


def fp8_rows_top64(x: mx.array, w: Fp8Matrix, impl: str | None = None) -> tuple[mx.array, mx.array]:
    """x [R, K] (R <= 16) through the FP8 matrix; the 64 best outputs per row, best first.

    The kernel reads bf16 activations as they are (the drafter's are); x of another dtype is
    rounded to bf16 for it, where the spec takes x as it is.
    impl: 'metal', 'cuda' or 'mlx' (default: `backend()`)."""
    R, K = x.shape
    N = w.shape[0]
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"fp8_rows takes 1..{MAX_ROWS} rows, got {R}")
    if K % 128 or N % 32 or N < TOP_K:
        raise ValueError(f"fp8_rows needs K a multiple of 128, N of 32, and N >= {TOP_K}; got N={N}, K={K}")
    impl = impl or backend()
    if impl == "mlx":
        return fp8_rows_reference(x, w)
    vals, ids = fp8_rows_tiles(x, w, impl)
    return top_k_best(vals.reshape(R, -1), ids.reshape(R, -1))


def ring_write(rings: mx.array, rows: mx.array, first: int, impl: str | None = None) -> mx.array:
    """One launch for all stages: the rings after writing rows at positions first.. (see the reference)."""
    S, W, D = rings.shape
    M = rows.shape[1]
    if rows.shape[0] != S or rows.shape[2] != D or not 1 <= M <= W:
        raise ValueError(f"ring_write: rows {rows.shape} do not fit rings {rings.shape}")
    impl = impl or backend()
    if impl == "mlx" or D % 8:
        return ring_write_reference(rings, rows, first)
    kernel = compiled(RING_WRITE, impl)
    total = S * W * (D // 8)
    (out,) = kernel(inputs=[rings.view(mx.uint16), rows.astype(rings.dtype).view(mx.uint16),
                            mx.array([first, M], dtype=mx.int32)],  # first grows with the sequence: not cached
                    template=[("S", S), ("W", W), ("D", D)],
                    grid=(-(-total // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[rings.shape], output_dtypes=[mx.uint16])
    return out.view(rings.dtype)


def markov_drafts(base: mx.array, candidates: mx.array, head: mx.array, embed: mx.array, anchor: int | mx.array,
                  temperature: float = 1.0, noise: mx.array | None = None,
                  impl: str | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The drafter's Markov pass over a block in one launch: base [B, C] fp32 (the head's logits
    of each position's candidates [B, C]), the Markov head and embedding tables head, embed
    [V, R] bf16, the anchor token, and what a pick maximises (logits / temperature + noise
    [B, C]) -> (drafts [B] int32, logits [B, C] fp32, embeddings [B, R] bf16). The spec is
    markov_drafts_reference: the same picks wherever the best two scores are further apart
    than the float32 sums of the bias, in another order, can move them."""
    B, C = base.shape
    V, R = head.shape
    if candidates.shape != (B, C) or embed.shape != (V, R) or (noise is not None and noise.shape != (B, C)):
        raise ValueError(f"markov_drafts: base {base.shape}, candidates {candidates.shape}, head {head.shape}, "
                         f"embed {embed.shape} and noise {None if noise is None else noise.shape} do not fit")
    if head.dtype != mx.bfloat16 or embed.dtype != mx.bfloat16 or C > MARKOV_MAX:
        raise ValueError(f"markov_drafts takes bf16 tables and at most {MARKOV_MAX} candidates, got {head.dtype}, "
                         f"{embed.dtype} and {C}")
    impl = impl or backend()
    if impl == "mlx":
        return markov_drafts_reference(base, candidates, head, embed, anchor, temperature, noise)
    (drafts, logits, embeds) = compiled(MARKOV_DRAFTS, impl)(
        inputs=[base.astype(mx.float32), candidates.astype(mx.int32), head.view(mx.uint16), embed.view(mx.uint16),
                mx.array(anchor, dtype=mx.int32).reshape(1), mx.array([temperature], dtype=mx.float32),
                noise if noise is not None else mx.array([0.0], dtype=mx.float32)],  # (unread: a constant, no launch)
        template=[("B", B), ("C", C), ("R", R), ("NOISE", int(noise is not None))],
        grid=(MARKOV_MAX, 1, 1), threadgroup=(MARKOV_MAX, 1, 1),
        output_shapes=[(B,), (B, C), (B, R)], output_dtypes=[mx.int32, mx.float32, mx.uint16])
    return drafts, logits, embeds.view(mx.bfloat16)
