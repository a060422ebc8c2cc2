// CUDA twin of mma_x.h (see there for what it computes).
template <int QX>  // lane 4g + t: pass column g's values 8t .. 8t + 7 of the block, p -> v = x / s; returns s
__device__ __forceinline__ float mma_x_lanes(const uint4 p, float* v) {
  bf16x8_floats(p, v);
  float amax = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; c++) {
    amax = fmaxf(amax, fabsf(v[c]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));  // the block's 32 values, 8 a lane
  const float s = fp8_block_scale(amax);
  const float inv = __uint_as_float((254u - (__float_as_uint(s) >> 23)) << 23);  // 1 / s, exact
#pragma unroll
  for (int c = 0; c < 8; c++) {
    v[c] = (QX ? fp8_fake_quant_value(v[c], s) : v[c]) * inv;
  }
  return s;
}

template <int QX>  // lane l: the one pass column's value at column l of the block -> x / s; *s_out = s
__device__ __forceinline__ float mma_x_column(const float v, float* s_out) {
  float amax = fabsf(v);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float s = fp8_block_scale(amax);
  *s_out = s;
  return (QX ? fp8_fake_quant_value(v, s) : v) * __uint_as_float((254u - (__float_as_uint(s) >> 23)) << 23);
}
