// CUDA twin of moe_gate_scores.metal (see there for what it computes). 256 threads per block,
// a block per expert.

constexpr int WARPS = 8;
__shared__ float partial[WARPS][RB];
constexpr int PER = (D + 32 * WARPS - 1) / (32 * WARPS);  // a thread's features: tid, tid + 256, ..
constexpr bool EVEN = D % (32 * WARPS) == 0;  // then no feature needs a bounds check
const int rows = sizes[0];
const int E = sizes[1];
const int e = (int)blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const float* we = w + (size_t)e * D;
// Every load first, with no branch between them: a row test (r < rows) between one feature's
// sums and the next feature's weight load kept the compiler from issuing that load early, so a
// thread's PER weight loads went to memory one after another (NVRTC's PTX: a branch per row
// per feature).
float wd[PER];
_Pragma("unroll")
for (int k = 0; k < PER; k++) {
  const int d = (int)tid + k * 32 * WARPS;
  wd[k] = EVEN || d < D ? we[EVEN ? d : min(d, D - 1)] : 0.0f;
}
float acc[RB];
_Pragma("unroll")
for (int r = 0; r < RB; r++) {
  acc[r] = 0.0f;
}
_Pragma("unroll")
for (int k = 0; k < PER; k++) {  // each row's products in feature order
  const int d = (int)tid + k * 32 * WARPS;
  if (EVEN || d < D) {
    _Pragma("unroll")
    for (int r = 0; r < RB; r++) {  // rows past `rows` read the last row again: their sums are never used
      acc[r] += static_cast<float>(x[min(r, rows - 1) * D + d]) * wd[k];
    }
  }
}
_Pragma("unroll")
for (int r = 0; r < RB; r++) {
  float a = acc[r];
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
  }
  if (lane == 0) {
    partial[warp][r] = a;
  }
}
__syncthreads();
if ((int)tid < rows) {  // thread r finishes row r
  float a = partial[0][tid];
  for (int g = 1; g < WARPS; g++) {
    a += partial[g][tid];
  }
  const float l = a / params[0];
  // log(1 + v) without losing a small v to the rounding of 1 + v
  const float v = expf(fminf(l, 20.0f));
  const float u = 1.0f + v;
  const float soft = (u == 1.0f) ? v : logf(u) * (v / (u - 1.0f));
  scores[tid * E + e] = sqrtf(l > 20.0f ? l : soft);
}
