// CUDA twin of fp8_mma_y.metal (fp8_mma.cu's end for kernels.FP8_MMA).
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a matrix has in y
const unsigned int y0 = SW ? n0 / 2 : n0;                           // the tile's first output in y
for (unsigned int o = threadIdx.x; o < (SW ? TR / 2u : (unsigned int)TR) * (unsigned int)out_rows; o += MMA_WARPS * 32) {
  const unsigned int r = o % (unsigned int)out_rows;  // the row (a padded forward's padding: zeros)
  const unsigned int out = o / (unsigned int)out_rows;  // with SW, pair `out`: rows 2 out (gate) and 2 out + 1 (up)
  float v = 0.0f;
  if ((int)r < rows) {
    float sum[2];
#pragma unroll
    for (int j = 0; j < (SW ? 2 : 1); j++) {  // each output's total over the warps, in warp order
      const unsigned int n = SW ? 2 * out + j : out;
      sum[j] = mma_warps_total<NH, TR>(red, n, r);
    }
    v = SW ? gemv_swiglu(sum[0], sum[1], swiglu[0]) : sum[0];
    if (AP > 0) {  // the row's AP parts, in order, then this output as bf16
      v = gemv_parts_added<AP>(parts + (size_t)r * AP * NY + y0 + out, NY, v);
    }
  }
  y[((size_t)r * G + grp) * NY + y0 + out] = __float2bfloat16(v);
}
