// The first half of a sub-layer's input (hc_input.metal is the second): the stream's mix
// projection and sum of squares, split over CH chunks of each row so that a decode step's
// few rows spread over many threadgroups (one threadgroup per row would read all of fn, 2 MB
// at the release's shape, alone).
//
// h [S, HC, D] bfloat16: the stream, each row flattened to HD = HC * D values; fn [M, HD]
// float32: the sub-layer's mix projection (M = (2 + HC) * HC); rows [1] int32 = S.
// Output: parts [S, CH, M + 1] float32: for row s and chunk c (values c * HD / CH up to the
// next chunk), the dot products with each fn_m, then the sum of squares. Thread t sums
// every 256th value of its chunk, each simdgroup its 32 sums in a butterfly, then the 8
// simdgroup sums are added in order (hc_mix_sum.h): a row's parts depend on that row alone.
// Template constants: D, HC, CH (HD a multiple of CH). 256 threads, S * CH threadgroups.
// CUDA twin: hc_mix.cu.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
constexpr int CHUNK = HD / CH;
constexpr int PER = (CHUNK + 32 * WARPS - 1) / (32 * WARPS);  // a thread's values: tid, tid + 256, ..
constexpr bool EVEN = CHUNK % (32 * WARPS) == 0;  // then no pass needs a bounds check
threadgroup float partial[WARPS][M + 1];

const uint row = threadgroup_position_in_grid.x / CH;
const uint chunk = threadgroup_position_in_grid.x % CH;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
const device bfloat16_t* hv = h + row * HD + chunk * CHUNK;
const device float* fc = fn + chunk * CHUNK;

float acc[M + 1];
for (int m = 0; m <= M; m++) {
  acc[m] = 0.0f;
}
for (int k = 0; k < PER; k++) {  // a compile-time count: the compiler may issue every pass's loads together
  const uint j = tid + k * 32 * WARPS;
  if (!EVEN && j >= uint(CHUNK)) {
    break;
  }
  const float v = float(hv[j]);
  for (int m = 0; m < M; m++) {
    acc[m] += v * fc[m * HD + j];
  }
  acc[M] += v * v;
}
hc_mix_totals<M, WARPS>(acc, &partial[0][0], lane, warp, tid, parts + (row * CH + chunk) * (M + 1));
