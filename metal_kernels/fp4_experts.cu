// CUDA twin of fp4_experts.metal (see there for what it computes and how the work is laid
// out). CUDA spelling of the same steps: mma.sync m16n8k16 (fp16 in, fp32 accumulate) holds
// the fragments in registers, so each lane decodes its own weight words instead of staging
// them in shared memory.
//
// Fragment bookkeeping (PTX ISA, mma.m16n8k16 .f16; fp8_rows.cu): lane = 4 * g + t holds A
// rows g and g + 8 and logical K columns {2t, 2t+1, 2t+8, 2t+9} of each k-step, B column
// (pass column) g at the same K, C rows g, g + 8 and columns 2t, 2t + 1. A dot product does
// not care how K is ordered, so the two k-steps of a 32-column block take lane t's logical
// columns from the block's physical columns 8t .. 8t + 7, one 32-bit word of each weight row:
//   k-step 0: (2t, 2t+1) <- (8t, 8t+4), (2t+8, 2t+9) <- (8t+1, 8t+5)
//   k-step 1: (2t, 2t+1) <- (8t+2, 8t+6), (2t+8, 2t+9) <- (8t+3, 8t+7)
// so each fp16 pair is codes i and i + 4 of the word (E2M1_HALF_PAIR), and x the same.

constexpr int WARPS = 8;
constexpr int U = 2;  // blocks whose loads a warp issues before it uses the first (1, 2, 3: 2 the fastest, session 17)
constexpr int COLS = 8 * NH;  // pass columns
__shared__ int picks[16];  // the pairs (r * KS + j, in order) that picked this expert: at most one a row
__shared__ int n_picks;
__shared__ float red[WARPS * 32 * COLS];  // each warp's sums [warp][row][column]
const int rows = sizes[0];
const int KS = sizes[1];  // experts per row (top-k)
const int N = sizes[2];
const int K = sizes[3];
const int X = sizes[4];   // 1: a row's slots share x[r, 0]; KS: slot j reads x[r, j]
const unsigned int tiles = (unsigned int)N / 32;
const int pair = (int)(blockIdx.x / tiles);
const unsigned int n0 = (blockIdx.x % tiles) * 32;  // the tile's first output
const unsigned int expert = ids[pair];
for (int q = 0; q < pair; q++) {
  if (ids[q] == expert) {
    return;  // the whole block: the expert's first pair does all of its pairs
  }
}
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const unsigned int g = lane / 4;
const unsigned int t = lane % 4;
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
const int m = n_picks;
const unsigned int nb = (unsigned int)K / 32;  // blocks of 32 columns, each with its own scale per row
const unsigned int per_warp = nb / WARPS;      // K a multiple of 256: the same count for every warp
const unsigned int b0 = warp * per_warp;       // the warp's first block
const unsigned int words = (unsigned int)K / 8;
const size_t row0 = (size_t)expert * N + n0;   // the tile's first weight row
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a pair has in y

