// CUDA twin of hc_split_row.h (see there for what it computes).
template <int HC, int ITERS>
__device__ inline void hc_split_row(const float* mix, const float* scale, const float* base, float e, float* pre,
                                    float* post, float* comb) {
  for (int i = 0; i < HC; i++) {
    pre[i] = 1.0f / (1.0f + expf(-(mix[i] * scale[0] + base[i]))) + e;
    post[i] = 2.0f * (1.0f / (1.0f + expf(-(mix[HC + i] * scale[1] + base[HC + i]))));
  }
  float c[HC * HC];
  for (int i = 0; i < HC; i++) {  // softmax over each row, then + eps
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = mix[2 * HC + i * HC + j] * scale[2] + base[2 * HC + i * HC + j];
    }
    float row_max = c[i * HC];
    for (int j = 1; j < HC; j++) {
      row_max = fmaxf(row_max, c[i * HC + j]);
    }
    float total = 0.0f;
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = expf(c[i * HC + j] - row_max);
      total += c[i * HC + j];
    }
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = c[i * HC + j] / total + e;
    }
  }
  for (int it = 0; it < ITERS; it++) {
    if (it > 0) {  // rows (the first pass normalised them in the softmax)
      for (int i = 0; i < HC; i++) {
        float total = 0.0f;
        for (int j = 0; j < HC; j++) {
          total += c[i * HC + j];
        }
        for (int j = 0; j < HC; j++) {
          c[i * HC + j] = c[i * HC + j] / (total + e);
        }
      }
    }
    for (int j = 0; j < HC; j++) {  // columns
      float total = 0.0f;
      for (int i = 0; i < HC; i++) {
        total += c[i * HC + j];
      }
      for (int i = 0; i < HC; i++) {
        c[i * HC + j] = c[i * HC + j] / (total + e);
      }
    }
  }
  for (int k = 0; k < HC * HC; k++) {
    comb[k] = c[k];
  }
}
