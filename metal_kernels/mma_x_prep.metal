// x rows -> what the matrix-unit kernels make of them a block of 32 columns at a time
// (mma_x_column, mma_x.h): xh = x / s as fp16 bits (exact: x is FP8 fake-quantised over the
// same blocks, by this kernel where QX = 1) and xs = s, the block's FP8 scale. fp4_experts
// with PX = 1 reads these instead of computing them in each of its threadgroups.
//
// x: bf16 [n, K] (the first n rows of the kernel's x); sizes [2] int32 = (n, K), K a multiple
// of 256. Outputs xh: uint16 [n, K], xs: float32 [n, K / 32]. A simdgroup a (row, block), a lane
// a column; the grid is n * K threads. Template constant: QX (0 or 1).
// CUDA twin: mma_x_prep.cu.

const uint K = uint(sizes[1]);
const uint nb = K / 32;
const uint item = thread_position_in_grid.x / 32;  // (row, block) = (item / nb, item % nb)
const uint lane = thread_index_in_simdgroup;
const ulong at = ulong(item / nb) * K + 32 * (item % nb) + lane;
float s;
const float q = mma_x_column<QX>(float(x[at]), &s);
xh[at] = as_type<ushort>(half(q));
if (lane == 0) {
  xs[item] = s;
}
