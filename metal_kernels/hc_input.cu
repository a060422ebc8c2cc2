// CUDA twin of hc_input.metal (see there for what it computes). 256 threads per block.

constexpr int WARPS = 8;
constexpr int M = (2 + HC) * HC;
constexpr int HD = HC * D;
constexpr int PER = (D + 32 * WARPS - 1) / (32 * WARPS);  // a thread's features: tid, tid + 256, ..
constexpr bool EVEN = D % (32 * WARPS) == 0;  // then no feature needs a bounds check
constexpr int CPW = (CH + WARPS - 1) / WARPS;  // the chunks a warp adds
static_assert(M < 32, "a lane for each mix and one for the squares");
__shared__ float partial[WARPS];
__shared__ float chunk_sums[WARPS][M + 1];
__shared__ float mix[M];

const unsigned int row = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole threadgroup
}
float v[CPW];  // this warp's chunks of the mixes' totals (lane m mix m, lane M the squares), loaded first
#pragma unroll
for (int k = 0; k < CPW; k++) {
  const unsigned int c = warp + k * WARPS;
  v[k] = lane <= (unsigned int)M && c < (unsigned int)CH ? parts[(row * CH + c) * (M + 1) + lane] : 0.0f;
}
const __nv_bfloat16* hr = h + row * HD;
float p[HC];
for (int i = 0; i < HC; i++) {
  p[i] = pre_in[row * HC + i];
}
float w[PER];  // the norm's weights for this thread's features, read before they are needed
#pragma unroll
for (int k = 0; k < PER; k++) {
  const unsigned int d = tid + k * 32 * WARPS;
  w[k] = EVEN || d < (unsigned int)D ? norm_w[d] : 0.0f;
}

// the collapse (its RMS below), each thread's values kept in registers
float cb[PER];
float sq = 0.0f;
#pragma unroll
for (int k = 0; k < PER; k++) {
  const unsigned int d = tid + k * 32 * WARPS;
  if (EVEN || d < (unsigned int)D) {
    float c = p[0] * __bfloat162float(hr[d]);
    for (int i = 1; i < HC; i++) {
      c += p[i] * __bfloat162float(hr[i * D + d]);
    }
    cb[k] = __bfloat162float(__float2bfloat16(c));
    sq += cb[k] * cb[k];
  }
}
for (int offset = 16; offset > 0; offset /= 2) {
  sq += __shfl_xor_sync(0xffffffffu, sq, offset);
}
if (lane <= (unsigned int)M) {  // this warp's chunks of the totals (their loads issued above)
  float t = v[0];
#pragma unroll
  for (int k = 1; k < CPW; k++) {
    t += v[k];
  }
  chunk_sums[warp][lane] = t;
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
#pragma unroll
for (int k = 0; k < PER; k++) {  // D a multiple of 32: lanes hold a block's 32 values
  const unsigned int d = tid + k * 32 * WARPS;
  if (EVEN || d < (unsigned int)D) {
    const __nv_bfloat16 xb = __float2bfloat16(cb[k] * r * w[k]);
    x[row * D + d] = xb;
    xq[row * D + d] = static_cast<O>(__float2bfloat16(fp8_fake_quant_lane(__bfloat162float(xb))));
  }
}

if (warp == 0) {  // the totals over the warps, in order, then the split, a lane for each entry (hc_split_lanes.cuh)
  float t = 0.0f;
  if (lane <= (unsigned int)M) {
    t = chunk_sums[0][lane];
    for (int g = 1; g < WARPS; g++) {
      t += chunk_sums[g][lane];
    }
  }
  const float rs = rsqrtf(__shfl_sync(0xffffffffu, t, M) / float(HD) + params[0]);
  if (lane < (unsigned int)M) {
    mix[lane] = t * rs;
  }
  __syncwarp();
  hc_split_lanes<HC, ITERS>(mix, scale, base, params[1], pre + row * HC, post + row * HC, comb + row * HC * HC,
                            lane);
}
