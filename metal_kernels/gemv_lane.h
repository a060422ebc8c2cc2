// The lane arithmetic fp8_gemv and fp4_experts share (CUDA twin: gemv_lane.cuh).
//
// gemv_lane_accumulate: a lane's 8 columns of one input row p (8 bf16 values, as a uint4)
// times the lane's decoded weights wf[i][0..7] of NW output rows, added to acc[i][r] in
// column order (float32 fma: the products of E4M3 or E2M1 values and bf16 values are exact).
// gemv_lane_total: the 32 lanes' sums in a butterfly; every lane gets the same bits (each
// step adds the same two numbers on both sides). Every lane of the simdgroup must call it.
template <int NW, int RB>  // wf: [NW][8], acc: [NW][RB]
inline void gemv_lane_accumulate(const uint4 p, thread const float* wf, thread float* acc, const int r) {
  const uint pairs[4] = {p.x, p.y, p.z, p.w};
  float xf[8];  // bf16 bits -> float
  for (int j = 0; j < 4; j++) {
    xf[2 * j] = as_type<float>(pairs[j] << 16);
    xf[2 * j + 1] = as_type<float>(pairs[j] & 0xFFFF0000u);
  }
  for (int i = 0; i < NW; i++) {
    for (int c = 0; c < 8; c++) {
      acc[i * RB + r] = fma(wf[i * 8 + c], xf[c], acc[i * RB + r]);
    }
  }
}

inline float gemv_lane_total(float v) {
  for (ushort offset = 16; offset > 0; offset /= 2) {
    v += simd_shuffle_xor(v, offset);
  }
  return v;
}
