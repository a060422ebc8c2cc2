// CUDA twin of sparse_attention.metal (see there for what it computes): 32 * WARPS threads a block.

constexpr int N = W + K;
constexpr int CH = D / 8;            // a key row's chunks of 8 features (16 bytes each)
constexpr int LCH = (CH + 31) / 32;  // the chunks a lane takes in the scores
constexpr int SUM_WARPS = 8;         // the warps of the softmax and the weighted sum (any WARPS >= 8)
constexpr int P = 32 * SUM_WARPS / CH;  // the key subsets of the weighted sum
__shared__ float qs[G][D];
__shared__ float sc[G][N];
__shared__ int key_row[N];
__shared__ float red[SUM_WARPS];
__shared__ float denom[G];
__shared__ float subset_sum[P][G][D];

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

// scores: warp w takes keys w, w + 8, ...; lane l the chunks l, l + 32, ... of each (its queries' in registers)
float qr[G][LCH][8];
#pragma unroll
for (int g = 0; g < G; g++) {
#pragma unroll
  for (int c = 0; c < LCH; c++) {
#pragma unroll
    for (int e = 0; e < 8; e++) {
      qr[g][c][e] = lane + 32 * c < CH ? qs[g][8 * (lane + 32 * c) + e] : 0.0f;
    }
  }
}
#pragma unroll 4
for (unsigned int j = warp; j < N; j += WARPS) {  // (unrolled: four keys' reads in flight a warp)
  const __nv_bfloat16* key = ((j < W) ? ring : kv) + (size_t)key_row[j] * D;
  const bool valid = (j < W) ? wmask[s * W + j] : pmask[s * K + (j - W)];
  float dot[G] = {};
#pragma unroll
  for (int c = 0; c < LCH; c++) {
    if (lane + 32 * c < CH) {
      float kf[8];
      bf16x8_floats(__ldg(reinterpret_cast<const uint4*>(key + 8 * (lane + 32 * c))), kf);
#pragma unroll
      for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
          dot[g] = fmaf(qr[g][c][e], kf[e], dot[g]);
        }
      }
    }
  }
#pragma unroll
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

// per head: the row max, the probabilities (kept rounded to bf16) and their sum, by the first
// SUM_WARPS warps whatever WARPS is, so that the sum runs in one order
for (int g = 0; g < G; g++) {
  if (warp < SUM_WARPS) {
    float m = neg_inf;
    for (unsigned int j = tid; j < N; j += 32 * SUM_WARPS) {
      m = fmaxf(m, sc[g][j]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (lane == 0) {
      red[warp] = m;
    }
  }
  __syncthreads();
  float row_max = red[0];
  for (int w = 1; w < SUM_WARPS; w++) {
    row_max = fmaxf(row_max, red[w]);
  }
  row_max = fmaxf(row_max, -1e30f);
  __syncthreads();  // everyone has read red
  if (warp < SUM_WARPS) {
    float sum = 0.0f;
    for (unsigned int j = tid; j < N; j += 32 * SUM_WARPS) {
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
  }
  __syncthreads();
  if (tid == 0) {
    float total = red[0];
    for (int w = 1; w < SUM_WARPS; w++) {
      total += red[w];
    }
    denom[g] = total + expf(sink[h0 + g] - row_max);
  }
  __syncthreads();
}

// the weighted keys: thread t < 256 takes chunk t % CH of keys t / CH, t / CH + P, ... (window
// keys first, then picked ones), the P subsets' sums then added in order
if (tid < P * CH) {
  const unsigned int ch = tid % CH;
  const unsigned int subset = tid / CH;
  float acc[G][8] = {};
#pragma unroll 8
  for (unsigned int j = subset; j < N; j += P) {  // (unrolled: eight keys' reads in flight a thread)
    const __nv_bfloat16* key = ((j < W) ? ring : kv) + (size_t)key_row[j] * D;
    float kf[8];
    bf16x8_floats(__ldg(reinterpret_cast<const uint4*>(key + 8 * ch)), kf);
#pragma unroll
    for (int g = 0; g < G; g++) {
      const float p = sc[g][j];
#pragma unroll
      for (int e = 0; e < 8; e++) {
        acc[g][e] = fmaf(p, kf[e], acc[g][e]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; g++) {
#pragma unroll
    for (int e = 0; e < 8; e++) {
      subset_sum[subset][g][8 * ch + e] = acc[g][e];
    }
  }
}
__syncthreads();
for (unsigned int i = tid; i < G * D; i += 32 * WARPS) {
  float t = subset_sum[0][i / D][i % D];
  for (int p = 1; p < P; p++) {
    t += subset_sum[p][i / D][i % D];
  }
  qs[i / D][i % D] = __bfloat162float(__float2bfloat16(t / denom[i / D]));  // the spec's o; qs is free
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
