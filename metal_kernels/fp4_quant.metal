// FP4 (E2M1) activation fake-quantisation: each block of BLOCK consecutive values is
// scaled, rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the
// even code) and scaled back; the reference's fp4_act_quant, applied to the indexer's
// queries and keys (BLOCK 32, SCALE_E4M3 0: scale 2^ceil(log2(amax / 6)), amax floored
// at 6 * 2^-126) and to the compressed KV (BLOCK 16, SCALE_E4M3 1: scale the E4M3
// value nearest amax / 6, amax floored at 6 * 2^-9).
//
// x [n] of type T (bfloat16 or float32), n (a 1-element int32 input) a multiple of 32;
// y [n] of type T. One thread per value; a block's amax in a butterfly over its lanes.
// Bit for bit the spec, quant.fp4_fake_quant_reference. Template: T, BLOCK (16 or 32),
// SCALE_E4M3 (0 or 1). CUDA twin: fp4_quant.cu.

const uint idx = thread_position_in_grid.x;
if (idx >= uint(n[0])) {
  return;  // whole SIMD groups only: n is a multiple of 32
}
const float v = static_cast<float>(x[idx]);
float amax = metal::abs(v);
for (ushort offset = BLOCK / 2; offset > 0; offset /= 2) {
  amax = metal::max(amax, simd_shuffle_xor(amax, offset));
}
float scale;
if (SCALE_E4M3) {
  const float a = metal::max(amax, 6.0f * as_type<float>(0x3b000000u)) / 6.0f;  // 2^-9
  const uint a_exponent = metal::max((as_type<uint>(a) >> 23) & 0xFFu, 121u);  // E4M3 subnormals: 2^-6's step
  const float step = as_type<float>((a_exponent - 3u) << 23);  // 3 mantissa bits
  scale = metal::min(metal::rint(a / step) * step, 448.0f);
} else {
  const float floor_ = 6.0f * as_type<float>(0x00800000u);  // 6 * 2^-126
  const uint t = as_type<uint>(metal::max(amax, floor_) * (1.0f / 6.0f));
  const uint exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
  scale = as_type<float>(exponent << 23);
}
const float q = metal::min(metal::max(v / scale, -6.0f), 6.0f);
const float mag = metal::abs(q);
const int code = int(mag > 0.25f) + int(mag > 0.75f) + int(mag > 1.25f) + int(mag > 1.75f) + int(mag > 2.5f) +
                 int(mag > 3.5f) + int(mag > 5.0f) + int(mag == 0.75f) + int(mag == 1.75f) + int(mag == 3.5f);
const float value = code < 5 ? 0.5f * float(code) : (code == 5 ? 3.0f : (code == 6 ? 4.0f : 6.0f));
const float r = (as_type<uint>(q) >> 31) ? -value : value;
y[idx] = static_cast<T>(r * scale);
