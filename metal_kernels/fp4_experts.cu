// CUDA twin of fp4_experts.metal (see there for what it computes and how the work
// is laid out). 256 threads per block.

constexpr int WARPS = 8;
const int rows = sizes[0];
const int KS = sizes[1];  // experts per row (top-k)
const int N = sizes[2];
const int K = sizes[3];
const int X = sizes[4];   // 1: a row's slots share x[r, 0]; KS: slot j reads x[r, j]
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const unsigned int tiles = (unsigned int)N / (WARPS * NW);
const int pair = (int)(blockIdx.x / tiles);
const unsigned int n0 = (blockIdx.x % tiles) * (WARPS * NW) + warp * NW;
const unsigned int expert = ids[pair];
for (int q = 0; q < pair; q++) {
  if (ids[q] == expert) {
    return;  // the whole block: the expert's first pair does all of its pairs
  }
}
int slot[RB];  // the slot of row r that picked this expert, or -1 (a row's experts are distinct)
#pragma unroll
for (int r = 0; r < RB; r++) {
  slot[r] = -1;
  if (r < rows) {
    for (int j = 0; j < KS; j++) {
      if (ids[r * KS + j] == expert) {
        slot[r] = j;
      }
    }
  }
}
const unsigned int words = (unsigned int)K / 8;
const unsigned int blocks = (unsigned int)K / 32;

float acc[NW][RB] = {};  // [output][row]
#pragma unroll 2
for (unsigned int k = 8 * lane; k < (unsigned int)K; k += 256) {  // this lane's 8 columns k .. k + 7
  float wf[NW][8];  // the weights' values (scale folded in), columns in order
#pragma unroll
  for (int i = 0; i < NW; i++) {
    const size_t n = (size_t)expert * N + n0 + i;
    const unsigned int q = __ldg(w + n * words + k / 8);
    const float sc = __uint_as_float(((unsigned int)scales[n * blocks + k / 32] + 14u) << 23);  // 2^(e-127) * 2^14
#pragma unroll
    for (int c = 0; c < 8; c++) {
      wf[i][c] = fp16_bits_to_float(E2M1_HALF((q >> (4 * c)) & 0xFu)) * sc;
    }
  }
#pragma unroll
  for (int r = 0; r < RB; r++) {
    if (slot[r] >= 0) {
      const int xr = r * X + (X > 1 ? slot[r] : 0);
      const uint4 p = __ldg(reinterpret_cast<const uint4*>(x + (size_t)xr * K + k));
      gemv_lane_accumulate<NW, RB>(p, &wf[0][0], &acc[0][0], r);
    }
  }
}

// each (output, pair) sum over the 32 lanes, then one lane writes it
#pragma unroll
for (int i = 0; i < NW; i++) {
#pragma unroll
  for (int r = 0; r < RB; r++) {
    const float v = gemv_lane_total(acc[i][r]);
    if (slot[r] >= 0 && lane == (unsigned int)((i * RB + r) % 32)) {
      y[((size_t)r * KS + slot[r]) * N + n0 + i] = __float2bfloat16(v);
    }
  }
}
