// CUDA twin of fp8_mma_hc.metal (fp8_mma.cu's end for kernels.FP8_MMA_HC; see there).
static_assert(TR == 32, "the mix parts are a 32-feature tile's, a lane each");
constexpr int M = (2 + HC) * HC;
constexpr int MG = 8;  // mixes a pass (fp8_mma_hc.metal says why)
const unsigned int d = n0 + lane;  // this lane's feature
for (unsigned int r = threadIdx.x / 32; r < (unsigned int)out_rows; r += MMA_WARPS) {
  float v = 0.0f;  // y[r, d]
  if ((int)r < rows) {
    v = mma_warps_total<NH>(red, lane, r);
    if (AP > 0) {  // the row's AP parts, in order, then this output as bf16
      v = gemv_parts_added<AP>(parts + (size_t)r * AP * N + d, N, v);
    }
  }
  const float yv = __bfloat162float(__float2bfloat16(v));
  float hv[HC];
#pragma unroll
  for (int c = 0; c < HC; c++) {
    const __nv_bfloat16 b = hc_expanded<HC>(yv, post[r * HC + c], comb + r * HC * HC, residual + (size_t)r * HC * N + d,
                                            N, c);
    h[((size_t)r * HC + c) * N + d] = b;
    hv[c] = __bfloat162float(b);
  }
  float sq = hv[0] * hv[0];  // the tile's sum of squares, then its share of each mix, in butterflies over the features
#pragma unroll
  for (int c = 1; c < HC; c++) {
    sq += hv[c] * hv[c];
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sq += __shfl_xor_sync(0xffffffffu, sq, offset);
  }
  const size_t out = ((size_t)r * tiles + n0 / 32) * (M + 1);  // this row's and tile's parts
  if (lane == 0) {
    mix_parts[out + M] = sq;
  }
#pragma unroll 1
  for (int m0 = 0; m0 < M; m0 += MG) {
    float acc[MG];
#pragma unroll
    for (int j = 0; j < MG; j++) {
      const size_t m = m0 + j < M ? m0 + j : M - 1;  // (past M: a repeat, not written)
      acc[j] = hv[0] * fn[m * HC * N + d];
#pragma unroll
      for (int c = 1; c < HC; c++) {
        acc[j] += hv[c] * fn[(m * HC + c) * N + d];
      }
    }
#pragma unroll
    for (int j = 0; j < MG; j++) {
      for (int offset = 16; offset > 0; offset /= 2) {
        acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], offset);
      }
      if (lane == 0 && m0 + j < M) {
        mix_parts[out + m0 + j] = acc[j];
      }
    }
  }
}
