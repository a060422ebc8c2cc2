// One row's hyper-connection split (hc_split.metal, hc_input.metal): mixes mix [(2 + HC) * HC]
// -> pre [HC] = sigmoid(mix * scale0 + base) + e, post [HC] = 2 sigmoid(mix * scale1 + base),
// comb [HC, HC] (row i, column j) = a row softmax + e, then ITERS alternating
// normalisations (columns first; the first pass's rows were the softmax's). The
// operations of kernels.hc_split_reference in its order (the sigmoid written out as
// 1 / (1 + e^-x)); sums run in index order.
// scale and base keep the address space MLX gives them: a kernel input of fewer than 8
// values arrives in `constant` memory (scale), a larger one in `device` memory (base).
// CUDA twin: hc_split_row.cuh.
template <int HC, int ITERS, typename ScalePtr, typename BasePtr>
inline void hc_split_row(thread const float* mix, ScalePtr scale, BasePtr base, float e, device float* pre,
                         device float* post, device float* comb) {
  for (int i = 0; i < HC; i++) {
    pre[i] = 1.0f / (1.0f + metal::exp(-(mix[i] * scale[0] + base[i]))) + e;
    post[i] = 2.0f * (1.0f / (1.0f + metal::exp(-(mix[HC + i] * scale[1] + base[HC + i]))));
  }
  float c[HC * HC];
  for (int i = 0; i < HC; i++) {  // softmax over each row, then + eps
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = mix[2 * HC + i * HC + j] * scale[2] + base[2 * HC + i * HC + j];
    }
    float row_max = c[i * HC];
    for (int j = 1; j < HC; j++) {
      row_max = metal::max(row_max, c[i * HC + j]);
    }
    float total = 0.0f;
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = metal::exp(c[i * HC + j] - row_max);
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
