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
__shared__ float e2m1[16];  // each E2M1 code's value / 2^14 (a table read costs less than a conversion)
if (threadIdx.x < 16) {
  e2m1[threadIdx.x] = fp16_bits_to_float(E2M1_HALF(threadIdx.x));
}
__syncthreads();
const unsigned int words = (unsigned int)K / 8;
const unsigned int blocks = (unsigned int)K / 32;
const size_t w0 = (size_t)expert * N + n0;  // the thread group's first weight row
const unsigned int steps = ((unsigned int)K + 16 * C - 1) / (16 * C);
constexpr int OT = SW ? T / 2 : T;  // outputs a thread group writes: with SW, one a (gate, up) pair
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a pair has in y

for (int p0 = 0;; p0 += RB) {  // a pass: the expert's picks p0 .. p0 + RB - 1 (later ones read its weights from cache)
  int pp[RB];  // the pass's pairs (r * KS + j), -1 past the last
#pragma unroll
  for (int r = 0; r < RB; r++) {
    pp[r] = -1;
  }
  int seen = 0;  // the expert's picks: at most one a row
  for (int p = pair; p < rows * KS; p++) {  // the pairs before `pair` did not pick it
    if (ids[p] == expert) {
#pragma unroll
      for (int r = 0; r < RB; r++) {
        pp[r] = seen == p0 + r ? p : pp[r];
      }
      seen++;
    }
  }
  int xr[RB];  // the x row each reads
#pragma unroll
  for (int r = 0; r < RB; r++) {
    xr[r] = X > 1 ? pp[r] : pp[r] / KS;
  }
  float acc[T][RB] = {};  // [output][pair]
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
        if (pp[r] >= 0) {
          xs[r] = gemv_input_block_scale(x + (size_t)xr[r] * K + k, active);
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
      q[i] = __ldg(reinterpret_cast<const uint2*>(w + (w0 + i) * words + k / 8));
      sc[i] = __uint_as_float(((unsigned int)scales[(w0 + i) * blocks + k / 32] + 14u) << 23);  // 2^(e-127) * 2^14
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
        if (pp[r] >= 0) {
          uint4 p = __ldg(reinterpret_cast<const uint4*>(x + (size_t)xr[r] * K + k + 8 * h));
          if (QX) {
            p = gemv_fake_quant8(p, xs[r]);
          }
          gemv_lane_accumulate<T, RB>(p, &wf[0][0], &acc[0][0], r);
        }
      }
    }
  }

  gemv_warp_totals<T, RB>(&acc[0][0], partial);
  for (unsigned int o = col; o < OT * RB; o += C) {  // output n0 * OT / T + o / RB of the pass's pair o % RB
    const int r = (int)(o % RB);
    int pr = -1;  // pp[r], picked out so that pp stays in registers (a variable index would not)
#pragma unroll
    for (int i = 0; i < RB; i++) {
      pr = i == r ? pp[i] : pr;
    }
    if (pr >= 0) {
      // with SW, output o / RB of the thread group is its pair o / RB: slot 2 (o / RB) its gate row,
      // the next its up row
      float v = gemv_group_total<T, RB, C>(partial, grp, SW ? o + o / RB * RB : o);
      if (SW) {
        v = gemv_swiglu(v, gemv_group_total<T, RB, C>(partial, grp, o + o / RB * RB + RB), swiglu[0]);
      }
      if (SW == 2) {
        v = v * weights[pr];  // the pair's routing weight
      }
      y[(size_t)pr * NY + n0 * OT / T + o / RB] = __float2bfloat16(v);
    }
  }
  if (seen <= p0 + RB) {
    break;  // (every thread alike)
  }
  __syncthreads();  // the next pass writes partial again
}
