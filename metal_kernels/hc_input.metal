// A sub-layer's input from the hyper-connection stream, a threadgroup per row (decode and
// verify forwards), after hc_mix.metal: together what model.HyperConnection.sublayer_input
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
// each total the row's CH chunk sums added in order.
// The products are summed in another order than the spec's matmul and reductions,
// so results match the spec to float32 noise, not bit for bit; each row is computed
// alone, the same bits in any forward. Template constants: D, HC, ITERS, O, CH.
// 256 threads. CUDA twin: hc_input.cu.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
threadgroup float collapsed[D];
threadgroup float partial[WARPS];
threadgroup float total[M + 1];

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
const device bfloat16_t* hr = h + row * HD;

// the collapse (its RMS below)
float sq = 0.0f;
for (uint d = tid; d < D; d += 32 * WARPS) {
  float c = pre_in[row * HC] * float(hr[d]);
  for (int i = 1; i < HC; i++) {
    c += pre_in[row * HC + i] * float(hr[i * D + d]);
  }
  const float cb = float(bfloat16_t(c));
  collapsed[d] = cb;
  sq += cb * cb;
}
for (ushort offset = 16; offset > 0; offset /= 2) {
  sq += simd_shuffle_xor(sq, offset);
}
if (tid <= M) {  // the mixes' totals over hc_mix's chunks, in order
  float t = parts[row * CH * (M + 1) + tid];
  for (int c = 1; c < CH; c++) {
    t += parts[(row * CH + c) * (M + 1) + tid];
  }
  total[tid] = t;
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
for (uint d = tid; d < D; d += 32 * WARPS) {  // D a multiple of 32: lanes hold a block's 32 values
  const bfloat16_t xb = bfloat16_t(collapsed[d] * r * norm_w[d]);
  x[row * D + d] = xb;
  xq[row * D + d] = static_cast<O>(bfloat16_t(fp8_fake_quant_lane(float(xb))));  // fp8_lane.h
}

if (tid == 0) {  // the split (hc_split_row.h)
  const float rs = metal::rsqrt(total[M] / float(HD) + params[0]);
  float mix[M];
  for (int m = 0; m < M; m++) {
    mix[m] = total[m] * rs;
  }
  hc_split_row<HC, ITERS>(mix, scale, base, params[1], pre + row * HC, post + row * HC,
                          comb + row * HC * HC);
}
