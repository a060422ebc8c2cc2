"""Check the GPU kernels (CUDA twins on an NVIDIA GPU, Metal on a Mac) against the pure-MLX spec.

    python scripts/check_kernels.py            # exits 1 on any mismatch
    python scripts/check_kernels.py moe_gate   # only the checks whose names start so
    python scripts/check_kernels.py --rows=1,6 # at these row counts only (fewer kernel builds)

fp8_rows: release head shape (129280 x 5120) and a small ragged one, rows 1, 2,
5, 8, 16, fresh random inputs each time, outputs poisoned before the launch
(every element must be written). Each 256-output tile's 64 candidates must be
that tile's 64 best by the spec's float32 logits (a swap is allowed only
between values closer than the tolerance), with values matching the spec's.
ring_write: random rings and rows, writes that wrap, byte equality.
act_quant: bf16 and fp32 activations over a wide range of magnitudes (with
zero blocks and E4M3-subnormal values), bit equality with quant's spec.
quantised GEMMs (MLX's own mxfp8 dense and grouped, mxfp4 experts) fed bf16 vs
fed fp32, at every shape of the flash-shaped model, decode to prefill row counts
(quant.gemm_input_dtype feeds bf16 on CUDA): at most 1% of values apart, each
within the bound of another fp32 summation order (many ulps where a sum nearly
cancels); NaN-free weight codes; an expert product of one row alone equals that
row's inside 8 rows.
fp4_quant: the indexer's and the compressed KV's FP4 fake-quant (blocks of 32 with
power-of-two scales, of 16 with E4M3 scales), bf16 and fp32, a wide range of
magnitudes, zeros and E2M1 ties: bit equality with quant's spec.
fp8_gemv: the decode FP8 GEMM at every FP8 shape of the flash-shaped model (and
wo_a's grouped one) and two ragged ones, 1..16 rows, outputs poisoned: within the
bound of another fp32 summation order of MLX's fp32-fed gather_qmm; a row
alone equals the row among 8 and among 16; with fewer real rows than rows, the
real rows the same bits and the padding zeros.
rms_norm_pair: q_norm and the rotated kv_norm in one launch at the release's widths and
small ones, 1..16 rows: each output the bits of rms_norm's kernel on its input alone, also
read from one array holding both inputs (rms_norm_halves, as the model feeds it).
fp8_gemv_pair: attention's wq_a and wkv stacked (one launch for both) at the flash-shaped
model's shapes and a ragged one, 1..16 rows, outputs poisoned: each part the same bits
as fp8_gemv on its own rows of the stack; padded, the real rows the same and zeros after.
fp4_experts: the routed experts' FP4 GEMMs at the model's expert stacks and a ragged
one, 1..16 rows of distinct experts, x per row and per slot, outputs poisoned: within
the bound of another fp32 summation order of MLX's fp32-fed gather_qmm; a row alone
equals the row among 8 and among 16.
gemv_epilogues: both GEMV kernels' SwiGLU epilogue at the model's gate and up
projections (FP8 shared expert, FP4 routed stacks with each pair's weight) and a ragged
one each, and fp8_gemv's added parts (the MoE's sum) at the shared expert's down
projection and a ragged one; 1..16 rows, clamped and not, fed FP8 and raw (quantised in
the kernel) input, padded: the same bits as the kernel's plain output through the spec
(kernels.swiglu_pairs, kernels.parts_added).
head_logits: the model's head from its bf16 weight at the release's 129280 x 5120 and a
small one, 1..16 rows, outputs poisoned: within the bound of another fp32 summation order
of the spec's (the products are exact); a row alone equals the row among 8 and 16; with
fewer real rows, the real rows the same bits and the padding zeros.
hc_split: random mixes at 1..300 rows, release hc 4 / 20 iterations, within
2e-6 of the spec (the spec's exp and sigmoid are not bit for bit the kernel's).
moe_gate: the router at 384 / 24 / 16 experts (top 6, 6, 3), rows 1..16: the
same experts as the spec (but where the k-th and (k+1)-th biased scores are
within float32 noise), weights within 1e-5; a row alone equals the same row
among others.
hc_input: a sub-layer's input from the stream at hc 4, dim 5120, rows 1..16, against
hyper.HyperConnection.sublayer_input's pure-MLX composition: x within a bf16 step
(equal in 99% of values), the mixes within 2e-5; a row alone equals the row among
others.
hc_post_input: the same with the stream expanded inside the kernel from the previous
sub-layer's output (hyper.hc_post's spec): the stream within a bf16 step of hc_post's
(equal in 99%), the rest as hc_input's against the spec of the kernel's own stream.
fp8_into_stream: wo_b and the shared expert's w2 (parts added) putting their output into
the stream (fp8_mma_hc), rows 1..16 with a padding row: the stream the same bits as
fp8_gemv then hc_post_input; the next
sub-layer's input from the kernel's mix parts (hc_input_from_parts) as hc_input's
against the spec of that stream; a row alone equals the row among others.
rms_norm: RMSNorm at widths 128..5120, rows 1..300, bf16 and fp32, against the
spec's casts around MLX's RMSNorm: bf16 within a bf16 step (equal in 99%), fp32
within 1e-6; a row alone equals the row among others; the quantised form bit for
bit the FP8 fake-quant of the kernel's own norm.
rms_norm_rope: its rotated form (the window keys' norm, RoPE and FP8 fake-quant), widths
128 and 512, 64 rotated features: within a bf16 step of layers.rotate of the kernel's own
norm (equal in 99%); quantised, bit for bit act_quant of that; a row alone the same.
sparse_attention: a decode forward's attention at 64 heads x 512, a 128-key window
and 512 picks (or none), rows 1..16 at random positions, masked keys and rows with
none visible, against the query RoPE, attention.sparse_attention on gathered keys and
the inverse RoPE (the release's 64 rotated features, YaRN on compressed layers):
each row-head within 1% of its largest value, 0.1% on average; a row alone equals
the row among others; with fewer real rows than rows, the real rows the same bits
and the padding zeros; at 8 simdgroups a threadgroup the bits of the backend's count.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the spec's matmul in true float32

import mlx.core as mx
import numpy as np

from dsv41_mlx import kernels
from dsv41_mlx.kernels import (TILE, TOP_K, backend, fp8_rows_tiles, fp8_rows_top64, hc_split, hc_split_reference,
                               ring_write, ring_write_reference)
from dsv41_mlx.kernels import (SwiGLU, act_quant_fp8, fp4_experts, fp4_quant, fp8_gemv, fp8_gemv_pair,
                               fp8_gemv_pair_fits, hc_input, hc_post_input, head_logits, head_logits_reference,
                               moe_gate, moe_gate_reference, padding_zeroed, pair_halves, parts_added, rms_norm,
                               rms_norm_halves, rms_norm_pair, rms_norm_reference, sparse_attention_rows,
                               swiglu_pairs)
from dsv41_mlx.quant import fp4_fake_quant_reference, fp8_fake_quant_reference, quantize_fp8_tiles_mx

POISON = -12345.0
CHECK_ROWS = (1, 2, 5, 8, 16)  # the row counts most checks run (--rows: others, for a quicker pass)


def check_fp8_rows(n: int, k: int, rows: int, impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    head = quantize_fp8_tiles_mx((mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16))
    x = mx.random.normal((rows, k)).astype(mx.bfloat16).astype(mx.float32)
    logits = x @ head.dequantize().T  # the spec's float32 logits [rows, n]
    vals, ids = fp8_rows_tiles(x, head, impl, init_value=POISON)
    mx.eval(logits, vals, ids)
    logits, vals, ids = np.array(logits), np.array(vals), np.array(ids)
    tol = 1e-5 * np.abs(logits).max()
    problems = []
    if (vals == POISON).any() or (ids == int(POISON)).any():
        problems.append("unwritten outputs")
    tiles = vals.shape[1]
    padded = np.full((rows, tiles * TILE), -np.inf, np.float32)
    padded[:, :n] = logits
    for r in range(rows):
        for t in range(tiles):
            got_ids = ids[r, t]
            if not np.all((got_ids >= t * TILE) & (got_ids < min((t + 1) * TILE, n))):
                problems.append(f"row {r} tile {t}: ids outside the tile")
                break
            ref_vals = padded[r, got_ids]
            if np.abs(vals[r, t] - ref_vals).max() > tol:
                problems.append(f"row {r} tile {t}: values off by {np.abs(vals[r, t] - ref_vals).max():.3g}")
                break
            kth = np.sort(padded[r, t * TILE:(t + 1) * TILE])[-TOP_K]
            if (ref_vals < kth - tol).any() or len(set(got_ids.tolist())) != TOP_K:
                problems.append(f"row {r} tile {t}: not the tile's 64 best")
                break
            if np.any(np.diff(vals[r, t]) > 0):
                problems.append(f"row {r} tile {t}: not sorted best first")
                break
    best_vals, best_ids = fp8_rows_top64(x, head, impl)
    ref_vals, ref_ids = fp8_rows_top64(x, head, "mlx")
    if np.abs(np.array(best_vals) - np.array(ref_vals)).max() > tol:
        problems.append("final top-64 values differ from the spec")
    return problems


def check_ring_write(impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    problems = []
    for stages, window, dim, m, first in [(3, 128, 512, 6, 125), (3, 128, 512, 128, 1000), (2, 8, 64, 3, 7)]:
        rings = mx.random.normal((stages, window, dim)).astype(mx.bfloat16)
        rows = mx.random.normal((stages, m, dim)).astype(mx.bfloat16)
        got = ring_write(rings, rows, first, impl)
        ref = ring_write_reference(rings, rows, first)
        if not mx.array_equal(got, ref).item():
            problems.append(f"ring_write {stages}x{window}x{dim} m={m} first={first} differs")
    return problems


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


def flash_args():
    """The flash-shaped model's ModelArgs (scripts/make_flash_shaped.py: the release's shapes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_flash_shaped import flash_config

    from dsv41_mlx.config import ModelArgs

    return ModelArgs.from_dict(flash_config())


