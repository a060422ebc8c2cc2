// y[r, g, n] = sum_k x[r, g, k] * dequant(w[g, n, k]) for forwards of up to 16 rows: the
// FP8 GEMMs of a decode or verify step, each weight byte read once for all rows.
//
// w: MLX `mxfp8` codes [G, N, K / 4] (uint32, four E4M3 bytes each, column order) with
// one E8M0 scale per row and 32 columns, scales [G, N, K / 32]. x: bf16 [rows, G, K]
// (exact: an FP8 fake-quantised activation, or wo_a's bf16 one). Output y: bf16
// [out_rows, G, N]. G = 1 for a dense GEMM; wo_a's 8 groups otherwise. sizes [5] int32 =
// (rows, N, K, G, out_rows): the first `rows` rows are computed, the rest of the out_rows
// (a padded forward's padding, Runner.padded) come out zeros; rows <= RB, and the
// padding rows past RB are written zeros without any sums.
// N a multiple of (256 / C) * T, K of 32.
//
// The arithmetic: an E4M3 code becomes the fp16 of its value / 256 by moving bits
// (fp8_common.h), then a float times its scale * 256 (a power of two: exact). Its
// product with a bf16 value is exact in float32; each thread sums its products in
// float32 in column order, then the sums are added over each simdgroup in a butterfly
// and over the simdgroups of a thread group in order (gemv_lane.h). Not MLX's summation
// order, so the result is the spec's (gather_qmm) up to another float32 summation order;
// each row is computed alone (the same bits in any forward).
//
// The work: a threadgroup of 256 threads is 256 / C thread groups of C threads; a thread
// group owns T consecutive outputs of one matrix and splits K among its threads, thread c
// taking columns 16c .. 16c + 15 of every 16 * C. Per step a thread reads 16 bytes of each
// of its T weight rows and 16 values of x per row, which serve all T outputs. Splitting K
// puts many threads on each output, so that a small GEMM still has bytes in flight on every
// core (the decode step is a chain of GEMMs, each waiting for the last).
// QX = 1: x is a bf16 activation not yet FP8 fake-quantised; the kernel quantises each row's
// blocks of 32 as it reads them (fp8_lane.h), two neighbouring threads exchanging their
// halves' largest magnitudes, which gives the bits of act_quant followed by QX = 0 (one
// launch fewer). Every thread then runs the same number of steps (the exchange needs all
// lanes), the steps past K only taking part in it.
// SW = 1: w is a SwiGLU's gate and up projections with their rows interleaved (row 2p pair
// p's gate, row 2p + 1 its up: checkpoint.stack_gate_up), and y [out_rows, G, N / 2] their
// SwiGLU in bf16, limit swiglu[0] (gemv_lane.h): each thread group sums its T rows as
// without SW (T / 2 pairs, the rows contiguous: the same addressing and registers) and writes
// T / 2 outputs, each sum the same bits as without SW (its order depends on K and C alone),
// so y is kernels.swiglu_pairs of the SW = 0 output, bit for bit, in one launch instead of two.
// swiglu: float32, [limit] (read only with SW).
// AP > 0 (G = 1): each computed row's output is added to AP parts, parts [rows, AP, N] bf16:
// y[r, n] = bf16(((parts[r, 0, n] + parts[r, 1, n]) + ...) + bf16(sum)), in float32 in that
// order (the MoE's routed experts' outputs, then the shared expert's, which is this GEMM:
// kernels.parts_added is the spec, bit for bit), one launch where the sum took another.
// SPLIT > 0 (G = 1, SW = 0, AP = 0): w is two matrices stacked, the first SPLIT rows one
// (attention's wq_a) and the rest the other (wkv), both fed the same x: y holds the first's
// outputs [out_rows, SPLIT], then the second's [out_rows, N - SPLIT] (gemv_y_index), each
// row-contiguous, so the two are views of y (kernels.fp8_gemv_pair): one launch for two
// GEMMs, each output summed as in a launch of its own matrix (the same K and C).
// Template constants: RB (a bound on the computed rows, a power of two up to 16), T (outputs
// per thread group), C (threads per thread group, a multiple of 32), QX (0 or 1), SW (0 or
// 1), AP (0 to 16), SPLIT (0, or a multiple of T); a row's bits do not depend on RB or T
// (tuning.Layout.gemv_layout picks them).
// CUDA twin: fp8_gemv.cu.

