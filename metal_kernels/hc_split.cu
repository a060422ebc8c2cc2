// CUDA twin of hc_split.metal (see there for what it computes).

const unsigned int row = blockIdx.x * blockDim.x + threadIdx.x;
if (row >= (unsigned int)rows[0]) {
  return;
}
float mix[(2 + HC) * HC];
for (int k = 0; k < (2 + HC) * HC; k++) {
  mix[k] = mixes[row * (2 + HC) * HC + k];
}
hc_split_row<HC, ITERS>(mix, scale, base, eps[0], pre + row * HC, post + row * HC, comb + row * HC * HC);
