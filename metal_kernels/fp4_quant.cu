// CUDA twin of fp4_quant.metal (see there for what it computes).

const unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
if (idx >= (unsigned int)n[0]) {
  return;  // whole warps only: n is a multiple of 32
}
const float v = static_cast<float>(x[idx]);
float amax = fabsf(v);
for (int offset = BLOCK / 2; offset > 0; offset /= 2) {
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
}
float scale;
if (SCALE_E4M3) {
  const float a = fmaxf(amax, 6.0f * __uint_as_float(0x3b000000u)) / 6.0f;  // 2^-9
  const unsigned int a_exponent = max((__float_as_uint(a) >> 23) & 0xFFu, 121u);  // E4M3 subnormals: 2^-6's step
  const float step = __uint_as_float((a_exponent - 3u) << 23);  // 3 mantissa bits
  scale = fminf(rintf(a / step) * step, 448.0f);
} else {
  const float floor_ = 6.0f * __uint_as_float(0x00800000u);  // 6 * 2^-126
  const unsigned int t = __float_as_uint(fmaxf(amax, floor_) * (1.0f / 6.0f));
  const unsigned int exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
  scale = __uint_as_float(exponent << 23);
}
const float q = fminf(fmaxf(v / scale, -6.0f), 6.0f);
const float mag = fabsf(q);
const int code = int(mag > 0.25f) + int(mag > 0.75f) + int(mag > 1.25f) + int(mag > 1.75f) + int(mag > 2.5f) +
                 int(mag > 3.5f) + int(mag > 5.0f) + int(mag == 0.75f) + int(mag == 1.75f) + int(mag == 3.5f);
const float value = code < 5 ? 0.5f * float(code) : (code == 5 ? 3.0f : (code == 6 ? 4.0f : 6.0f));
const float r = (__float_as_uint(q) >> 31) ? -value : value;
y[idx] = static_cast<T>(r * scale);