threadgroup float partial[8 * T * RB];  // each simdgroup's sums (gemv_warp_totals)
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const int out_rows = sizes[4];
constexpr int GROUPS = 256 / C;  // thread groups per threadgroup, T outputs each
const uint col = thread_position_in_threadgroup.x % C;
const uint grp = thread_position_in_threadgroup.x / C;
const uint tiles = uint(N) / (GROUPS * T);
const uint g = threadgroup_position_in_grid.x / tiles;
const uint n0 = (threadgroup_position_in_grid.x % tiles) * (GROUPS * T) + grp * T;
const uint words = uint(K) / 4;
const uint blocks = uint(K) / 32;

float acc[T][RB] = {};  // [output][row]
const uint steps = (uint(K) + 16 * C - 1) / (16 * C);
for (uint s = 0; s < steps; s++) {
  const uint k = 16 * col + s * 16 * C;  // this thread's 16 columns k .. k + 15
  const bool active = k < uint(K);
  if (!QX && !active) {
    break;
  }
  float xs[RB];  // QX: each row's scale for the block of 32 columns holding k (this thread's and its neighbour's)
  if (QX) {
    for (int r = 0; r < RB; r++) {
      if (r < rows) {
        xs[r] = gemv_input_block_scale(x + (ulong(r) * G + g) * K + k, active);
      }
    }
  }
  if (!active) {
    continue;
  }
  uint4 q[T];  // 16 E4M3 codes of each output row
  float sc[T];
  for (int i = 0; i < T; i++) {
    const ulong n = ulong(g) * N + n0 + i;
    q[i] = *((const device uint4*)(w + n * words + k / 4));
    sc[i] = as_type<float>((uint(scales[n * blocks + k / 32]) + 8u) << 23);  // 2^(e-127) * 256
  }
  for (int h = 0; h < 2; h++) {  // columns k + 8h .. k + 8h + 7
    float wf[T][8];  // the weights' values (scale folded in), columns in order
    for (int i = 0; i < T; i++) {
      const uint half_words[2] = {h ? q[i].z : q[i].x, h ? q[i].w : q[i].y};
      for (int j = 0; j < 2; j++) {
        const uint even = E4M3_EVEN(half_words[j]);  // columns 4j, 4j + 2
        const uint odd = E4M3_ODD(half_words[j]);    // columns 4j + 1, 4j + 3
        wf[i][4 * j + 0] = float(as_type<half>(ushort(even & 0xFFFFu))) * sc[i];
        wf[i][4 * j + 1] = float(as_type<half>(ushort(odd & 0xFFFFu))) * sc[i];
        wf[i][4 * j + 2] = float(as_type<half>(ushort(even >> 16))) * sc[i];
        wf[i][4 * j + 3] = float(as_type<half>(ushort(odd >> 16))) * sc[i];
      }
    }
    for (int r = 0; r < RB; r++) {
      if (r < rows) {
        uint4 p = *((const device uint4*)(x + (ulong(r) * G + g) * K + k + 8 * h));
        if (QX) {
          p = gemv_fake_quant8(p, xs[r]);
        }
        gemv_lane_accumulate<T, RB>(p, &wf[0][0], &acc[0][0], r);
      }
    }
  }
}

gemv_warp_totals<T, RB>(&acc[0][0], partial, thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
constexpr int OT = SW ? T / 2 : T;  // outputs a thread group writes: with SW, one a (gate, up) pair
const uint NY = SW ? uint(N) / 2 : uint(N);  // outputs a matrix has in y
const uint y0 = n0 * OT / T;  // the thread group's first output in y
for (uint o = col; o < OT * RB; o += C) {  // output y0 + o / RB, row o % RB
  if (int(o % RB) < out_rows) {  // a row past `rows`: its sums stayed zero
    // with SW, output o / RB of the thread group is its pair o / RB: slot 2 (o / RB) its gate row, the next its up row
    float v = gemv_group_total<T, RB, C>(partial, grp, SW ? o + o / RB * RB : o);
    if (SW) {
      v = gemv_swiglu(v, gemv_group_total<T, RB, C>(partial, grp, o + o / RB * RB + RB), swiglu[0]);
    }
    if (AP > 0 && int(o % RB) < rows) {  // the row's AP parts, in order, then this output as bf16
      v = gemv_parts_added<AP>(parts + ulong(o % RB) * AP * NY + y0 + o / RB, NY, v);
    }
    y[gemv_y_index<SPLIT>(o % RB, y0 + o / RB, g, G, NY, out_rows)] = bfloat16_t(v);
  }
}
const int pad = out_rows - RB;  // padding rows past RB: zeros
for (int o = int(col); o < OT * pad; o += C) {  // output y0 + o / pad, row RB + o % pad
  y[gemv_y_index<SPLIT>(RB + o % pad, y0 + o / pad, g, G, NY, out_rows)] = bfloat16_t(0.0f);
}
