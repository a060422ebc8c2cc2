// CUDA twin of hc_split_lanes.h (see there for what it computes).
template <int HC, int ITERS>
__device__ inline void hc_split_lanes(const float* mix, const float* scale, const float* base, float e, float* pre,
                                      float* post, float* comb, const unsigned int lane) {
  static_assert(HC * HC <= 32, "a lane for each comb entry");
  constexpr unsigned int ALL = 0xffffffffu;
  if (lane < (unsigned int)HC) {
    pre[lane] = 1.0f / (1.0f + expf(-(mix[lane] * scale[0] + base[lane]))) + e;
  } else if (lane < (unsigned int)(2 * HC)) {
    const unsigned int i = lane - HC;
    post[i] = 2.0f * (1.0f / (1.0f + expf(-(mix[HC + i] * scale[1] + base[HC + i]))));
  }
  const int first = (lane % (HC * HC)) / HC * HC;  // the lane of this row's entry 0
  const int col = lane % HC;
  float c = mix[2 * HC + first + col] * scale[2] + base[2 * HC + first + col];
  float row_max = __shfl_sync(ALL, c, first);  // softmax over the row, then + eps
  for (int j = 1; j < HC; j++) {
    row_max = fmaxf(row_max, __shfl_sync(ALL, c, first + j));
  }
  c = expf(c - row_max);
  float total = 0.0f;
  for (int j = 0; j < HC; j++) {
    total += __shfl_sync(ALL, c, first + j);
  }
  c = c / total + e;
  for (int it = 0; it < ITERS; it++) {
    if (it > 0) {  // rows (the first pass normalised them in the softmax)
      total = 0.0f;
      for (int j = 0; j < HC; j++) {
        total += __shfl_sync(ALL, c, first + j);
      }
      c = c / (total + e);
    }
    total = 0.0f;  // columns
    for (int i = 0; i < HC; i++) {
      total += __shfl_sync(ALL, c, i * HC + col);
    }
    c = c / (total + e);
  }
  if (lane < (unsigned int)(HC * HC)) {
    comb[lane] = c;
  }
}
