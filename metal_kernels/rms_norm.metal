// RMSNorm of each row in float32, a threadgroup per row: what kernels.rms_norm_reference
// does with three operations (a cast to float32, MLX's RMSNorm, a cast back).
//
// x [rows, D] (T: bfloat16 or float32), w [D] float32, eps [1] float32, sizes [2] int32 =
// (rows, D), rope_cos and rope_sin (ROPE below). Output y [rows, D] (O):
// x * rsqrt(mean(x^2) + eps) * w in float32, rounded to T once. Threads sum every 256th
// square, each simdgroup its 32 partial sums in a butterfly, then the 8 simdgroup sums in
// order: not the spec's order, so results match it to float32 noise; each row is computed
// alone, the same bits in any forward.
// ROPE > 0: then the last ROPE features rotated as layers.rotate rotates them: feature d
// becomes v_d * rope_cos_d + v_(d^1) * rope_sin_d in float32 (its pair partner d ^ 1; the
// sin table carries the signs), rounded to T again. rope_cos, rope_sin [rows, D] float32 are
// layers.Rope.tables' first two; D a multiple of 32. ROPE 0 reads neither (placeholders).
// QUANT 1: the result also FP8 fake-quantised per 32 values (act_quant.metal, bit for bit
// on the rounded result; D a multiple of 32), as an FP8 GEMM takes it, stored as O.
// Template constants: T, O, QUANT, ROPE. 256 threads. The row's work: rms_norm_row.h.
// CUDA twin: rms_norm.cu.

threadgroup float partial[8];  // each simdgroup's sum of squares

const uint row = threadgroup_position_in_grid.x;
const int D = sizes[1];
if (row >= uint(sizes[0])) {
  return;  // the whole threadgroup
}
rms_norm_row<T, O, QUANT, ROPE>(x + ulong(row) * D, w, D, eps[0], rope_cos, rope_sin, row, y + ulong(row) * D, partial,
                                thread_position_in_threadgroup.x, thread_index_in_simdgroup,
                                simdgroup_index_in_threadgroup);
