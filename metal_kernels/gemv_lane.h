// The arithmetic fp8_gemv and fp4_experts share (CUDA twin: gemv_lane.cuh).
//
// gemv_lane_accumulate: a thread's 8 columns of one input row p (8 bf16 values, as a uint4)
// times the thread's decoded weights wf[i][0..7] of T output rows, added to acc[i][r] in
// column order (float32 fma: the products of E4M3 or E2M1 values and bf16 values are exact).
// gemv_warp_totals: each (output, row) sum acc[o] over the 32 lanes of each simdgroup, in a
// butterfly, into partial[simdgroup][o]; then a threadgroup barrier. Every thread calls it.
// gemv_group_total: the sum of output-row o of thread group grp over its C / 32 simdgroups,
// in simdgroup order. So each output's order of additions depends on K and C only: never on
// how many rows the forward has.
// gemv_amax16, gemv_fake_quant8: for kernels that FP8 fake-quantise their input as they read
// it (QX): the largest magnitude of 16 bf16 values (a thread's half of a block of 32), and 8
// bf16 values through fp8_fake_quant_value with their block's scale, as bf16 again (exact);
// gemv_input_block_scale: the scale of the block of 32 inputs holding a thread's 16 at xr, its
// neighbour (lane ^ 1) holding the other 16. Every lane of the SIMD group must call it,
// those past K (active false) too.
// gemv_swiglu, for kernels whose matrix is a SwiGLU's gate and up projections with their rows
// interleaved (SW; a thread group's slots 2p and 2p + 1 hold pair p's): the output of a gate
// and an up sum, each rounded to bf16 first (as the GEMM's bf16 output would be): SiLU(gate) *
// up in float32, up clamped to [-limit, limit] and gate from above where limit > 0, in the
// operations of kernels.swiglu (MLX's fused kernel for it: x / (1 + e^-x) * up, precise exp
// and division; a NaN passes the clamps as a NaN).
template <int T, int RB>  // wf: [T][8], acc: [T][RB]
inline void gemv_lane_accumulate(const uint4 p, thread const float* wf, thread float* acc, const int r) {
  float xf[8];
  bf16x8_floats(p, xf);
  for (int i = 0; i < T; i++) {
    for (int c = 0; c < 8; c++) {
      acc[i * RB + r] = fma(wf[i * 8 + c], xf[c], acc[i * RB + r]);
    }
  }
}

template <int T, int RB>  // acc: [T][RB], partial: [8 simdgroups][T * RB]
inline void gemv_warp_totals(thread const float* acc, threadgroup float* partial, const uint lane, const uint warp) {
  for (int o = 0; o < T * RB; o++) {
    float v = acc[o];
    for (ushort offset = 16; offset > 0; offset /= 2) {
      v += simd_shuffle_xor(v, offset);
    }
    if (lane == uint(o % 32)) {
      partial[warp * T * RB + o] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

template <int T, int RB, int C>
inline float gemv_group_total(threadgroup const float* partial, const uint grp, const uint o) {
  float v = partial[grp * (C / 32) * T * RB + o];
  for (int s = 1; s < C / 32; s++) {
    v += partial[(grp * (C / 32) + s) * T * RB + o];
  }
  return v;
}

inline float gemv_amax16(const uint4 p0, const uint4 p1) {
  const uint pairs[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
  float amax = 0.0f;
  for (int j = 0; j < 8; j++) {
    amax = metal::max(amax, metal::max(metal::abs(as_type<float>(pairs[j] << 16)),
                                       metal::abs(as_type<float>(pairs[j] & 0xFFFF0000u))));
  }
  return amax;
}

inline uint4 gemv_fake_quant8(const uint4 p, const float scale) {
  uint pairs[4] = {p.x, p.y, p.z, p.w};
  for (int j = 0; j < 4; j++) {
    const float lo = fp8_fake_quant_value(as_type<float>(pairs[j] << 16), scale);
    const float hi = fp8_fake_quant_value(as_type<float>(pairs[j] & 0xFFFF0000u), scale);
    pairs[j] = (as_type<uint>(lo) >> 16) | (as_type<uint>(hi) & 0xFFFF0000u);  // exact in bf16
  }
  return uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

inline float gemv_input_block_scale(const device bfloat16_t* xr, const bool active) {
  float amax = 0.0f;
  if (active) {
    amax = gemv_amax16(*((const device uint4*)xr), *((const device uint4*)(xr + 8)));
  }
  return fp8_block_scale(metal::max(amax, simd_shuffle_xor(amax, ushort(1))));
}


inline float gemv_swiglu(const float gate_sum, const float up_sum, const float limit) {
  float gate = float(bfloat16_t(gate_sum));
  float up = float(bfloat16_t(up_sum));
  if (limit > 0.0f) {
    up = metal::isnan(up) ? up : metal::min(metal::max(up, -limit), limit);
    gate = metal::isnan(gate) ? gate : metal::min(gate, limit);
  }
  return metal::precise::divide(gate, 1.0f + metal::precise::exp(-gate)) * up;
}


// A row's AP parts added to a GEMM's sum v, the way kernels.parts_added specifies it bit for bit:
// ((parts[0] + parts[1]) + ...) + bf16(v) in float32, pr the row's first part at this output and
// the parts `stride` apart
template <int AP>
inline float gemv_parts_added(const device bfloat16_t* pr, const uint stride, const float v) {
  float t = float(pr[0]);
  for (int j = 1; j < AP; j++) {
    t += float(pr[ulong(j) * stride]);
  }
  return t + float(bfloat16_t(v));
}

// Where output n of row r of matrix g goes in y: [out_rows, G, NY] (SPLIT 0); with SPLIT > 0 (G 1) two matrices
// stacked, their outputs apart: the first SPLIT outputs' [out_rows, SPLIT], then the rest's [out_rows, NY - SPLIT]
template <int SPLIT>
inline ulong gemv_y_index(const uint r, const uint n, const uint g, const int G, const uint NY, const int out_rows) {
  if (SPLIT == 0) {
    return (ulong(r) * G + g) * NY + n;
  }
  return n < uint(SPLIT) ? ulong(r) * SPLIT + n : ulong(out_rows) * SPLIT + ulong(r) * (NY - SPLIT) + (n - SPLIT);
}
