// RMSNorm of each row in float32, a threadgroup per row: what kernels.rms_norm_reference
// does with three operations (a cast to float32, MLX's RMSNorm, a cast back).
//
// x [rows, D] (T: bfloat16 or float32), w [D] float32, eps [1] float32, sizes [2] int32 =
// (rows, D), rope_cos and rope_sin (ROPE below). Output y [rows, D] (O):
// x * rsqrt(mean(x^2) + eps) * w in float32, rounded to T once. Threads sum every 256th
// square, each simdgroup its 32 partial sums in a butterfly, then the 8 simdgroup sums in
// order: not the spec's order, so results match it to float32 noise; each row is computed
// alone, the same bits in any forward.
// ROPE > 0: then the last ROPE features rotated as model.rotate rotates them: feature d
// becomes v_d * rope_cos_d + v_(d^1) * rope_sin_d in float32 (its pair partner d ^ 1; the
// sin table carries the signs), rounded to T again. rope_cos, rope_sin [rows, D] float32 are
// model.Rope.tables' first two; D a multiple of 32. ROPE 0 reads neither (placeholders).
// QUANT 1: the result also FP8 fake-quantised per 32 values (act_quant.metal, bit for bit
// on the rounded result; D a multiple of 32), as an FP8 GEMM takes it, stored as O.
// Template constants: T, O, QUANT, ROPE. 256 threads. CUDA twin: rms_norm.cu.

constexpr int WARPS = 8;
threadgroup float partial[WARPS];

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const int D = sizes[1];
if (row >= uint(sizes[0])) {
  return;  // the whole threadgroup
}
const device T* xr = x + ulong(row) * D;

float sq = 0.0f;
for (int d = int(tid); d < D; d += 32 * WARPS) {
  const float v = float(xr[d]);
  sq += v * v;
}
for (ushort offset = 16; offset > 0; offset /= 2) {
  sq += simd_shuffle_xor(sq, offset);
}
if (lane == 0) {
  partial[warp] = sq;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = partial[0];
for (int g = 1; g < WARPS; g++) {
  total += partial[g];
}
const float r = metal::rsqrt(total / float(D) + eps[0]);
for (int d = int(tid); d < D; d += 32 * WARPS) {
  float v = float(T(float(xr[d]) * r * w[d]));  // the norm, rounded to T
  if (ROPE) {  // then RoPE on the last ROPE features; a pair's two values sit in neighbouring lanes
    const float partner = simd_shuffle_xor(v, ushort(1));
    if (d >= D - ROPE) {
      const ulong at = ulong(row) * D + d;
      v = float(T(v * rope_cos[at] + partner * rope_sin[at]));
    }
  }
  if (QUANT) {  // then the FP8 fake-quant (fp8_lane.h): lanes hold a block's 32 consecutive values
    y[ulong(row) * D + d] = static_cast<O>(static_cast<T>(fp8_fake_quant_lane(v)));
  } else {
    y[ulong(row) * D + d] = static_cast<O>(v);
  }
}
