// CUDA twin of fp8_mma_hc.metal (fp8_mma.cu's end for kernels.FP8_MMA_HC; see there).
constexpr int M = (2 + HC) * HC;
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
  float acc[M + 1];
#pragma unroll
  for (int m = 0; m < M; m++) {
    acc[m] = hv[0] * fn[(size_t)m * HC * N + d];
#pragma unroll
    for (int c = 1; c < HC; c++) {
      acc[m] += hv[c] * fn[((size_t)m * HC + c) * N + d];
    }
  }
  acc[M] = hv[0] * hv[0];
#pragma unroll
  for (int c = 1; c < HC; c++) {
    acc[M] += hv[c] * hv[c];
  }
#pragma unroll
  for (int m = 0; m <= M; m++) {  // the tile's totals, every lane left with them
    for (int offset = 16; offset > 0; offset /= 2) {
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
    }
  }
  if (lane == 0) {
    for (int m = 0; m <= M; m++) {
      mix_parts[((size_t)r * tiles + n0 / 32) * (M + 1) + m] = acc[m];
    }
  }
}
