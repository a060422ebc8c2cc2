// The MoE router's choice for a decode or verify forward, a simdgroup per row: the K
// experts of largest score_e + bias_e (ties: the lower id), in ascending id order,
// weighted by their unbiased scores (divided by the sum of the K scores, added in id
// order, when NORMALIZE) times the route scale. The scores come from
// moe_gate_scores.metal.
//
// scores [rows, E] float32, bias [E] float32, params [1] float32 = (route scale,),
// rows [1] int32. Outputs: weights [rows, K] float32, ids [rows, K] uint32. K rounds of a
// simdgroup argmax over the biased scores (lane l holds experts l, l + 32, ...; the
// shuffles leave every lane with the best). Template constants:
// E, K, NORMALIZE. 32 threads. CUDA twin: moe_gate_topk.cu.

threadgroup float choice[E];

const uint row = threadgroup_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
const float neg_inf = as_type<float>(0xff800000u);

for (uint e = lane; e < E; e += 32) {  // a lane reads only the choices it writes: no barrier
  choice[e] = scores[row * E + e] + bias[e];
}

int picked[K];  // every lane holds the picks
for (int k = 0; k < K; k++) {
  float v = neg_inf;
  int i = E;
  for (uint e = lane; e < E; e += 32) {  // ascending ids: a tie keeps the lower
    if (choice[e] > v) {
      v = choice[e];
      i = (int)e;
    }
  }
  for (ushort offset = 16; offset > 0; offset /= 2) {  // every lane ends with the simdgroup's best
    const float ov = simd_shuffle_xor(v, offset);
    const int oi = simd_shuffle_xor(i, offset);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  if (i >= E) {  // no finite score left (NaN or -inf input): the lowest id not yet picked
    for (i = 0; i < E; i++) {
      bool used = false;
      for (int p = 0; p < k; p++) {
        used = used || picked[p] == i;
      }
      if (!used) {
        break;
      }
    }
  }
  picked[k] = i;
  if (uint(i) % 32 == lane) {
    choice[i] = neg_inf;
  }
}

if (lane == 0) {
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
    total += scores[row * E + order[k]];
  }
  for (int k = 0; k < K; k++) {
    const float s = scores[row * E + order[k]];
    weights[row * K + k] = ((NORMALIZE && K > 1) ? s / (total + 1e-20f) : s) * params[0];
    ids[row * K + k] = uint(order[k]);
  }
}
