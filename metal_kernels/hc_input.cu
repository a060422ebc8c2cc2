// CUDA twin of hc_input.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
__shared__ float collapsed[D];
__shared__ float partial[WARPS];
__shared__ float total[M + 1];

const unsigned int row = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole threadgroup
}
const __nv_bfloat16* hr = h + row * HD;

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
__syncthreads();
float sq_all = partial[0];
for (int g = 1; g < WARPS; g++) {
  sq_all += partial[g];
}
const float r = rsqrtf(sq_all / float(D) + params[2]);
for (unsigned int d = tid; d < D; d += 32 * WARPS) {  // D a multiple of 32: lanes hold a block's 32 values
  const __nv_bfloat16 xb = __float2bfloat16(collapsed[d] * r * norm_w[d]);
  x[row * D + d] = xb;
  xq[row * D + d] = static_cast<O>(__float2bfloat16(fp8_fake_quant_lane(__bfloat162float(xb))));
}

if (tid == 0) {  // the split (hc_split_row.cuh)
  const float rs = rsqrtf(total[M] / float(HD) + params[0]);
  float mix[M];
  for (int m = 0; m < M; m++) {
    mix[m] = total[m] * rs;
  }
  hc_split_row<HC, ITERS>(mix, scale, base, params[1], pre + row * HC, post + row * HC,
                          comb + row * HC * HC);
}
