// fp8_mma.metal's end for kernels.FP8_MMA: the tile's outputs y, the SwiGLU (SW) and the parts
// (AP) applied, the padding rows' zeros included (see fp8_mma.metal). CUDA twin: fp8_mma_y.cu.
const uint NY = SW ? uint(N) / 2 : uint(N);  // outputs a matrix has in y
const uint y0 = SW ? n0 / 2 : n0;            // the tile's first output in y
for (uint o = tid; o < (SW ? uint(TR) / 2 : uint(TR)) * uint(out_rows); o += WARPS * 32) {
  const uint r = o % uint(out_rows);    // the row (a padded forward's padding: zeros)
  const uint out = o / uint(out_rows);  // with SW, pair `out`: rows 2 out (gate) and 2 out + 1 (up)
  float v = 0.0f;
  if (int(r) < rows) {
    float sum[2] = {0.0f, 0.0f};
    for (int j = 0; j < (SW ? 2 : 1); j++) {  // each output's total over the simdgroups, in order
      sum[j] = mma_warps_total<COLS, TR>(red, SW ? 2 * out + j : out, r);
    }
    v = SW ? gemv_swiglu(sum[0], sum[1], swiglu[0]) : sum[0];
    if (AP > 0) {  // the row's AP parts, in order, then this output as bf16
      v = gemv_parts_added<AP>(parts + ulong(r) * AP * NY + y0 + out, NY, v);
    }
  }
  y[(ulong(r) * G + grp) * NY + y0 + out] = bfloat16_t(v);
}
