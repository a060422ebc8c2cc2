// CUDA twin of fp8_gemv.metal (see there for what it computes and how the work
// is laid out). 256 threads per block.

constexpr int WARPS = 8;
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const unsigned int lane = threadIdx.x % 32;
const unsigned int warp = threadIdx.x / 32;
const unsigned int tiles = (unsigned int)N / (WARPS * NW);
const unsigned int g = blockIdx.x / tiles;
const unsigned int n0 = (blockIdx.x % tiles) * (WARPS * NW) + warp * NW;
const unsigned int words = (unsigned int)K / 4;
const unsigned int blocks = (unsigned int)K / 32;

float acc[NW][RB] = {};  // [output][row]
#pragma unroll 2
for (unsigned int k = 8 * lane; k < (unsigned int)K; k += 256) {  // this lane's 8 columns k .. k + 7
  float wf[NW][8];  // the weights' values (scale folded in), columns in order
#pragma unroll
  for (int i = 0; i < NW; i++) {
    const size_t n = (size_t)g * N + n0 + i;
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(w + n * words + k / 4));
    const float sc = __uint_as_float(((unsigned int)scales[n * blocks + k / 32] + 8u) << 23);  // 2^(e-127) * 256
    const unsigned int half_words[2] = {q.x, q.y};
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const unsigned int even = E4M3_EVEN(half_words[h]);  // columns 4h, 4h + 2
      const unsigned int odd = E4M3_ODD(half_words[h]);    // columns 4h + 1, 4h + 3
      wf[i][4 * h + 0] = fp16_bits_to_float(even & 0xFFFFu) * sc;
      wf[i][4 * h + 1] = fp16_bits_to_float(odd & 0xFFFFu) * sc;
      wf[i][4 * h + 2] = fp16_bits_to_float(even >> 16) * sc;
      wf[i][4 * h + 3] = fp16_bits_to_float(odd >> 16) * sc;
    }
  }
#pragma unroll
  for (int r = 0; r < RB; r++) {
    if (r < rows) {
      const uint4 p = __ldg(reinterpret_cast<const uint4*>(x + ((size_t)r * G + g) * K + k));
      gemv_lane_accumulate<NW, RB>(p, &wf[0][0], &acc[0][0], r);
    }
  }
}

// each (output, row) sum over the 32 lanes, then one lane writes it
#pragma unroll
for (int i = 0; i < NW; i++) {
#pragma unroll
  for (int r = 0; r < RB; r++) {
    const float v = gemv_lane_total(acc[i][r]);
    if (r < rows && lane == (unsigned int)((i * RB + r) % 32)) {
      y[((size_t)r * G + g) * N + n0 + i] = __float2bfloat16(v);
    }
  }
}
