// CUDA twin of moe_gate_scores.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
constexpr int MAX_ROWS = 16;
const int rows = sizes[0];
const int E = sizes[1];
const int D = sizes[2];
const int e = (int)blockIdx.x * WARPS + (int)(threadIdx.x / 32);
const unsigned int lane = threadIdx.x % 32;
if (e >= E) {
  return;  // a whole warp
}
const float* we = w + (size_t)e * D;
float acc[MAX_ROWS];
for (int r = 0; r < MAX_ROWS; r++) {
  acc[r] = 0.0f;
}
for (int d = (int)lane; d < D; d += 32) {
  const float wd = we[d];
  _Pragma("unroll")
  for (int r = 0; r < MAX_ROWS && r < rows; r++) {
    acc[r] += static_cast<float>(x[r * D + d]) * wd;
  }
}
_Pragma("unroll")
for (int r = 0; r < MAX_ROWS && r < rows; r++) {
  float a = acc[r];
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
  }
  if (lane == 0) {
    const float l = a / params[0];
    // log(1 + v) without losing a small v to the rounding of 1 + v
    const float v = expf(fminf(l, 20.0f));
    const float u = 1.0f + v;
    const float soft = (u == 1.0f) ? v : logf(u) * (v / (u - 1.0f));
    scores[r * E + e] = sqrtf(l > 20.0f ? l : soft);
  }
}
