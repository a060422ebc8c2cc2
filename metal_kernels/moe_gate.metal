// The MoE router of one decode or verify forward in one launch: a threadgroup per row.
//
// x [N, D] (T: bfloat16 or float32), w [E, D] float32 (the router's weight), bias [E]
// float32, params [2] float32 = (temperature, route scale), rows [1] int32 = N.
// Outputs: weights [N, K] float32, ids [N, K] uint32 (ascending).
//
// What kernels.moe_gate_reference computes: logit_e = (x . w_e) / temperature,
// score_e = sqrt(softplus(logit_e)) (softplus(l) = l above 20, log(1 + e^l) below),
// the K experts of largest score_e + bias_e (ties: the lower id), in ascending id
// order, weighted by their unbiased scores (divided by the sum of the K scores, added
// in id order, when NORMALIZE) times the route scale. Each row is computed alone, so a
// row's result does not depend on the others (the losslessness contract).
//
// The work: the row goes to threadgroup memory as float; simdgroup g takes experts
// g, g + 8, ..., each lane summing every 32nd product of the dot and the simdgroup
// adding the 32 partial sums in a butterfly; then K rounds of a threadgroup argmax
// over the biased scores. Template constants: T, D, E, K, NORMALIZE. 256 threads.
// CUDA twin: moe_gate.cu.

constexpr int WARPS = 8;
threadgroup float xs[D];
threadgroup float score[E];
threadgroup float choice[E];
threadgroup float best_v[WARPS];
threadgroup int best_i[WARPS];
threadgroup int picked[K];

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
const float neg_inf = as_type<float>(0xff800000u);

for (uint d = tid; d < D; d += 32 * WARPS) {
  xs[d] = float(x[row * D + d]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (uint e = warp; e < E; e += WARPS) {
  const device float* we = w + e * D;
  float acc = 0.0f;
  for (uint d = lane; d < D; d += 32) {
    acc += xs[d] * we[d];
  }
  for (ushort offset = 16; offset > 0; offset /= 2) {
    acc += simd_shuffle_xor(acc, offset);
  }
  if (lane == 0) {
    const float l = acc / params[0];
    // log(1 + v) without losing a small v to the rounding of 1 + v
    const float v = metal::exp(metal::min(l, 20.0f));
    const float u = 1.0f + v;
    const float soft = (u == 1.0f) ? v : metal::log(u) * (v / (u - 1.0f));
    score[e] = metal::sqrt(l > 20.0f ? l : soft);
    choice[e] = score[e] + bias[e];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int k = 0; k < K; k++) {
  float v = neg_inf;
  int i = E;
  for (uint e = tid; e < E; e += 32 * WARPS) {  // ascending ids: a tie keeps the lower
    if (choice[e] > v) {
      v = choice[e];
      i = int(e);
    }
  }
  for (ushort offset = 16; offset > 0; offset /= 2) {
    const float ov = simd_shuffle_xor(v, offset);
    const int oi = simd_shuffle_xor(i, offset);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = i;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float bv = best_v[0];
    int bi = best_i[0];
    for (int g = 1; g < WARPS; g++) {
      if (best_v[g] > bv || (best_v[g] == bv && best_i[g] < bi)) {
        bv = best_v[g];
        bi = best_i[g];
      }
    }
    picked[k] = bi;
    choice[bi] = neg_inf;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

if (tid == 0) {
  int order[K];
  for (int k = 0; k < K; k++) {  // insertion sort: ascending expert ids
    int j = k;
    while (j > 0 && order[j - 1] > picked[k]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = picked[k];
  }
  float total = 0.0f;
  for (int k = 0; k < K; k++) {
    total += score[order[k]];
  }
  for (int k = 0; k < K; k++) {
    const float s = score[order[k]];
    weights[row * K + k] = ((NORMALIZE && K > 1) ? s / (total + 1e-20f) : s) * params[1];
    ids[row * K + k] = uint(order[k]);
  }
}
