"""Codecs in dsv41_mlx.quant against float64 numpy references built here from the bit layouts."""

import contextlib
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from dsv41_mlx.quant import (
    e2m1_round,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    fp4_decode,
    fp4_fake_quant,
    fp4_rows_to_mx,
    fp8_fake_quant,
    pow2_ceil_scale,
    quantize_fp4_rows,
    quantize_fp8_tiles,
)
from dsv41_mlx.kernels import tuning
from dsv41_mlx.kernels.specs import fp8_tiles_to_mx

# ------------------------------------------------------------------ references


def _e4m3_table() -> np.ndarray:
    """All 256 E4M3 (fn) codes -> float64: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    out = np.empty(256)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if (b & 0x7F) == 0x7F:
            out[b] = np.nan
        elif e == 0:
            out[b] = sign * (m / 8) * 2.0**-6
        else:
            out[b] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return out


E4M3 = _e4m3_table()
E4M3_POS = E4M3[:0x7F]  # codes 0..126: +0 .. 448, increasing with the code
E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1 = np.concatenate([E2M1_POS, -E2M1_POS])  # nibble -> value (8 = -0)


def _rne_codes(x, grid: np.ndarray) -> np.ndarray:
    """|x| -> index into the increasing grid of magnitudes: nearest, ties to the even index,
    saturating at the top (the codes of a sign-magnitude format are these indices)."""
    mag = np.minimum(np.abs(np.asarray(x, np.float64)), grid[-1])
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def ref_e4m3(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.copysign(E4M3_POS[_rne_codes(x, E4M3_POS)], x)


def ref_e4m3_codes(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (_rne_codes(x, E4M3_POS) | (np.signbit(x) << 7)).astype(np.uint8)


def ref_e2m1(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.copysign(E2M1_POS[_rne_codes(x, E2M1_POS)], x)


def ceil_log2(r) -> np.ndarray:
    """Exact ceil(log2(r)) for positive float64 r."""
    m, e = np.frexp(np.asarray(r, np.float64))  # r = m * 2**e, m in [0.5, 1)
    return np.where(m == 0.5, e - 1, e)


def ref_fp8_fake_quant(x: np.ndarray, block: int = 32) -> np.ndarray:
    g = np.asarray(x, np.float64).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 1e-4)
    s = 2.0 ** ceil_log2(amax / 448)
    return (ref_e4m3(g / s) * s).reshape(x.shape)


def ref_fp4_fake_quant(x: np.ndarray, block: int, scale_format: str) -> np.ndarray:
    g = np.asarray(x, np.float64).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(g).max(-1, keepdims=True)
    if scale_format == "e8m0":
        s = 2.0 ** ceil_log2(np.maximum(amax, 6 * 2.0**-126) / 6)
    else:
        s = ref_e4m3(np.maximum(amax, 6 * 2.0**-9) / 6)
    return (ref_e2m1(np.clip(g / s, -6, 6)) * s).reshape(x.shape)


def wide_range(rng, shape, lo=-8, hi=5) -> np.ndarray:
    """Normal values times a per-element power of ten in [10**lo, 10**hi]: large dynamic range."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(lo, hi, shape)).astype(np.float32)


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# ------------------------------------------------------------ sanity of the refs


def test_reference_e4m3_table_layout():
    assert np.isnan(E4M3[0x7F]) and np.isnan(E4M3[0xFF])
    assert np.isnan(E4M3).sum() == 2
    assert E4M3[0x7E] == 448 and E4M3[0xFE] == -448
    assert E4M3[0x01] == 2.0**-9 and E4M3[0x08] == 2.0**-6 and E4M3[0x38] == 1.0
    assert np.all(np.diff(E4M3_POS) > 0)
    assert np.signbit(E4M3[0x80]) and E4M3[0x80] == 0


# ------------------------------------------------------------------ E4M3 / E8M0


def test_e4m3_decode_all_codes():
    got = e4m3_decode(np.arange(256, dtype=np.uint8))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, E4M3.astype(np.float32))  # NaN == NaN here
    assert np.array_equal(np.signbit(got[:0x7F]), np.zeros(0x7F, bool))
    assert np.all(np.signbit(got[0x80:0xFF]))


