// One row of RMSNorm, for rms_norm.cu (a block per row) and rms_norm_pair.cu (a block per row of
// either of two inputs): see rms_norm.metal for what it computes. Every thread of the block calls it.
template <typename T, typename O, int QUANT, int ROPE>
__device__ __forceinline__ void rms_norm_row(const T* xr, const float* w, const int D, const float eps,
                                             const float* rope_cos, const float* rope_sin, const unsigned int row,
                                             O* yr, float* partial) {
  constexpr int WARPS = 8;
  const unsigned int tid = threadIdx.x;
  const unsigned int lane = threadIdx.x % 32;
  const unsigned int warp = threadIdx.x / 32;
  float sq = 0.0f;
  for (int d = (int)tid; d < D; d += 32 * WARPS) {
    const float v = static_cast<float>(xr[d]);
    sq += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sq += __shfl_xor_sync(0xffffffffu, sq, offset);
  }
  if (lane == 0) {
    partial[warp] = sq;
  }
  __syncthreads();
  float total = partial[0];
  for (int g = 1; g < WARPS; g++) {
    total += partial[g];
  }
  const float r = rsqrtf(total / (float)D + eps);
  for (int d = (int)tid; d < D; d += 32 * WARPS) {
    float v = static_cast<float>(static_cast<T>(static_cast<float>(xr[d]) * r * w[d]));  // rounded to T
    if (ROPE) {  // then RoPE on the last ROPE features; a pair's two values sit in neighbouring lanes
      const float partner = __shfl_xor_sync(0xffffffffu, v, 1);
      if (d >= D - ROPE) {
        const size_t at = (size_t)row * D + d;
        v = static_cast<float>(static_cast<T>(v * rope_cos[at] + partner * rope_sin[at]));
      }
    }
    if (QUANT) {  // then the FP8 fake-quant (fp8_lane.cuh): lanes hold a block's 32 consecutive values
      yr[d] = static_cast<O>(static_cast<T>(fp8_fake_quant_lane(v)));
    } else {
      yr[d] = static_cast<O>(v);
    }
  }
}
