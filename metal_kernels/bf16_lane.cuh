// CUDA twin of bf16_lane.h (see there for what it computes).
__device__ __forceinline__ void bf16x8_floats(const uint4 p, float* f) {
  const unsigned int pairs[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    f[2 * j] = __uint_as_float(pairs[j] << 16);
    f[2 * j + 1] = __uint_as_float(pairs[j] & 0xFFFF0000u);
  }
}
