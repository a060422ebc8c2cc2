// CUDA twin of fp8_rows.metal (see there for what it computes and how the
// work is laid out). CUDA spelling of the same steps: the 16x8x16 fp16 MMA
// (mma.sync m16n8k16, fp32 accumulate) holds a warp's weight fragment in
// registers, so each lane decodes its own bytes instead of going through
// shared memory, and scales its own slice of x.
//
// Fragment bookkeeping (PTX ISA, mma.m16n8k16 .f16): lane = 4 * g + t holds
// A rows g and g + 8, logical K columns {2t, 2t+1, 2t+8, 2t+9}; B columns
// (= our rows r) g, logical K rows {2t, 2t+1, 2t+8, 2t+9}; C rows g, g + 8,
// columns 2t, 2t+1. A dot product does not care how K is ordered, so within a
// 128-wide K chunk, logical column c of step j (0..7) is the physical column
// kb + 32t + 4j + m(c), m = 0,1 for c = 2t,2t+1 and 2,3 for c = 2t+8,2t+9:
// lane t reads the 32 bytes of 32-wide block t of the chunk in each of its
// weight rows (4 lanes: one 128-byte line per row) and the matching 32 fp16
// of x, which it scales by that block's scale.

constexpr int TILE = 256;
constexpr int WARPS = 8;
constexpr int KEEP = 64;
constexpr int RP = (R + 7) / 8 * 8;  // rows padded to MMA columns (padding columns' sums are never read)
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
float acc[2][NH][4] = {};  // [m group][row group][C fragment]
if (w0 < N) {
  const unsigned char* srow = scales + (w0 / 32) * (K / 32);
  for (unsigned int kb = 0; kb < K; kb += 128) {
    const unsigned int k = kb + 32 * t;  // this lane's block of 32 columns
    const float s = __uint_as_float(E8M0_BITS(srow[k / 32])) * 256.0f;
    unsigned int wq[2][2][8];  // [m group][row g / g + 8][word]
#pragma unroll
    for (int mg = 0; mg < 2; mg++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const uint4* src = reinterpret_cast<const uint4*>(w + (long)(w0 + 16 * mg + g + 8 * e) * K + k);
        const uint4 q0 = __ldg(src), q1 = __ldg(src + 1);
        wq[mg][e][0] = q0.x; wq[mg][e][1] = q0.y; wq[mg][e][2] = q0.z; wq[mg][e][3] = q0.w;
        wq[mg][e][4] = q1.x; wq[mg][e][5] = q1.y; wq[mg][e][6] = q1.z; wq[mg][e][7] = q1.w;
      }
    }
    unsigned int xs[NH][16];  // fp16(x * scale * 256) pairs, columns k .. k + 31 of row 8h + g
#pragma unroll
    for (int h = 0; h < NH; h++) {
      const unsigned int r = min(8 * h + g, (unsigned int)R - 1);  // MMA columns past R repeat row R - 1
      const uint4* src = reinterpret_cast<const uint4*>(x + (long)r * K + k);
#pragma unroll
      for (int v = 0; v < 4; v++) {
        const uint4 q = src[v];
        const unsigned int raw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
          xs[h][4 * v + i] = float_pair_to_fp16_bits(__uint_as_float(raw[i] << 16) * s,
                                                     __uint_as_float(raw[i] & 0xFFFF0000u) * s);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
#pragma unroll
      for (int mg = 0; mg < 2; mg++) {
        const unsigned int wl = __byte_perm(wq[mg][0][j], 0, 0x3120);  // bytes 0,2,1,3
        const unsigned int wh = __byte_perm(wq[mg][1][j], 0, 0x3120);
        const unsigned int a0 = E4M3_EVEN(wl), a2 = E4M3_ODD(wl);  // row g: m = 0,1 / m = 2,3
        const unsigned int a1 = E4M3_EVEN(wh), a3 = E4M3_ODD(wh);  // row g + 8
#pragma unroll
        for (int h = 0; h < NH; h++) {
          mma_m16n8k16(acc[mg][h], a0, a1, a2, a3, xs[h][2 * j], xs[h][2 * j + 1]);
        }
      }
    }
  }
}
mma_c_each<NH>(acc, lane, [&](unsigned int row, unsigned int r, float v) {  // C rows: outputs; columns: rows of x
  const unsigned int out = warp * 32 + row;
  tile_vals[r * TILE + out] = (w0 < N) ? v : neg_inf;
  tile_ids[r * TILE + out] = (unsigned char)out;
});
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
