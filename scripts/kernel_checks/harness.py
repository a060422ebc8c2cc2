"""What the kernel checks share: poisoned outputs, the row counts most checks run, random
inputs and the comparisons of a kernel's output with its spec's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv41_mlx.quant import fp8_fake_quant_reference

POISON = -12345.0
# the row counts most checks run; check_kernels.py --rows sets others (a quicker pass), so the
# checks read it as harness.CHECK_ROWS
CHECK_ROWS = (1, 2, 5, 8, 16)


def bits_differ(got: mx.array, want: mx.array) -> int:
    """How many values of two bfloat16 or float32 arrays of one dtype differ in their bits."""
    bits = {mx.bfloat16: mx.uint16, mx.float32: mx.uint32}[want.dtype]
    return (got.view(bits) != want.view(bits)).sum().item()


def bf16_step_problem(got: mx.array, want: mx.array) -> str | None:
    """None where bfloat16 got equals want in at least 99% of the values and is nowhere more
    than one bfloat16 step (at want's value) away; else what is wrong."""
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    step = np.abs(w) * 2.0**-7 + 1e-30
    beyond, differ = (np.abs(g - w) > step).sum(), (g != w).mean()
    if beyond or differ > 0.01:
        return f"{differ:.2%} of values differ, {beyond} by more than a bf16 step"
    return None


def random_fp8_input(shape) -> mx.array:
    """Normal values FP8 fake-quantised per 32, in bf16 (exact): an FP8 GEMM's input."""
    return fp8_fake_quant_reference(mx.random.normal(shape).astype(mx.bfloat16))


def abs_words(w: mx.array, fp4: bool = False) -> mx.array:
    """The codes' absolute values (their sign bits cleared)."""
    return w & (0xFFFFFFFF ^ (0x88888888 if fp4 else 0x80808080))


def bf16_ulps_apart(a: mx.array, b: mx.array) -> np.ndarray:
    """How many bf16 steps apart a and b are, once both are rounded to bf16."""
    def ordered(x):
        bits = np.array(x.astype(mx.bfloat16).view(mx.uint16)).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)  # bf16 bits in value order
    return np.abs(ordered(a) - ordered(b))


def gemm_agreement(name: str, wide: mx.array, narrow: mx.array, magnitude: mx.array, k: int):
    """(problem or None, note or None) for a bf16-fed GEMM's output `narrow` against the
    fp32-fed one's `wide` (fp32), both sums of k products whose absolute values sum to
    `magnitude`. Two fp32 sums of the same k products taken in different orders are each
    within k * 2**-24 * magnitude of the exact sum, and they round to different bf16 values
    where the exact sum lies that close to a rounding boundary: for random products about
    sqrt(k) * 2**-24 / 2**-8 of the values (0.05% at k = 1024; the H200 showed 126 of
    204,800 at 8 rows), many bf16 steps apart where the sum nearly cancels. So: at most 1%
    of the values may differ at all (a kernel that rounds to bf16 along the way puts most
    values off), and each value that differs must be within that bound plus one bf16 step."""
    ulps = bf16_ulps_apart(wide, narrow)
    differ = int((ulps > 0).sum())
    if differ > max(1, ulps.size // 100):
        return f"{name}: {differ} of {ulps.size} values differ, by up to {ulps.max()} ulp", None
    if not differ:
        return None, None
    wide32 = np.array(wide.astype(mx.float32))
    step = np.abs(wide32) * 2.0**-7 + 2.0**-133  # one bf16 step at |wide| (or more), never zero
    bound = step + 2 * k * 2.0**-24 * np.array(magnitude.astype(mx.float32))
    gap = np.abs(np.array(narrow.astype(mx.float32)) - wide32)
    far = ulps > 1
    if (gap > bound).any():
        return (f"{name}: {int((gap > bound).sum())} values apart beyond the fp32 summation-order bound "
                f"(largest {float(np.max(gap / bound)):.3g}x it)"), None
    if far.any():
        worst = np.argmax(np.where(far, ulps, 0))
        return None, (f"{name}: {differ} of {ulps.size} values differ, by up to {ulps.max()} ulp; those beyond 1 "
                      f"ulp are within the summation-order bound (the largest at {wide32.flat[worst]:.3g}, "
                      f"where the products' absolute values sum to {float(magnitude.flatten()[worst].item()):.3g})")
    return None, f"{name}: {differ} of {ulps.size} values 1 ulp apart"


def against_fp32(name: str, narrow: mx.array, gemm, x: mx.array, w: mx.array, s: mx.array, **kw):
    """gemm_agreement of `narrow` with the same MLX `gemm` fed x in fp32, the products'
    magnitudes from that gemm on |x| and the codes' absolute values (kw: the gemm's own)."""
    x32 = x.astype(mx.float32)
    wide = gemm(x32, w, s, **kw)
    magnitude = gemm(mx.abs(x32), abs_words(w, kw["mode"] == "mxfp4"), s, **kw)
    return gemm_agreement(name, wide, narrow.reshape(wide.shape), magnitude, x.shape[-1])


def raw_activation(shape) -> mx.array:
    """bf16 values not yet FP8 fake-quantised, of magnitudes far apart from block to block (so
    that the blocks' scales differ, some below the 1e-4 floor of amax, where values round to
    E4M3 subnormals), the first block of each row all zeros, and a zero and a negative zero."""
    blocks = shape[:-1] + (shape[-1] // 32,)
    x = mx.random.normal(blocks + (32,)) * mx.power(2.0, mx.random.randint(-30, 8, blocks + (1,)).astype(mx.float32))
    x = mx.concatenate([mx.zeros(shape[:-1] + (32,)), x.reshape(shape)[..., 32:]], axis=-1).astype(mx.bfloat16)
    return mx.concatenate([x[..., :-2], mx.zeros(shape[:-1] + (1,), dtype=mx.bfloat16),
                           mx.full(shape[:-1] + (1,), -0.0, dtype=mx.bfloat16)], axis=-1)


def quantizing_problems(name: str, kernel, shape, alone: bool) -> list[str]:
    """A GEMV kernel that FP8 fake-quantises its input as it reads it (quantize_input) against
    the same kernel fed the spec's fake-quantised input: the same bits, outputs poisoned; and a
    row alone the same bits as among the others."""
    x = raw_activation(shape)
    got = kernel(x, quantize_input=True, init_value=POISON)
    problems = []
    differ = bits_differ(got, kernel(fp8_fake_quant_reference(x)))
    if differ:
        problems.append(f"{name}, quantising its input: {differ} values differ from the kernel fed the "
                        f"fake-quantised input")
    if alone and not mx.array_equal(kernel(x[:1], quantize_input=True), got[:1]).item():
        problems.append(f"{name}, quantising its input: row 0 alone differs")
    return problems


def mixed_parts(rows: int, n: int) -> mx.array:
    """A MoE's routed parts [rows, 6, n] bf16 whose sums depend on the order of their float32
    additions, even in bf16: magnitudes 2^-6 to 2^6, and half the places with a large part
    and its negative in parts 0 and 1 (in order they cancel exactly; the other way round the
    small ones are rounded to the large one's precision first)."""
    p = mx.random.normal((rows, 6, n)) * mx.power(2.0, mx.random.randint(-6, 6, (rows, 6, n)).astype(mx.float32))
    big = mx.where(mx.random.uniform(shape=(rows, n)) < 0.5, 2.0**18, 0.0)
    return mx.concatenate([(p[:, 0] + big)[:, None], (p[:, 1] - big)[:, None], p[:, 2:]], axis=1).astype(mx.bfloat16)
