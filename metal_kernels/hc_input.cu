// CUDA twin of hc_input.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
__shared__ float collapsed[D];
__shared__ float partial[WARPS][M + 1];
__shared__ float total[M + 1];

const unsigned int row = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole threadgroup
}
const __nv_bfloat16* hr = h + row * HD;

// the mixes' dot products and the row's sum of squares: thread t takes every 256th value
float acc[M + 1];
for (int m = 0; m <= M; m++) {
  acc[m] = 0.0f;
}
for (unsigned int j = tid; j < HD; j += 32 * WARPS) {
  const float v = __bfloat162float(hr[j]);
  for (int m = 0; m < M; m++) {
    acc[m] += v * fn[m * HD + j];
  }
  acc[M] += v * v;
}
for (int m = 0; m <= M; m++) {
  float a = acc[m];
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
  }
  if (lane == 0) {
    partial[warp][m] = a;
  }
}

// the collapse (its RMS below)
float sq = 0.0f;
for (unsigned int d = tid; d < D; d += 32 * WARPS) {
  float c = pre_in[row * HC] * __bfloat162float(hr[d]);
  for (int i = 1; i < HC; i++) {
    c += pre_in[row * HC + i] * __bfloat162float(hr[i * D + d]);
  }
  const float cb = __bfloat162float(__float2bfloat16(c));
  collapsed[d] = cb;
  sq += cb * cb;
}
for (int offset = 16; offset > 0; offset /= 2) {
  sq += __shfl_xor_sync(0xffffffffu, sq, offset);
}
__syncthreads();
if (tid <= M) {  // totals over the simdgroups, in order
  float t = partial[0][tid];
  for (int g = 1; g < WARPS; g++) {
    t += partial[g][tid];
  }
  total[tid] = t;
}
__syncthreads();
if (lane == 0) {
  partial[warp][0] = sq;  // the mixes' partials are summed already
}
__syncthreads();
float sq_all = partial[0][0];
for (int g = 1; g < WARPS; g++) {
  sq_all += partial[g][0];
}
const float r = rsqrtf(sq_all / float(D) + params[2]);
for (unsigned int d = tid; d < D; d += 32 * WARPS) {
  x[row * D + d] = __float2bfloat16(collapsed[d] * r * norm_w[d]);
}

if (tid == 0) {  // the split, as hc_split.cu
  const float rs = rsqrtf(total[M] / float(HD) + params[0]);
  float mix[M];
  for (int m = 0; m < M; m++) {
    mix[m] = total[m] * rs;
  }
  const float e = params[1];
  for (int i = 0; i < HC; i++) {
    pre[row * HC + i] = 1.0f / (1.0f + expf(-(mix[i] * scale[0] + base[i]))) + e;
    post[row * HC + i] = 2.0f * (1.0f / (1.0f + expf(-(mix[HC + i] * scale[1] + base[HC + i]))));
  }
  float c[HC * HC];
  for (int i = 0; i < HC; i++) {  // softmax over each row, then + eps
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = mix[2 * HC + i * HC + j] * scale[2] + base[2 * HC + i * HC + j];
    }
    float row_max = c[i * HC];
    for (int j = 1; j < HC; j++) {
      row_max = fmaxf(row_max, c[i * HC + j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = expf(c[i * HC + j] - row_max);
      sum += c[i * HC + j];
    }
    for (int j = 0; j < HC; j++) {
      c[i * HC + j] = c[i * HC + j] / sum + e;
    }
  }
  for (int it = 0; it < ITERS; it++) {
    if (it > 0) {  // rows (the first pass normalised them in the softmax)
      for (int i = 0; i < HC; i++) {
        float sum = 0.0f;
        for (int j = 0; j < HC; j++) {
          sum += c[i * HC + j];
        }
        for (int j = 0; j < HC; j++) {
          c[i * HC + j] = c[i * HC + j] / (sum + e);
        }
      }
    }
    for (int j = 0; j < HC; j++) {  // columns
      float sum = 0.0f;
      for (int i = 0; i < HC; i++) {
        sum += c[i * HC + j];
      }
      for (int i = 0; i < HC; i++) {
        c[i * HC + j] = c[i * HC + j] / (sum + e);
      }
    }
  }
  for (int k = 0; k < HC * HC; k++) {
    comb[row * HC * HC + k] = c[k];
  }
}
