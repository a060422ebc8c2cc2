// CUDA twin of hc_split.metal (see there for what it computes).

const unsigned int row = blockIdx.x * blockDim.x + threadIdx.x;
if (row >= (unsigned int)rows[0]) {
  return;
}
const float* m = mixes + row * (2 + HC) * HC;
const float e = eps[0];
for (int i = 0; i < HC; i++) {
  pre[row * HC + i] = 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + e;
  post[row * HC + i] = 2.0f * (1.0f / (1.0f + expf(-(m[HC + i] * scale[1] + base[HC + i]))));
}
float c[HC * HC];
for (int i = 0; i < HC; i++) {  // softmax over each row, then + eps
  for (int j = 0; j < HC; j++) {
    c[i * HC + j] = m[2 * HC + i * HC + j] * scale[2] + base[2 * HC + i * HC + j];
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
  comb[row * HC * HC + k] = c[k];
}
