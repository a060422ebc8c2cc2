"""Custom kernels (docs/kernels.md is the catalogue).

Each kernel exists three ways, and one wrapper picks:

* `mx.fast.metal_kernel` on Metal (Macs): body in `metal_kernels/<name>.metal`;
* `mx.fast.cuda_kernel` on CUDA: body in `metal_kernels/<name>.cu`, the same
  algorithm line for line;
* pure MLX everywhere else (the CPU): the `*_reference` functions of specs.py, which
  are the specification both kernels are tested against.

rows_gate, which computes nothing (it holds a forward's launches until the host has
written their rows), is the one kernel with a CUDA text only.

The bodies share `fp8_common.h` (integer bit tricks valid in both languages).

One module per kernel family, each with its wrappers, their `*_fits` and their KernelSpecs:
drafter (fp8_rows_top64, markov_drafts, ring_write), fake_quant (act_quant_fp8, fp4_quant), hyper
(hc_split, hc_input), gate (moe_gate), attention (sparse_attention_rows), norm (rms_norm
and its pair forms), gemv (fp8_gemv, fp8_gemv_pair, fp8_into_stream), experts
(fp4_experts), head (head_logits), rows_gate. Below them: build (sources, backend, the
compile cache, `dispatching`), tuning (the launch `Layout`) and specs. This module
re-exports their public names: the model calls `kernels.<name>`.
"""

from . import specs, tuning
from .attention import SPARSE_ATTENTION, attention_fits, sparse_attention_rows
from .build import (DECODE_MAX_ROWS, KernelSpec, backend, compile_kernel, compiled, computed_rows, device_backend,
                    dispatching, included_texts, kernel_dir, kernel_text, kernel_text_cache, kernels_switched_off)
from .drafter import FP8_ROWS, MARKOV_DRAFTS, RING_WRITE, TILE, fp8_rows_tiles, fp8_rows_top64, markov_drafts, ring_write
from .experts import FP4_EXPERTS, MMA_X_PREP, fp4_experts, fp4_experts_fits, fp4_experts_template, mma_x_prepared
from .fake_quant import ACT_QUANT, FP4_QUANT, act_quant_fp8, fp4_quant, fp4_quant_fits
from .gate import MOE_GATE_SCORES, MOE_GATE_TOPK, moe_gate
from .gemv import (FP8_GEMV, FP8_MMA, FP8_MMA_HC, MMA_MAX_K, StreamOnto, fp8_gemv, fp8_gemv_fits,
                   fp8_gemv_on_matrix_unit, fp8_gemv_pair, fp8_gemv_pair_fits, fp8_into_stream, fp8_into_stream_fits,
                   gemv_threads_per_output, pair_halves, quantizes_in_kernel)
from .head import HEAD_LOGITS, head_logits, head_logits_fits
from .hyper import (HC_INPUT, HC_MIX, HC_MIX_CHUNKS, HC_POST_MIX, HC_SPLIT, hc_input, hc_input_fits,
                    hc_input_from_parts, hc_post_input, hc_split)
from .norm import RMS_NORM, RMS_NORM_PAIR, rms_norm, rms_norm_fits, rms_norm_halves, rms_norm_pair, rms_norm_pair_fits
from .rows_gate import ROWS_GATE, rows_gate, rows_gate_fits
from .specs import (TOP_K, Fp8Matrix, SwiGLU, fp4_experts_reference, fp8_gemv_reference, fp8_rows_reference,
                    head_logits_reference, hc_split_reference, moe_gate_reference, padding_zeroed, parts_added,
                    markov_drafts_reference, ring_write_reference, rms_norm_reference, swiglu, swiglu_pairs, top_k_best)

__all__ = [
    "specs", "tuning",
    "SPARSE_ATTENTION", "attention_fits", "sparse_attention_rows",
    "DECODE_MAX_ROWS", "KernelSpec", "backend", "compile_kernel", "compiled", "computed_rows", "device_backend",
    "dispatching", "included_texts", "kernel_dir", "kernel_text", "kernel_text_cache", "kernels_switched_off",
    "FP8_ROWS", "MARKOV_DRAFTS", "RING_WRITE", "TILE", "fp8_rows_tiles", "fp8_rows_top64", "markov_drafts", "ring_write",
    "FP4_EXPERTS", "MMA_X_PREP", "fp4_experts", "fp4_experts_fits", "fp4_experts_template", "mma_x_prepared",
    "ACT_QUANT", "FP4_QUANT", "act_quant_fp8", "fp4_quant", "fp4_quant_fits",
    "MOE_GATE_SCORES", "MOE_GATE_TOPK", "moe_gate",
    "FP8_GEMV", "FP8_MMA", "FP8_MMA_HC", "MMA_MAX_K", "StreamOnto", "fp8_gemv", "fp8_gemv_fits",
    "fp8_gemv_on_matrix_unit", "fp8_gemv_pair", "fp8_gemv_pair_fits", "fp8_into_stream", "fp8_into_stream_fits",
    "gemv_threads_per_output", "pair_halves", "quantizes_in_kernel",
    "HEAD_LOGITS", "head_logits", "head_logits_fits",
    "HC_INPUT", "HC_MIX", "HC_MIX_CHUNKS", "HC_POST_MIX", "HC_SPLIT", "hc_input", "hc_input_fits",
    "hc_input_from_parts", "hc_post_input", "hc_split",
    "RMS_NORM", "RMS_NORM_PAIR", "rms_norm", "rms_norm_fits", "rms_norm_halves", "rms_norm_pair",
    "rms_norm_pair_fits",
    "ROWS_GATE", "rows_gate", "rows_gate_fits",
    "TOP_K", "Fp8Matrix", "SwiGLU", "fp4_experts_reference", "fp8_gemv_reference", "fp8_rows_reference",
    "head_logits_reference", "hc_split_reference", "moe_gate_reference", "padding_zeroed", "parts_added",
    "markov_drafts_reference", "ring_write_reference", "rms_norm_reference", "swiglu", "swiglu_pairs", "top_k_best",
]
