// CUDA twin of mma_x.h (see there for what it computes).
template <int QX>  // lane 4g + t: pass column g's values 8t .. 8t + 7 of the block, p -> v = x / s; returns s
__device__ __forceinline__ float mma_x_lanes(const uint4 p, float* v) {
  bf16x8_floats(p, v);
  float amax = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; c++) {
    amax = fmaxf(amax, fabsf(v[c]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));  // the block's 32 values, 8 a lane
  const float s = fp8_block_scale(amax);
  const float inv = __uint_as_float((254u - (__float_as_uint(s) >> 23)) << 23);  // 1 / s, exact
#pragma unroll
  for (int c = 0; c < 8; c++) {
    v[c] = (QX ? fp8_fake_quant_value(v[c], s) : v[c]) * inv;
  }
  return s;
}

template <int QX>  // lane l: the one pass column's value at column l of the block -> x / s; *s_out = s
__device__ __forceinline__ float mma_x_column(const float v, float* s_out) {
  float amax = fabsf(v);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float s = fp8_block_scale(amax);
  *s_out = s;
  return (QX ? fp8_fake_quant_value(v, s) : v) * __uint_as_float((254u - (__float_as_uint(s) >> 23)) << 23);
}

// The weight side (A operand) and one warp's walk over K, shared by the CUDA matrix-unit
// kernels (CUDA only: the Metal twins stage their decoded tiles in threadgroup memory and
// each spell their own loop). Fragment bookkeeping (PTX ISA, mma.m16n8k16 .f16; fp8_rows.cu):
// lane = 4 * g + t holds A rows g and g + 8 and logical K columns {2t, 2t+1, 2t+8, 2t+9} of
// each k-step, B column g at the same K, C rows g, g + 8 and columns 2t, 2t + 1. A dot product
// does not care how K is ordered, so the two k-steps of a 32-column block take lane t's
// logical columns from the block's physical columns 8t .. 8t + 7; a code format says which:
// B pair c (registers 2 ks, 2 ks + 1 of the fragment, c = 0..3) is physical columns
// 8t + pair_first(c) and 8t + pair_first(c) + PAIR_GAP, the A registers likewise.
constexpr int MMA_WARPS = 8;  // the warps of a threadgroup, splitting K

// fp16 values i and j of 8 (a uint4, value 0 in the low half of .x) as a B register: i low, j high
__device__ __forceinline__ unsigned int fp16_pair(const uint4 v, int i, int j) {
  const unsigned int a = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  const unsigned int b = j < 2 ? v.x : j < 4 ? v.y : j < 6 ? v.z : v.w;
  return ((i & 1) ? a >> 16 : a & 0xffffu) | ((j & 1) ? b & 0xffff0000u : b << 16);
}

struct E2m1Codes {  // fp4_experts: one 32-bit word (8 codes) of a weight row a lane and block
  using Word = unsigned int;
  static constexpr unsigned int PAIR_GAP = 4;  // codes i and i + 4 of the word (E2M1_HALF_PAIR)
  static constexpr unsigned int SCALE_BIAS = 14u;  // the decoding's 2^-14, folded into the scale
  __device__ static unsigned int pair_first(int c) { return (unsigned int)c; }
  __device__ static Word load(const unsigned int* w, size_t row, unsigned int b, unsigned int t) {
    return __ldg(w + row + 4 * b + t);
  }
  __device__ static unsigned int a(Word w, int ks, int half) { return E2M1_HALF_PAIR(w, 2 * ks + half); }
};

struct E4m3Codes {  // fp8_mma: two 32-bit words (8 codes) of a weight row a lane and block
  using Word = uint2;
  static constexpr unsigned int PAIR_GAP = 2;  // bytes 0 and 2 or 1 and 3 of a word (E4M3_EVEN / ODD)
  static constexpr unsigned int SCALE_BIAS = 8u;  // the decoding's 2^-8, folded into the scale
  __device__ static unsigned int pair_first(int c) { return (unsigned int)(c + (c & 2)); }  // 0, 1, 4, 5
  __device__ static Word load(const unsigned int* w, size_t row, unsigned int b, unsigned int t) {
    return __ldg(reinterpret_cast<const uint2*>(w + row + 8 * b + 2 * t));
  }
  __device__ static unsigned int a(Word w, int ks, int half) {
    const unsigned int v = ks ? w.y : w.x;
    return half ? E4M3_ODD(v) : E4M3_EVEN(v);
  }
};

