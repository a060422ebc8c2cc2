// CUDA twin of fp8_lane.h (see there for what it computes).
__device__ inline float fp8_block_scale(float amax) {
  const unsigned int t = __float_as_uint(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
  const unsigned int exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
  return __uint_as_float(exponent << 23);
}

__device__ inline float fp8_fake_quant_value(float v, float scale) {  // see fp8_lane.h: exact reciprocals
  const float q = v * __uint_as_float((254u - (__float_as_uint(scale) >> 23)) << 23);
  const unsigned int q_exponent = max((__float_as_uint(q) >> 23) & 0xFFu, 121u);  // E4M3 subnormals: 2^-6's step
  const float step = __uint_as_float((q_exponent - 3u) << 23);  // 3 mantissa bits
  return rintf(q * __uint_as_float((257u - q_exponent) << 23)) * step * scale;
}

__device__ inline float fp8_fake_quant_lane(float v) {  // every lane of the warp must call it
  float amax = fabsf(v);
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  return fp8_fake_quant_value(v, fp8_block_scale(amax));
}
