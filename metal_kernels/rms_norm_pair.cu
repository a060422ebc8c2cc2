// CUDA twin of rms_norm_pair.metal (see there for what it computes). 256 threads per block.

__shared__ float partial[8];  // each warp's sum of squares

const unsigned int block = blockIdx.x;
const unsigned int rows = (unsigned int)sizes[0];
const int D = sizes[1];
const int D2 = sizes[2];
const size_t start2 = (size_t)sizes[3];  // where x2's rows start in x2
if (block < rows) {
  rms_norm_row<T, O, QUANT, 0>(x + (size_t)block * D, w, D, eps[0], rope_cos, rope_sin, block, y + (size_t)block * D,
                               partial);
} else if (block < 2 * rows) {
  const unsigned int row = block - rows;
  rms_norm_row<T, O2, QUANT, ROPE>(x2 + start2 + (size_t)row * D2, w2, D2, eps[0], rope_cos, rope_sin, row,
                                   y2 + (size_t)row * D2, partial);
}
