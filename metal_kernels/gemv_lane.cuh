// CUDA twin of gemv_lane.h (see there for what it computes).
template <int T, int RB>  // wf: [T][8], acc: [T][RB]
__device__ __forceinline__ void gemv_lane_accumulate(const uint4 p, const float* wf, float* acc, const int r) {
  const unsigned int pairs[4] = {p.x, p.y, p.z, p.w};
  float xf[8];  // bf16 bits -> float
#pragma unroll
  for (int j = 0; j < 4; j++) {
    xf[2 * j] = __uint_as_float(pairs[j] << 16);
    xf[2 * j + 1] = __uint_as_float(pairs[j] & 0xFFFF0000u);
  }
#pragma unroll
  for (int i = 0; i < T; i++) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
      acc[i * RB + r] = fmaf(wf[i * 8 + c], xf[c], acc[i * RB + r]);
    }
  }
}

template <int T, int RB>  // every thread of the block must call it; acc: [T][RB], partial: [8 warps][T * RB]
__device__ __forceinline__ void gemv_warp_totals(const float* acc, float* partial) {
  const unsigned int lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 0; o < T * RB; o++) {
    float v = acc[o];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    if (lane == (unsigned int)(o % 32)) {
      partial[(threadIdx.x / 32) * T * RB + o] = v;
    }
  }
  __syncthreads();
}

template <int T, int RB, int C>  // the total of (output, row) o of thread group grp
__device__ __forceinline__ float gemv_group_total(const float* partial, const unsigned int grp, const unsigned int o) {
  float v = partial[grp * (C / 32) * T * RB + o];
  for (int s = 1; s < C / 32; s++) {
    v += partial[(grp * (C / 32) + s) * T * RB + o];
  }
  return v;
}
