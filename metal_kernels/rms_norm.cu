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
  const float v = static_cast<float>(static_cast<T>(static_cast<float>(xr[d]) * r * w[d]));  // rounded to T
  if (QUANT) {  // then act_quant.cu's FP8 fake-quant: lanes hold a block's 32 consecutive values
    float amax = fabsf(v);
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    amax = fmaxf(amax, 1e-4f);
    const unsigned int t = __float_as_uint(amax * (1.0f / 448.0f));
    const unsigned int exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
    const float scale = __uint_as_float(exponent << 23);
    const float q = v / scale;
    const unsigned int q_exponent = max((__float_as_uint(q) >> 23) & 0xFFu, 121u);  // E4M3 subnormals
    const float step = __uint_as_float((q_exponent - 3u) << 23);  // 3 mantissa bits
    y[(size_t)row * D + d] = static_cast<O>(static_cast<T>(rintf(q / step) * step * scale));
  } else {
    y[(size_t)row * D + d] = static_cast<O>(v);
  }
}
