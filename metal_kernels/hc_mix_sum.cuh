// CUDA twin of hc_mix_sum.h (see there for what it computes).
template <int M, int WARPS>
__device__ inline void hc_mix_totals(const float* acc, float* partial, const unsigned int lane,
                                     const unsigned int warp, const unsigned int tid, float* out) {
  for (int m = 0; m <= M; m++) {
    float a = acc[m];
    for (int offset = 16; offset > 0; offset /= 2) {
      a += __shfl_xor_sync(0xffffffffu, a, offset);
    }
    if (lane == 0) {
      partial[warp * (M + 1) + m] = a;
    }
  }
  __syncthreads();
  if (tid <= (unsigned int)M) {  // totals over the warps, in order
    float t = partial[tid];
    for (int g = 1; g < WARPS; g++) {
      t += partial[g * (M + 1) + tid];
    }
    out[tid] = t;
  }
}
