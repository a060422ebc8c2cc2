// The x side (B operand) of the matrix-unit GEMM kernels (fp4_experts, fp8_mma) for one block
// of 32 columns: x / s as the matrix unit takes it, s the FP8 block scale of the block's 32
// values (fp8_lane.h: a power of two, so x / s is exact in fp16 for an FP8 fake-quantised x),
// QX = 1: x FP8 fake-quantised first with that scale (act_quant's bits).
// mma_x_lanes (CUDA only; Metal stages x column by column): a pass column a group of 4 lanes, lane 4g + t holding column g's values
// 8t .. 8t + 7 (a uint4 of bf16): v[0..7] = x / s, and s returned; the group's 4 lanes exchange
// their largest magnitudes.
// mma_x_column: one pass column spread over the SIMD group, lane l holding its value at column
// l: x / s of that value, and s; a pass of one pick (a decode step) reads and scales 1 value a
// lane this way instead of 8, the same values either way. Every lane must call either.
// CUDA twin: mma_x.cuh, which also holds the CUDA kernels' weight side and warp walk
// (mma_warp_sums: the Metal kernels stage their decoded tiles in threadgroup memory instead).
template <int QX>
inline float mma_x_column(const float v, thread float* s_out) {
  const float s = fp8_block_scale(simd_max(metal::abs(v)));
  *s_out = s;
  return (QX ? fp8_fake_quant_value(v, s) : v) * as_type<float>((254u - (as_type<uint>(s) >> 23)) << 23);
}

// Tile row n's total at column r over the 8 simdgroups, in simdgroup order: red [8][TR rows][COLS],
// each simdgroup's sums after its blocks (fp8_mma's ends; CUDA twin: mma_x.cuh's mma_warps_total)
template <int COLS, int TR = 32>
inline float mma_warps_total(threadgroup const float* red, const uint n, const uint r) {
  float sum = red[n * COLS + r];
  for (int q = 1; q < 8; q++) {
    sum += red[(q * TR + n) * COLS + r];
  }
  return sum;
}
