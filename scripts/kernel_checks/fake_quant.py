"""The FP8 and FP4 fake-quant kernels.

act_quant: bf16 and fp32 activations over a wide range of magnitudes (with zero blocks and
E4M3-subnormal values), bit equality with quant's spec.

fp4_quant: the indexer's and the compressed KV's FP4 fake-quant (blocks of 32 with
power-of-two scales, of 16 with E4M3 scales), bf16 and fp32, a wide range of
magnitudes, zeros and E2M1 ties: bit equality with quant's spec.
"""

from __future__ import annotations

import mlx.core as mx

from dsv41_mlx.kernels import act_quant_fp8, fp4_quant
from dsv41_mlx.quant import fp4_fake_quant_reference, fp8_fake_quant_reference

from .harness import bits_differ


def check_act_quant(impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    problems = []
    for shape in [(1, 512), (8, 5120), (8, 2304), (37, 4096), (8, 1, 6, 1, 2304)]:
        for dtype in (mx.bfloat16, mx.float32):
            blocks = shape[:-1] + (shape[-1] // 32, 32)  # one magnitude per block, from 2^-17 to 2^17
            x = mx.random.normal(blocks) * mx.exp(mx.random.uniform(-12, 12, blocks[:-1] + (1,)))
            x = x.reshape(shape) * (mx.random.uniform(shape=shape) > 0.05)  # some exact zeros
            x = mx.concatenate([x[..., :-32], mx.zeros(shape[:-1] + (32,))], axis=-1).astype(dtype)
            for out in (dtype, mx.float32):
                differ = bits_differ(act_quant_fp8(x, impl, out), fp8_fake_quant_reference(x).astype(out))
                if differ:
                    problems.append(f"act_quant {shape} {dtype} -> {out}: {differ} values differ")
    return problems


def check_fp4_quant(impl: str, seed: int) -> list[str]:
    """The FP4 fake-quant kernel against its spec, bit for bit: the indexer's queries and keys
    (blocks of 32, power-of-two scales) and the compressed KV (blocks of 16, E4M3 scales),
    bfloat16 and float32, block magnitudes from 2^-17 to 2^17 (the E4M3 scales' subnormals
    and their saturation), exact zeros, whole zero blocks and the E2M1 ties."""
    mx.random.seed(seed)
    problems = []
    for shape, block, e4m3 in [((8, 32, 128), 32, False), ((1, 128), 32, False), ((37, 512), 16, True),
                               ((8, 512), 16, True), ((8, 4096), 32, True)]:
        for dtype in (mx.bfloat16, mx.float32):
            blocks = shape[:-1] + (shape[-1] // block, block)
            x = mx.random.normal(blocks) * mx.exp(mx.random.uniform(-12, 12, blocks[:-1] + (1,)))
            x = x.reshape(shape) * (mx.random.uniform(shape=shape) > 0.05)  # some exact zeros
            ties = mx.array([0.75, 1.75, 3.5, -0.25, 2.5, 5.0, 6.0, -6.0] * (block // 8))  # E2M1 ties at scale 1
            x = mx.concatenate([x[..., :-2 * block], mx.zeros(shape[:-1] + (block,)),
                                mx.broadcast_to(ties, shape[:-1] + (block,))], axis=-1).astype(dtype)
            fmt = "e4m3" if e4m3 else "e8m0"
            differ = bits_differ(fp4_quant(x, block, e4m3, impl), fp4_fake_quant_reference(x, block, fmt))
            if differ:
                problems.append(f"fp4_quant {shape} block {block} {fmt} {dtype}: {differ} values differ")
    return problems