def test_e4m3_encode_exact_values_midpoints_and_saturation():
    exact = E4M3_POS.astype(np.float32)
    np.testing.assert_array_equal(e4m3_encode(exact), np.arange(0x7F, dtype=np.uint8))
    np.testing.assert_array_equal(e4m3_encode(-exact[1:]), np.arange(0x81, 0xFF, dtype=np.uint8))
    # every midpoint between neighbours is a tie: the even code wins
    mids = ((E4M3_POS[:-1] + E4M3_POS[1:]) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (E4M3_POS[:-1] + E4M3_POS[1:]) / 2)  # exact in f32
    codes = e4m3_encode(mids)
    lo = np.arange(0x7E)
    np.testing.assert_array_equal(codes, np.where(lo % 2 == 0, lo, lo + 1).astype(np.uint8))
    np.testing.assert_array_equal(e4m3_encode(-mids), codes | 0x80)
    # just off the midpoints: nearest
    up = np.nextafter(mids, np.float32(np.inf))
    np.testing.assert_array_equal(e4m3_encode(up), (lo + 1).astype(np.uint8))
    # saturation at +-448 instead of overflow to NaN
    big = np.array([449, 464, 465, 1000, 3.0e38, np.inf], np.float32)
    np.testing.assert_array_equal(e4m3_encode(big), np.full(6, 0x7E, np.uint8))
    np.testing.assert_array_equal(e4m3_encode(-big), np.full(6, 0xFE, np.uint8))
    # random values against the reference, including subnormals
    rng = np.random.default_rng(1)
    x = wide_range(rng, (4096,), lo=-5, hi=3)
    np.testing.assert_array_equal(e4m3_encode(x), ref_e4m3_codes(x))


def test_e8m0_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = e8m0_decode(codes)
    assert got.dtype == np.float32
    assert np.isnan(got[255])
    np.testing.assert_array_equal(got[:255].astype(np.float64), 2.0 ** (np.arange(255) - 127.0))
    assert e8m0_decode(np.array([[127, 128], [126, 1]], np.uint8)).tolist() == [[1.0, 2.0], [0.5, 2.0**-126]]


# ------------------------------------------------------------- pow2 ceil scale


def test_pow2_ceil_scale_matches_exact_ceil_log2():
    rng = np.random.default_rng(2)
    amax = np.abs(wide_range(rng, (2000,), lo=-20, hi=20)) + np.float32(1e-30)
    # boundaries: exact multiples of 448 * 2**k and their float32 neighbours
    k = np.arange(-30, 30, dtype=np.float64)
    edge = (448.0 * 2.0**k).astype(np.float32)
    amax = np.concatenate([amax, edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(np.inf))])
    got = _np(pow2_ceil_scale(mx.array(amax), 448.0)).astype(np.float64)
    np.testing.assert_array_equal(got, 2.0 ** ceil_log2(amax.astype(np.float64) / 448))
    edge6 = (6.0 * 2.0**k).astype(np.float32)
    a6 = np.concatenate([edge6, np.nextafter(edge6, np.float32(0)), np.nextafter(edge6, np.float32(np.inf))])
    got6 = _np(pow2_ceil_scale(mx.array(a6), 6.0)).astype(np.float64)
    np.testing.assert_array_equal(got6, 2.0 ** ceil_log2(a6.astype(np.float64) / 6))


# ------------------------------------------------------------ fp8 fake quant