def quantised_gemm_shapes() -> tuple[set, set, set]:
    """(dense mxfp8 (in, out), grouped wo_a (groups, in, out), mxfp4 experts (experts, in, out))
    of every quantised GEMM in the flash-shaped model (its dense shapes are the release's)."""
    from dsv41_mlx.io.load import build_model
    from dsv41_mlx.models.attention import Attention
    from dsv41_mlx.models.moe import Fp4Stack
    from dsv41_mlx.quant import Fp8Linear

    model = build_model(flash_args())  # the DSpark stages too; weights are lazy zeros: nothing is allocated
    dense, grouped, experts = set(), set(), set()
    for _, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            dense.add((m.weight.shape[1] * 4, m.weight.shape[0]))
        elif isinstance(m, Fp4Stack):
            experts.add((m.weight.shape[0], m.weight.shape[2] * 8, m.weight.shape[1]))
        if isinstance(m, Attention):
            grouped.add((m.n_groups, m.wo_a.weight.shape[1] * 4, m.o_lora_rank))
    return dense, grouped, experts


def random_fp8_input(shape) -> mx.array:
    """Normal values FP8 fake-quantised per 32, in bf16 (exact): an FP8 GEMM's input."""
    return fp8_fake_quant_reference(mx.random.normal(shape).astype(mx.bfloat16))


def random_words(shape, fp4: bool = False) -> mx.array:
    """Random weight codes packed as MLX stores them (uint32 words of 4 E4M3 or 8 E2M1 codes),
    without E4M3's NaN codes S.1111.111 (one would make a whole output row NaN on every side
    of a comparison, which then compares nothing)."""
    codes = mx.random.randint(0, 256, shape[:-1] + (shape[-1] * 4,)).astype(mx.uint8)
    if not fp4:
        codes = mx.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.view(mx.uint32)


def random_scales(shape) -> mx.array:
    return mx.random.randint(112, 124, shape).astype(mx.uint8)


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


