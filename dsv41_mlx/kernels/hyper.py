"""The hyper-connections' kernels: a sub-layer's mixes (hc_split) and its whole input from the
stream (hc_input: hc_mix or hc_post_mix, then hc_input's second launch)."""

from __future__ import annotations

import mlx.core as mx

from .build import DECODE_MAX_ROWS, KernelSpec, backend, compiled, float32s, int32s
from .specs import hc_split_reference

HC_SPLIT = KernelSpec("hc_split", ("mixes", "scale", "base", "eps", "rows"), ("pre", "post", "comb"),
                      "hc_split.metal", "hc_split.cu", header_files=(), twin_headers=("hc_split_row",))
HC_MIX = KernelSpec("hc_mix", ("h", "fn", "rows"), ("parts",), "hc_mix.metal", "hc_mix.cu", header_files=(),
                    twin_headers=("hc_mix_sum",))
HC_POST_MIX = KernelSpec("hc_post_mix", ("y", "residual", "post", "comb", "fn", "rows"), ("parts", "h"),
                         "hc_post_mix.metal", "hc_post_mix.cu", header_files=(), twin_headers=("hc_expand", "hc_mix_sum"))
HC_INPUT = KernelSpec("hc_input", ("h", "pre_in", "parts", "scale", "base", "norm_w", "params", "rows"),
                      ("x", "xq", "pre", "post", "comb"), "hc_input.metal", "hc_input.cu", header_files=(),
                      twin_headers=("hc_split_lanes", "fp8_lane"))

HC_MIX_CHUNKS = 16  # hc_mix's threadgroups per row (a row holds hc * dim values, a multiple of 32)
HC_INPUT_MAX_DIM = 8192  # hc_input: 32 values and 32 weights a thread


