// CUDA twin of fp8_gemv.metal (see there for what it computes and how the work
// is laid out). 256 threads per block.

__shared__ float partial[8 * T * RB];  // each simdgroup's sums (gemv_warp_totals)
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const int out_rows = sizes[4];
constexpr int GROUPS = 256 / C;  // thread groups per block, T outputs each
const unsigned int col = threadIdx.x % C;
const unsigned int grp = threadIdx.x / C;
const unsigned int tiles = (unsigned int)N / (GROUPS * T);
const unsigned int g = blockIdx.x / tiles;
const unsigned int n0 = (blockIdx.x % tiles) * (GROUPS * T) + grp * T;
const unsigned int words = (unsigned int)K / 4;
const unsigned int blocks = (unsigned int)K / 32;

float acc[T][RB] = {};  // [output][row]
const unsigned int steps = ((unsigned int)K + 16 * C - 1) / (16 * C);
for (unsigned int s = 0; s < steps; s++) {
  const unsigned int k = 16 * col + s * 16 * C;  // this thread's 16 columns k .. k + 15
  const bool active = k < (unsigned int)K;
  if (!QX && !active) {
    break;
  }
  float xs[RB];  // QX: each row's scale for the block of 32 columns holding k (this thread's and its neighbour's)
  if (QX) {
#pragma unroll
    for (int r = 0; r < RB; r++) {
      if (r < rows) {
        xs[r] = gemv_input_block_scale(x + ((size_t)r * G + g) * K + k, active);
      }
    }
  }
  if (!active) {
    continue;
  }
  uint4 q[T];  // 16 E4M3 codes of each output row
  float sc[T];
#pragma unroll
  for (int i = 0; i < T; i++) {
    const size_t n = (size_t)g * N + n0 + i;
    q[i] = __ldg(reinterpret_cast<const uint4*>(w + n * words + k / 4));
    sc[i] = __uint_as_float(((unsigned int)scales[n * blocks + k / 32] + 8u) << 23);  // 2^(e-127) * 256
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {  // columns k + 8h .. k + 8h + 7
    float wf[T][8];  // the weights' values (scale folded in), columns in order
#pragma unroll
    for (int i = 0; i < T; i++) {
      const unsigned int half_words[2] = {h ? q[i].z : q[i].x, h ? q[i].w : q[i].y};
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const unsigned int even = E4M3_EVEN(half_words[j]);  // columns 4j, 4j + 2
        const unsigned int odd = E4M3_ODD(half_words[j]);    // columns 4j + 1, 4j + 3
        wf[i][4 * j + 0] = fp16_bits_to_float(even & 0xFFFFu) * sc[i];
        wf[i][4 * j + 1] = fp16_bits_to_float(odd & 0xFFFFu) * sc[i];
        wf[i][4 * j + 2] = fp16_bits_to_float(even >> 16) * sc[i];
        wf[i][4 * j + 3] = fp16_bits_to_float(odd >> 16) * sc[i];
      }
    }
#pragma unroll
    for (int r = 0; r < RB; r++) {
      if (r < rows) {
        uint4 p = __ldg(reinterpret_cast<const uint4*>(x + ((size_t)r * G + g) * K + k + 8 * h));
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
const unsigned int NY = SW ? (unsigned int)N / 2 : (unsigned int)N;  // outputs a matrix has in y
const unsigned int y0 = n0 * OT / T;  // the thread group's first output in y
for (unsigned int o = col; o < OT * RB; o += C) {  // output y0 + o / RB, row o % RB
  if ((int)(o % RB) < out_rows) {  // a row past `rows`: its sums stayed zero
    // with SW, output o / RB of the thread group is its pair o / RB: slot 2 (o / RB) its gate row, the next its up row
    float v = gemv_group_total<T, RB, C>(partial, grp, SW ? o + o / RB * RB : o);
    if (SW) {
      v = gemv_swiglu(v, gemv_group_total<T, RB, C>(partial, grp, o + o / RB * RB + RB), swiglu[0]);
    }
    if (AP > 0 && (int)(o % RB) < rows) {  // the row's AP parts, in order, then this output as bf16
      v = gemv_parts_added<AP>(parts + (size_t)(o % RB) * AP * NY + y0 + o / RB, NY, v);
    }
    y[gemv_y_index<SPLIT>(o % RB, y0 + o / RB, g, G, NY, out_rows)] = __float2bfloat16(v);
  }
}
const int pad = out_rows - RB;  // padding rows past RB: zeros
for (int o = (int)col; o < OT * pad; o += C) {  // output y0 + o / pad, row RB + o % pad
  y[gemv_y_index<SPLIT>(RB + o % pad, y0 + o / pad, g, G, NY, out_rows)] = __float2bfloat16(0.0f);
}
