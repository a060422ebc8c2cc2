// CUDA twin of hc_post_mix.metal (see there for what it computes). 256 threads per block,
// S * CH blocks.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
constexpr int CHUNK = HD / CH;
constexpr int PER = (CHUNK + 32 * WARPS - 1) / (32 * WARPS);  // a thread's values: tid, tid + 256, ..
constexpr bool EVEN = CHUNK % (32 * WARPS) == 0;  // then no pass needs a bounds check
__shared__ float partial[WARPS][M + 1];

const unsigned int row = blockIdx.x / CH;
const unsigned int chunk = blockIdx.x % CH;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole block
}
const float* fc = fn + chunk * CHUNK;

// Three passes over the thread's values, so that no store sits between loads: the mixed
// values first (their loads), then their stores to h, then the mix sums (fn's loads). A store
// to h between one value's sums and the next value's loads kept the compiler from issuing
// those loads early (h might alias them), and the passes' memory trips went one after another.
// Each sum still adds the values in the same order.
__nv_bfloat16 hb[PER];
#pragma unroll
for (int k = 0; k < PER; k++) {
  const unsigned int j = tid + k * 32 * WARPS;
  if (!EVEN && j >= (unsigned int)CHUNK) {
    break;
  }
  const unsigned int e = chunk * CHUNK + j;  // the value's place in the row: copy c, feature d
  const unsigned int c = e / D;
  const unsigned int d = e % D;
  hb[k] = hc_expanded<HC>(__bfloat162float(y[row * D + d]), post[row * HC + c], comb + row * HC * HC,
                          residual + row * HD + d, D, c);
}
#pragma unroll
for (int k = 0; k < PER; k++) {
  const unsigned int j = tid + k * 32 * WARPS;
  if (!EVEN && j >= (unsigned int)CHUNK) {
    break;
  }
  h[row * HD + chunk * CHUNK + j] = hb[k];
}
float acc[M + 1];
for (int m = 0; m <= M; m++) {
  acc[m] = 0.0f;
}
#pragma unroll
for (int k = 0; k < PER; k++) {
  const unsigned int j = tid + k * 32 * WARPS;
  if (!EVEN && j >= (unsigned int)CHUNK) {
    break;
  }
  const float v = __bfloat162float(hb[k]);
  #pragma unroll
  for (int m = 0; m < M; m++) {
    acc[m] += v * fc[m * HD + j];
  }
  acc[M] += v * v;
}
hc_mix_totals<M, WARPS>(acc, &partial[0][0], lane, warp, tid, parts + (row * CH + chunk) * (M + 1));
