// CUDA twin of fp8_rows.metal: the same algorithm, line for line (see there
// for what it computes). Metal -> CUDA: simdgroup -> warp, simd_sum -> xor
// shuffles, threadgroup -> __shared__, as_type -> __uint_as_float and a
// cvt.f32.f16 for the fp16 bits.

constexpr int TILE = 256;
constexpr int NPW = 4;     // outputs per warp pass
constexpr int WARPS = 8;
constexpr int KEEP = 64;
__shared__ float tile_vals[R * TILE];
__shared__ unsigned char tile_ids[R * TILE];

const unsigned int tile = blockIdx.x;
const unsigned int tid = threadIdx.x;
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const float neg_inf = __uint_as_float(0xff800000u);

for (unsigned int base = warp * NPW; base < TILE; base += WARPS * NPW) {
  const unsigned int n0 = tile * TILE + base;
  float acc[NPW][R];
#pragma unroll
  for (int o = 0; o < NPW; o++) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      acc[o][r] = 0.0f;
    }
  }
  if (n0 < N) {
    for (unsigned int k0 = lane * 16; k0 < K; k0 += 512) {
      unsigned int words[NPW][4];
#pragma unroll
      for (int o = 0; o < NPW; o++) {
        uint4 q = make_uint4(0, 0, 0, 0);
        if (n0 + o < N) {
          q = *reinterpret_cast<const uint4*>(w + (long)(n0 + o) * K + k0);
        }
        words[o][0] = q.x;
        words[o][1] = q.y;
        words[o][2] = q.z;
        words[o][3] = q.w;
      }
      const unsigned int e = scales[(n0 / 32) * (K / 32) + k0 / 32];
      const float s = __uint_as_float(E8M0_BITS(e)) * 256.0f;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        float wf[NPW][4];
#pragma unroll
        for (int o = 0; o < NPW; o++) {
          const unsigned int even = E4M3_EVEN(words[o][c]);
          const unsigned int odd = E4M3_ODD(words[o][c]);
          wf[o][0] = fp16_bits_to_float(even & 0xFFFFu);
          wf[o][1] = fp16_bits_to_float(odd & 0xFFFFu);
          wf[o][2] = fp16_bits_to_float(even >> 16);
          wf[o][3] = fp16_bits_to_float(odd >> 16);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
          float4 xv = *reinterpret_cast<const float4*>(x + r * K + k0 + 4 * c);
          xv.x *= s;
          xv.y *= s;
          xv.z *= s;
          xv.w *= s;
#pragma unroll
          for (int o = 0; o < NPW; o++) {
            float a = acc[o][r];
            a = fmaf(xv.x, wf[o][0], a);
            a = fmaf(xv.y, wf[o][1], a);
            a = fmaf(xv.z, wf[o][2], a);
            a = fmaf(xv.w, wf[o][3], a);
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
      float total = acc[o][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        total += __shfl_xor_sync(0xffffffffu, total, offset);
      }
      if (lane == 0) {
        tile_vals[r * TILE + base + o] = (n0 + o < N) ? total : neg_inf;
        tile_ids[r * TILE + base + o] = (unsigned char)(base + o);
      }
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
