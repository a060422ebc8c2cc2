// FP8 (E4M3) fake-quantisation over blocks of 32 values (CUDA twin: fp8_lane.cuh).
//
// fp8_block_scale: a block's scale from the largest magnitude in it, a power of two,
// 2^ceil(log2(amax / 448)) with amax floored at 1e-4.
// fp8_fake_quant_value: v / scale rounded to the nearest E4M3 value (ties to even;
// |v / scale| <= 448, so no saturation) and scaled back, as float32 for the caller to round
// to the activation's dtype (exact in bf16).
// fp8_fake_quant_lane: one value of a block held by the 32 lanes of a SIMD group
// (act_quant.metal, rms_norm.metal, hc_input.metal). Every lane of the SIMD group must call
// it (its amax is a SIMD-group reduction).
inline float fp8_block_scale(float amax) {
  const uint t = as_type<uint>(metal::max(amax, 1e-4f) * (1.0f / 448.0f));
  const uint exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
  return as_type<float>(exponent << 23);
}

inline float fp8_fake_quant_value(float v, float scale) {
  // scale and step are powers of two (normal, far from the ends of the range), so multiplying
  // by their reciprocals, made from the exponent bits, is exact: v / scale and q / step, bit for bit
  const float q = v * as_type<float>((254u - (as_type<uint>(scale) >> 23)) << 23);
  const uint q_exponent = metal::max((as_type<uint>(q) >> 23) & 0xFFu, 121u);  // E4M3 subnormals: 2^-6's step
  const float step = as_type<float>((q_exponent - 3u) << 23);  // 3 mantissa bits
  return metal::rint(q * as_type<float>((257u - q_exponent) << 23)) * step * scale;
}

inline float fp8_fake_quant_lane(float v) {
  return fp8_fake_quant_value(v, fp8_block_scale(simd_max(metal::abs(v))));
}
