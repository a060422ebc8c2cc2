"""Mixture of experts: the sqrt-softplus router, the routed FP4 experts and the shared FP8
expert, each a SwiGLU with a clamp (reference `Gate`, `Expert`, `MoE`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..config import ModelArgs
from ..quant import Fp8Linear, fp8_input, gemm_input_dtype
from .layers import fused, index_range

F32, BF16 = mx.float32, mx.bfloat16


class Fp4Stack(nn.Module):
    """One projection of every routed expert: release FP4 bits in MLX `mxfp4` layout.

    weight [E, out, in/8] uint32 (eight E2M1 codes, first in the low nibble),
    scales [E, out, in/32] E8M0 bytes.
    """

    def __init__(self, n_experts: int, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((n_experts, out_dims, in_dims // 8), dtype=mx.uint32)
        self.scales = mx.zeros((n_experts, out_dims, in_dims // 32), dtype=mx.uint8)

    def __call__(self, x: mx.array, ids: mx.array, sorted_ids: bool = False, rows: mx.array | None = None,
                 quantize: bool = False, swiglu: kernels.SwiGLU | None = None) -> mx.array:
        """x [N, 1|k, 1, in] FP8-rounded activations through experts ids [N, k] -> bf16
        [N, k, 1, out]: the fp32 products summed in fp32, rounded to bf16 once (MLX's
        gather_qmm; on a GPU, a decode or verify step runs `pairs` instead). sorted_ids: ids
        are in ascending order (MLX then runs each expert's rows as one GEMM). rows: which x
        row each pair takes (default: x's own batch order). quantize: x is a bf16 activation
        to go through quant.fp8_input first. swiglu: this is a w13 stack (gate and up rows
        interleaved); the output is their kernels.swiglu_pairs [.., out / 2]."""
        x = fp8_input(x) if quantize else x
        y = mx.gather_qmm(x.astype(gemm_input_dtype()), self.weight, self.scales, lhs_indices=rows, rhs_indices=ids,
                          transpose=True, mode="mxfp4", sorted_indices=sorted_ids).astype(BF16)
        return y if swiglu is None else kernels.swiglu_pairs(y, swiglu)

    def pairs(self, x: mx.array, ids: mx.array, real: int, quantize: bool = False,
              swiglu: kernels.SwiGLU | None = None) -> mx.array:
        """A decode or verify step's (row, expert) pairs on a GPU, where kernels.fp4_experts_fits:
        x [S, in] (each of a row's experts reads its row) or [S, k, in] (pair (r, j) reads
        x[r, j]) through experts ids [S, k], the first `real` rows -> bf16 [real, k, out] (or
        the SwiGLU's [real, k, out / 2]) in one launch that reads each expert's weights once
        for all the rows that picked it. The arrays go in as they are: the kernel indexes them
        itself, so no views of them are made. quantize and swiglu as __call__'s; a bf16 x
        is quantised by the kernel as it reads it where kernels.quantizes_in_kernel."""
        in_kernel = quantize and kernels.quantizes_in_kernel(x, real, matrix_unit=True)
        if quantize and not in_kernel:
            x = fp8_input(x)
        return kernels.fp4_experts(x, self.weight, self.scales, ids, quantize_input=in_kernel, swiglu=swiglu, rows=real)


class Fp4Experts(nn.Module):
    """Every routed expert's SwiGLU projections: w13, the release's w1 (gate) and w3 (up)
    stacked along the outputs at load (one GEMM for both), and w2 (down)."""

    def __init__(self, n_experts: int, dim: int, inter: int):
        super().__init__()
        self.w13 = Fp4Stack(n_experts, dim, 2 * inter)
        self.w2 = Fp4Stack(n_experts, inter, dim)


class Expert(nn.Module):
    """The shared expert: FP8 SwiGLU, w1 (gate) and w3 (up) stacked as w13 at load."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w13, self.w2 = Fp8Linear(dim, 2 * inter), Fp8Linear(inter, dim)
        self.limit = limit

    def __call__(self, xq: mx.array, real: int | None = None, routed: mx.array | None = None,
                 onto: kernels.StreamOnto | None = None,
                 after: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """xq: the input through quant.fp8_input (shared with the routed experts); real: the
        rows that matter, the first `real` (on a GPU the others come out zeros; Fp8Linear).
        routed: the routed experts' outputs [real, k, dim] bf16, added to this one's
        (kernels.parts_added): the MoE's output. onto: w2 puts it into that stream
        (Fp8Linear.into_stream) and this returns (h, mix_parts). after: on a GPU, an array
        w13's launch waits for (kernels.fp8_gemv's)."""
        h = self.w13.quantized(xq, real, kernels.SwiGLU(self.limit), after)
        return self.w2(h, real, routed) if onto is None else self.w2.into_stream(h, onto, real, routed)


class Gate(nn.Module):
    """sqrt-softplus router: the bias picks experts, the unbiased scores weight them."""

    def __init__(self, args: ModelArgs, n_experts: int, top_k: int):
        super().__init__()
        self.weight = mx.zeros((n_experts, args.hidden_size), dtype=F32)  # BF16 in the release, widened at load
        self.bias = mx.zeros((n_experts,), dtype=F32)
        self.top_k, self.temp = top_k, args.gate_temp
        self.normalize, self.route_scale = args.norm_topk_prob, args.routed_scaling_factor
        if args.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {args.scoring_func!r} is not supported (release: sqrtsoftplus)")

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [N, dim] -> (weights [N, k] fp32, expert ids [N, k] in ascending order)."""
        return kernels.moe_gate(x, self.weight, self.bias, self.top_k, self.temp, self.route_scale, self.normalize)


SORT_EXPERTS_AT = 64  # (row, expert) pairs from which the MoE groups them by expert (prefill)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        n_experts, top_k = args.moe_shape(layer_id)
        self.gate = Gate(args, n_experts, top_k)
        self.experts = Fp4Experts(n_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = Expert(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)
        self.limit = args.swiglu_limit
        self._pair_ids = index_range(SORT_EXPERTS_AT)

    @fused()
    def __call__(self, x: mx.array, rows: int | None = None, x8: mx.array | None = None,
                 onto: kernels.StreamOnto | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """x [N, dim] bf16 -> [N, dim] bf16. x8: x through quant.fp8_input, where the caller has it.
        onto: the output goes into that stream (Expert's onto): -> (h, mix_parts).

        rows: only the first `rows` rows are real (a padded decode forward, Runner.padded);
        the others get the shared expert alone. Each (row, expert) pair is its own
        product, so a real row's output is the same bits whatever the padding, and
        the padding reads no expert weights of its own."""
        weights, ids = self.gate(x)
        N, k = ids.shape
        real = N if rows is None else rows
        x8 = fp8_input(x) if x8 is None else x8  # once, for the routed experts and the shared expert
        # y [real, k, dim]: row r's j-th expert's output at [r, j]
        if real * k < SORT_EXPERTS_AT:  # decode and verify: each row through its own k experts
            y = self._routed_rows(x8, weights, ids, real)
        else:  # prefill: the (row, expert) pairs grouped by expert, so each expert's rows form one GEMM
            xq, weights, flat = x8[:real, None, None, :], weights[:real], ids[:real].flatten()
            order = mx.argsort(flat)
            pairs = self._routed(xq[order // k, 0], weights.flatten()[order][:, None, None], flat[order], True)
            y = pairs[mx.argsort(order)].reshape(real, k, -1)
        # the shared expert adds them to its own output, in expert-id order as the reference adds
        # them (kernels.parts_added; on a GPU inside its last GEMM); the padding rows get the
        # shared expert alone (zeros on a GPU). Its w13 waits for the router's picks (`after`):
        # a CUDA graph runs it as soon as its input is ready, and beside the router's two small
        # launches, which a one-row step waits on, it slowed them; beside the routed experts'
        # GEMMs it is hidden.
        return self.shared_experts(x8, rows, y, onto, after=ids)

    def _routed_rows(self, x8: mx.array, weights: mx.array, ids: mx.array, real: int) -> mx.array:
        """The routed experts of a decode or verify step: the first `real` rows of x8 [N, dim]
        (through quant.fp8_input), their weights and ids [N, k] -> bf16 [real, k, dim]. On a GPU
        two fp4_experts launches (Fp4Stack.pairs) over the arrays as they are, the SwiGLU
        written by the first; elsewhere _routed's gathered GEMMs, its spec."""
        w13, w2 = self.experts.w13, self.experts.w2
        if kernels.fp4_experts_fits(x8, w13.weight, ids, rows=real):
            h = w13.pairs(x8, ids, real, swiglu=kernels.SwiGLU(self.limit, weights))  # [real, k, inter]
            return w2.pairs(h, ids, real, quantize=True)
        weights, ids = weights[:real, :, None, None], ids[:real]
        return self._routed(x8[:real, None, None, :], weights, ids, False).reshape(real, ids.shape[1], -1)

    def _routed(self, xq: mx.array, weights: mx.array, ids: mx.array, sorted_ids: bool) -> mx.array:
        """The routed experts' SwiGLU, weighted before the down projection (as the reference):
        xq [N, 1|k, 1, dim] through experts ids [N, k] (or [N] sorted pairs) -> bf16 [.., 1, dim]."""
        rows = pairs = None  # each pair's row of x, then of h: index constants on the decode path
        if not sorted_ids and ids.size <= self._pair_ids.size:
            N, k = ids.shape
            rows, pairs = self._pair_ids[:N, None], self._pair_ids[: N * k].reshape(N, k)
        h = self.experts.w13(xq, ids, sorted_ids, rows, swiglu=kernels.SwiGLU(self.limit, weights))
        return self.experts.w2(h, ids, sorted_ids, pairs, quantize=True)  # bf16
