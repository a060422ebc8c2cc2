// A sub-layer's input from the hyper-connection stream in one launch, a threadgroup per
// row (decode and verify forwards): what model.HyperConnection.sublayer_input computes with about
// eight operations.
//
// h [S, HC, D] bfloat16: the stream; pre_in [S, HC] float32: the collapse weights the
// previous sub-layer made; fn [M, HC * D], scale [3], base [M] float32: this sub-layer's
// mix parameters (M = (2 + HC) * HC); norm_w [D] float32: the sub-layer's RMSNorm weight;
// params [3] float32 = (hc norm eps, Sinkhorn eps, RMSNorm eps); rows [1] int32 = S.
// Outputs: x [S, D] bfloat16, the collapsed and normed input:
//   c_d = sum_i pre_in_i * h_id (fp32, i in order), rounded to bfloat16;
//   x_d = c_d * rsqrt(mean(c^2) + eps) * norm_w_d;
// xq [S, D] (O): x FP8 fake-quantised per 32 values (act_quant.metal, bit for bit on x),
// as the sub-layer's FP8 GEMMs take it;
// pre [S, HC], post [S, HC], comb [S, HC, HC] float32: this sub-layer's mixes, split
// (sigmoids, softmax and ITERS Sinkhorn passes, as hc_split.metal) from
//   mix_m = (h . fn_m) * rsqrt(mean(h^2) + hc norm eps)   over the flattened row.
// The products are summed in another order than the spec's matmul and reductions,
// so results match the spec to float32 noise, not bit for bit; each row is computed
// alone, the same bits in any forward. Template constants: D, HC, ITERS, O. 256 threads.
// CUDA twin: hc_input.cu.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
threadgroup float collapsed[D];
threadgroup float partial[WARPS][M + 1];
threadgroup float total[M + 1];

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
const device bfloat16_t* hr = h + row * HD;

// the mixes' dot products and the row's sum of squares: thread t takes every 256th value
float acc[M + 1];
for (int m = 0; m <= M; m++) {
  acc[m] = 0.0f;
}
for (uint j = tid; j < HD; j += 32 * WARPS) {
  const float v = float(hr[j]);
  for (int m = 0; m < M; m++) {
    acc[m] += v * fn[m * HD + j];
  }
  acc[M] += v * v;
}
for (int m = 0; m <= M; m++) {
  float a = acc[m];
  for (ushort offset = 16; offset > 0; offset /= 2) {
    a += simd_shuffle_xor(a, offset);
  }
  if (lane == 0) {
    partial[warp][m] = a;
  }
}

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
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid <= M) {  // totals over the simdgroups, in order
  float t = partial[0][tid];
  for (int g = 1; g < WARPS; g++) {
    t += partial[g][tid];
  }
  total[tid] = t;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (lane == 0) {
  partial[warp][0] = sq;  // the mixes' partials are summed already
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float sq_all = partial[0][0];
for (int g = 1; g < WARPS; g++) {
  sq_all += partial[g][0];
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
