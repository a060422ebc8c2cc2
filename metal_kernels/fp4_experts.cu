// CUDA twin of fp4_experts.metal (see there for what it computes and how the work
// is laid out). 256 threads per block.

__shared__ float partial[8 * T * RB];  // each simdgroup's sums (gemv_warp_totals)
const int rows = sizes[0];
const int KS = sizes[1];  // experts per row (top-k)
const int N = sizes[2];
const int K = sizes[3];
const int X = sizes[4];   // 1: a row's slots share x[r, 0]; KS: slot j reads x[r, j]
constexpr int GROUPS = 256 / C;  // thread groups per block, T outputs each
const unsigned int col = threadIdx.x % C;
const unsigned int grp = threadIdx.x / C;
const unsigned int tiles = (unsigned int)N / (GROUPS * T);
const int pair = (int)(blockIdx.x / tiles);
const unsigned int n0 = (blockIdx.x % tiles) * (GROUPS * T) + grp * T;
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
__shared__ float e2m1[16];  // each E2M1 code's value / 2^14 (a table read costs less than a conversion)
if (threadIdx.x < 16) {
  e2m1[threadIdx.x] = fp16_bits_to_float(E2M1_HALF(threadIdx.x));
}
__syncthreads();
const unsigned int words = (unsigned int)K / 8;
const unsigned int blocks = (unsigned int)K / 32;

float acc[T][RB] = {};  // [output][row]
const unsigned int steps = ((unsigned int)K + 16 * C - 1) / (16 * C);
for (unsigned int s = 0; s < steps; s++) {
  const unsigned int k = 16 * col + s * 16 * C;  // this thread's 16 columns k .. k + 15
  const bool active = k < (unsigned int)K;
  if (!QX && !active) {
    break;
  }
  float xs[RB];  // QX: each pair's scale for the block of 32 columns holding k (this thread's and its neighbour's)
  if (QX) {
#pragma unroll
    for (int r = 0; r < RB; r++) {
      if (slot[r] >= 0) {
        xs[r] = gemv_input_block_scale(x + (size_t)(r * X + (X > 1 ? slot[r] : 0)) * K + k, active);
      }
    }
  }
  if (!active) {
    continue;
  }
  uint2 q[T];  // 16 E2M1 codes of each output row
  float sc[T];
#pragma unroll
  for (int i = 0; i < T; i++) {
    const size_t n = (size_t)expert * N + n0 + i;
    q[i] = __ldg(reinterpret_cast<const uint2*>(w + n * words + k / 8));
    sc[i] = __uint_as_float(((unsigned int)scales[n * blocks + k / 32] + 14u) << 23);  // 2^(e-127) * 2^14
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {  // columns k + 8h .. k + 8h + 7
    float wf[T][8];  // the weights' values (scale folded in), columns in order
#pragma unroll
    for (int i = 0; i < T; i++) {
      const unsigned int word = h ? q[i].y : q[i].x;
      const unsigned int codes[2] = {E2M1_EVEN_CODES(word), E2M1_ODD_CODES(word)};
#pragma unroll
      for (int c = 0; c < 8; c++) {  // code c: byte c / 2 of codes[c % 2]
        wf[i][c] = e2m1[(codes[c % 2] >> (8 * (c / 2))) & 0xFu] * sc[i];
      }
    }
#pragma unroll
    for (int r = 0; r < RB; r++) {
      if (slot[r] >= 0) {
        const int xr = r * X + (X > 1 ? slot[r] : 0);
        uint4 p = __ldg(reinterpret_cast<const uint4*>(x + (size_t)xr * K + k + 8 * h));
        if (QX) {
          p = gemv_fake_quant8(p, xs[r]);
        }
        gemv_lane_accumulate<T, RB>(p, &wf[0][0], &acc[0][0], r);
      }
    }
  }
}

gemv_warp_totals<T, RB>(&acc[0][0], partial);
constexpr int OT = SW ? T / 2 : T;  // outputs a thread group writes: with SW, one a (gate, up) pair
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a pair has in y
for (unsigned int o = col; o < OT * RB; o += C) {  // output n0 * OT / T + o / RB of row o % RB's pair
  const int r = (int)(o % RB);
  int picked = -1;  // slot[r], picked out so that slot stays in registers (a variable index would not)
#pragma unroll
  for (int i = 0; i < RB; i++) {
    picked = i == r ? slot[i] : picked;
  }
  if (picked >= 0) {
    // with SW, output o / RB of the thread group is its pair o / RB: slot 2 (o / RB) its gate row, the next its up row
    float v = gemv_group_total<T, RB, C>(partial, grp, SW ? o + o / RB * RB : o);
    if (SW) {
      v = gemv_swiglu(v, gemv_group_total<T, RB, C>(partial, grp, o + o / RB * RB + RB), swiglu[0]);
    }
    if (SW == 2) {
      v = v * weights[r * KS + picked];  // the pair's routing weight
    }
    y[((size_t)r * KS + picked) * NY + n0 * OT / T + o / RB] = __float2bfloat16(v);
  }
}
