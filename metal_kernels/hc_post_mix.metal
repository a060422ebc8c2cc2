// hc_mix.metal for a stream that is still to be expanded from the previous sub-layer: its
// new value h = hc_post(y, residual, post, comb) is computed here, written out, and projected
// as hc_mix projects a stream it is given, so the expansion needs no launch of its own.
//
// y [S, D] bfloat16: the previous sub-layer's output; residual [S, HC, D] bfloat16: the
// stream it ran on; post [S, HC] and comb [S, HC, HC] float32: its expansion mixes; fn
// [M, HD] float32 (M = (2 + HC) * HC, HD = HC * D); rows [1] int32 = S.
// Outputs: parts [S, CH, M + 1] float32 as hc_mix's; h [S, HC, D] bfloat16: copy c of the
// new stream, h[c, d] = post[c] * y[d] + sum over i of comb[i, c] * residual[i, d], in
// float32, the sum in i order, rounded to bfloat16 once (hyper._hc_post's arithmetic; a
// compiler may fuse a multiply and an add differently from MLX's, so h matches the spec to
// within a bfloat16 step, not bit for bit). Each value of h is written by the one thread that
// projects it. Template constants: D, HC, CH (HD a multiple of CH). 256 threads, S * CH
// threadgroups. CUDA twin: hc_post_mix.cu.

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
const device float* fc = fn + chunk * CHUNK;

// Three passes over the thread's values, so that no store sits between loads: the mixed
// values first (their loads), then their stores to h, then the mix sums (fn's loads). A store
// to h between one value's sums and the next value's loads kept the compiler from issuing
// those loads early (h might alias them), and the passes' memory trips went one after another.
// Each sum still adds the values in the same order.
bfloat16_t hb[PER];
for (int k = 0; k < PER; k++) {
  const uint j = tid + k * 32 * WARPS;
  if (!EVEN && j >= uint(CHUNK)) {
    break;
  }
  const uint e = chunk * CHUNK + j;  // the value's place in the row: copy c, feature d
  const uint c = e / D;
  const uint d = e % D;
  hb[k] = hc_expanded<HC>(float(y[row * D + d]), post[row * HC + c], comb + row * HC * HC, residual + row * HD + d,
                          D, c);
}
for (int k = 0; k < PER; k++) {
  const uint j = tid + k * 32 * WARPS;
  if (!EVEN && j >= uint(CHUNK)) {
    break;
  }
  h[row * HD + chunk * CHUNK + j] = hb[k];
}
float acc[M + 1];
for (int m = 0; m <= M; m++) {
  acc[m] = 0.0f;
}
for (int k = 0; k < PER; k++) {
  const uint j = tid + k * 32 * WARPS;
  if (!EVEN && j >= uint(CHUNK)) {
    break;
  }
  const float v = float(hb[k]);
  for (int m = 0; m < M; m++) {
    acc[m] += v * fc[m * HD + j];
  }
  acc[M] += v * v;
}
hc_mix_totals<M, WARPS>(acc, &partial[0][0], lane, warp, tid, parts + (row * CH + chunk) * (M + 1));
