// FP8 (E4M3) fake-quantisation of one value of a block of 32 held by the 32 lanes of a SIMD
// group (act_quant.metal, rms_norm.metal, hc_input.metal): the block's scale is a power of
// two, 2^ceil(log2(amax / 448)) with amax floored at 1e-4, and v / scale is rounded to the
// nearest E4M3 value (ties to even; |v / scale| <= 448, so no saturation) and scaled back.
// Returns that value as float32 for the caller to round to the activation's dtype. Every
// lane of the SIMD group must call it (its amax is a SIMD-group reduction).
// CUDA twin: fp8_lane.cuh.
inline float fp8_fake_quant_lane(float v) {
  const float amax = metal::max(simd_max(metal::abs(v)), 1e-4f);
  const uint t = as_type<uint>(amax * (1.0f / 448.0f));
  const uint exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
  const float scale = as_type<float>(exponent << 23);
  const float q = v / scale;
  const uint q_exponent = metal::max((as_type<uint>(q) >> 23) & 0xFFu, 121u);  // E4M3 subnormals: 2^-6's step
  const float step = as_type<float>((q_exponent - 3u) << 23);  // 3 mantissa bits
  return metal::rint(q / step) * step * scale;
}
