// CUDA twin of fp4_experts.metal (see there for what it computes and how the work is laid
// out). CUDA spelling of the same steps: mma.sync m16n8k16 (fp16 in, fp32 accumulate) holds
// the fragments in registers, so each lane decodes its own weight words instead of staging
// them in shared memory; a warp's walk over its blocks is mma_warp_sums (mma_x.cuh) with
// E2m1Codes: lane t takes one 32-bit word of each weight row a block (physical columns
// 8t .. 8t + 7) as its logical columns of the block's two k-steps:
//   k-step 0: (2t, 2t+1) <- (8t, 8t+4), (2t+8, 2t+9) <- (8t+1, 8t+5)
//   k-step 1: (2t, 2t+1) <- (8t+2, 8t+6), (2t+8, 2t+9) <- (8t+3, 8t+7)
// so each fp16 pair is codes i and i + 4 of the word (E2M1_HALF_PAIR), and x the same.

// U (a template constant, tuning.Layout.experts_loads_ahead): the blocks whose loads a warp issues before it uses the first
// PX: x and xs are mma_x_prep's (see fp4_experts.metal)
constexpr int COLS = 8 * NH;  // pass columns
__shared__ int picks[16];  // the pairs (r * KS + j, in order) that picked this expert: at most one a row
__shared__ int n_picks;
__shared__ float red[MMA_WARPS * 32 * COLS];  // each warp's sums [warp][row][column]
__shared__ uint4 staged[MMA_MAX_K / 16];  // the tile's weight scales (mma_tile_scales)
const int rows = sizes[0];
const int KS = sizes[1];  // experts per row (top-k)
const int N = sizes[2];
const int K = sizes[3];
const int X = sizes[4];   // 1: a row's slots share x[r, 0]; KS: slot j reads x[r, j]
const unsigned int tiles = (unsigned int)N / 32;
const int pair = (int)(blockIdx.x / tiles);
const unsigned int n0 = (blockIdx.x % tiles) * 32;  // the tile's first output
const unsigned int expert = ids[pair];
// a one-row launch: the row's experts are distinct, so `pair` is its expert's one pick, found without
// reading ids again (each read before the walk, and the barrier behind them, delays every warp's first loads)
const bool alone = rows == 1;
if (!alone) {
  for (int q = 0; q < pair; q++) {
    if (ids[q] == expert) {
      return;  // the whole block: the expert's first pair does all of its pairs
    }
  }
}
const unsigned int lane = threadIdx.x % 32;
const unsigned int g = lane / 4;  // lane 4g + t
if (!alone) {
  if (threadIdx.x == 0) {
    int m = 0;
    for (int p = pair; p < rows * KS; p++) {  // the pairs before `pair` did not pick it
      if (ids[p] == expert) {
        picks[m++] = p;
      }
    }
    n_picks = m;
  }
  __syncthreads();
}
const float limit = SW ? swiglu[0] : 0.0f;                 // read now, used after the walk
const float own_weight = SW == 2 && alone ? weights[pair] : 0.0f;  // likewise, a one-row launch's weight
const unsigned int nb = (unsigned int)K / 32;  // blocks of 32 columns, each with its own scale per row
const unsigned int per_warp = nb / MMA_WARPS;  // K a multiple of 256: the same count for every warp
const unsigned int b0 = threadIdx.x / 32 * per_warp;  // the warp's first block
const unsigned int words = (unsigned int)K / 8;
const size_t row0 = (size_t)expert * N + n0;   // the tile's first weight row
const unsigned char* tile_scales = mma_tile_scales<!ONE>(scales, row0, nb, staged);
const int m = alone ? 1 : n_picks;
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a pair has in y

for (int p0 = 0; p0 < m; p0 += COLS) {  // a pass: picks p0 .. p0 + COLS - 1
  const __nv_bfloat16* xrow[NH];  // B column 8h + g's x row (past the last pick: the pass's first, its sums unread)
  const float* xsrow[NH];         // PX: its scales, a block each
#pragma unroll
  for (int h = 0; h < NH; h++) {
    const int p = alone ? pair : p0 + 8 * h + (int)g < m ? picks[p0 + 8 * h + g] : picks[p0];
    const size_t r = (size_t)(X > 1 ? p : p / KS);
    xrow[h] = reinterpret_cast<const __nv_bfloat16*>(x) + r * K;  // (PX: fp16 bits, read as such)
    xsrow[h] = xs + r * nb;
  }
  float acc[2][NH][4] = {};  // [m group][column group][C fragment]
  mma_warp_sums<E2m1Codes, U, NH, QX, ONE, PX>(w, tile_scales, row0, words, nb, xrow, b0, per_warp, lane, acc, xsrow);
  mma_warp_sums_to<NH>(red, acc, lane);
  __syncthreads();
  for (unsigned int o = threadIdx.x; o < (SW ? 16u : 32u) * COLS; o += MMA_WARPS * 32) {
    const unsigned int col = o % COLS;
    const unsigned int out = o / COLS;  // with SW, pair `out`: rows 2 out (gate) and 2 out + 1 (up)
    if (p0 + (int)col < m) {
      float sum[2];
#pragma unroll
      for (int j = 0; j < (SW ? 2 : 1); j++) {  // each row's total over the warps, in warp order
        const unsigned int row = SW ? 2 * out + j : out;
        sum[j] = mma_warps_total<NH>(red, row, col);
      }
      const int pr = alone ? pair : picks[p0 + col];
      float v = SW ? gemv_swiglu(sum[0], sum[1], limit) : sum[0];
      if (SW == 2) {
        v = v * (alone ? own_weight : weights[pr]);  // the pair's routing weight
      }
      y[(size_t)pr * NY + (SW ? n0 / 2 : n0) + out] = __float2bfloat16(v);
    }
  }
  if (p0 + COLS < m) {
    __syncthreads();  // the next pass writes red again
  }
}
