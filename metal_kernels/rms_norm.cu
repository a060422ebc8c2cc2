// CUDA twin of rms_norm.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
__shared__ float partial[WARPS];

const unsigned int row = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const int D = sizes[1];
if (row >= (unsigned int)sizes[0]) {
  return;  // the whole block
}
const T* xr = x + (size_t)row * D;

float sq = 0.0f;
for (int d = (int)tid; d < D; d += 32 * WARPS) {
  const float v = static_cast<float>(xr[d]);
  sq += v * v;
}
for (int offset = 16; offset > 0; offset /= 2) {
  sq += __shfl_xor_sync(0xffffffffu, sq, offset);
}
if (lane == 0) {
  partial[warp] = sq;
}
__syncthreads();
float total = partial[0];
for (int g = 1; g < WARPS; g++) {
  total += partial[g];
}
const float r = rsqrtf(total / (float)D + eps[0]);
for (int d = (int)tid; d < D; d += 32 * WARPS) {
  float v = static_cast<float>(static_cast<T>(static_cast<float>(xr[d]) * r * w[d]));  // rounded to T
  if (ROPE) {  // then RoPE on the last ROPE features; a pair's two values sit in neighbouring lanes
    const float partner = __shfl_xor_sync(0xffffffffu, v, 1);
    if (d >= D - ROPE) {
      const size_t at = (size_t)row * D + d;
      v = static_cast<float>(static_cast<T>(v * rope_cos[at] + partner * rope_sin[at]));
    }
  }
  if (QUANT) {  // then the FP8 fake-quant (fp8_lane.cuh): lanes hold a block's 32 consecutive values
    y[(size_t)row * D + d] = static_cast<O>(static_cast<T>(fp8_fake_quant_lane(v)));
  } else {
    y[(size_t)row * D + d] = static_cast<O>(v);
  }
}