// A tile's weight scales: rows row0 .. row0 + TR - 1 of the scales [rows, nb] bytes, TR nb
// contiguous bytes (TR the tile's rows: 32, or fp8_mma's 16), as the walk (mma_warp_sums)
// reads them, [TR][nb] from the pointer returned.
// STAGE (a launch that computes more than one row): the threadgroup first reads them into
// shared memory `tile` at once, 16 bytes a read where they are 16-byte aligned, then waits
// (__syncthreads), and the walk reads them there; otherwise straight from memory, a byte from
// each of 8 rows a load, every lane, every block. Staging pays at more than one row, where the
// walk's own scale loads are a large share of fp4_experts' time; at one row, where a
// threadgroup's walk is short, the wait before its first weight loads costs fp8_mma more than
// it saves. K at most MMA_MAX_K (kernels.MMA_MAX_K; K a multiple of 256): `tile` holds
// MMA_MAX_K bytes, a 32-row tile's.
constexpr unsigned int MMA_MAX_K = 8192;
template <bool STAGE, int TR = 32, class S>
__device__ __forceinline__ const unsigned char* mma_tile_scales(const S* scales, size_t row0, unsigned int nb,
                                                                uint4* tile) {
  const unsigned char* from = reinterpret_cast<const unsigned char*>(scales) + row0 * nb;
  if (!STAGE) {
    return from;
  }
  const unsigned int n = TR * nb;
  if (reinterpret_cast<size_t>(from) % 16 == 0) {
    for (unsigned int i = threadIdx.x; i < n / 16; i += MMA_WARPS * 32) {
      tile[i] = __ldg(reinterpret_cast<const uint4*>(from) + i);
    }
  } else {
    unsigned char* to = reinterpret_cast<unsigned char*>(tile);
    for (unsigned int i = threadIdx.x; i < n; i += MMA_WARPS * 32) {
      to[i] = from[i];
    }
  }
  __syncthreads();
  return reinterpret_cast<const unsigned char*>(tile);
}