def _fp8_inputs() -> np.ndarray:
    rng = np.random.default_rng(3)
    x = wide_range(rng, (6, 20, 128))  # per-element magnitudes 1e-8 .. 1e5
    # whole blocks of one magnitude, from below the 1e-4 floor to large
    for i, scale in enumerate([1e-7, 1e-5, 3e-4, 1.0, 300.0, 7e4]):
        x[i, 0, 32:64] = (rng.standard_normal(32) * scale).astype(np.float32)
    x[0, 1, :32] = 0.0  # all-zero block
    # a block with amax exactly 448 (scale 1) holding E4M3 ties: 2**-10 -> 0, 3*2**-10 -> 2**-8,
    # 17 -> 16, 19 -> 20, 232 -> 224 (even code), 240 -> 240, 464 can not occur
    ties = [448, 2.0**-10, 3 * 2.0**-10, 17, 19, 232, -17, -19, 0.1, -0.0]
    x[0, 2, :32] = 0.01
    x[0, 2, : len(ties)] = ties
    # block amax a hair above 448 -> scale 2
    x[0, 3, :32] = 1.0
    x[0, 3, 0] = np.nextafter(np.float32(448), np.float32(1e9))
    # block amax exactly 448 * 2**-20
    x[0, 4, :32] = 2.0**-21
    x[0, 4, 5] = 448 * 2.0**-20
    return x


def test_fp8_fake_quant_matches_reference_f32():
    x = _fp8_inputs()
    ref = ref_fp8_fake_quant(x)
    y = fp8_fake_quant(mx.array(x))
    assert y.dtype == mx.float32 and y.shape == x.shape
    got = _np(y)
    np.testing.assert_array_equal(got.astype(np.float64), ref)
    # the tie block, spelled out
    np.testing.assert_array_equal(got[0, 2, :9], [448, 0, 2.0**-8, 16, 20, 224, -16, -20, 0.1015625])
    assert got[0, 3, 0] == 448 and got[0, 3, 1] == 1.0  # scale 2: 448.00003/2 -> 224 * 2
    assert got[0, 1, :32].tolist() == [0.0] * 32


def test_fp8_fake_quant_bf16_input_keeps_dtype():
    rng = np.random.default_rng(4)
    xb = mx.array(wide_range(rng, (3, 256), lo=-3, hi=3)).astype(mx.bfloat16)
    x = _np(xb)  # the exact bf16 values
    y = fp8_fake_quant(xb)
    assert y.dtype == mx.bfloat16
    np.testing.assert_array_equal(_np(y).astype(np.float64), ref_fp8_fake_quant(x))


def test_fp8_fake_quant_other_block_size():
    rng = np.random.default_rng(5)
    x = wide_range(rng, (4, 128), lo=-4, hi=2)
    got = _np(fp8_fake_quant(mx.array(x), block=64))
    np.testing.assert_array_equal(got.astype(np.float64), ref_fp8_fake_quant(x, block=64))
    assert not np.array_equal(got, _np(fp8_fake_quant(mx.array(x))))  # block size matters


# -------------------------------------------------------------------- E2M1


def test_e2m1_round_exact_ties_and_signs():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    got = _np(e2m1_round(mx.array(ties, dtype=mx.float32)))
    assert got.tolist() == want
    got_neg = _np(e2m1_round(mx.array([-t for t in ties], dtype=mx.float32)))
    assert got_neg.tolist() == [-w for w in want]
    # off the ties
    eps = 1e-6
    assert _np(e2m1_round(mx.array([0.25 + eps, 1.25 + eps, 2.5 + eps, 5 + eps, 0.75 - eps, 3.5 - eps]))).tolist() \
        == [0.5, 1.5, 3.0, 6.0, 0.5, 3.0]
    # grid values map to themselves; beyond 6 -> 6
    grid = np.concatenate([E2M1_POS, -E2M1_POS[1:]]).astype(np.float32)
    assert _np(e2m1_round(mx.array(grid))).tolist() == grid.tolist()
    assert _np(e2m1_round(mx.array([6.0, 7.9, -7.9]))).tolist() == [6.0, 6.0, -6.0]
    # the sign of zero is kept
    z = _np(e2m1_round(mx.array([-0.1, -0.0, 0.1, 0.0])))
    assert z.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert np.signbit(z).tolist() == [True, True, False, False]


def test_e2m1_round_random_matches_reference():
    rng = np.random.default_rng(6)
    v = rng.uniform(-6, 6, 20000).astype(np.float32)
    np.testing.assert_array_equal(_np(e2m1_round(mx.array(v))).astype(np.float64), ref_e2m1(v))


