// Two RMSNorms in one launch, a threadgroup per row of either input: attention's q_norm of
// wq_a's product and kv_norm of wkv's (rotated), both FP8 fake-quantised, as two rms_norm
// launches give them (rms_norm.metal; each row the same bits: the same rms_norm_row).
//
// x [rows, D] (T) with w [D] float32 -> y [rows, D] (O), ROPE 0; x2 [rows, D2] (T) with w2 [D2]
// float32 -> y2 [rows, D2] (O2), its last ROPE features rotated by rope_cos, rope_sin
// [rows, D2] float32 (ROPE 0: neither read, placeholders). eps [1] float32 (both norms'),
// sizes [4] int32 = (rows, D, D2, where x2's rows start in x2: 0, or rows * D where x2 is
// x's buffer and its rows follow x's, as fp8_gemv_pair writes wq_a's and wkv's products:
// kernels.rms_norm_halves). Threadgroups 0 .. rows - 1 take x's rows, the next rows x2's.
// QUANT 1: both results FP8 fake-quantised per 32 values (D and D2 multiples of 32).
// Template constants: T, O, O2, QUANT, ROPE. 256 threads. CUDA twin: rms_norm_pair.cu.

threadgroup float partial[8];  // each simdgroup's sum of squares

const uint block = threadgroup_position_in_grid.x;
const uint rows = uint(sizes[0]);
const int D = sizes[1];
const int D2 = sizes[2];
const ulong start2 = ulong(sizes[3]);
const uint tid = thread_position_in_threadgroup.x;
if (block < rows) {
  rms_norm_row<T, O, QUANT, 0>(x + ulong(block) * D, w, D, eps[0], rope_cos, rope_sin, block, y + ulong(block) * D,
                               partial, tid, thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
} else if (block < 2 * rows) {
  const uint row = block - rows;
  rms_norm_row<T, O2, QUANT, ROPE>(x2 + start2 + ulong(row) * D2, w2, D2, eps[0], rope_cos, rope_sin, row,
                                   y2 + ulong(row) * D2, partial, tid, thread_index_in_simdgroup,
                                   simdgroup_index_in_threadgroup);
}
