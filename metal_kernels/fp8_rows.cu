// CUDA twin of fp8_rows.metal (see there for what it computes and how the
// work is laid out). CUDA spelling of the same steps: the 16x8x16 fp16 MMA
// (mma.sync m16n8k16, fp32 accumulate) holds a warp's weight fragment in
// registers, so each lane decodes its own 8 bytes per row and 32-wide K block
// instead of going through shared memory; the sum over K is the same set of
// exact fp16 x fp16 products, accumulated in fp32 per 32-wide scale block and
// then scaled into the running fp32 sum.
//
// Fragment bookkeeping (PTX ISA, mma.m16n8k16 .f16): lane = 4 * g + t holds
// A rows g and g + 8, logical K columns {2t, 2t+1, 2t+8, 2t+9}; B columns
// (= our rows r) g, logical K rows {2t, 2t+1, 2t+8, 2t+9}; C rows g, g + 8,
// columns 2t, 2t+1. A dot product does not care how K is ordered, so logical
// K column c of step j is mapped to the physical column kb + 8t + 4j + m(c)
// with m = 0,1 for c = 2t,2t+1 and m = 2,3 for c = 2t+8,2t+9: each lane reads
// 8 contiguous bytes per weight row and 8 contiguous fp16 of x per row.
// Scheduling differs where the hardware asks for it: the next K block's loads
// are issued before this block's MMAs (Metal's compiler and memory system
// hide that latency without being told).

constexpr int TILE = 256;
constexpr int WARPS = 8;
constexpr int KEEP = 64;
constexpr int RP = (R + 7) / 8 * 8;  // rows padded to MMA columns (x arrives padded)
constexpr int NH = RP / 8;
__shared__ float tile_vals[RP * TILE];
__shared__ unsigned char tile_ids[RP * TILE];

const unsigned int tile = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const unsigned int g = lane / 4;
const unsigned int t = lane % 4;
const float neg_inf = __uint_as_float(0xff800000u);

// each warp: 32 outputs (one scale tile row) = 2 MMA row groups of 16
const unsigned int w0 = tile * TILE + warp * 32;
float acc[2][NH][4];
#pragma unroll
for (int mg = 0; mg < 2; mg++) {
#pragma unroll
  for (int h = 0; h < NH; h++) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      acc[mg][h][i] = 0.0f;
    }
  }
}
if (w0 < N) {
  // software pipeline: the next K block's weights and x are loaded while this one multiplies
  uint2 wcur[2][2], wnext[2][2];  // [m group][row g / g + 8]
  uint4 xcur[NH], xnext[NH];      // x[8h + g][kb + 8t .. + 7] as fp16 pairs
#pragma unroll
  for (int mg = 0; mg < 2; mg++) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
      wcur[mg][e] = *reinterpret_cast<const uint2*>(w + (long)(w0 + 16 * mg + g + 8 * e) * K + 8 * t);
    }
  }
#pragma unroll
  for (int h = 0; h < NH; h++) {
    xcur[h] = *reinterpret_cast<const uint4*>(x + (long)(8 * h + g) * K + 8 * t);
  }
  for (unsigned int kb = 0; kb < K; kb += 32) {
    const unsigned int kn = (kb + 32 < K) ? kb + 32 : kb;  // the last block reloads itself (unused)
#pragma unroll
    for (int mg = 0; mg < 2; mg++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        wnext[mg][e] = *reinterpret_cast<const uint2*>(w + (long)(w0 + 16 * mg + g + 8 * e) * K + kn + 8 * t);
      }
    }
#pragma unroll
    for (int h = 0; h < NH; h++) {
      xnext[h] = *reinterpret_cast<const uint4*>(x + (long)(8 * h + g) * K + kn + 8 * t);
    }
    const float s = __uint_as_float(E8M0_BITS(scales[(w0 / 32) * (K / 32) + kb / 32])) * 256.0f;
#pragma unroll
    for (int mg = 0; mg < 2; mg++) {
      float part[NH][4];
#pragma unroll
      for (int h = 0; h < NH; h++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
          part[h][i] = 0.0f;
        }
      }
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const unsigned int wl = __byte_perm(j ? wcur[mg][0].y : wcur[mg][0].x, 0, 0x3120);  // bytes 0,2,1,3
        const unsigned int wh = __byte_perm(j ? wcur[mg][1].y : wcur[mg][1].x, 0, 0x3120);
        const unsigned int a0 = E4M3_EVEN(wl), a2 = E4M3_ODD(wl);  // row g: columns m=0,1 / m=2,3
        const unsigned int a1 = E4M3_EVEN(wh), a3 = E4M3_ODD(wh);  // row g+8
#pragma unroll
        for (int h = 0; h < NH; h++) {
          const unsigned int b0 = j ? xcur[h].z : xcur[h].x;
          const unsigned int b1 = j ? xcur[h].w : xcur[h].y;
          asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
              "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
              : "+f"(part[h][0]), "+f"(part[h][1]), "+f"(part[h][2]), "+f"(part[h][3])
              : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
      }
#pragma unroll
      for (int h = 0; h < NH; h++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
          acc[mg][h][i] = fmaf(s, part[h][i], acc[mg][h][i]);
        }
      }
    }
#pragma unroll
    for (int mg = 0; mg < 2; mg++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        wcur[mg][e] = wnext[mg][e];
      }
    }
#pragma unroll
    for (int h = 0; h < NH; h++) {
      xcur[h] = xnext[h];
    }
  }
}
#pragma unroll
for (int mg = 0; mg < 2; mg++) {
#pragma unroll
  for (int h = 0; h < NH; h++) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const unsigned int out = warp * 32 + 16 * mg + g + 8 * (i / 2);  // C rows g, g+8
      const unsigned int r = 8 * h + 2 * t + (i % 2);                  // C columns 2t, 2t+1
      tile_vals[r * TILE + out] = (w0 < N) ? acc[mg][h][i] : neg_inf;
      tile_ids[r * TILE + out] = (unsigned char)out;
    }
  }
}
__syncthreads();

// bitonic sort of every row's 256 (value, id) pairs, best first
for (unsigned int size = 2; size <= TILE; size <<= 1) {
  for (unsigned int stride = size / 2; stride > 0; stride >>= 1) {
    for (unsigned int p = tid; p < R * (TILE / 2); p += WARPS * 32) {
      const unsigned int r = p / (TILE / 2);
      const unsigned int q = p % (TILE / 2);
      const unsigned int i = r * TILE + 2 * stride * (q / stride) + (q % stride);
      const unsigned int j = i + stride;
      const float vi = tile_vals[i];
      const float vj = tile_vals[j];
      const unsigned int ii = tile_ids[i];
      const unsigned int ij = tile_ids[j];
      const bool best_first = ((i % TILE) & size) == 0;
      if (best_first != PAIR_BEFORE(vi, ii, vj, ij)) {
        tile_vals[i] = vj;
        tile_vals[j] = vi;
        tile_ids[i] = (unsigned char)ij;
        tile_ids[j] = (unsigned char)ii;
      }
    }
    __syncthreads();
  }
}

for (unsigned int p = tid; p < R * KEEP; p += WARPS * 32) {
  const unsigned int r = p / KEEP;
  const unsigned int j = p % KEEP;
  const unsigned int out = (r * TILES + tile) * KEEP + j;
  top_vals[out] = tile_vals[r * TILE + j];
  top_ids[out] = (int)(tile * TILE + tile_ids[r * TILE + j]);
}
