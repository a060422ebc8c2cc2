// CUDA twin of hc_expand.h (see there for what it computes).
template <int HC>
__device__ __forceinline__ __nv_bfloat16 hc_expanded(const float y, const float post_c, const float* comb,
                                                     const __nv_bfloat16* res, const unsigned int stride,
                                                     const unsigned int c) {
  float mixed = comb[c] * __bfloat162float(res[0]);
  for (int i = 1; i < HC; i++) {
    mixed += comb[i * HC + c] * __bfloat162float(res[i * stride]);
  }
  return __float2bfloat16(post_c * y + mixed);
}
