// One row of RMSNorm, for rms_norm.metal (a threadgroup per row) and rms_norm_pair.metal (a
// threadgroup per row of either of two inputs): see rms_norm.metal for what it computes. Every
// thread of the threadgroup calls it. CUDA twin: rms_norm_row.cuh.
template <typename T, typename O, int QUANT, int ROPE>
inline void rms_norm_row(const device T* xr, const device float* w, const int D, const float eps,
                         const device float* rope_cos, const device float* rope_sin, const uint row, device O* yr,
                         threadgroup float* partial, const uint tid, const uint lane, const uint warp) {
  constexpr int WARPS = 8;
  float sq = 0.0f;
  for (int d = int(tid); d < D; d += 32 * WARPS) {
    const float v = float(xr[d]);
    sq += v * v;
  }
  for (ushort offset = 16; offset > 0; offset /= 2) {
    sq += simd_shuffle_xor(sq, offset);
  }
  if (lane == 0) {
    partial[warp] = sq;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = partial[0];
  for (int g = 1; g < WARPS; g++) {
    total += partial[g];
  }
  const float r = metal::rsqrt(total / float(D) + eps);
  for (int d = int(tid); d < D; d += 32 * WARPS) {
    float v = float(T(float(xr[d]) * r * w[d]));  // the norm, rounded to T
    if (ROPE) {  // then RoPE on the last ROPE features; a pair's two values sit in neighbouring lanes
      const float partner = simd_shuffle_xor(v, ushort(1));
      if (d >= D - ROPE) {
        const ulong at = ulong(row) * D + d;
        v = float(T(v * rope_cos[at] + partner * rope_sin[at]));
      }
    }
    if (QUANT) {  // then the FP8 fake-quant (fp8_lane.h): lanes hold a block's 32 consecutive values
      yr[d] = static_cast<O>(static_cast<T>(fp8_fake_quant_lane(v)));
    } else {
      yr[d] = static_cast<O>(v);
    }
  }
}