def hc_split(mixes: mx.array, scale: mx.array, base: mx.array, hc: int, iters: int, eps: float,
             impl: str | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One launch for what the spec does in about 4 * iters operations (see the reference)."""
    S, M = mixes.shape
    if M != (2 + hc) * hc or iters < 1:
        raise ValueError(f"hc_split: mixes {mixes.shape} do not hold (2 + {hc}) * {hc} values per row")
    impl = impl or backend()
    if impl == "mlx":
        return hc_split_reference(mixes, scale, base, hc, iters, eps)
    kernel = compiled(HC_SPLIT, impl)
    threads = min(S, 64)
    return tuple(kernel(inputs=[mixes.astype(mx.float32), scale, base, float32s(eps),
                                int32s(S)],
                        template=[("HC", hc), ("ITERS", iters)],
                        grid=(-(-S // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
                        output_shapes=[(S, hc), (S, hc), (S, hc, hc)],
                        output_dtypes=[mx.float32] * 3))


def hc_input_fits(h: mx.array, impl: str | None = None) -> bool:
    """Whether hc_input runs for this stream [S, hc, dim]: a GPU, at most DECODE_MAX_ROWS
    rows, a bfloat16 stream, dim a multiple of 32 (whole FP8 blocks) and at most
    HC_INPUT_MAX_DIM (each of the 256 threads keeps its share of the row's collapsed values
    and norm weights in registers), with (2 + hc) * hc < 32 (a lane for each mix, and one for
    the sum of squares)."""
    impl = impl or backend()
    return (impl != "mlx" and h.ndim == 3 and h.shape[0] <= DECODE_MAX_ROWS and h.dtype == mx.bfloat16
            and h.shape[2] % 32 == 0 and h.shape[2] <= HC_INPUT_MAX_DIM and (2 + h.shape[1]) * h.shape[1] < 32)


def hc_input(h: mx.array, pre_in: mx.array, fn: mx.array, scale: mx.array, base: mx.array, norm_w: mx.array,
             iters: int, hc_norm_eps: float, eps: float, norm_eps: float, quantize_to: mx.Dtype,
             impl: str | None = None) -> tuple[mx.array, ...]:
    """A sub-layer's input from the stream in two launches: the collapse by pre_in,
    RMS-normed by norm_w -> x [S, dim] bf16, x FP8 fake-quantised as quantize_to (what
    quant.fp8_input makes of x, for the sub-layer's FP8 GEMMs), and this sub-layer's mixes
    pre [S, hc], post [S, hc], comb [S, hc, hc]. The first launch (hc_mix) sums the mix
    projection in HC_MIX_CHUNKS chunks of each row, a threadgroup each, so that the 2 MB of
    fn are read by many threadgroups at once; the second (hc_input, a threadgroup per row)
    does the rest. Its spec is hyper.HyperConnection.sublayer_input's composition of hc_pre,
    rms_norm, fp8_input, the mix projection and hc_split (scripts/check_kernels.py compares
    them); only where hc_input_fits."""
    impl = _hc_input_impl(h, impl)
    S, hc, dim = h.shape
    (parts,) = compiled(HC_MIX, impl)(
        inputs=[h, fn.astype(mx.float32), int32s(S)], template=[("D", dim), ("HC", hc), ("CH", HC_MIX_CHUNKS)],
        grid=(S * HC_MIX_CHUNKS * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, HC_MIX_CHUNKS, (2 + hc) * hc + 1)], output_dtypes=[mx.float32])
    return hc_input_from_parts(h, parts, pre_in, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to,
                               impl)


def hc_post_input(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array, pre_in: mx.array,
                  fn: mx.array, scale: mx.array, base: mx.array, norm_w: mx.array, iters: int, hc_norm_eps: float,
                  eps: float, norm_eps: float, quantize_to: mx.Dtype,
                  impl: str | None = None) -> tuple[mx.array, ...]:
    """hc_input of the stream h = hyper.hc_post(y, residual, post, comb) (the previous
    sub-layer's output y [S, dim] expanded by its mixes post [S, hc], comb [S, hc, hc] onto the
    stream residual [S, hc, dim] it ran on), in the same two launches: the first (hc_post_mix)
    computes h as it projects it and writes it out. -> (h, x, xq, pre, post, comb). Its spec is
    hyper.hc_post, then hc_input's; only where hc_input_fits the residual."""
    impl = _hc_input_impl(residual, impl)
    S, hc, dim = residual.shape
    f32 = mx.float32
    parts, h = compiled(HC_POST_MIX, impl)(
        inputs=[y.astype(mx.bfloat16), residual, post.astype(f32), comb.astype(f32), fn.astype(f32), int32s(S)],
        template=[("D", dim), ("HC", hc), ("CH", HC_MIX_CHUNKS)],
        grid=(S * HC_MIX_CHUNKS * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, HC_MIX_CHUNKS, (2 + hc) * hc + 1), (S, hc, dim)], output_dtypes=[f32, mx.bfloat16])
    return (h, *hc_input_from_parts(h, parts, pre_in, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps,
                                    quantize_to, impl))


def _hc_input_impl(h: mx.array, impl: str | None) -> str:
    impl = impl or backend()
    if not hc_input_fits(h, impl):
        raise ValueError(f"hc_input takes a bfloat16 stream [<= {DECODE_MAX_ROWS}, hc, dim] on a GPU, "
                         f"got {h.dtype} {h.shape} on {impl}")
    return impl


def hc_input_from_parts(h: mx.array, parts: mx.array, pre_in: mx.array, scale: mx.array, base: mx.array,
                        norm_w: mx.array, iters: int, hc_norm_eps: float, eps: float, norm_eps: float,
                        quantize_to: mx.Dtype, impl: str | None = None) -> tuple[mx.array, ...]:
    """hc_input's second launch, after hc_mix, hc_post_mix or fp8_into_stream made the parts of
    the stream h [S, hc, dim]: parts [S, CH, (2 + hc) * hc + 1] float32, each chunk's share of
    h's mix projection and of its sum of squares, which it adds up (each of its 8 simdgroups
    every eighth chunk in order, then the 8 sums in order). -> (x, xq, pre, post, comb) as
    hc_input's."""
    impl = _hc_input_impl(h, impl)
    S, hc, dim = h.shape
    if parts.shape[0] != S or parts.shape[2] != (2 + hc) * hc + 1:
        raise ValueError(f"hc_input's parts are [{S}, chunks, {(2 + hc) * hc + 1}] for a stream {h.shape}, "
                         f"got {parts.shape}")
    f32 = mx.float32  # the bodies read these as float32 (a build is keyed by its template values only)
    return tuple(compiled(HC_INPUT, impl)(
        inputs=[h, pre_in.astype(f32), parts, scale.astype(f32), base.astype(f32), norm_w.astype(f32),
                float32s(hc_norm_eps, eps, norm_eps), int32s(S)],
        template=[("D", dim), ("HC", hc), ("ITERS", iters), ("O", quantize_to), ("CH", parts.shape[1])],
        grid=(S * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(S, dim), (S, dim), (S, hc), (S, hc), (S, hc, hc)],
        output_dtypes=[mx.bfloat16, quantize_to, f32, f32, f32]))
