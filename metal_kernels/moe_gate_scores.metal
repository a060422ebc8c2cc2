// The MoE router's scores for a decode or verify forward (up to 16 rows), a simdgroup
// per expert: each expert's weights are read once for every row. moe_gate_topk.metal
// then picks each row's experts; together they do what kernels.moe_gate_reference does
// with about ten operations.
//
// x [rows, D] (T: bfloat16 or float32), w [E, D] float32 (the router's weight),
// params [1] float32 = (temperature,), sizes [3] int32 = (rows, E, D). Output:
// scores [rows, E] float32 = sqrt(softplus((x . w_e) / temperature)), softplus(l) = l
// above 20, log(1 + e^l) below. Lane l sums every 32nd product of a dot, the simdgroup
// its 32 partial sums in a butterfly: not the spec's matmul order, so a score matches
// the spec to float32 noise; each row's score is computed alone (the same bits in any
// forward). Template constant: T. 256 threads (8 experts per threadgroup).
// CUDA twin: moe_gate_scores.cu.

constexpr int WARPS = 8;
constexpr int MAX_ROWS = 16;
const int rows = sizes[0];
const int E = sizes[1];
const int D = sizes[2];
const int e = int(threadgroup_position_in_grid.x) * WARPS + int(simdgroup_index_in_threadgroup);
const uint lane = thread_index_in_simdgroup;
if (e >= E) {
  return;  // a whole simdgroup
}
const device float* we = w + ulong(e) * D;
float acc[MAX_ROWS];
for (int r = 0; r < MAX_ROWS; r++) {
  acc[r] = 0.0f;
}
for (int d = int(lane); d < D; d += 32) {
  const float wd = we[d];
  for (int r = 0; r < MAX_ROWS && r < rows; r++) {
    acc[r] += float(x[r * D + d]) * wd;
  }
}
for (int r = 0; r < MAX_ROWS && r < rows; r++) {
  float a = acc[r];
  for (ushort offset = 16; offset > 0; offset /= 2) {
    a += simd_shuffle_xor(a, offset);
  }
  if (lane == 0) {
    const float l = a / params[0];
    // log(1 + v) without losing a small v to the rounding of 1 + v
    const float v = metal::exp(metal::min(l, 20.0f));
    const float u = 1.0f + v;
    const float soft = (u == 1.0f) ? v : metal::log(u) * (v / (u - 1.0f));
    scores[r * E + e] = metal::sqrt(l > 20.0f ? l : soft);
  }
}
