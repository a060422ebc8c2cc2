// CUDA twin of gemv_lane.h (see there for what it computes).
template <int NW, int RB>  // wf: [NW][8], acc: [NW][RB]
__device__ __forceinline__ void gemv_lane_accumulate(const uint4 p, const float* wf, float* acc, const int r) {
  const unsigned int pairs[4] = {p.x, p.y, p.z, p.w};
  float xf[8];  // bf16 bits -> float
#pragma unroll
  for (int j = 0; j < 4; j++) {
    xf[2 * j] = __uint_as_float(pairs[j] << 16);
    xf[2 * j + 1] = __uint_as_float(pairs[j] & 0xFFFF0000u);
  }
#pragma unroll
  for (int i = 0; i < NW; i++) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
      acc[i * RB + r] = fmaf(wf[i * 8 + c], xf[c], acc[i * RB + r]);
    }
  }
}

__device__ __forceinline__ float gemv_lane_total(float v) {  // every lane of the warp must call it
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
