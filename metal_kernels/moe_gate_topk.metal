// The MoE router's choice for a decode or verify forward, a threadgroup per row: the K
// experts of largest score_e + bias_e (ties: the lower id), in ascending id order,
// weighted by their unbiased scores (divided by the sum of the K scores, added in id
// order, when NORMALIZE) times the route scale. The scores come from
// moe_gate_scores.metal.
//
// scores [rows, E] float32, bias [E] float32, params [1] float32 = (route scale,),
// rows [1] int32. Outputs: weights [rows, K] float32, ids [rows, K] uint32. K rounds of a
// threadgroup argmax over the biased scores. Template constants: E, K, NORMALIZE.
// 256 threads. CUDA twin: moe_gate_topk.cu.

constexpr int WARPS = 8;
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

for (uint e = tid; e < E; e += 32 * WARPS) {
  score[e] = scores[row * E + e];
  choice[e] = score[e] + bias[e];
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
    if (bi >= E) {  // no finite score left (NaN or -inf input): the lowest id not yet picked
      for (bi = 0; bi < E; bi++) {
        bool used = false;
        for (int p = 0; p < k; p++) {
          used = used || picked[p] == bi;
        }
        if (!used) {
          break;
        }
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
    weights[row * K + k] = ((NORMALIZE && K > 1) ? s / (total + 1e-20f) : s) * params[0];
    ids[row * K + k] = uint(order[k]);
  }
}