# ------------------------------------------------------------ fp4 fake quant


def _fp4_inputs(block: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = wide_range(rng, (5, 16, 64))
    for i, scale in enumerate([1e-30, 1e-6, 1e-3, 1.0, 5e4]):
        x[i, 0, :block] = (rng.standard_normal(block) * scale).astype(np.float32)
    x[0, 1, :block] = 0.0
    # amax exactly 6 * 2**k: scale 2**k, ties of E2M1 land exactly
    x[0, 2, :block] = 0.0
    x[0, 2, :8] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x[0, 2, :8] *= 2.0**-3
    return x


def test_fp4_fake_quant_e8m0_matches_reference():
    x = _fp4_inputs(32)
    y = fp4_fake_quant(mx.array(x), block=32, scale_format="e8m0")
    assert y.dtype == mx.float32
    got = _np(y)
    np.testing.assert_array_equal(got.astype(np.float64), ref_fp4_fake_quant(x, 32, "e8m0"))
    assert (got[0, 2, :8] * 8).tolist() == [6, 0, 1, 1, 2, 2, 4, 4]
    # scales are powers of two: every output is an E2M1 value times 2**k
    nz = np.abs(got[got != 0]).astype(np.float64)
    mant = nz / 2.0 ** np.floor(np.log2(nz))
    assert np.all(np.isin(mant, [1.0, 1.5]))


def test_fp4_fake_quant_e4m3_matches_reference():
    x = _fp4_inputs(16)
    x[1, 1, :16] = (np.arange(16) - 8) * 1000.0  # amax 8000: amax/6 > 448 saturates the scale
    x[2, 1, :16] = 2.0**-12  # below the floor 6 * 2**-9
    y = fp4_fake_quant(mx.array(x), block=16, scale_format="e4m3")
    got = _np(y)
    np.testing.assert_array_equal(got.astype(np.float64), ref_fp4_fake_quant(x, 16, "e4m3"))
    assert got[1, 1, 0] == -6 * 448  # clipped at 6 * (saturated scale 448)
    assert got[2, 1, :16].tolist() == [0.0] * 16  # 2**-12 / 2**-9 = 0.125 -> 0


def test_fp4_fake_quant_scale_formats_differ_and_bad_format():
    rng = np.random.default_rng(8)
    x = mx.array(rng.standard_normal((4, 64)).astype(np.float32))
    a = _np(fp4_fake_quant(x, block=16, scale_format="e8m0"))
    b = _np(fp4_fake_quant(x, block=16, scale_format="e4m3"))
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError):
        fp4_fake_quant(x, scale_format="ue4m3")


# ------------------------------------------------------------ weight codecs


def _e4m3_step(q: np.ndarray) -> np.ndarray:
    """Spacing of the E4M3 grid in the binade of |q| (subnormal spacing below 2**-6)."""
    mag = np.abs(q.astype(np.float64))
    e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    return 2.0 ** (np.maximum(e, -6) - 3)


