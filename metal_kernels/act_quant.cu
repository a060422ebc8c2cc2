// CUDA twin of act_quant.metal (see there for what it computes).

const unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
if (idx >= (unsigned int)n[0]) {
  return;  // whole warps only: n is a multiple of 32
}
const float v = static_cast<float>(x[idx]);
y[idx] = static_cast<O>(static_cast<T>(fp8_fake_quant_lane(v)));
