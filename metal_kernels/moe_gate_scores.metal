// The MoE router's scores for a decode or verify forward (up to 16 rows), a threadgroup
// per expert: each expert's weights are read once for every row. moe_gate_topk.metal
// then picks each row's experts; together they do what kernels.moe_gate_reference does
// with about ten operations.
//
// x [rows, D] (T: bfloat16 or float32), w [E, D] float32 (the router's weight),
// params [1] float32 = (temperature,), sizes [3] int32 = (rows, E, D; D also a template
// constant, so that a thread's passes over it are a compile-time count). Output:
// scores [rows, E] float32 = sqrt(softplus((x . w_e) / temperature)), softplus(l) = l
// above 20, log(1 + e^l) below. Thread t sums every 256th product of a dot (t, t + 256,
// ...), each simdgroup its 32 partial sums in a butterfly, then the 8 simdgroup sums are
// added in order: not the spec's matmul order, so a score matches the spec to float32
// noise; each row's score is computed alone (the same bits in any forward, whatever RB).
// Template constants: T, RB (1, 8 or 16, at least the rows: each thread keeps a sum per row;
// tuning.Layout.gate_row_bound), D.
// 256 threads per threadgroup, E threadgroups. CUDA twin: moe_gate_scores.cu.
//
// A threadgroup, not a simdgroup, per expert: a simdgroup alone would walk all of D in 160
// dependent steps at D = 5120; spread over a threadgroup, a thread takes 20.

constexpr int WARPS = 8;
threadgroup float partial[WARPS][RB];
constexpr int PER = (D + 32 * WARPS - 1) / (32 * WARPS);  // a thread's features: tid, tid + 256, ..
constexpr bool EVEN = D % (32 * WARPS) == 0;  // then no feature needs a bounds check
const int rows = sizes[0];
const int E = sizes[1];
const int e = int(threadgroup_position_in_grid.x);
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const device float* we = w + ulong(e) * D;
// Every load first, with no branch between them: a row test (r < rows) between one feature's
// sums and the next feature's weight load kept the compiler from issuing that load early, so a
// thread's PER weight loads went to memory one after another (on CUDA, NVRTC's PTX: a branch per
// row per feature).
float wd[PER];
for (int k = 0; k < PER; k++) {
  const int d = int(tid) + k * 32 * WARPS;
  wd[k] = EVEN || d < D ? we[EVEN ? d : min(d, D - 1)] : 0.0f;
}
float acc[RB];
for (int r = 0; r < RB; r++) {
  acc[r] = 0.0f;
}
for (int k = 0; k < PER; k++) {  // each row's products in feature order
  const int d = int(tid) + k * 32 * WARPS;
  if (EVEN || d < D) {
    for (int r = 0; r < RB; r++) {  // rows past `rows` read the last row again: their sums are never used
      acc[r] += float(x[min(r, rows - 1) * D + d]) * wd[k];
    }
  }
}
for (int r = 0; r < RB; r++) {
  float a = acc[r];
  for (ushort offset = 16; offset > 0; offset /= 2) {
    a += simd_shuffle_xor(a, offset);
  }
  if (lane == 0) {
    partial[warp][r] = a;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (int(tid) < rows) {  // thread r finishes row r
  float a = partial[0][tid];
  for (int g = 1; g < WARPS; g++) {
    a += partial[g][tid];
  }
  const float l = a / params[0];
  // log(1 + v) without losing a small v to the rounding of 1 + v
  const float v = metal::exp(metal::min(l, 20.0f));
  const float u = 1.0f + v;
  const float soft = (u == 1.0f) ? v : metal::log(u) * (v / (u - 1.0f));
  scores[int(tid) * E + e] = metal::sqrt(l > 20.0f ? l : soft);
}
