// CUDA twin of rms_norm.metal (see there for what it computes). 256 threads per block.

__shared__ float partial[8];  // each warp's sum of squares

const unsigned int row = blockIdx.x;
const int D = sizes[1];
if (row >= (unsigned int)sizes[0]) {
  return;  // the whole block
}
rms_norm_row<T, O, QUANT, ROPE>(x + (size_t)row * D, w, D, eps[0], rope_cos, rope_sin, row, y + (size_t)row * D, partial);
