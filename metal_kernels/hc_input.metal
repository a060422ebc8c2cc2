// A sub-layer's input from the hyper-connection stream, a threadgroup per row (decode and
// verify forwards), after hc_mix.metal: together what hyper.HyperConnection.sublayer_input
// computes with about eight operations.
//
// h [S, HC, D] bfloat16: the stream; pre_in [S, HC] float32: the collapse weights the
// previous sub-layer made; parts [S, CH, M + 1] float32: hc_mix's chunk sums of the mix
// projection and of the squares (M = (2 + HC) * HC); scale [3], base [M] float32: this
// sub-layer's mix parameters; norm_w [D] float32: the sub-layer's RMSNorm weight;
// params [3] float32 = (hc norm eps, Sinkhorn eps, RMSNorm eps); rows [1] int32 = S.
// Outputs: x [S, D] bfloat16, the collapsed and normed input:
//   c_d = sum_i pre_in_i * h_id (fp32, i in order), rounded to bfloat16;
//   x_d = c_d * rsqrt(mean(c^2) + eps) * norm_w_d;
// xq [S, D] (O): x FP8 fake-quantised per 32 values (act_quant.metal, bit for bit on x),
// as the sub-layer's FP8 GEMMs take it;
// pre [S, HC], post [S, HC], comb [S, HC, HC] float32: this sub-layer's mixes, split
// (sigmoids, softmax and ITERS Sinkhorn passes, as hc_split.metal) from
//   mix_m = (h . fn_m) * rsqrt(mean(h^2) + hc norm eps)   over the flattened row,
// each total the row's CH chunk sums added up: simdgroup g adds chunks g, g + 8, .. in order
// (lane m mix m, lane M the squares; the loads all issued before the first is used: a chain
// of loads, each waiting for the last, costs a memory trip a chunk, and fp8_mma_hc leaves
// D / 32 chunks), then the split's simdgroup adds the 8 simdgroups' sums in order.
// The products are summed in another order than the spec's matmul and reductions,
// so results match the spec to float32 noise, not bit for bit; each row is computed
// alone, the same bits in any forward. Each thread keeps its features' values in registers
// (tid, tid + 256, ..; their loads all issued before the first is used), and the split runs
// on a simdgroup, a lane for each mix entry (hc_split_lanes.h): a row's work is a few
// kilobytes, so what it costs is latency, not bandwidth. Template constants: D, HC,
// ITERS, O, CH. 256 threads. CUDA twin: hc_input.cu.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
constexpr int PER = (D + 32 * WARPS - 1) / (32 * WARPS);  // a thread's features: tid, tid + 256, ..
constexpr bool EVEN = D % (32 * WARPS) == 0;  // then no feature needs a bounds check
constexpr int CPW = (CH + WARPS - 1) / WARPS;  // the chunks a simdgroup adds
static_assert(M < 32, "a lane for each mix and one for the squares");
threadgroup float partial[WARPS];
threadgroup float chunk_sums[WARPS][M + 1];
threadgroup float mix[M];

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
float v[CPW];  // this simdgroup's chunks of the mixes' totals (lane m mix m, lane M the squares), loaded first
for (int k = 0; k < CPW; k++) {
  const uint c = warp + k * WARPS;
  v[k] = lane <= uint(M) && c < uint(CH) ? parts[(row * CH + c) * (M + 1) + lane] : 0.0f;
}
const device bfloat16_t* hr = h + row * HD;
float p[HC];
for (int i = 0; i < HC; i++) {
  p[i] = pre_in[row * HC + i];
}
float w[PER];  // the norm's weights for this thread's features, read before they are needed
for (int k = 0; k < PER; k++) {
  const uint d = tid + k * 32 * WARPS;
  w[k] = EVEN || d < uint(D) ? norm_w[d] : 0.0f;
}

// the collapse (its RMS below), each thread's values kept in registers
float cb[PER];
float sq = 0.0f;
for (int k = 0; k < PER; k++) {
  const uint d = tid + k * 32 * WARPS;
  if (EVEN || d < uint(D)) {
    float c = p[0] * float(hr[d]);
    for (int i = 1; i < HC; i++) {
      c += p[i] * float(hr[i * D + d]);
    }
    cb[k] = float(bfloat16_t(c));
    sq += cb[k] * cb[k];
  }
}
for (ushort offset = 16; offset > 0; offset /= 2) {
  sq += simd_shuffle_xor(sq, offset);
}
if (lane <= uint(M)) {  // this simdgroup's chunks of the totals (their loads issued above)
  float t = v[0];
  for (int k = 1; k < CPW; k++) {
    t += v[k];
  }
  chunk_sums[warp][lane] = t;
}
if (lane == 0) {
  partial[warp] = sq;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float sq_all = partial[0];
for (int g = 1; g < WARPS; g++) {
  sq_all += partial[g];
}
const float r = metal::rsqrt(sq_all / float(D) + params[2]);
for (int k = 0; k < PER; k++) {  // D a multiple of 32: lanes hold a block's 32 values
  const uint d = tid + k * 32 * WARPS;
  if (EVEN || d < uint(D)) {
    const bfloat16_t xb = bfloat16_t(cb[k] * r * w[k]);
    x[row * D + d] = xb;
    xq[row * D + d] = static_cast<O>(bfloat16_t(fp8_fake_quant_lane(float(xb))));  // fp8_lane.h
  }
}

if (warp == 0) {  // the totals over the simdgroups, in order, then the split, a lane for each entry (hc_split_lanes.h)
  float t = 0.0f;
  if (lane <= uint(M)) {
    t = chunk_sums[0][lane];
    for (int g = 1; g < WARPS; g++) {
      t += chunk_sums[g][lane];
    }
  }
  const float rs = metal::rsqrt(simd_shuffle(t, ushort(M)) / float(HD) + params[0]);
  if (lane < uint(M)) {
    mix[lane] = t * rs;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  hc_split_lanes<HC, ITERS>(mix, scale, base, params[1], pre + row * HC, post + row * HC, comb + row * HC * HC,
                            lane);
}
