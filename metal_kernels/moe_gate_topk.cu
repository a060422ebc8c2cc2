// CUDA twin of moe_gate_topk.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
__shared__ float score[E];
__shared__ float choice[E];
__shared__ float best_v[WARPS];
__shared__ int best_i[WARPS];
__shared__ int picked[K];

const unsigned int row = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole block
}
const float neg_inf = __uint_as_float(0xff800000u);

for (unsigned int e = tid; e < E; e += 32 * WARPS) {
  score[e] = scores[row * E + e];
  choice[e] = score[e] + bias[e];
}
__syncthreads();

for (int k = 0; k < K; k++) {
  float v = neg_inf;
  int i = E;
  for (unsigned int e = tid; e < E; e += 32 * WARPS) {  // ascending ids: a tie keeps the lower
    if (choice[e] > v) {
      v = choice[e];
      i = (int)e;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, i, offset);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = i;
  }
  __syncthreads();
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
  __syncthreads();
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
    ids[row * K + k] = (uint32_t)order[k];
  }
}
