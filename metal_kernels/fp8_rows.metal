// y[r, n] = sum_k x[r, k] * dequant(w[n, k]) for R rows, fused with a top-64 per row.
//
// w: E4M3 codes [N, K] (uint8) with one E8M0 scale per 32x32 tile, scales
// [N/32, K/32]. x: bf16 bits [R, K] (uint16), the activations as they come.
// Each weight byte is read once, for all rows.
//
// The arithmetic: an E4M3 code becomes the fp16 of its value / 256 by moving
// bits (fp8_common.h), and x becomes fp16(x * scale * 256) with the scale of
// the weight tile it meets (exact while that stays in fp16's normal range:
// the scale is a power of two). Their products, summed over all of K in fp32
// by the matrix unit, are the logits. The matrix unit takes rows 8 at a time:
// the columns past R (up to RP = 8 * ceil(R / 8)) repeat row R - 1, and their
// sums are never read.
//
// The work: a threadgroup owns a tile of 256 outputs, 8 simdgroups of 32
// outputs each (one scale-tile row). Per 32-wide K block a simdgroup writes
// its scaled x (all rows) and, 16 columns at a time, its decoded weights
// (a lane per output row) into threadgroup memory, then multiplies 8x8 fp16
// tiles (outputs x K) by 8x8 tiles of x^T (K x rows) into 8x8 fp32
// accumulators. Afterwards each row's 256 values are bitonic-sorted in
// threadgroup memory (which the staging buffers give back) and the best 64
// (values, global ids) go to top_vals / top_ids [R, TILES, 64]; the caller
// picks the final 64. Template constants: R (rows), K (a multiple of 128),
// N (a multiple of 32), TILES = ceil(N / 256).
// The CUDA twin (fp8_rows.cu) does the same with mma.sync m16n8k16, holding
// the fragments in registers.

constexpr int TILE = 256;
constexpr int WARPS = 8;
constexpr int KEEP = 64;
constexpr int RP = (R + 7) / 8 * 8;
constexpr int NH = RP / 8;
// staging (decoded weights, scaled x) during the K loop, the sort tile after it
constexpr int STAGE_FLOATS = WARPS * 32 * 16 / 2 + WARPS * RP * 32 / 2;
constexpr int TG_FLOATS = STAGE_FLOATS > RP * TILE ? STAGE_FLOATS : RP * TILE;
threadgroup float tg_mem[TG_FLOATS];
threadgroup uchar tile_ids[RP * TILE];
threadgroup float* tile_vals = tg_mem;

const uint tile = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const float neg_inf = as_type<float>(0xff800000u);
threadgroup half* wbuf = (threadgroup half*)tg_mem + warp * 32 * 16;               // [32 outputs][16 k]
threadgroup half* xbuf = (threadgroup half*)tg_mem + WARPS * 32 * 16 + warp * RP * 32;  // [RP rows][32 k]

const uint w0 = tile * TILE + warp * 32;  // this simdgroup's 32 outputs
simdgroup_float8x8 acc[4][NH];
for (int mg = 0; mg < 4; mg++) {
  for (int h = 0; h < NH; h++) {
    acc[mg][h] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
}
if (w0 < N) {
  for (uint kb = 0; kb < K; kb += 32) {
    const float s = as_type<float>(E8M0_BITS(scales[(w0 / 32) * (K / 32) + kb / 32])) * 256.0f;
    for (int r = 0; r < RP; r++) {
      const uint bits = x[(long)min(r, R - 1) * K + kb + lane];
      xbuf[r * 32 + lane] = half(as_type<float>(bits << 16) * s);
    }
    for (uint hk = 0; hk < 32; hk += 16) {
      const uint4 q = *((const device uint4*)(w + (long)(w0 + lane) * K + kb + hk));
      const uint words[4] = {q.x, q.y, q.z, q.w};
      for (int c = 0; c < 4; c++) {
        const uint even = E4M3_EVEN(words[c]);
        const uint odd = E4M3_ODD(words[c]);
        wbuf[lane * 16 + 4 * c + 0] = as_type<half>(ushort(even & 0xFFFFu));
        wbuf[lane * 16 + 4 * c + 1] = as_type<half>(ushort(odd & 0xFFFFu));
        wbuf[lane * 16 + 4 * c + 2] = as_type<half>(ushort(even >> 16));
        wbuf[lane * 16 + 4 * c + 3] = as_type<half>(ushort(odd >> 16));
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int k8 = 0; k8 < 16; k8 += 8) {
        simdgroup_half8x8 b[NH];
        for (int h = 0; h < NH; h++) {
          simdgroup_load(b[h], xbuf + (8 * h) * 32 + hk + k8, 32, ulong2(0, 0), true);
        }
        for (int mg = 0; mg < 4; mg++) {
          simdgroup_half8x8 a;
          simdgroup_load(a, wbuf + (8 * mg) * 16 + k8, 16);
          for (int h = 0; h < NH; h++) {
            simdgroup_multiply_accumulate(acc[mg][h], a, b[h], acc[mg][h]);
          }
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the staging buffers
if (w0 < N) {
  for (int mg = 0; mg < 4; mg++) {
    for (int h = 0; h < NH; h++) {
      // acc is outputs x rows: store transposed into the [row][output] tile
      simdgroup_store(acc[mg][h], tile_vals + (8 * h) * TILE + warp * 32 + 8 * mg, TILE, ulong2(0, 0), true);
    }
  }
} else {
  for (int r = 0; r < RP; r++) {
    tile_vals[r * TILE + warp * 32 + lane] = neg_inf;
  }
}
for (int r = 0; r < RP; r++) {
  tile_ids[r * TILE + warp * 32 + lane] = uchar(warp * 32 + lane);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// bitonic sort of every row's 256 (value, id) pairs, best first
for (uint size = 2; size <= TILE; size <<= 1) {
  for (uint stride = size / 2; stride > 0; stride >>= 1) {
    for (uint p = tid; p < R * (TILE / 2); p += WARPS * 32) {
      const uint r = p / (TILE / 2);
      const uint q = p % (TILE / 2);
      const uint i = r * TILE + 2 * stride * (q / stride) + (q % stride);
      const uint j = i + stride;
      const float vi = tile_vals[i];
      const float vj = tile_vals[j];
      const uint ii = tile_ids[i];
      const uint ij = tile_ids[j];
      const bool best_first = ((i % TILE) & size) == 0;
      if (best_first != PAIR_BEFORE(vi, ii, vj, ij)) {
        tile_vals[i] = vj;
        tile_vals[j] = vi;
        tile_ids[i] = uchar(ij);
        tile_ids[j] = uchar(ii);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

for (uint p = tid; p < R * KEEP; p += WARPS * 32) {
  const uint r = p / KEEP;
  const uint j = p % KEEP;
  const uint out = (r * TILES + tile) * KEEP + j;
  top_vals[out] = tile_vals[r * TILE + j];
  top_ids[out] = int(tile * TILE + tile_ids[r * TILE + j]);
}
