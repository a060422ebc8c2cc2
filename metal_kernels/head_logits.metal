// The model's head for forwards of up to 16 rows: fp32 logits y[r, v] = sum_k x[r, k] * w[v, k]
// from the bf16 head weight as the release stores it, w [V, D], and a bf16 x [out_rows, D]
// (the final norm's output), reading each weight byte once for all rows. The spec is
// kernels.head_logits_reference (both widened to float32, then MLX's matmul): a bf16 times
// bf16 product is exact in float32, so the two differ only in the order of the float32 sums.
//
// sizes [4] int32 = (rows, V, D, out_rows): the first `rows` rows are computed, the rest of
// the out_rows (a padded forward's padding) come out zeros; rows <= R. V a multiple of 32,
// D of 256.
//
// The work: a threadgroup's 8 simdgroups own T = 4 consecutive outputs each. Lane l takes
// columns 8l .. 8l + 7 of every 256 (16 bytes of each of its T weight rows and of each row of
// x a step), each sum an fma chain in column order; then a butterfly over the simdgroup
// (offsets 16, 8, 4, 2, 1) gives every lane the total. Each row's sums run the same steps at
// any rows or R, so a row's bits are the same in every forward (a verify's rows equal the
// decode steps'). U steps' weight loads are issued before the first is used.
// Template constant: R (a bound on the computed rows: 1, 8 or 16, tuning.Layout.head_row_bound).
// CUDA twin: head_logits.cu.

constexpr int T = 4;  // outputs a simdgroup
constexpr int U = 2;  // steps whose weight loads a lane issues before it uses the first
const int rows = sizes[0];
const int D = sizes[2];
const int out_rows = sizes[3];
const uint V = uint(sizes[1]);
const uint lane = thread_index_in_simdgroup;
const uint v0 = (threadgroup_position_in_grid.x * 8 + simdgroup_index_in_threadgroup) * T;  // the first output
const uint steps = uint(D) / 256;
float acc[T][R];
for (int o = 0; o < T; o++) {
  for (int r = 0; r < R; r++) {
    acc[o][r] = 0.0f;
  }
}
for (uint i0 = 0; i0 < steps; i0 += U) {
  uint4 wv[U][T];  // this lane's 8 values of each output's row, U steps
  for (int u = 0; u < U; u++) {
    const uint k = 256 * metal::min(i0 + u, steps - 1) + 8 * lane;  // past the last step: the last again, unused
    for (int o = 0; o < T; o++) {
      wv[u][o] = *((const device uint4*)(w + size_t(v0 + o) * uint(D) + k));
    }
  }
  for (int u = 0; u < U; u++) {
    if (i0 + u >= steps) {
      break;  // (every lane alike)
    }
    const uint k = 256 * (i0 + u) + 8 * lane;
    for (int r = 0; r < R; r++) {
      if (r >= rows) {
        break;
      }
      float xf[8];
      bf16x8_floats(*((const device uint4*)(x + size_t(r) * uint(D) + k)), xf);
      for (int o = 0; o < T; o++) {
        float wf[8];
        bf16x8_floats(wv[u][o], wf);
        for (int e = 0; e < 8; e++) {
          acc[o][r] = fma(wf[e], xf[e], acc[o][r]);
        }
      }
    }
  }
}
for (int r = 0; r < R; r++) {
  if (r >= rows) {
    break;
  }
  float mine = 0.0f;  // lane o < T: output v0 + o's total
  for (int o = 0; o < T; o++) {
    float total = acc[o][r];
    for (ushort offset = 16; offset > 0; offset /= 2) {
      total += simd_shuffle_xor(total, offset);
    }
    mine = uint(o) == lane ? total : mine;
  }
  if (lane < T) {
    y[size_t(r) * V + v0 + lane] = mine;
  }
}
for (int r = rows; r < out_rows; r++) {  // a padded forward's padding rows
  if (lane < T) {
    y[size_t(r) * V + v0 + lane] = 0.0f;
  }
}