for (int p0 = 0; p0 < m; p0 += COLS) {  // a pass: picks p0 .. p0 + COLS - 1
  const __nv_bfloat16* xrow[NH];  // B column 8h + g's x row (past the last pick: the pass's first, its sums unread)
#pragma unroll
  for (int h = 0; h < NH; h++) {
    const int p = p0 + 8 * h + (int)g < m ? picks[p0 + 8 * h + g] : picks[p0];
    xrow[h] = x + (size_t)(X > 1 ? p : p / KS) * K;
  }
  constexpr bool single = ONE;  // a one-row launch's passes are of one pick: x read and scaled a value a lane
  float acc[2][NH][4] = {};  // [m group][column group][C fragment]
  for (unsigned int i0 = 0; i0 < per_warp; i0 += U) {
    unsigned int wq[U][2][2];  // [block][m group][row g, g + 8]: this lane's word of each row
    unsigned int ws[U][2][2];  // their scale bytes
    uint4 xv[U][NH];           // x at the block's columns 8t .. 8t + 7 of column 8h + g
    float x1[U];               // a single pick's x at the block's column `lane`
#pragma unroll
    for (int u = 0; u < U; u++) {
      const unsigned int b = b0 + min(i0 + u, per_warp - 1);  // past the warp's blocks: its last again, unused
#pragma unroll
      for (int mg = 0; mg < 2; mg++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const size_t r = row0 + 16 * mg + g + 8 * e;
          wq[u][mg][e] = __ldg(w + r * words + 4 * b + t);
          ws[u][mg][e] = scales[r * nb + b];
        }
      }
    }
    if (single) {  // (every lane alike) x's loads after all the weights'
#pragma unroll
      for (int u = 0; u < U; u++) {
        x1[u] = __bfloat162float(xrow[0][32 * (b0 + min(i0 + u, per_warp - 1)) + lane]);
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; u++) {
#pragma unroll
        for (int h = 0; h < NH; h++) {
          xv[u][h] = __ldg(reinterpret_cast<const uint4*>(xrow[h] + 32 * (b0 + min(i0 + u, per_warp - 1)) + 8 * t));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (i0 + u >= per_warp) {
        break;  // (every lane alike)
      }
      unsigned int bx[NH][4];  // fp16 pairs of x / s: (8t, 8t+4), (8t+1, 8t+5), (8t+2, 8t+6), (8t+3, 8t+7)
      float sx[NH][2];         // s of C columns 2t and 2t + 1
      if (single) {  // column 0 alone: its x a value a lane, then moved to lanes 4 * 0 + t
        float s;
        const float q = mma_x_column<QX>(x1[u], &s);
#pragma unroll
        for (int c = 0; c < 4; c++) {
          const unsigned int pair = float_pair_to_fp16_bits(__shfl_sync(0xffffffffu, q, 8 * t + c),
                                                            __shfl_sync(0xffffffffu, q, 8 * t + c + 4));
          bx[0][c] = g == 0 ? pair : 0u;  // the other columns zeros, their sums unread
        }
        sx[0][0] = s;  // column 0's (lanes t = 0); the rest unread
        sx[0][1] = s;
#pragma unroll
        for (int h = 1; h < NH; h++) {
          bx[h][0] = bx[h][1] = bx[h][2] = bx[h][3] = 0u;
          sx[h][0] = sx[h][1] = s;
        }
      } else {
#pragma unroll
        for (int h = 0; h < NH; h++) {
          float v[8];
          const float s = mma_x_lanes<QX>(xv[u][h], v);
#pragma unroll
          for (int c = 0; c < 4; c++) {
            bx[h][c] = float_pair_to_fp16_bits(v[c], v[c + 4]);
          }
          sx[h][0] = __shfl_sync(0xffffffffu, s, 8 * t);      // column 2t's x is lane 4 (2t)'s
          sx[h][1] = __shfl_sync(0xffffffffu, s, 8 * t + 4);
        }
      }
#pragma unroll
      for (int mg = 0; mg < 2; mg++) {
        const unsigned int wl = wq[u][mg][0];
        const unsigned int wh = wq[u][mg][1];
        const float f0 = __uint_as_float((ws[u][mg][0] + 14u) << 23);  // 2^(e-127) * 2^14, row g
        const float f1 = __uint_as_float((ws[u][mg][1] + 14u) << 23);  // row g + 8
#pragma unroll
        for (int h = 0; h < NH; h++) {
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the block's sums alone
#pragma unroll
          for (int ks = 0; ks < 2; ks++) {
            asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(E2M1_HALF_PAIR(wl, 2 * ks)), "r"(E2M1_HALF_PAIR(wh, 2 * ks)),
                  "r"(E2M1_HALF_PAIR(wl, 2 * ks + 1)), "r"(E2M1_HALF_PAIR(wh, 2 * ks + 1)),
                  "r"(bx[h][2 * ks]), "r"(bx[h][2 * ks + 1]));
          }
          acc[mg][h][0] = fmaf(d[0], f0 * sx[h][0], acc[mg][h][0]);
          acc[mg][h][1] = fmaf(d[1], f0 * sx[h][1], acc[mg][h][1]);
          acc[mg][h][2] = fmaf(d[2], f1 * sx[h][0], acc[mg][h][2]);
          acc[mg][h][3] = fmaf(d[3], f1 * sx[h][1], acc[mg][h][3]);
        }
      }
    }
  }

#pragma unroll
  for (int mg = 0; mg < 2; mg++) {
#pragma unroll
    for (int h = 0; h < NH; h++) {
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const unsigned int row = 16 * mg + g + 8 * (i / 2);
        const unsigned int col = 8 * h + 2 * t + i % 2;
        red[(warp * 32 + row) * COLS + col] = acc[mg][h][i];
      }
    }
  }
  __syncthreads();
  for (unsigned int o = threadIdx.x; o < (SW ? 16u : 32u) * COLS; o += WARPS * 32) {
    const unsigned int col = o % COLS;
    const unsigned int out = o / COLS;  // with SW, pair `out`: rows 2 out (gate) and 2 out + 1 (up)
    if (p0 + (int)col < m) {
      float sum[2];
#pragma unroll
      for (int j = 0; j < (SW ? 2 : 1); j++) {  // each row's total over the warps, in warp order
        const unsigned int row = SW ? 2 * out + j : out;
        sum[j] = red[row * COLS + col];
        for (int v = 1; v < WARPS; v++) {
          sum[j] += red[(v * 32 + row) * COLS + col];
        }
      }
      const int pr = picks[p0 + col];
      float v = SW ? gemv_swiglu(sum[0], sum[1], swiglu[0]) : sum[0];
      if (SW == 2) {
        v = v * weights[pr];  // the pair's routing weight
      }
      y[(size_t)pr * NY + (SW ? n0 / 2 : n0) + out] = __float2bfloat16(v);
    }
  }
  __syncthreads();  // the next pass writes red again
}
