// CUDA twin of sparse_attention.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
constexpr int N = W + K;
__shared__ float qs[G][D];
__shared__ float sc[G][N];
__shared__ int key_row[N];
__shared__ float red[WARPS];
__shared__ float denom[G];

const unsigned int groups = H / G;
const unsigned int s = blockIdx.x / groups;
const unsigned int h0 = (blockIdx.x % groups) * G;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
if (s >= (unsigned int)rows[0]) {  // a padding row: zeros (the whole block)
  for (unsigned int i = tid; i < G * D; i += 32 * WARPS) {
    out[(s * H + h0) * D + i] = __float2bfloat16(0.0f);
  }
  return;
}
const float neg_inf = __uint_as_float(0xff800000u);
const float scale = params[0];

// the queries, their last RD features rotated (rounded to bf16, as the spec's rotated q is)
const unsigned int q0 = (s * H + h0) * D;
for (unsigned int i = tid; i < G * D; i += 32 * WARPS) {
  const unsigned int d = i % D;
  float v = __bfloat162float(q[q0 + i]);
  if (d >= D - RD) {
    v = __bfloat162float(__float2bfloat16(v * rope_cos[s * D + d] +
                                          __bfloat162float(q[q0 + (i ^ 1)]) * rope_sin[s * D + d]));
  }
  qs[i / D][d] = v;
}
for (unsigned int j = tid; j < N; j += 32 * WARPS) {
  key_row[j] = (j < W) ? (int)index[s * W + j] : (int)ids[s * K + (j - W)];
}
__syncthreads();

// scores: warp w takes keys w, w + 8, ...; its lanes split the features
for (unsigned int j = warp; j < N; j += WARPS) {
  const __nv_bfloat16* key = ((j < W) ? ring : kv) + (size_t)key_row[j] * D;
  const bool valid = (j < W) ? wmask[s * W + j] : pmask[s * K + (j - W)];
  float dot[G];
  for (int g = 0; g < G; g++) {
    dot[g] = 0.0f;
  }
  for (unsigned int d = lane; d < D; d += 32) {
    const float kd = __bfloat162float(key[d]);
    for (int g = 0; g < G; g++) {
      dot[g] += qs[g][d] * kd;
    }
  }
  for (int g = 0; g < G; g++) {
    float a = dot[g];
    for (int offset = 16; offset > 0; offset /= 2) {
      a += __shfl_xor_sync(0xffffffffu, a, offset);
    }
    if (lane == 0) {
      sc[g][j] = valid ? a * scale : neg_inf;
    }
  }
}
__syncthreads();

// per head: the row max, the probabilities (kept rounded to bf16) and their sum
for (int g = 0; g < G; g++) {
  float m = neg_inf;
  for (unsigned int j = tid; j < N; j += 32 * WARPS) {
    m = fmaxf(m, sc[g][j]);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  if (lane == 0) {
    red[warp] = m;
  }
  __syncthreads();
  float row_max = red[0];
  for (int w = 1; w < WARPS; w++) {
    row_max = fmaxf(row_max, red[w]);
  }
  row_max = fmaxf(row_max, -1e30f);
  __syncthreads();  // everyone has read red
  float sum = 0.0f;
  for (unsigned int j = tid; j < N; j += 32 * WARPS) {
    const float p = expf(sc[g][j] - row_max);
    sum += p;
    sc[g][j] = __bfloat162float(__float2bfloat16(p));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  if (lane == 0) {
    red[warp] = sum;
  }
  __syncthreads();
  if (tid == 0) {
    float total = red[0];
    for (int w = 1; w < WARPS; w++) {
      total += red[w];
    }
    denom[g] = total + expf(sink[h0 + g] - row_max);
  }
  __syncthreads();
}

// the weighted keys: thread t takes features t, t + 256, ...; window keys, then picked ones
for (unsigned int d = tid; d < D; d += 32 * WARPS) {
  float win[G], pick[G];
  for (int g = 0; g < G; g++) {
    win[g] = 0.0f;
    pick[g] = 0.0f;
  }
  for (int j = 0; j < W; j++) {
    const float kd = __bfloat162float(ring[(size_t)key_row[j] * D + d]);
    for (int g = 0; g < G; g++) {
      win[g] += sc[g][j] * kd;
    }
  }
  for (int j = W; j < N; j++) {
    const float kd = __bfloat162float(kv[(size_t)key_row[j] * D + d]);
    for (int g = 0; g < G; g++) {
      pick[g] += sc[g][j] * kd;
    }
  }
  for (int g = 0; g < G; g++) {
    qs[g][d] = __bfloat162float(__float2bfloat16((win[g] + pick[g]) / denom[g]));  // the spec's o; qs is free
  }
}
__syncthreads();

// the inverse RoPE of o: a pair's two features were written by two threads
for (unsigned int i = tid; i < G * D; i += 32 * WARPS) {
  const unsigned int d = i % D;
  float v = qs[i / D][d];
  if (d >= D - RD) {
    v = v * rope_cos[s * D + d] + qs[i / D][d ^ 1] * -rope_sin[s * D + d];
  }
  out[q0 + i] = __float2bfloat16(v);
}
