// CUDA twin of head_logits.metal (see there for what it computes and how the work is laid out).

constexpr int T = 4;  // outputs a warp
constexpr int U = 2;  // steps whose weight loads a lane issues before it uses the first
const int rows = sizes[0];
const int D = sizes[2];
const int out_rows = sizes[3];
const unsigned int V = (unsigned int)sizes[1];
const unsigned int lane = threadIdx.x % 32;
const unsigned int v0 = (blockIdx.x * 8 + threadIdx.x / 32) * T;  // the first output
const unsigned int steps = (unsigned int)D / 256;
float acc[T][R];
#pragma unroll
for (int o = 0; o < T; o++) {
#pragma unroll
  for (int r = 0; r < R; r++) {
    acc[o][r] = 0.0f;
  }
}
for (unsigned int i0 = 0; i0 < steps; i0 += U) {
  uint4 wv[U][T];  // this lane's 8 values of each output's row, U steps
#pragma unroll
  for (int u = 0; u < U; u++) {
    const unsigned int k = 256 * min(i0 + u, steps - 1) + 8 * lane;  // past the last step: the last again, unused
#pragma unroll
    for (int o = 0; o < T; o++) {
      wv[u][o] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)(v0 + o) * (unsigned int)D + k));
    }
  }
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (i0 + u >= steps) {
      break;  // (every lane alike)
    }
    const unsigned int k = 256 * (i0 + u) + 8 * lane;
#pragma unroll
    for (int r = 0; r < R; r++) {
      if (r >= rows) {
        break;
      }
      float xf[8];
      bf16x8_floats(__ldg(reinterpret_cast<const uint4*>(x + (size_t)r * (unsigned int)D + k)), xf);
#pragma unroll
      for (int o = 0; o < T; o++) {
        float wf[8];
        bf16x8_floats(wv[u][o], wf);
#pragma unroll
        for (int e = 0; e < 8; e++) {
          acc[o][r] = fmaf(wf[e], xf[e], acc[o][r]);
        }
      }
    }
  }
}
#pragma unroll
for (int r = 0; r < R; r++) {
  if (r >= rows) {
    break;
  }
  float mine = 0.0f;  // lane o < T: output v0 + o's total
#pragma unroll
  for (int o = 0; o < T; o++) {
    float total = acc[o][r];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    }
    mine = (unsigned int)o == lane ? total : mine;
  }
  if (lane < T) {
    y[(size_t)r * V + v0 + lane] = mine;
  }
}
for (int r = rows; r < out_rows; r++) {  // a padded forward's padding rows
  if (lane < T) {
    y[(size_t)r * V + v0 + lane] = 0.0f;
  }
}