@pytest.mark.parametrize("shape", [(64, 128), (70, 96), (33, 40)])
def test_quantize_fp8_tiles_round_trip(shape):
    rng = np.random.default_rng(9)
    w = wide_range(rng, shape, lo=-6, hi=3)
    w[:32, :32] *= 1e-3  # tiles of different magnitude
    codes, scales = quantize_fp8_tiles(w)
    to, ti = -(-shape[0] // 32), -(-shape[1] // 32)
    assert codes.dtype == np.uint8 and codes.shape == shape
    assert scales.dtype == np.uint8 and scales.shape == (to, ti)
    # scale: 2**ceil(log2(amax/448)) of each tile
    pad = np.zeros((to * 32, ti * 32))
    pad[: shape[0], : shape[1]] = w
    amax = np.abs(pad.reshape(to, 32, ti, 32)).max(axis=(1, 3))
    np.testing.assert_array_equal(scales.astype(np.int64) - 127, ceil_log2(amax / 448))
    # decode: codes x tile scale
    tile_scale = np.repeat(np.repeat(e8m0_decode(scales), 32, 0), 32, 1)[: shape[0], : shape[1]]
    deq = e4m3_decode(codes).astype(np.float64) * tile_scale
    q = w.astype(np.float64) / tile_scale
    assert np.all(np.abs(deq - w) <= 0.5 * _e4m3_step(q) * tile_scale)
    # and exactly the round-to-nearest-even value
    np.testing.assert_array_equal(codes, ref_e4m3_codes(q))
    np.testing.assert_array_equal(deq, ref_e4m3(q) * tile_scale)


def test_quantize_fp8_tiles_zero_tile():
    w = np.zeros((32, 64), np.float32)
    w[:, 32:] = 1.0
    codes, scales = quantize_fp8_tiles(w)
    assert not codes[:, :32].any()
    np.testing.assert_array_equal(e4m3_decode(codes[:, 32:]) * e8m0_decode(scales[0, 1]), 1.0)


def test_quantize_fp4_rows_round_trip():
    rng = np.random.default_rng(10)
    w = wide_range(rng, (48, 128), lo=-5, hi=3)
    w[3] = 0.0
    packed, scales = quantize_fp4_rows(w)
    assert packed.dtype == np.int8 and packed.shape == (48, 64)
    assert scales.dtype == np.uint8 and scales.shape == (48, 4)
    g = w.astype(np.float64).reshape(48, 4, 32)
    amax = np.maximum(np.abs(g).max(-1), 1e-30)
    np.testing.assert_array_equal(scales.astype(np.int64) - 127, ceil_log2(amax / 6))
    s = e8m0_decode(scales).astype(np.float64)[..., None]
    deq = (fp4_decode(packed).astype(np.float64).reshape(48, 4, 32) * s)
    np.testing.assert_array_equal(deq, ref_e2m1(g / s) * s)
    assert not deq[3].any()


def test_fp4_nibble_order_and_codes():
    w = np.zeros((1, 32), np.float32)
    w[0, :8] = [0.5, 6.0, -1.0, 0.0, 1.5, -6.0, 3.0, 2.0]  # amax 6 -> scale 1
    packed, scales = quantize_fp4_rows(w)
    assert scales.tolist() == [[127]]
    b = packed.view(np.uint8)[0]
    # byte j: input 2j in the low nibble, input 2j+1 in the high nibble
    assert b[:4].tolist() == [0x71, 0x0A, 0xF3, 0x45]
    assert not b[4:].any()
    np.testing.assert_array_equal(fp4_decode(packed)[0, :8], w[0, :8])
    # decoding every byte value
    allb = np.arange(256, dtype=np.uint8).reshape(1, 256)
    dec = fp4_decode(allb.view(np.int8))
    assert dec.shape == (1, 512)
    np.testing.assert_array_equal(dec[0, 0::2], E2M1[np.arange(256) & 0xF])
    np.testing.assert_array_equal(dec[0, 1::2], E2M1[np.arange(256) >> 4])
    # 3-D input keeps its leading axes
    assert fp4_decode(np.zeros((2, 3, 4), np.uint8)).shape == (2, 3, 8)


# --------------------------------------------------------- MLX layouts


@pytest.mark.parametrize("out_dim", [64, 70])
def test_fp8_tiles_to_mx_matches_mx_dequantize(out_dim):
    rng = np.random.default_rng(11)
    in_dim = 96
    codes = rng.integers(0, 256, (out_dim, in_dim), dtype=np.uint8)
    codes[codes & 0x7F == 0x7F] = 0x3C  # no NaN codes
    tiles = rng.integers(1, 240, (-(-out_dim // 32), in_dim // 32), dtype=np.uint8)
    w, s = fp8_tiles_to_mx(mx.array(codes), mx.array(tiles))
    assert w.dtype == mx.uint32 and w.shape == (out_dim, in_dim // 4)
    assert s.dtype == mx.uint8 and s.shape == (out_dim, in_dim // 32)
    got = _np(mx.dequantize(w, s, mode="mxfp8", dtype=mx.float32))
    scale = 2.0 ** (np.repeat(np.repeat(tiles.astype(np.float64), 32, 0), 32, 1)[:out_dim] - 127)
    ref = (E4M3[codes] * scale).astype(np.float32)
    np.testing.assert_array_equal(got, ref)


def test_fp8_release_weight_through_mx_dequantize():
    rng = np.random.default_rng(12)
    w = wide_range(rng, (96, 64), lo=-3, hi=2)
    codes, tiles = quantize_fp8_tiles(w)
    wq, s = fp8_tiles_to_mx(mx.array(codes), mx.array(tiles))
    got = _np(mx.dequantize(wq, s, mode="mxfp8", dtype=mx.float32))
    tile_scale = np.repeat(np.repeat(e8m0_decode(tiles), 32, 0), 32, 1)
    np.testing.assert_array_equal(got, e4m3_decode(codes) * tile_scale)


def test_fp4_rows_to_mx_matches_mx_dequantize():
    rng = np.random.default_rng(13)
    n_exp, out_dim, in_dim = 3, 40, 128
    packed = rng.integers(-128, 128, (n_exp, out_dim, in_dim // 2), dtype=np.int8)
    scales = rng.integers(1, 250, (n_exp, out_dim, in_dim // 32), dtype=np.uint8)
    w = fp4_rows_to_mx(mx.array(packed))
    assert w.dtype == mx.uint32 and w.shape == (n_exp, out_dim, in_dim // 8)
    got = _np(mx.dequantize(w, mx.array(scales), mode="mxfp4", dtype=mx.float32))
    b = packed.view(np.uint8).astype(np.int64)
    vals = np.stack([E2M1[b & 0xF], E2M1[b >> 4]], -1).reshape(n_exp, out_dim, in_dim)
    ref = (vals * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, -1)).astype(np.float32)
    np.testing.assert_array_equal(got, ref)
    # one expert alone (2-D) gives the same words
    np.testing.assert_array_equal(np.array(fp4_rows_to_mx(mx.array(packed[1]))), np.array(w[1]))


def test_fp4_release_weight_through_mx_dequantize():
    rng = np.random.default_rng(14)
    w = wide_range(rng, (32, 96), lo=-3, hi=2)
    packed, scales = quantize_fp4_rows(w)
    got = _np(mx.dequantize(fp4_rows_to_mx(mx.array(packed)), mx.array(scales), mode="mxfp4", dtype=mx.float32))
    np.testing.assert_array_equal(got, fp4_decode(packed) * np.repeat(e8m0_decode(scales), 32, -1))


def test_fp8_matmul_takes_the_gemv_kernel_for_a_decode_steps_rows_on_a_gpu(monkeypatch):
    """On a GPU, an FP8 GEMM of up to 16 rows (a decode or verify step) runs kernels.fp8_gemv
    in its dense form (x [S, K], w [N, K/4]: no reshapes around it), told how many rows are
    real where the caller says (the rest come out zeros), and given a SwiGLU's w13 it writes
    their swiglu_pairs itself; more rows, or a shape the kernel does not take, keep MLX's
    GEMM (then swiglu_pairs). The array its launch is to wait for (after) is handed on."""
    from dsv41_mlx import kernels, quant

    calls, waits = [], []

    def gemv(x, w, s, impl=None, init_value=None, real_rows=None, swiglu=None, parts=None, after=None):
        calls.append((x.shape, w.shape))
        waits.append(after)
        return kernels.fp8_gemv_reference(x, w, s, real_rows=real_rows, swiglu=swiglu, parts=parts)

    monkeypatch.setattr(kernels, "fp8_gemv", gemv)
    mx.random.seed(4)
    with kernels.dispatching("cuda"):
        w = (mx.random.randint(0, 2**31, (96, 64)).astype(mx.uint32) & 0x3F3F3F3F)  # 96 outputs x 256 inputs
        s = mx.random.randint(118, 124, (96, 8)).astype(mx.uint8)
        x = mx.random.normal((17, 256))
        for rows, kernel in ((1, True), (8, True), (16, True), (17, False)):
            calls.clear()
            got = quant.fp8_matmul(x[:rows], w, s)
            assert calls == ([((rows, 256), (96, 64))] if kernel else [])
            want = mx.quantized_matmul(x[:rows], w, s, transpose=True, mode="mxfp8").astype(mx.bfloat16)
            assert got.shape == (rows, 96) and mx.array_equal(got, want).item()
        marker = mx.zeros((8, 6), dtype=mx.uint32)
        quant.Fp8Linear(256, 96).quantized(x[:1], after=marker)
        assert waits[-1] is marker and not any(a is not None for a in waits[:-1])
        calls.clear()
        got = quant.fp8_matmul(x[:8], w, s, real=3)  # a padded forward's 3 real rows of 8
        want = mx.quantized_matmul(x[:3], w, s, transpose=True, mode="mxfp8").astype(mx.bfloat16)
        assert mx.array_equal(got[:3], want).item() and not got[3:].any().item()
        act = kernels.SwiGLU(1.5)  # w's rows as a gate projection's 48 and an up projection's 48
        for rows, kernel in ((1, True), (16, True), (17, False)):
            calls.clear()
            got = quant.fp8_matmul(x[:rows], w, s, swiglu=act)
            assert calls == ([((rows, 256), (96, 64))] if kernel else [])
            want = mx.quantized_matmul(x[:rows], w, s, transpose=True, mode="mxfp8").astype(mx.bfloat16)
            assert got.shape == (rows, 48) and mx.array_equal(got, kernels.swiglu_pairs(want, act)).item()
        calls.clear()
        quant.fp8_matmul(mx.random.normal((8, 128)), w[:, :32], s[:, :4])  # K = 128: not the kernel's
        assert calls == []


@contextlib.contextmanager
def _gemv_on_a_gpu(monkeypatch, gemv, act_quant, seed: int):
    """Inside: the kernels' dispatch answers as on a GPU (kernels.dispatching), with fp8_gemv
    and act_quant_fp8 replaced (by stand-ins that run their specs); yields a random `mxfp8`
    weight of 96 outputs and 256 inputs (codes, scales) and 17 bf16 rows of input."""
    from dsv41_mlx import kernels

    monkeypatch.setattr(kernels, "fp8_gemv", gemv)
    monkeypatch.setattr(kernels, "act_quant_fp8", act_quant)
    mx.random.seed(seed)
    w = (mx.random.randint(0, 2**31, (96, 64)).astype(mx.uint32) & 0x3F3F3F3F)
    s = mx.random.randint(118, 124, (96, 8)).astype(mx.uint8)
    with kernels.dispatching("cuda"):
        yield w, s, mx.random.normal((17, 256)).astype(mx.bfloat16)


def test_fp8_linear_lets_the_gemv_kernel_quantise_a_decode_steps_row_on_a_gpu(monkeypatch):
    """On a GPU, Fp8Linear's product of a decode step's one computed bf16 row (of a padded
    forward's 8, or alone) is one fp8_gemv launch that FP8-quantises x as it reads it
    (quantize_input), where it was act_quant then the GEMM. More computed rows (a verify
    step: the scalar kernel would quantise every row again in each threadgroup; a matrix on
    the matrix unit takes up to 8), another dtype (the kernel quantises bf16 only) or more
    than 16 rows are quantised first, as before. Either way the values are fp8_input's then
    the GEMM's."""
    from dsv41_mlx import kernels, quant

    from .test_kernels import act_quant_spec

    calls, quantised = [], []

    def gemv(x, w, s, impl=None, init_value=None, quantize_input=False, real_rows=None, swiglu=None, parts=None,
             after=None):
        calls.append((x.dtype, quantize_input, real_rows))
        return kernels.fp8_gemv_reference(x, w, s, quantize_input, real_rows, parts=parts)

    def act_quant(x, impl, dtype=None):
        quantised.append(x.shape)
        return act_quant_spec(x, impl, dtype)

    with _gemv_on_a_gpu(monkeypatch, gemv, act_quant, seed=5) as (w, s, bf16):
        fed = quant.gemm_input_dtype()  # what act_quant hands the GEMM
        for x, real, launches, grouped in ((bf16[:8], 1, [(mx.bfloat16, True, 1)], []),
                                           (bf16[:1], None, [(mx.bfloat16, True, None)], []),
                                           (bf16[:8], 3, [(fed, False, 3)], [(8, 256)]),
                                           (mx.random.normal((1, 256)), None, [(fed, False, None)], [(1, 256)]),
                                           (bf16, None, [], [(17, 256)])):
            calls.clear(), quantised.clear()
            got = quant.fp8_linear(x, w, s, real)
            assert calls == launches and quantised == grouped
            rows = real or x.shape[0]
            want = mx.quantized_matmul(quant.fp8_fake_quant_reference(x[:rows]).astype(mx.float32), w, s,
                                       transpose=True, mode="mxfp8").astype(mx.bfloat16)
            assert mx.array_equal(got[:rows], want).item() and not got[rows:].any().item()
        # a matrix on the matrix unit (fp8_mma) quantises a verify step's rows too, up to 8
        with tuning.using(replace(tuning.current(), mma_min_outputs=w.shape[0])):
            for x, real, launches, grouped in ((bf16[:8], 6, [(mx.bfloat16, True, 6)], []),
                                               (bf16[:16], 9, [(fed, False, 9)], [(16, 256)])):
                calls.clear(), quantised.clear()
                quant.fp8_linear(x, w, s, real)
                assert calls == launches and quantised == grouped


def test_fp8_linear_adds_a_moes_routed_parts_in_the_gemv_kernel_on_a_gpu(monkeypatch):
    """A MoE's output is its shared expert's down projection with the routed experts' parts
    added (kernels.parts_added). On a GPU, a decode or verify step's is one fp8_gemv launch
    that adds them as it writes its output (parts=, one for each computed row), where the sum
    took a launch of its own; a padded forward's padding rows stay the kernel's zeros. More
    than 16 rows take MLX's GEMM and then parts_added. Either way the values are the spec's."""
    from dsv41_mlx import kernels, quant

    from .test_kernels import act_quant_spec

    calls = []

    def gemv(x, w, s, impl=None, init_value=None, quantize_input=False, real_rows=None, swiglu=None, parts=None,
             after=None):
        calls.append((x.shape[0], real_rows, None if parts is None else parts.shape))
        return kernels.fp8_gemv_reference(x, w, s, quantize_input, real_rows, parts=parts)

    kernel_wrapper = kernels.fp8_gemv
    with _gemv_on_a_gpu(monkeypatch, gemv, act_quant_spec, seed=7) as (w, s, x):
        for rows, real, kernel in ((8, 1, True), (1, None, True), (8, 3, True), (6, None, True), (17, None, False)):
            computed = real or rows
            parts = mx.random.normal((computed, 3, 96)).astype(mx.bfloat16)
            calls.clear()
            got = quant.fp8_linear(x[:rows], w, s, real, parts)
            assert calls == ([(rows, real, (computed, 3, 96))] if kernel else [])
            plain = mx.quantized_matmul(quant.fp8_fake_quant_reference(x[:rows]).astype(mx.float32), w, s,
                                        transpose=True, mode="mxfp8").astype(mx.bfloat16)
            total = parts[:, 0].astype(mx.float32) + parts[:, 1].astype(mx.float32) + parts[:, 2].astype(mx.float32)
            want = (total + plain[:computed].astype(mx.float32)).astype(mx.bfloat16)
            assert got.shape == (rows, 96) and mx.array_equal(got[:computed], want).item()
            assert not got[computed:].any().item()  # the padding: the kernel's zeros
        with pytest.raises(ValueError, match="adds parts"):  # parts for 3 rows where 4 are computed
            kernel_wrapper(x[:4], w, s, impl="cuda", parts=mx.zeros((3, 2, 96), dtype=mx.bfloat16))
