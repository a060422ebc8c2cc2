// CUDA twin of fp8_mma.metal (see there for what it computes and how the work is laid out).
// CUDA spelling of the same steps, as fp4_experts.cu: mma.sync m16n8k16 (fp16 in, fp32
// accumulate) with the fragments in registers. Lane = 4 * g + t holds A rows g and g + 8 of
// each 16 and, per 32-column block, the physical columns 8t .. 8t + 7 (8 bytes of each weight
// row) as its logical columns of the block's two k-steps:
//   k-step 0: (2t, 2t+1) <- (8t, 8t+2), (2t+8, 2t+9) <- (8t+1, 8t+3)
//   k-step 1: (2t, 2t+1) <- (8t+4, 8t+6), (2t+8, 2t+9) <- (8t+5, 8t+7)
// so each fp16 pair is E4M3_EVEN or E4M3_ODD of one of the two words, and x the same.

constexpr int WARPS = 8;
constexpr int U = 6;  // blocks whose loads a warp issues before it uses the first (2, 4, 6: 6 the fastest at 6 rows, session 18)
constexpr int COLS = 8 * NH;  // the matrix products' columns: the computed rows, padded
__shared__ float red[WARPS * 32 * COLS];  // each warp's sums [warp][output][row]
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const int out_rows = sizes[4];
const unsigned int tiles = (unsigned int)N / 32;
const unsigned int grp = blockIdx.x / tiles;  // the matrix (wo_a's group; 0 for a dense GEMM)
const unsigned int n0 = (blockIdx.x % tiles) * 32;  // the tile's first output
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const unsigned int g = lane / 4;
const unsigned int t = lane % 4;
const unsigned int nb = (unsigned int)K / 32;  // blocks of 32 columns, each with its own scale per row
const unsigned int per_warp = nb / WARPS;      // K a multiple of 256: the same count for every warp
const unsigned int b0 = warp * per_warp;       // the warp's first block
const unsigned int words = (unsigned int)K / 4;
const size_t row0 = (size_t)grp * N + n0;      // the tile's first weight row

const __nv_bfloat16* xrow[NH];  // B column 8h + g's x row (past the computed rows: the last one, its sums unread)
#pragma unroll
for (int h = 0; h < NH; h++) {
  const int r = min(8 * h + (int)g, rows - 1);
  xrow[h] = x + ((size_t)r * G + grp) * K;
}
constexpr bool single = ONE;  // a one-row launch (a decode step): x read and scaled a value a lane
float acc[2][NH][4] = {};  // [m group][column group][C fragment]
for (unsigned int i0 = 0; i0 < per_warp; i0 += U) {
  uint2 wq[U][2][2];         // [block][m group][row g, g + 8]: this lane's 8 bytes of each row
  unsigned int ws[U][2][2];  // their scale bytes
  uint4 xv[U][NH];           // x at the block's columns 8t .. 8t + 7 of column 8h + g
  float x1[U];               // a single row's x at the block's column `lane`
#pragma unroll
  for (int u = 0; u < U; u++) {
    const unsigned int b = b0 + min(i0 + u, per_warp - 1);  // past the warp's blocks: its last again, unused
#pragma unroll
    for (int mg = 0; mg < 2; mg++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const size_t r = row0 + 16 * mg + g + 8 * e;
        wq[u][mg][e] = __ldg(reinterpret_cast<const uint2*>(w + r * words + 8 * b + 2 * t));
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
    unsigned int bx[NH][4];  // fp16 pairs of x / s: (8t, 8t+2), (8t+1, 8t+3), (8t+4, 8t+6), (8t+5, 8t+7)
    float sx[NH][2];         // s of C columns 2t and 2t + 1
    if (single) {  // column 0 alone: its x a value a lane, then moved to lanes 4 * 0 + t
      float s;
      const float q = mma_x_column<QX>(x1[u], &s);
      const int lo[4] = {0, 1, 4, 5};  // the pairs (lo, lo + 2) of the fragment's layout above
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const unsigned int pair = float_pair_to_fp16_bits(__shfl_sync(0xffffffffu, q, 8 * t + lo[c]),
                                                          __shfl_sync(0xffffffffu, q, 8 * t + lo[c] + 2));
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
        bx[h][0] = float_pair_to_fp16_bits(v[0], v[2]);
        bx[h][1] = float_pair_to_fp16_bits(v[1], v[3]);
        bx[h][2] = float_pair_to_fp16_bits(v[4], v[6]);
        bx[h][3] = float_pair_to_fp16_bits(v[5], v[7]);
        sx[h][0] = __shfl_sync(0xffffffffu, s, 8 * t);      // column 2t's x is lane 4 (2t)'s
        sx[h][1] = __shfl_sync(0xffffffffu, s, 8 * t + 4);
      }
    }
#pragma unroll
    for (int mg = 0; mg < 2; mg++) {
      const uint2 wl = wq[u][mg][0];
      const uint2 wh = wq[u][mg][1];
      const float f0 = __uint_as_float((ws[u][mg][0] + 8u) << 23);  // 2^(e-127) * 256, row g
      const float f1 = __uint_as_float((ws[u][mg][1] + 8u) << 23);  // row g + 8
#pragma unroll
      for (int h = 0; h < NH; h++) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the block's sums alone
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
          const unsigned int lw = ks ? wl.y : wl.x;
          const unsigned int hw = ks ? wh.y : wh.x;
          asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
              "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
              : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
              : "r"(E4M3_EVEN(lw)), "r"(E4M3_EVEN(hw)), "r"(E4M3_ODD(lw)), "r"(E4M3_ODD(hw)),
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
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a matrix has in y
const unsigned int y0 = SW ? n0 / 2 : n0;                           // the tile's first output in y
for (unsigned int o = threadIdx.x; o < (SW ? 16u : 32u) * (unsigned int)out_rows; o += WARPS * 32) {
  const unsigned int r = o % (unsigned int)out_rows;  // the row (a padded forward's padding: zeros)
  const unsigned int out = o / (unsigned int)out_rows;  // with SW, pair `out`: rows 2 out (gate) and 2 out + 1 (up)
  float v = 0.0f;
  if ((int)r < rows) {
    float sum[2];
#pragma unroll
    for (int j = 0; j < (SW ? 2 : 1); j++) {  // each output's total over the warps, in warp order
      const unsigned int n = SW ? 2 * out + j : out;
      sum[j] = red[n * COLS + r];
      for (int q = 1; q < WARPS; q++) {
        sum[j] += red[(q * 32 + n) * COLS + r];
      }
    }
    v = SW ? gemv_swiglu(sum[0], sum[1], swiglu[0]) : sum[0];
    if (AP > 0) {  // the row's AP parts, in order, then this output as bf16
      const __nv_bfloat16* pr = parts + (size_t)r * AP * NY + y0 + out;
      float total = __bfloat162float(pr[0]);
      for (int j = 1; j < AP; j++) {
        total += __bfloat162float(pr[(size_t)j * NY]);
      }
      v = total + __bfloat162float(__float2bfloat16(v));
    }
  }
  y[((size_t)r * G + grp) * NY + y0 + out] = __float2bfloat16(v);
}