def check_gemms_bf16(seed: int, rows_list=(1, 5, 8, 16, 37, 256)) -> tuple[list[str], list[str]]:
    """MLX's quantised GEMMs fed bf16 against the same GEMMs fed fp32, at every shape of the
    flash-shaped model, at decode / verify and prefill row counts (quant.gemm_input_dtype
    feeds bf16 on CUDA). The inputs are exact in bf16 and both kernels accumulate in fp32,
    so the bf16 one may differ only where its fp32 sum, taken in another order, rounds to
    another bf16 (`gemm_agreement`). Also: a gathered (row, expert) product must not depend
    on the other rows (the MoE runs a padded forward's real rows alone). The random weights
    hold no NaN codes (E4M3's 0x7F and 0xFF): one would make the whole output row NaN on
    both sides and the comparison empty. Returns (problems, notes on the values that differ)."""
    mx.random.seed(seed)
    problems, notes = [], []

    def compare(name, gemm, x, w, s, **kw):
        narrow = gemm(x, w, s, **kw)
        problem, note = against_fp32(name, narrow, gemm, x, w, s, **kw)
        problems.extend([problem] if problem else [])
        notes.extend([note] if note else [])
        return narrow

    fp8_input, words, scales = random_fp8_input, random_words, random_scales
    dense, grouped, experts = quantised_gemm_shapes()
    for d_in, d_out in sorted(dense):
        w, s = words((d_out, d_in // 4)), scales((d_out, d_in // 32))
        for rows in rows_list:
            compare(f"mxfp8 {d_in}->{d_out} rows={rows}", mx.quantized_matmul, fp8_input((rows, d_in)), w, s,
                    transpose=True, mode="mxfp8")
    for groups, d_in, d_out in sorted(grouped):
        w, s, g = words((groups, d_out, d_in // 4)), scales((groups, d_out, d_in // 32)), mx.arange(groups)
        for rows in rows_list:
            o = mx.random.normal((rows, groups, 1, d_in)).astype(mx.bfloat16)
            compare(f"grouped mxfp8 {groups}x{d_in}->{d_out} rows={rows}", mx.gather_qmm, o, w, s,
                    rhs_indices=g, transpose=True, mode="mxfp8")
    top = 6
    for n_experts, d_in, d_out in sorted(experts):
        w, s = words((n_experts, d_out, d_in // 8), fp4=True), scales((n_experts, d_out, d_in // 32))
        for rows in (1, 5, 8, 16):  # decode and verify; prefill groups its pairs by expert (sorted)
            ids = mx.random.randint(0, n_experts, (rows, top)).astype(mx.uint32)
            x = fp8_input((rows, 1, 1, d_in))
            narrow = compare(f"mxfp4 {n_experts}x{d_in}->{d_out} rows={rows}", mx.gather_qmm, x, w, s,
                             rhs_indices=ids, transpose=True, mode="mxfp4")
            if rows > 1:
                alone = mx.gather_qmm(x[:1], w, s, rhs_indices=ids[:1], transpose=True, mode="mxfp4")
                if not mx.array_equal(alone, narrow[:1]).item():
                    problems.append(f"mxfp4 {n_experts}x{d_in}->{d_out}: row 0 alone differs from row 0 of {rows}")
    return problems, notes


def check_fp8_gemv(impl: str, seed: int) -> list[str]:
    """The decode FP8 GEMM kernel against MLX's gather_qmm fed fp32, at every FP8 shape
    of the flash-shaped model (the release's dense ones and wo_a's 8 groups) and two ragged
    ones, 1..16 rows, outputs poisoned before the launch: every value within the bound of
    another float32 summation order (`gemm_agreement`); a row alone the same bits as among
    others, at 8 rows and at 16 (row bounds RB 8 and 16 against RB 1); a dense GEMM's 2-D form the same
    bits as one group, a grouped one's stacked form (attention.Attention.output's) the same bits as
    its [S, G, K] form; asked for fewer real rows (a padded forward), those the same bits and
    the rest zeros."""
    mx.random.seed(seed)
    problems = []
    dense, grouped, _ = quantised_gemm_shapes()
    shapes = [(1, d_in, d_out) for d_in, d_out in sorted(dense)] + sorted(grouped) + [(1, 512, 96), (3, 256, 32)]
    for groups, d_in, d_out in shapes:
        w, s = random_words((groups, d_out, d_in // 4)), random_scales((groups, d_out, d_in // 32))
        for rows in (1, 2, 5, 8, 9, 16):
            x = random_fp8_input((rows, groups, d_in))
            got = fp8_gemv(x, w, s, impl=impl, init_value=POISON)
            name = f"fp8_gemv {groups}x{d_in}->{d_out} rows={rows}"
            problem, _ = against_fp32(name, got, mx.gather_qmm, x[:, :, None], w, s, rhs_indices=mx.arange(groups),
                                      transpose=True, mode="mxfp8")  # as kernels.fp8_gemv_reference
            problems.extend([problem] if problem else [])
            if rows in (8, 16) and not mx.array_equal(fp8_gemv(x[:1], w, s, impl=impl), got[:1]).item():
                problems.append(f"{name}: row 0 alone differs from row 0 of {rows}")
            if rows in (8, 16):  # a padded forward: its real rows the same bits, the padding zeros
                for real in (1, rows - 2):
                    padded = fp8_gemv(x, w, s, impl=impl, init_value=POISON, real_rows=real)
                    if not (mx.array_equal(padded[:real], got[:real]).item() and not padded[real:].any().item()):
                        problems.append(f"{name}: with {real} real rows, not the same real rows and zeros after "
                                        f"them")
            if groups == 1 and not mx.array_equal(fp8_gemv(x[:, 0], w[0], s[0], impl=impl), got[:, 0]).item():
                problems.append(f"{name}: the dense form (x [S, K], w [N, K/4]) differs from one group")
            if groups > 1:  # attention's wo_a as the model runs it: x [S, H, D] and the matrices stacked [G * N, K/4]
                flat = fp8_gemv(x.reshape(rows, -1), w.reshape(-1, w.shape[-1]), s.reshape(-1, s.shape[-1]),
                                impl=impl, init_value=POISON, groups=groups)
                if not mx.array_equal(flat, got.reshape(rows, -1)).item():
                    problems.append(f"{name}: the stacked form (groups={groups}) differs from [S, G, K] by [G, N, K/4]")
            problems.extend(quantizing_problems(name, lambda v, **kw: fp8_gemv(v, w, s, impl=impl, **kw),
                                                (rows, groups, d_in), rows in (8, 16)))
    return problems


def check_fp8_gemv_pair(impl: str, seed: int) -> list[str]:
    """fp8_gemv_pair (attention's wq_a and wkv in one launch) at the flash-shaped model's
    stacked shapes and a ragged one, 1..16 rows, outputs poisoned: each part the same bits as
    fp8_gemv on its own rows of the stack (a view, as the drafter's stages run them), and
    with fewer real rows the real rows the same bits and the padding zeros."""
    from dsv41_mlx.io.load import build_model
    from dsv41_mlx.models.attention import Attention

    mx.random.seed(seed)
    problems = []
    stacks = {(m.wq_a_wkv.weight.shape[1] * 4, m.wq_a_wkv.weight.shape[0], m.q_lora_rank)
              for _, m in build_model(flash_args()).named_modules() if isinstance(m, Attention)}
    for d_in, d_out, split in sorted(stacks) + [(512, 96, 64)]:
        w, s = random_words((d_out, d_in // 4)), random_scales((d_out, d_in // 32))
        for rows in CHECK_ROWS:
            name = f"fp8_gemv_pair {d_in}->{split}+{d_out - split} rows={rows}"
            x = random_fp8_input((rows, d_in))
            if not fp8_gemv_pair_fits(x, w, split, impl):
                problems.append(f"{name}: does not fit")
                continue
            want = (fp8_gemv(x, w[:split], s[:split], impl=impl), fp8_gemv(x, w[split:], s[split:], impl=impl))
            got = pair_halves(fp8_gemv_pair(x, w, s, split, impl=impl, init_value=POISON), rows, split)
            if not all(mx.array_equal(a, b).item() for a, b in zip(got, want)):
                problems.append(f"{name}: not the bits of fp8_gemv on each matrix")
            for real in (1, rows - 2) if rows >= 8 else ():
                padded = pair_halves(fp8_gemv_pair(x, w, s, split, impl=impl, init_value=POISON, real_rows=real),
                                     rows, split)
                if not all(mx.array_equal(p[:real], b[:real]).item() and not p[real:].any().item()
                           for p, b in zip(padded, want)):
                    problems.append(f"{name}: with {real} real rows, not the same real rows and zeros after them")
    return problems


def check_gemv_epilogues(impl: str, seed: int) -> list[str]:
    """The GEMV kernels' epilogues, 1..16 rows: the SwiGLU (swiglu=) at the flash-shaped
    model's gate and up projections (the shared experts' FP8 w13, the routed experts' FP4 w13
    stacks with each pair's weight) and a ragged one of each (`swiglu_problems`), and
    fp8_gemv's added parts at the shared experts' down projection and a ragged one
    (`parts_problems`)."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    problems = []
    dense, _, experts = quantised_gemm_shapes()
    inter2 = 2 * flash_args().moe_intermediate_size
    for d_in, d_out in sorted(shape for shape in dense if shape[1] == inter2) + [(512, 96)]:
        w, s = random_words((d_out, d_in // 4)), random_scales((d_out, d_in // 32))
        for rows in CHECK_ROWS:
            problems.extend(swiglu_problems(f"fp8_gemv {d_in}->{d_out} rows={rows}",
                                            lambda v, **kw: fp8_gemv(v, w, s, impl=impl, **kw),
                                            random_fp8_input((rows, d_in)), None, rows - 2 if rows > 2 else None))
    for d_in, d_out in sorted(shape for shape in dense if shape[0] == inter2 // 2) + [(512, 96)]:
        w, s = random_words((d_out, d_in // 4)), random_scales((d_out, d_in // 32))
        for rows in CHECK_ROWS:
            problems.extend(parts_problems(f"fp8_gemv {d_in}->{d_out} rows={rows}",
                                           lambda v, **kw: fp8_gemv(v, w, s, impl=impl, **kw), (rows, d_in), d_out))
    for n_experts, d_in, d_out in sorted(shape for shape in experts if shape[2] == inter2) + [(5, 256, 96)]:
        w, s = random_words((n_experts, d_out, d_in // 8), fp4=True), random_scales((n_experts, d_out, d_in // 32))
        for rows in CHECK_ROWS:
            top = min(6, n_experts)
            ids = mx.array(np.sort([rng.choice(n_experts, top, replace=False) for _ in range(rows)], axis=1)
                           .astype(np.uint32))
            problems.extend(swiglu_problems(f"fp4_experts {n_experts}x{d_in}->{d_out} rows={rows}",
                                            lambda v, **kw: fp4_experts(v, w, s, ids, impl=impl, **kw),
                                            random_fp8_input((rows, 1, d_in)), mx.random.uniform(shape=(rows, top, 1)),
                                            None))
    return problems


def mixed_parts(rows: int, n: int) -> mx.array:
    """A MoE's routed parts [rows, 6, n] bf16 whose sums depend on the order of their float32
    additions, even in bf16: magnitudes 2^-6 to 2^6, and half the places with a large part
    and its negative in parts 0 and 1 (in order they cancel exactly; the other way round the
    small ones are rounded to the large one's precision first)."""
    p = mx.random.normal((rows, 6, n)) * mx.power(2.0, mx.random.randint(-6, 6, (rows, 6, n)).astype(mx.float32))
    big = mx.where(mx.random.uniform(shape=(rows, n)) < 0.5, 2.0**18, 0.0)
    return mx.concatenate([(p[:, 0] + big)[:, None], (p[:, 1] - big)[:, None], p[:, 2:]], axis=1).astype(mx.bfloat16)


def parts_problems(name: str, kernel, shape: tuple, n: int) -> list[str]:
    """fp8_gemv adding a MoE's routed parts [rows, 6, n] to its output as it writes it
    (parts=) against the same kernel's plain output through the spec, kernels.parts_added:
    the same bits, outputs poisoned; fed an FP8 input and a raw one it quantises; and, from
    3 rows on, a padded forward's (parts for the real rows, the padding zeros)."""
    problems = []
    x, raw = random_fp8_input(shape), raw_activation(shape)
    cases = [("", x, shape[0], {}), (", quantising its input", raw, shape[0], {"quantize_input": True})]
    if shape[0] > 2:
        cases.append((", 2 real rows", x, 2, {"real_rows": 2}))
    for what, v, real, kw in cases:
        parts = mixed_parts(real, n)
        problems += epilogue_problems(f"{name}, parts added{what}", kernel(v, parts=parts, init_value=POISON, **kw),
                                      parts_added(kernel(v, **kw), parts), "parts_added to its output")
    return problems


def epilogue_problems(label: str, got: mx.array, want: mx.array, spec: str) -> list[str]:
    """A kernel's output with an epilogue against its plain output through the epilogue's
    spec (want): [] where they are the same bits, else what differs."""
    if got.shape != want.shape:
        return [f"{label}: shape {got.shape}, the spec's {want.shape}"]
    differ = bits_differ(got, want)
    return [f"{label}: {differ} values differ from {spec}"] if differ else []


def swiglu_problems(name: str, kernel, x: mx.array, weights: mx.array | None, real: int | None) -> list[str]:
    """A GEMV kernel writing the SwiGLU of its outputs' pairs (swiglu=, each gate row followed
    by its up row) against the same kernel's plain output through the spec, kernels.swiglu_pairs:
    the same bits, outputs poisoned. Clamped at a limit that some of the outputs pass and at
    none (limit 0), fed an FP8 input and a raw one it quantises, and, where real is given, a
    padded forward's (the padding zeros either way)."""
    problems = []
    plain = kernel(x)
    for limit in (float(mx.abs(plain.astype(mx.float32)).max().item()) / 4, 0.0):
        act = SwiGLU(limit, weights)
        cases = [("", x, {}), (", quantising its input", raw_activation(x.shape), {"quantize_input": True})]
        if real is not None:
            cases.append((f", {real} real rows", x, {"real_rows": real}))
        for what, v, kw in cases:
            problems += epilogue_problems(f"{name}, SwiGLU at limit {limit:g}{what}",
                                          kernel(v, swiglu=act, init_value=POISON, **kw),
                                          swiglu_pairs(kernel(v, **kw), act), "swiglu_pairs of its output")
    return problems


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


def check_fp4_experts(impl: str, seed: int) -> list[str]:
    """The routed-expert FP4 kernel against MLX's gather_qmm fed fp32, at the flash-shaped
    model's expert stacks (gate + up, down; target and DSpark) and a ragged one, 1..16 rows
    of distinct sorted experts, x per row and per slot, outputs poisoned before the launch:
    every value within the bound of another float32 summation order (`gemm_agreement`); a row
    alone the same bits as among others, at 8 rows and at 16; the first rows of longer inputs
    (rows=, a padded forward's arrays as they are, with and without the weighted SwiGLU) the
    bits of those rows alone."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    problems = []
    _, _, experts = quantised_gemm_shapes()
    for n_experts, d_in, d_out in sorted(experts) + [(5, 256, 96)]:
        w, s = random_words((n_experts, d_out, d_in // 8), fp4=True), random_scales((n_experts, d_out, d_in // 32))
        top = min(6, n_experts)
        for rows in (1, 2, 5, 8, 9, 16):
            picks = np.sort([rng.choice(n_experts, top, replace=False) for _ in range(rows)], axis=1)
            ids = mx.array(picks.astype(np.uint32))
            for per_slot in (False, True):
                x = random_fp8_input((rows, top if per_slot else 1, d_in))
                got = fp4_experts(x, w, s, ids, impl=impl, init_value=POISON)
                name = f"fp4_experts {n_experts}x{d_in}->{d_out} rows={rows} x per {'slot' if per_slot else 'row'}"
                problem, _ = against_fp32(name, got, mx.gather_qmm, x[:, :, None], w, s, rhs_indices=ids,
                                          transpose=True, mode="mxfp4")
                problems.extend([problem] if problem else [])
                if rows in (8, 16) and not mx.array_equal(fp4_experts(x[:1], w, s, ids[:1], impl=impl), got[:1]).item():
                    problems.append(f"{name}: row 0 alone differs from row 0 of {rows}")
                if rows in (8, 16):  # a padded forward's arrays as they are, its real rows computed (Fp4Stack.pairs)
                    xs = x if per_slot else x[:, 0]  # as the gate and up projection: x [S, K], a weighted SwiGLU
                    weights = mx.array(rng.random((rows, top)).astype(np.float32))
                    for real in (1, rows - 2):
                        act, act_real = (None, None) if per_slot else (SwiGLU(7.0, weights),
                                                                       SwiGLU(7.0, weights[:real]))
                        alone = fp4_experts(xs[:real], w, s, ids[:real], impl=impl, swiglu=act_real)
                        padded = fp4_experts(xs, w, s, ids, impl=impl, init_value=POISON, rows=real, swiglu=act)
                        if not mx.array_equal(alone, padded).item():
                            problems.append(f"{name}: {real} rows of {rows} (rows={real}) differ from those rows "
                                            f"alone")
                problems.extend(quantizing_problems(
                    name, lambda v, **kw: fp4_experts(v, w, s, ids[: v.shape[0]], impl=impl, **kw),
                    x.shape, rows in (8, 16)))
    return problems


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
        for rows in CHECK_ROWS:
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


def check_hc_split(impl: str, seed: int) -> list[str]:
    mx.random.seed(seed)
    problems = []
    hc, iters, eps = 4, 20, 1e-6
    for rows in (1, 8, 37, 300):
        mixes = mx.random.normal((rows, (2 + hc) * hc)) * 3
        scale, base = mx.random.normal((3,)), mx.random.normal(((2 + hc) * hc,))
        got = hc_split(mixes, scale, base, hc, iters, eps, impl)
        ref = hc_split_reference(mixes, scale, base, hc, iters, eps)
        for name, a, b in zip(("pre", "post", "comb"), got, ref):
            err = mx.abs(a - b).max().item()
            if not err <= 2e-6:
                problems.append(f"hc_split rows={rows} {name} off by {err:.3g}")
        sums = got[2].sum(axis=-2)  # the last pass normalised the columns
        if not mx.allclose(sums, mx.ones_like(sums), atol=1e-4).item():
            problems.append(f"hc_split rows={rows}: comb columns do not sum to 1")
    return problems


def check_moe_gate(impl: str, seed: int) -> list[str]:
    """The router kernel against its spec at the release's and the flash checkpoint's shapes.
    Its dot products are summed in another order, so the k-th and (k+1)-th experts may swap
    where their biased scores are within float32 noise: such rows are counted apart; every
    other row must pick the same experts, with weights within 1e-5 (relative)."""
    rng = np.random.default_rng(seed)
    problems = []
    for E, k, normalize in ((384, 6, True), (24, 6, True), (16, 3, False)):
        w = mx.array(rng.normal(0, 1 / np.sqrt(5120), (E, 5120)).astype(np.float32))
        bias = mx.array(rng.normal(0, 0.05, E).astype(np.float32))
        for rows in CHECK_ROWS:
            x = mx.array(rng.normal(0, 1, (rows, 5120)).astype(np.float32)).astype(mx.bfloat16)
            got_w, got_ids = moe_gate(x, w, bias, k, 1.0, 2.5, normalize, impl=impl)
            want_w, want_ids = moe_gate_reference(x, w, bias, k, 1.0, 2.5, normalize)
            logits = np.array(x.astype(mx.float32)) @ np.array(w).T
            biased = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20))))) + np.array(bias)
            edge = -np.sort(-biased, axis=-1)[:, k - 1: k + 1]  # the k-th and (k+1)-th biased scores
            for r in range(rows):
                if np.array_equal(np.array(got_ids[r]), np.array(want_ids[r])):
                    err = np.abs(np.array(got_w[r]) - np.array(want_w[r])) / np.abs(np.array(want_w[r]))
                    if not err.max() <= 1e-5:
                        problems.append(f"moe_gate E={E} k={k} rows={rows} row {r}: weights off by {err.max():.3g}")
                elif not edge[r, 0] - edge[r, 1] <= 1e-5 * abs(edge[r, 0]):
                    problems.append(f"moe_gate E={E} k={k} rows={rows} row {r}: other experts "
                                    f"{np.array(got_ids[r]).tolist()} vs {np.array(want_ids[r]).tolist()}")
            alone = moe_gate(x[-1:], w, bias, k, 1.0, 2.5, normalize, impl=impl)
            if not (mx.array_equal(alone[0], got_w[-1:]).item() and mx.array_equal(alone[1], got_ids[-1:]).item()):
                problems.append(f"moe_gate E={E} k={k} rows={rows}: the last row alone differs from the same row "
                                f"among {rows}")
    return problems


def hc_input_spec(h, pre_in, fn, scale, base, norm_w, iters, hc_norm_eps, eps, norm_eps, quantize_to):
    """What kernels.hc_input computes, by hyper.HyperConnection.sublayer_input's pure-MLX path."""
    from dsv41_mlx.models.hyper import hc_pre

    hf = h.reshape(h.shape[0], -1).astype(mx.float32)  # the stream projected to its mixes, RMS-scaled
    projected = (hf @ fn.T) * mx.rsqrt(mx.mean(hf * hf, axis=-1, keepdims=True) + hc_norm_eps)
    mixes = hc_split_reference(projected, scale, base, h.shape[1], iters, eps)
    x = rms_norm_reference(hc_pre(h, pre_in), norm_w, norm_eps)
    return (x, fp8_fake_quant_reference(x).astype(quantize_to), *mixes)


def hc_parameters(rng, hc: int, dim: int) -> tuple[mx.array, ...]:
    """A sub-layer's random hyper-connection parameters for the checks: its mix projection fn
    [(2 + hc) * hc, hc * dim], scale [3], base and the RMSNorm weight [dim], float32."""
    M = (2 + hc) * hc
    fn = mx.array(rng.normal(0, 1 / np.sqrt(hc * dim), (M, hc * dim)).astype(np.float32))
    scale = mx.array(rng.normal(0, 1, 3).astype(np.float32))
    base = mx.array(rng.normal(0, 1, M).astype(np.float32))
    norm_w = mx.array(rng.normal(1, 0.2, dim).astype(np.float32))
    return fn, scale, base, norm_w


def check_hc_input(impl: str, seed: int) -> list[str]:
    """The sub-layer input kernel against its spec at the release's shape (hc 4, dim 5120,
    20 Sinkhorn passes), rows 1..16. Its sums run in another order, so: x (bf16) within one
    bf16 step of the spec in every value and equal in at least 99% of them; the mixes within
    2e-5. These tolerances are set before any GPU run of the kernel. A row alone equals the
    same row among others."""
    return _check_sublayer_input(impl, seed, expanded=False)


def check_hc_post_input(impl: str, seed: int) -> list[str]:
    """hc_post_input (the stream expanded from the previous sub-layer's output inside the
    sub-layer input's first launch) against hyper.hc_post then hc_input's spec, as
    check_hc_input: the new stream h within one bf16 step of hc_post's in every value and equal
    in at least 99% of them (a multiply and an add may fuse differently); the rest against the
    spec of the kernel's own h, with check_hc_input's tolerances; a row alone equals the same
    row among others."""
    return _check_sublayer_input(impl, seed, expanded=True)


def _check_sublayer_input(impl: str, seed: int, expanded: bool) -> list[str]:
    from dsv41_mlx.models.hyper import HcMixes, hc_post

    rng = np.random.default_rng(seed)
    problems = []
    hc, dim, iters = 4, 5120, 20
    name = "hc_post_input" if expanded else "hc_input"
    fn, scale, base, norm_w = hc_parameters(rng, hc, dim)
    for rows in CHECK_ROWS:
        h = mx.array(rng.normal(0, 1, (rows, hc, dim)).astype(np.float32)).astype(mx.bfloat16)
        pre_in = mx.array(rng.uniform(0, 1, (rows, hc)).astype(np.float32))
        args = (fn, scale, base, norm_w, iters, 1e-6, 1e-6, 1e-6, mx.bfloat16 if rows % 2 else mx.float32)
        if expanded:  # h is the residual; the kernel makes the stream from it
            y = mx.array(rng.normal(0, 1, (rows, dim)).astype(np.float32)).astype(mx.bfloat16)
            post = mx.array(rng.uniform(0, 2, (rows, hc)).astype(np.float32))
            comb = mx.array(rng.uniform(0, 1, (rows, hc, hc)).astype(np.float32))
            inputs = (y, h, post, comb, pre_in)
            got_h, *got = hc_post_input(*inputs, *args, impl=impl)
            problem = bf16_step_problem(got_h, hc_post(y, h, HcMixes(pre_in, post, comb)))
            if problem:
                problems.append(f"{name} rows={rows} h: {problem}")
            want = hc_input_spec(got_h, pre_in, *args)
            alone = hc_post_input(*(a[-1:] for a in inputs), *args, impl=impl)[1:]
        else:
            got = hc_input(h, pre_in, *args, impl=impl)
            want = hc_input_spec(h, pre_in, *args)
            alone = hc_input(h[-1:], pre_in[-1:], *args, impl=impl)
        problems += sublayer_input_problems(f"{name} rows={rows}", got, want)
        if not all(mx.array_equal(a, b[-1:]).item() for a, b in zip(alone, got)):
            problems.append(f"{name} rows={rows}: the last row alone differs from the same row among {rows}")
    return problems


def sublayer_input_problems(label: str, got: tuple, want: tuple) -> list[str]:
    """A sub-layer input kernel's (x, xq, pre, post, comb) against hc_input_spec's: x within a
    bf16 step (equal in 99% of values), xq act_quant's bits of the kernel's own x, the mixes
    within 2e-5."""
    problems = []
    problem = bf16_step_problem(got[0], want[0])
    if problem:
        problems.append(f"{label} x: {problem}")
    differ = bits_differ(got[1], fp8_fake_quant_reference(got[0]).astype(want[1].dtype))
    if differ:
        problems.append(f"{label} xq: {differ} values differ from act_quant of its x")
    for part, a, b in zip(("pre", "post", "comb"), got[2:], want[2:]):
        err = mx.abs(a - b).max().item()
        if not err <= 2e-5:
            problems.append(f"{label} {part} off by {err:.3g}")
    return problems


def check_fp8_into_stream(impl: str, seed: int) -> list[str]:
    """kernels.fp8_into_stream (fp8_mma_hc) at the release's two shapes that take it, wo_b
    (8192 -> 5120, its input quantised in the kernel) and the shared expert's w2 (its inputs ->
    5120, the routed experts' parts added), rows 1..16 of a forward one row longer (the padding
    row's y zeros), against two launches of the other kernels on the same inputs: fp8_gemv's
    output y put into the stream by hc_post_input. The stream h the same bits (fp8_mma's y
    and hc_post_mix's arithmetic, hc_expand), so it meets the spec as those two do (checks
    fp8_gemv and hc_post_input; against hyper.hc_post of fp8_gemv_reference's y directly, a
    few values of h lie more than a bf16 step apart: where y's sum nearly cancels, the two
    orders of its float32 sums differ by many ulps, within fp8_gemv's bound). Then
    hc_input_from_parts of the kernel's mix parts against hc_input's spec of h, with
    check_hc_input's tolerances; a row alone equals the same row among others."""
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    problems = []
    args, hc, iters = flash_args(), 4, 20
    dim = args.hidden_size
    fn, scale, base, norm_w = hc_parameters(rng, hc, dim)
    for name, k, ap in (("wo_b", args.o_groups * args.o_lora_rank, 0), ("shared w2", args.moe_intermediate_size, 6)):
        w, s = random_words((dim, k // 4)), random_scales((dim, k // 32))
        for rows in CHECK_ROWS:
            S = min(rows + 1, kernels.DECODE_MAX_ROWS)
            x = raw_activation((S, k)) if ap == 0 else random_fp8_input((S, k))
            gemm = {"quantize_input": ap == 0, "real_rows": rows, "parts": mixed_parts(rows, dim) if ap else None}
            residual = mx.array(rng.normal(0, 1, (S, hc, dim)).astype(np.float32)).astype(mx.bfloat16)
            post = mx.array(rng.uniform(0, 2, (S, hc)).astype(np.float32))
            comb = mx.array(rng.uniform(0, 1, (S, hc, hc)).astype(np.float32))
            pre_in = mx.array(rng.uniform(0, 1, (S, hc)).astype(np.float32))
            hc_args = (scale, base, norm_w, iters, 1e-6, 1e-6, 1e-6, mx.bfloat16)
            onto = kernels.StreamOnto(residual, post, comb, fn)
            label = f"fp8_into_stream {name} rows={rows} of {S}"
            h, parts = kernels.fp8_into_stream(x, w, s, onto, impl=impl, **gemm)
            y = fp8_gemv(x, w, s, impl=impl, **gemm)
            want_h = kernels.hc_post_input(y, residual, post, comb, pre_in, fn, *hc_args, impl=impl)[0]
            differ = bits_differ(h, want_h)
            if differ:
                problems.append(f"{label}: {differ} values of h differ from fp8_gemv then hc_post_input's")
            got = kernels.hc_input_from_parts(h, parts, pre_in, *hc_args, impl=impl)
            problems += sublayer_input_problems(label, got, hc_input_spec(h, pre_in, fn, *hc_args))
            if rows > 1:
                r = rows - 1  # the last real row alone
                one = {**gemm, "real_rows": 1, "parts": None if ap == 0 else gemm["parts"][r:]}
                alone = kernels.fp8_into_stream(x[r:r + 1], w, s, kernels.StreamOnto(*(a[r:r + 1] for a in onto[:3]), fn),
                                                impl=impl, **one)
                if not (mx.array_equal(alone[0], h[r:r + 1]).item() and mx.array_equal(alone[1], parts[r:r + 1]).item()):
                    problems.append(f"{label}: the last real row alone differs from the same row among {S}")
    return problems

def sparse_attention_spec(q, ring, index, window_mask, kv, ids, picked_mask, sink, scale, rope, rope_dims,
                          real_rows=None):
    """What kernels.sparse_attention_rows computes, by attention.Attention's pure-MLX path: q
    ([S, H, D], or [S, H * D] with H from sink) rotated, the attention over gathered keys, its
    output rotated back (rope: Rope.tables, which say themselves which features rotate;
    rope_dims is the kernel's copy of that); rows from real_rows on (a padded forward's
    padding) zeros."""
    from dsv41_mlx.models.layers import Rope
    from dsv41_mlx.models.attention import sparse_attention

    q = q.reshape(q.shape[0], sink.shape[0], -1)
    picked = None if ids is None else kv[ids]
    o = sparse_attention(Rope.apply(q, rope), ring[index], window_mask, picked, picked_mask, sink, scale)
    return padding_zeroed(Rope.apply(o, rope, inverse=True), real_rows)


def release_ropes() -> tuple:
    """The flash-shaped (release) model's attention RoPEs as attention.Attention picks them:
    (a compressed layer's, YaRN; a window-only layer's, plain)."""
    from dsv41_mlx.models.attention import Attention

    args = flash_args()
    ratios = args.compress_ratios[: args.num_hidden_layers]
    compressed, window_only = next(i for i, r in enumerate(ratios) if r), ratios.index(0)
    return Attention(args, compressed).rope, Attention(args, window_only).rope  # lazy zero weights: no memory


def attention_rows(args: tuple, rows: slice) -> tuple:
    """sparse_attention_rows' arguments (as check_sparse_attention passes them) for some of
    the rows: q, index, the masks, ids and the RoPE tables are per row."""
    q, ring, index, wmask, kv, ids, pmask, sink, scale, rope, rope_dims = args
    rope = tuple(t[rows] for t in rope[:6]) + rope[6:]  # the rotated-feature mask is not per row
    return (q[rows], ring, index[rows], wmask[rows], kv, None if ids is None else ids[rows],
            None if pmask is None else pmask[rows], sink, scale, rope, rope_dims)


@contextlib.contextmanager
def attention_warps(impl: str, warps: int):
    """Inside: the attention kernel runs `warps` simdgroups a threadgroup on impl, and
    kernels.ATTENTION_HEADS_PER_GROUP heads, at every row count (no one-row layout)."""
    saved, one_row = kernels.ATTENTION_WARPS, kernels.ATTENTION_ONE_ROW
    kernels.ATTENTION_WARPS = {**saved, impl: warps}
    kernels.ATTENTION_ONE_ROW = {k: v for k, v in one_row.items() if k != impl}
    try:
        yield
    finally:
        kernels.ATTENTION_WARPS, kernels.ATTENTION_ONE_ROW = saved, one_row


def check_sparse_attention(impl: str, seed: int) -> list[str]:
    """The attention kernel against its spec at the release's shape (64 heads x 512, a
    128-key window, 512 picks or none; the last 64 features rotated, by the compressed
    layers' YaRN RoPE where there are picks, by the window-only layers' plain one where
    not), rows 1..16 at random positions, with masked window slots and picks, a row whose
    window is all masked and one with no visible key at all. Its sums run in another order
    (and a probability may round to the other bf16 neighbour), so: each row-head within 1%
    of its largest value, and on average within 0.1%. These tolerances are set before any
    GPU run of the kernel. A row alone equals the same row among others; q as wq_b gives it,
    [S, H * D], the bits of [S, H, D]; at 8 simdgroups a threadgroup (kernels.ATTENTION_WARPS),
    the bits of the backend's own count."""
    rng = np.random.default_rng(seed)
    problems = []
    H, D, W, K, R, T = 64, 512, 128, 512, 160, 700
    ropes = dict(zip((K, 0), release_ropes()))  # by the picks: compressed layers have them
    ring = mx.array(rng.normal(0, 1, (R, D)).astype(np.float32)).astype(mx.bfloat16)
    kv = mx.array(rng.normal(0, 1, (T, D)).astype(np.float32)).astype(mx.bfloat16)
    sink = mx.array(rng.normal(0, 1, H).astype(np.float32))
    for picks in (K, 0):
        for rows in CHECK_ROWS:
            q = mx.array(rng.normal(0, 1, (rows, H, D)).astype(np.float32)).astype(mx.bfloat16)
            index = mx.array(rng.integers(0, R, (rows, W)).astype(np.int32))
            wmask = rng.random((rows, W)) < 0.9
            if rows > 1:
                wmask[1] = False  # a row that sees no window key
            ids = mx.array(rng.integers(0, T, (rows, picks)).astype(np.uint32)) if picks else None
            pmask = rng.random((rows, picks)) < 0.7
            if rows > 2:
                wmask[2], pmask[2] = False, False  # a row that sees no key at all: zeros
            rope = ropes[picks].tables(mx.array(rng.integers(0, 1 << 20, rows).astype(np.int32)), D)
            args = (q, ring, index, mx.array(wmask), kv if picks else None, ids,
                    mx.array(pmask) if picks else None, sink, D ** -0.5, rope, ropes[picks].dims)
            got = np.array(sparse_attention_rows(*args, impl=impl).astype(mx.float32))
            want = np.array(sparse_attention_spec(*args).astype(mx.float32))
            scale_rh = np.abs(want).max(axis=-1, keepdims=True) + 1e-30
            worst = (np.abs(got - want) / scale_rh).max()
            mean = np.abs(got - want).mean() / (np.abs(want).mean() + 1e-30)
            if not (worst <= 1e-2 and mean <= 1e-3):
                problems.append(f"sparse_attention picks={picks} rows={rows}: off by {worst:.3g} of a row's "
                                f"largest value, {mean:.3g} on average")
            alone = sparse_attention_rows(*attention_rows(args, slice(-1, None)), impl=impl)
            if not np.array_equal(np.array(alone.astype(mx.float32)), got[-1:]):
                problems.append(f"sparse_attention picks={picks} rows={rows}: the last row alone differs")
            flat = sparse_attention_rows(q.reshape(rows, -1), *args[1:], impl=impl)  # as wq_b gives q: [S, H * D]
            if not np.array_equal(np.array(flat.astype(mx.float32)), got):
                problems.append(f"sparse_attention picks={picks} rows={rows}: q as [S, H * D] differs from [S, H, D]")
            with attention_warps(impl, 8):
                eight = sparse_attention_rows(*args, impl=impl)
            if not np.array_equal(np.array(eight.astype(mx.float32)), got):
                problems.append(f"sparse_attention picks={picks} rows={rows}: 8 simdgroups a threadgroup differ "
                                f"from {kernels.ATTENTION_WARPS.get(impl)}")
            if rows in (8, 16):  # a padded forward: its real rows the same bits, the padding zeros
                for real in (1, rows - 2):
                    padded = np.array(sparse_attention_rows(*args, real, impl=impl).astype(mx.float32))
                    if not (np.array_equal(padded[:real], got[:real]) and not padded[real:].any()):
                        problems.append(f"sparse_attention picks={picks} rows={rows}: with {real} real rows, "
                                        f"not the same real rows and zeros after them")
    return problems


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
        for rows in CHECK_ROWS:
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


def main() -> int:
    impl = backend()
    if impl == "mlx":
        print("no GPU backend here (Metal or CUDA): nothing to check")
        return 1
    global CHECK_ROWS
    only = [a for a in sys.argv[1:] if not a.startswith("--rows=")]
    for a in sys.argv[1:]:
        if a.startswith("--rows="):  # e.g. --rows=1,6: a decode step's and a verify step's, each kernel
            CHECK_ROWS = tuple(int(r) for r in a.split("=", 1)[1].split(","))  # build fewer (NVRTC's minutes)
    print(f"checking the {impl} kernels against the pure-MLX spec at {', '.join(map(str, CHECK_ROWS))} rows")

    def wanted(name):
        return not only or any(name.startswith(prefix) for prefix in only)

    failures = 0
    for n, k in [(129280, 5120), (8192 + 96, 128)] if wanted("fp8_rows") else []:
        for rows in CHECK_ROWS:
            problems = check_fp8_rows(n, k, rows, impl, seed=rows * 7 + k)
            failures += bool(problems)
            print(f"fp8_rows N={n} K={k} rows={rows}: {'ok' if not problems else '; '.join(problems[:3])}")
    checks = [("ring_write", check_ring_write, 3), ("act_quant", check_act_quant, 9),
              ("fp4_quant", check_fp4_quant, 29)]
    if impl == "cuda":
        checks.append(("quantised GEMMs, bf16-fed vs fp32-fed", check_gemms_bf16, 11))
    checks += [("fp8_gemv", check_fp8_gemv, 31), ("fp8_gemv_pair", check_fp8_gemv_pair, 59), ("fp4_experts", check_fp4_experts, 37),
               ("gemv_epilogues", check_gemv_epilogues, 47), ("head_logits", check_head_logits, 53),
               ("hc_split", check_hc_split, 5), ("rms_norm", check_rms_norm, 23),
               ("rms_norm_rope", check_rms_norm_rope, 43), ("rms_norm_pair", check_rms_norm_pair, 61),
               ("hc_input", check_hc_input, 17),
               ("hc_post_input", check_hc_post_input, 41),
               ("fp8_into_stream", check_fp8_into_stream, 67),
               ("sparse_attention", check_sparse_attention, 19), ("moe_gate", check_moe_gate, 13)]
    for name, check, seed in [c for c in checks if wanted(c[0])]:
        problems, notes = (check(seed=seed) if check is check_gemms_bf16 else (check(impl, seed=seed), []))
        failures += bool(problems)
        print(f"{name}: {'ok' if not problems else '; '.join(problems[:5])}")
        for note in notes:
            print(f"  {note}")
    print("ALL OK" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
