// The end of hc_mix.metal and hc_post_mix.metal (CUDA twin: hc_mix_sum.cuh): a thread's
// M + 1 sums acc over its values of one chunk of a row -> the chunk's totals in out [M + 1].
// Each simdgroup adds its 32 lanes' sums in a butterfly into partial[simdgroup][m]
// (threadgroup memory, [WARPS][M + 1]), then threads 0..M add the WARPS simdgroup sums in
// order: a row's totals depend on that row alone. Every thread of the threadgroup calls it.
template <int M, int WARPS>
inline void hc_mix_totals(thread const float* acc, threadgroup float* partial, const uint lane, const uint warp,
                          const uint tid, device float* out) {
  for (int m = 0; m <= M; m++) {
    float a = acc[m];
    for (ushort offset = 16; offset > 0; offset /= 2) {
      a += simd_shuffle_xor(a, offset);
    }
    if (lane == 0) {
      partial[warp * (M + 1) + m] = a;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid <= uint(M)) {  // totals over the simdgroups, in order
    float t = partial[tid];
    for (int g = 1; g < WARPS; g++) {
      t += partial[g * (M + 1) + tid];
    }
    out[tid] = t;
  }
}
