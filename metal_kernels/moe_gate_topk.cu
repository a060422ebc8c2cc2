// CUDA twin of moe_gate_topk.metal (see there for what it computes). One warp a block.

__shared__ float choice[E];

const unsigned int row = blockIdx.x;
const unsigned int lane = threadIdx.x;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole block
}
const float neg_inf = __uint_as_float(0xff800000u);

for (unsigned int e = lane; e < E; e += 32) {  // a lane reads only the choices it writes: no barrier
  choice[e] = scores[row * E + e] + bias[e];
}

int picked[K];  // every lane holds the picks
for (int k = 0; k < K; k++) {
  float v = neg_inf;
  int i = E;
  for (unsigned int e = lane; e < E; e += 32) {  // ascending ids: a tie keeps the lower
    if (choice[e] > v) {
      v = choice[e];
      i = (int)e;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {  // every lane ends with the warp's best
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, i, offset);
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
  if ((unsigned int)i % 32 == lane) {
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
    ids[row * K + k] = (uint32_t)order[k];
  }
}
