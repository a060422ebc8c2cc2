"""The RMSNorm kernels.

rms_norm: RMSNorm at widths 128..5120, rows 1..300, bf16 and fp32, against the
spec's casts around MLX's RMSNorm: bf16 within a bf16 step (equal in 99%), fp32
within 1e-6; a row alone equals the row among others; the quantised form bit for
bit the FP8 fake-quant of the kernel's own norm.

rms_norm_rope: its rotated form (the window keys' norm, RoPE and FP8 fake-quant), widths
128 and 512, 64 rotated features: within a bf16 step of layers.rotate of the kernel's own
norm (equal in 99%); quantised, bit for bit act_quant of that; a row alone the same.

rms_norm_pair: q_norm and the rotated kv_norm in one launch at the release's widths and
small ones, 1..16 rows: each output the bits of rms_norm's kernel on its input alone, also
read from one array holding both inputs (rms_norm_halves, as the model feeds it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx.kernels import rms_norm, rms_norm_halves, rms_norm_pair, rms_norm_reference
from dsv41_mlx.quant import fp8_fake_quant_reference
from scripts.benchmarks.harness import release_ropes

from . import harness
from .harness import bf16_step_problem, bits_differ


def check_rms_norm(impl: str, seed: int) -> list[str]:
    """The RMSNorm kernel against its spec at every width the model norms (128, 512, 1280,
    5120), decode to prefill rows, bfloat16 and float32: bf16 out within one bf16 step and
    equal in at least 99% of values, fp32 out within 1e-6 (relative). These tolerances are
    set before any GPU run of the kernel. A row alone equals the same row among others."""
    rng = np.random.default_rng(seed)
    problems = []
    for D in (128, 512, 1280, 5120):
        w = mx.array(rng.normal(1, 0.3, D).astype(np.float32))
        for rows in (1, 8, 300):
            for dtype in (mx.bfloat16, mx.float32):
                x = mx.array(rng.normal(0, 3, (rows, D)).astype(np.float32)).astype(dtype)
                plain = rms_norm(x, w, 1e-6, impl=impl)
                spec = rms_norm_reference(x, w, 1e-6)
                if dtype == mx.bfloat16:
                    problem = bf16_step_problem(plain, spec)
                else:
                    got, want = np.array(plain), np.array(spec)
                    far = (np.abs(got - want) > 1e-6 * np.abs(want) + 1e-30).sum()
                    problem = f"{far} values differ by more than 1e-6 (relative)" if far else None
                if problem:
                    problems.append(f"rms_norm D={D} rows={rows} {dtype}: {problem}")
                alone = rms_norm(x[-1:], w, 1e-6, impl=impl)
                if bits_differ(alone, plain[-1:]):
                    problems.append(f"rms_norm D={D} rows={rows} {dtype}: the last row alone differs")
                for out in (mx.bfloat16, mx.float32):  # the quantised form: act_quant on the kernel's own norm
                    differ = bits_differ(rms_norm(x, w, 1e-6, impl=impl, quantize_to=out),
                                         fp8_fake_quant_reference(plain).astype(out))
                    if differ:
                        problems.append(f"rms_norm D={D} rows={rows} {dtype} quantised to {out}: "
                                        f"{differ} values differ from act_quant of the norm")
    return problems


def rotated_spec(normed: mx.array, cos: mx.array, sin: mx.array, dims: int) -> mx.array:
    """layers.rotate of rows [S, D] by Rope.tables' cos and sin [S, D]: the last dims features."""
    from dsv41_mlx.models.layers import rotate

    S, D = normed.shape
    pairs = (S, D // 2, 2)
    rotated = (mx.arange(D) >= D - dims).reshape(D // 2, 2)
    return rotate(normed, cos.reshape(pairs), sin.reshape(pairs), rotated)


def check_rms_norm_rope(impl: str, seed: int) -> list[str]:
    """The RMSNorm kernel's rotated form (the window keys' norm, RoPE and FP8 fake-quant in
    one launch) at the latent's width 512 and at 128, the release's 64 rotated features and
    YaRN tables (the flash-shaped config's) at random positions, decode to prefill rows:
    against layers.rotate of the kernel's own norm (the norm is check_rms_norm's), within one
    bf16 step and equal in at least 99% of values (a multiply and an add may fuse differently
    from MLX's); the quantised form bit for bit act_quant of the kernel's own rotated norm; a
    row alone equals the same row among others. Tolerances set before any GPU run."""
    rng = np.random.default_rng(seed)
    problems = []
    rope = release_ropes()[0]  # a compressed layer's: YaRN, 64 rotated features
    for D in (128, 512):
        w = mx.array(rng.normal(1, 0.3, D).astype(np.float32))
        for rows in (1, 8, 300):
            x = mx.array(rng.normal(0, 3, (rows, D)).astype(np.float32)).astype(mx.bfloat16)
            tables = rope.tables(mx.array(rng.integers(0, 100000, rows).astype(np.int32)), D)
            cos, sin = tables[0].reshape(rows, D), tables[1].reshape(rows, D)
            got = rms_norm(x, w, 1e-6, impl=impl, rope=(cos, sin, rope.dims))
            problem = bf16_step_problem(got, rotated_spec(rms_norm(x, w, 1e-6, impl=impl), cos, sin, rope.dims))
            if problem:
                problems.append(f"rms_norm_rope D={D} rows={rows}: {problem}")
            quantised = rms_norm(x, w, 1e-6, impl=impl, quantize_to=mx.bfloat16, rope=(cos, sin, rope.dims))
            differ = bits_differ(quantised, fp8_fake_quant_reference(got))
            if differ:
                problems.append(f"rms_norm_rope D={D} rows={rows}: {differ} quantised values differ from "
                                f"act_quant of the rotated norm")
            alone = rms_norm(x[-1:], w, 1e-6, impl=impl, quantize_to=mx.bfloat16,
                             rope=(cos[-1:], sin[-1:], rope.dims))
            if bits_differ(alone, quantised[-1:]):
                problems.append(f"rms_norm_rope D={D} rows={rows}: the last row alone differs")
    return problems


def check_rms_norm_pair(impl: str, seed: int) -> list[str]:
    """rms_norm_pair (attention's q_norm and rotated kv_norm in one launch) at the release's
    widths (1280; 512 with 64 rotated features, YaRN tables at random positions) and small
    ones, 1..16 rows, the first output in the GEMMs' input dtype: each output the bits of
    rms_norm's kernel on its input alone; and rms_norm_halves, the two inputs one after the
    other in one array (as fp8_gemv_pair writes them), the same bits."""
    from dsv41_mlx.quant import gemm_input_dtype

    rng = np.random.default_rng(seed)
    problems = []
    rope = release_ropes()[0]
    for D, D2 in ((1280, 512), (64, 128)):
        w, w2 = (mx.array(rng.normal(1, 0.3, n).astype(np.float32)) for n in (D, D2))
        for rows in harness.CHECK_ROWS:
            x, x2 = (mx.array(rng.normal(0, 3, (rows, n)).astype(np.float32)).astype(mx.bfloat16) for n in (D, D2))
            tables = rope.tables(mx.array(rng.integers(0, 100000, rows).astype(np.int32)), D2)
            rope2 = (tables[0].reshape(rows, D2), tables[1].reshape(rows, D2), rope.dims)
            got = rms_norm_pair(x, w, x2, w2, 1e-6, gemm_input_dtype(), mx.bfloat16, rope2, impl=impl)
            want = (rms_norm(x, w, 1e-6, impl=impl, quantize_to=gemm_input_dtype()),
                    rms_norm(x2, w2, 1e-6, impl=impl, quantize_to=mx.bfloat16, rope=rope2))
            for part, a, b in zip(("first", "second"), got, want):
                if a.dtype != b.dtype or bits_differ(a, b):
                    problems.append(f"rms_norm_pair {D}+{D2} rows={rows}: the {part} output is not rms_norm's bits")
            both = mx.concatenate([x.reshape(-1), x2.reshape(-1)])
            halves = rms_norm_halves(both, rows, D, w, w2, 1e-6, gemm_input_dtype(), mx.bfloat16, rope2, impl=impl)
            if any(bits_differ(a, b) for a, b in zip(halves, want)):
                problems.append(f"rms_norm_halves {D}+{D2} rows={rows}: not rms_norm_pair's bits")
    return problems