// One warp's share of a tile of 16 MGS weight rows (MGS m groups of 16: 2, or 1 in fp8_mma's
// 16-row tiles; row0 .. row0 + 16 MGS - 1 of w, `words` 32-bit words a row; their scales `nb`
// bytes a row, from mma_tile_scales) in the 32-column blocks b0 .. b0 + per_warp - 1, times B
// columns 8h + g (xrow[h]: bf16 x of the whole K): each block's products summed by the matrix
// unit in fp32, then times both scales into acc [m group][column group][C fragment]. A row's
// sums do not depend on MGS: its m group's products are the same either way.
// `lane`: threadIdx.x % 32, computed by the kernel up front (so ptxas keeps the
// registers of the kernels before this helper: 64 for fp4_experts at NH 1). U blocks' loads
// are issued before the first is used. ONE: column 0 alone (a one-row
// launch), its x read a value a lane (mma_x_column), the other columns zeros, their sums unread.
// PX: x is already x / s, as fp16 bits (mma_x_prep), and xsrow[h] column 8h + g's scales s a
// block: the same B fragments and scales, read instead of computed by every threadgroup.
template <class Codes, int U, int NH, int QX, bool ONE, int PX = 0, int MGS, class W>
__device__ __forceinline__ void mma_warp_sums(const W* w, const unsigned char* scales, size_t row0, unsigned int words,
                                              unsigned int nb, const __nv_bfloat16* const* xrow, unsigned int b0,
                                              unsigned int per_warp, unsigned int lane, float (&acc)[MGS][NH][4],
                                              const float* const* xsrow = nullptr) {
  const unsigned int g = lane / 4;
  const unsigned int t = lane % 4;
  for (unsigned int i0 = 0; i0 < per_warp; i0 += U) {
    typename Codes::Word wq[U][MGS][2];  // [block][m group][row g, g + 8]: this lane's codes of each row
    unsigned int ws[U][MGS][2];          // their scale bytes
    uint4 xv[U][NH];                   // x (PX: x / s) at the block's columns 8t .. 8t + 7 of column 8h + g
    float x1[U];                       // ONE: column 0's x at the block's column `lane`
    float xs[U][NH];                   // PX: column 8h + g's s of the block
#pragma unroll
    for (int u = 0; u < U; u++) {
      const unsigned int b = b0 + min(i0 + u, per_warp - 1);  // past the warp's blocks: its last again, unused
#pragma unroll
      for (int mg = 0; mg < MGS; mg++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const unsigned int r = 16 * mg + g + 8 * e;  // the tile's row
          wq[u][mg][e] = Codes::load(w, (row0 + r) * words, b, t);
          ws[u][mg][e] = scales[r * nb + b];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {  // (every lane alike) x's loads after all the weights'
      const unsigned int b = b0 + min(i0 + u, per_warp - 1);
      if (PX) {  // ONE: column 0's, in lanes 4 * 0 + t (the other lanes' B registers are zeros)
#pragma unroll
        for (int h = 0; h < (ONE ? 1 : NH); h++) {
          if (!ONE || g == 0) {
            xv[u][h] = __ldg(reinterpret_cast<const uint4*>(xrow[h] + 32 * b + 8 * t));
          }
          xs[u][h] = xsrow[h][b];
        }
      } else if (ONE) {
        x1[u] = __bfloat162float(xrow[0][32 * b + lane]);
      } else {
#pragma unroll
        for (int h = 0; h < NH; h++) {
          xv[u][h] = __ldg(reinterpret_cast<const uint4*>(xrow[h] + 32 * b + 8 * t));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (i0 + u >= per_warp) {
        break;  // (every lane alike)
      }
      unsigned int bx[NH][4];  // B pairs c = 0..3 of x / s (see pair_first)
      float sx[NH][2];         // s of C columns 2t and 2t + 1
      if (PX) {
#pragma unroll
        for (int h = 0; h < NH; h++) {
#pragma unroll
          for (int c = 0; c < 4; c++) {
            bx[h][c] = (ONE && (h > 0 || g != 0)) ? 0u
                       : fp16_pair(xv[u][h], Codes::pair_first(c), Codes::pair_first(c) + Codes::PAIR_GAP);
          }
          sx[h][0] = ONE ? xs[u][0] : __shfl_sync(0xffffffffu, xs[u][h], 8 * t);  // column 2t's x is lane 4 (2t)'s
          sx[h][1] = ONE ? xs[u][0] : __shfl_sync(0xffffffffu, xs[u][h], 8 * t + 4);
        }
      } else if (ONE) {  // column 0's x a value a lane, moved to lanes 4 * 0 + t
        float s;
        const float q = mma_x_column<QX>(x1[u], &s);
#pragma unroll
        for (int c = 0; c < 4; c++) {
          const unsigned int pair = float_pair_to_fp16_bits(
              __shfl_sync(0xffffffffu, q, 8 * t + Codes::pair_first(c)),
              __shfl_sync(0xffffffffu, q, 8 * t + Codes::pair_first(c) + Codes::PAIR_GAP));
          bx[0][c] = g == 0 ? pair : 0u;
        }
        sx[0][0] = sx[0][1] = s;  // column 0's (lanes t = 0); the rest unread
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
            bx[h][c] = float_pair_to_fp16_bits(v[Codes::pair_first(c)], v[Codes::pair_first(c) + Codes::PAIR_GAP]);
          }
          sx[h][0] = __shfl_sync(0xffffffffu, s, 8 * t);  // column 2t's x is lane 4 (2t)'s
          sx[h][1] = __shfl_sync(0xffffffffu, s, 8 * t + 4);
        }
      }
#pragma unroll
      for (int mg = 0; mg < MGS; mg++) {
        const float f0 = __uint_as_float((ws[u][mg][0] + Codes::SCALE_BIAS) << 23);  // 2^(e-127) times the bias, row g
        const float f1 = __uint_as_float((ws[u][mg][1] + Codes::SCALE_BIAS) << 23);  // row g + 8
#pragma unroll
        for (int h = 0; h < NH; h++) {
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the block's sums alone
#pragma unroll
          for (int ks = 0; ks < 2; ks++) {
            mma_m16n8k16(d, Codes::a(wq[u][mg][0], ks, 0), Codes::a(wq[u][mg][1], ks, 0),
                         Codes::a(wq[u][mg][0], ks, 1), Codes::a(wq[u][mg][1], ks, 1),
                         bx[h][2 * ks], bx[h][2 * ks + 1]);
          }
          acc[mg][h][0] = fmaf(d[0], f0 * sx[h][0], acc[mg][h][0]);
          acc[mg][h][1] = fmaf(d[1], f0 * sx[h][1], acc[mg][h][1]);
          acc[mg][h][2] = fmaf(d[2], f1 * sx[h][0], acc[mg][h][2]);
          acc[mg][h][3] = fmaf(d[3], f1 * sx[h][1], acc[mg][h][3]);
        }
      }
    }
  }
}

// acc into red [warp][tile row][column] (16 MGS tile rows, COLS = 8 NH columns), for the totals
// over the warps.
template <int NH, int MGS>
__device__ __forceinline__ void mma_warp_sums_to(float* red, const float (&acc)[MGS][NH][4], unsigned int lane) {
  float* mine = red + (threadIdx.x / 32) * (16 * MGS) * (8 * NH);
  mma_c_each<NH>(acc, lane, [&](unsigned int row, unsigned int col, float v) { mine[row * (8 * NH) + col] = v; });
}

// Tile row `row`'s total at column `col` over the warps, in warp order (red: mma_warp_sums_to,
// TR = 16 MGS tile rows).
template <int NH, int TR = 32>
__device__ __forceinline__ float mma_warps_total(const float* red, unsigned int row, unsigned int col) {
  float sum = red[row * (8 * NH) + col];
  for (int q = 1; q < MMA_WARPS; q++) {
    sum += red[(q * TR + row) * (8 * NH) + col];
  }
  return sum;
}
