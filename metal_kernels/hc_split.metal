// Split one sub-layer's hyper-connection mixes into pre, post and the
// Sinkhorn-normalised comb matrix, one thread per row (a row's HC*HC comb
// entries stay in registers through all ITERS alternations).
//
// mixes [S, (2 + HC) * HC] float32: the projected, RMS-scaled stream; scale [3],
// base [(2 + HC) * HC], eps [1] float32. Outputs: pre [S, HC], post [S, HC],
// comb [S, HC, HC] (row i, column j). Same operations in the same order as
// kernels.hc_split_reference; sums run in index order.
// rows: a 1-element int32 input (the row count S, not a template constant, so
// one build serves every S). Template constants: HC (copies), ITERS.
// CUDA twin: hc_split.cu.

const uint row = thread_position_in_grid.x;
if (row >= uint(rows[0])) {
  return;
}
const device float* m = mixes + row * (2 + HC) * HC;
const float e = eps[0];
for (int i = 0; i < HC; i++) {
  pre[row * HC + i] = 1.0f / (1.0f + metal::exp(-(m[i] * scale[0] + base[i]))) + e;
  post[row * HC + i] = 2.0f * (1.0f / (1.0f + metal::exp(-(m[HC + i] * scale[1] + base[HC + i]))));
}
float c[HC * HC];
for (int i = 0; i < HC; i++) {  // softmax over each row, then + eps
  for (int j = 0; j < HC; j++) {
    c[i * HC + j] = m[2 * HC + i * HC + j] * scale[2] + base[2 * HC + i * HC + j];
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
  comb[row * HC * HC + k] = c[k];
}
