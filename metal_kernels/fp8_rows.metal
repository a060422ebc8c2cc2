// y[r, n] = sum_k x[r, k] * dequant(w[n, k]) for R rows, fused with a top-64 per row.
//
// w: E4M3 codes [N, K] (uint8) with one E8M0 scale per 32x32 tile, scales
// [N/32, K/32]. x: float32 [R, K]. Accumulation in float32.
// One threadgroup computes a tile of 256 outputs for all R rows and writes the
// 64 best of them per row (values, global ids) to top_vals / top_ids
// [R, TILES, 64]; the caller picks the final 64 among the TILES * 64.
// Each weight byte is read once, for all rows.
//
// Layout of the work: 8 simdgroups; a simdgroup takes 4 consecutive outputs at
// a time and walks K in steps of 512, each lane reading 16 bytes per output
// (so the 4 outputs share one tile scale and each lane one 32-wide K block).
// The scale is applied to x (exact: a power of two), x is read once per 4
// outputs. Template constants: R (rows), K, N, TILES = ceil(N / 256).
// The CUDA twin is fp8_rows.cu: same algorithm, line for line.

constexpr int TILE = 256;
constexpr int NPW = 4;     // outputs per simdgroup pass
constexpr int WARPS = 8;
constexpr int KEEP = 64;
threadgroup float tile_vals[R * TILE];
threadgroup uchar tile_ids[R * TILE];

const uint tile = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const float neg_inf = as_type<float>(0xff800000u);

for (uint base = warp * NPW; base < TILE; base += WARPS * NPW) {
  const uint n0 = tile * TILE + base;
  float acc[NPW][R];
#pragma unroll
  for (int o = 0; o < NPW; o++) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      acc[o][r] = 0.0f;
    }
  }
  if (n0 < N) {
    for (uint k0 = lane * 16; k0 < K; k0 += 512) {
      uint words[NPW][4];
#pragma unroll
      for (int o = 0; o < NPW; o++) {
        uint4 q = uint4(0);
        if (n0 + o < N) {
          q = *((const device uint4*)(w + (long)(n0 + o) * K + k0));
        }
        words[o][0] = q.x;
        words[o][1] = q.y;
        words[o][2] = q.z;
        words[o][3] = q.w;
      }
      const uint e = scales[(n0 / 32) * (K / 32) + k0 / 32];
      const float s = as_type<float>(E8M0_BITS(e)) * 256.0f;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        float wf[NPW][4];
#pragma unroll
        for (int o = 0; o < NPW; o++) {
          const uint even = E4M3_EVEN(words[o][c]);
          const uint odd = E4M3_ODD(words[o][c]);
          wf[o][0] = float(as_type<half>(ushort(even & 0xFFFFu)));
          wf[o][1] = float(as_type<half>(ushort(odd & 0xFFFFu)));
          wf[o][2] = float(as_type<half>(ushort(even >> 16)));
          wf[o][3] = float(as_type<half>(ushort(odd >> 16)));
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
          const float4 xv = *((const device float4*)(x + r * K + k0 + 4 * c)) * s;
#pragma unroll
          for (int o = 0; o < NPW; o++) {
            float a = acc[o][r];
            a = fma(xv.x, wf[o][0], a);
            a = fma(xv.y, wf[o][1], a);
            a = fma(xv.z, wf[o][2], a);
            a = fma(xv.w, wf[o][3], a);
            acc[o][r] = a;
          }
        }
      }
    }
  }
#pragma unroll
  for (int o = 0; o < NPW; o++) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      const float total = simd_sum(acc[o][r]);
      if (lane == 0) {
        tile_vals[r * TILE + base + o] = (n0 + o < N) ? total : neg_inf;
        tile_ids[r * TILE + base + o] = uchar(base + o);
      }
    }
  }
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
