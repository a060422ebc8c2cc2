// CUDA twin of mma_x_prep.metal (see there for what it computes): a warp a (row, block).
const unsigned int K = (unsigned int)sizes[1];
const unsigned int nb = K / 32;
const unsigned int item = (blockIdx.x * blockDim.x + threadIdx.x) / 32;  // (row, block) = (item / nb, item % nb)
const unsigned int lane = threadIdx.x % 32;
const size_t at = (size_t)(item / nb) * K + 32 * (item % nb) + lane;
float s;
const float q = mma_x_column<QX>(__bfloat162float(x[at]), &s);
xh[at] = (unsigned short)(float_pair_to_fp16_bits(q, 0.0f) & 0xffffu);
if (lane == 0) {
  xs[item] = s;
}
