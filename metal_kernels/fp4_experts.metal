// The routed experts' FP4 GEMMs for forwards of up to 16 rows: y[r, j] = dequant(w[ids[r, j]])
// . x[r, j or 0], each expert's weights read once for all the (row, slot) pairs that picked it.
//
// w: MLX `mxfp4` codes [E, N, K / 8] (uint32, eight E2M1 codes each, the first in the low
// nibble) with one E8M0 scale per row and 32 columns, scales [E, N, K / 32]. ids: uint32
// [rows, KS], each row's experts (distinct within a row). x: bf16 [rows, X, K] (exact:
// FP8 fake-quantised activations); X = 1: all of a row's slots read x[r, 0] (the gate and
// up projection), X = KS: slot j reads x[r, j] (the down projection). Output y: bf16
// [rows, KS, N]. sizes [5] int32 = (rows, KS, N, K, X); rows <= 16. N a multiple of
// (256 / C) * T, K of 32.
//
// The arithmetic is fp8_gemv's: an E2M1 code becomes the fp16 of its value / 2^14 by moving
// bits (fp8_common.h), then a float (read from a 16-entry table the threadgroup fills first:
// one table read a code, where converting each would bound the kernel by the GPU's slow
// conversion rate) times its scale * 2^14 (a power of two: exact); products
// with bf16 values are exact in float32, summed per thread in column order, then over each
// simdgroup in a butterfly and over a thread group's simdgroups in order (gemv_lane.h). Each
// pair's outputs are computed alone: the same bits whatever the other rows and their experts.
// The spec is MLX's gather_qmm (kernels.fp4_experts_reference), equal up to the order of the
// float32 sums.
//
// The work: a threadgroup per (pair, tile of (256 / C) * T outputs). A pair whose expert an
// earlier pair (in row-major order) also picked leaves at once; the first pair of each expert
// runs all the pairs that picked it (at most one per row, found by a scan of the pairs after
// it), RB at a time, each pass as fp8_gemv runs its rows (a later pass reads the tile's
// weights again, from cache: with a verify forward's few rows an expert is picked by one or
// two): a thread group of C threads owns T outputs and splits K, thread c taking columns
// 16c .. 16c + 15 of every 16 * C (8 bytes of each weight row per step).
// QX = 1: x not yet FP8 fake-quantised, the kernel quantises it as it reads it (fp8_gemv.metal).
// SW = 1: the experts' gate and up projections, rows interleaved (w13), y [rows, KS, N / 2] their SwiGLU
// in bf16, as fp8_gemv's SW; SW = 2: that times the pair's routing weight, float32, before
// the rounding (the MoE's weighted SwiGLU: kernels.swiglu_pairs of the SW = 0 output, bit for
// bit). swiglu: float32 [limit]; weights: float32 [rows * KS], each pair's (read with SW = 2).
// Template constants: RB (the pairs a pass runs: 1, 2, 4, 8 or 16), T (outputs per thread
// group), C (threads per thread group, a multiple of 32), QX (0 or 1), SW (0, 1 or 2); a
// pair's bits do not depend on RB or T (kernels.FP4_EXPERTS_LAYOUT).
// CUDA twin: fp4_experts.cu.

threadgroup float partial[8 * T * RB];  // each simdgroup's sums (gemv_warp_totals)
const int rows = sizes[0];
const int KS = sizes[1];  // experts per row (top-k)
const int N = sizes[2];
const int K = sizes[3];
const int X = sizes[4];   // 1: a row's slots share x[r, 0]; KS: slot j reads x[r, j]
constexpr int GROUPS = 256 / C;  // thread groups per threadgroup, T outputs each
const uint col = thread_position_in_threadgroup.x % C;
const uint grp = thread_position_in_threadgroup.x / C;
const uint tiles = uint(N) / (GROUPS * T);
const int pair = int(threadgroup_position_in_grid.x / tiles);
const uint n0 = (threadgroup_position_in_grid.x % tiles) * (GROUPS * T) + grp * T;
const uint expert = ids[pair];
for (int q = 0; q < pair; q++) {
  if (ids[q] == expert) {
    return;  // the whole threadgroup: the expert's first pair does all of its pairs
  }
}
threadgroup float e2m1[16];  // each E2M1 code's value / 2^14 (a table read costs less than a conversion)
if (thread_position_in_threadgroup.x < 16) {
  e2m1[thread_position_in_threadgroup.x] = float(as_type<half>(ushort(E2M1_HALF(thread_position_in_threadgroup.x))));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint words = uint(K) / 8;
const uint blocks = uint(K) / 32;
const ulong w0 = ulong(expert) * N + n0;  // the thread group's first weight row
const uint steps = (uint(K) + 16 * C - 1) / (16 * C);
constexpr int OT = SW ? T / 2 : T;  // outputs a thread group writes: with SW, one a (gate, up) pair
const uint NY = SW ? uint(N) / 2 : uint(N);  // outputs a pair has in y

for (int p0 = 0;; p0 += RB) {  // a pass: the expert's picks p0 .. p0 + RB - 1 (later ones read its weights from cache)
  int pp[RB];  // the pass's pairs (r * KS + j), -1 past the last
  for (int r = 0; r < RB; r++) {
    pp[r] = -1;
  }
  int seen = 0;  // the expert's picks: at most one a row
  for (int p = pair; p < rows * KS; p++) {  // the pairs before `pair` did not pick it
    if (ids[p] == expert) {
      for (int r = 0; r < RB; r++) {
        pp[r] = seen == p0 + r ? p : pp[r];
      }
      seen++;
    }
  }
  int xr[RB];  // the x row each reads
  for (int r = 0; r < RB; r++) {
    xr[r] = X > 1 ? pp[r] : pp[r] / KS;
  }
  float acc[T][RB] = {};  // [output][pair]
  for (uint s = 0; s < steps; s++) {
    const uint k = 16 * col + s * 16 * C;  // this thread's 16 columns k .. k + 15
    const bool active = k < uint(K);
    if (!QX && !active) {
      break;
    }
    float xs[RB];  // QX: each pair's scale for the block of 32 columns holding k (this thread's and its neighbour's)
    if (QX) {
      for (int r = 0; r < RB; r++) {
        if (pp[r] >= 0) {
          xs[r] = gemv_input_block_scale(x + ulong(xr[r]) * K + k, active);
        }
      }
    }
    if (!active) {
      continue;
    }
    uint2 q[T];  // 16 E2M1 codes of each output row
    float sc[T];
    for (int i = 0; i < T; i++) {
      q[i] = *((const device uint2*)(w + (w0 + i) * words + k / 8));
      sc[i] = as_type<float>((uint(scales[(w0 + i) * blocks + k / 32]) + 14u) << 23);  // 2^(e-127) * 2^14
    }
    for (int h = 0; h < 2; h++) {  // columns k + 8h .. k + 8h + 7
      float wf[T][8];  // the weights' values (scale folded in), columns in order
      for (int i = 0; i < T; i++) {
        const uint word = h ? q[i].y : q[i].x;
        const uint codes[2] = {E2M1_EVEN_CODES(word), E2M1_ODD_CODES(word)};
        for (int c = 0; c < 8; c++) {  // code c: byte c / 2 of codes[c % 2]
          wf[i][c] = e2m1[(codes[c % 2] >> (8 * (c / 2))) & 0xFu] * sc[i];
        }
      }
      for (int r = 0; r < RB; r++) {
        if (pp[r] >= 0) {
          uint4 p = *((const device uint4*)(x + ulong(xr[r]) * K + k + 8 * h));
          if (QX) {
            p = gemv_fake_quant8(p, xs[r]);
          }
          gemv_lane_accumulate<T, RB>(p, &wf[0][0], &acc[0][0], r);
        }
      }
    }
  }

  gemv_warp_totals<T, RB>(&acc[0][0], partial, thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
  for (uint o = col; o < OT * RB; o += C) {  // output n0 * OT / T + o / RB of the pass's pair o % RB
    const int r = int(o % RB);
    int pr = -1;  // pp[r], picked out so that pp stays in registers (a variable index would not)
    for (int i = 0; i < RB; i++) {
      pr = i == r ? pp[i] : pr;
    }
    if (pr >= 0) {
      // with SW, output o / RB of the thread group is its pair o / RB: slot 2 (o / RB) its gate row,
      // the next its up row
      float v = gemv_group_total<T, RB, C>(partial, grp, SW ? o + o / RB * RB : o);
      if (SW) {
        v = gemv_swiglu(v, gemv_group_total<T, RB, C>(partial, grp, o + o / RB * RB + RB), swiglu[0]);
      }
      if (SW == 2) {
        v = v * weights[pr];  // the pair's routing weight
      }
      y[ulong(pr) * NY + n0 * OT / T + o / RB] = bfloat16_t(v);
    }
  }
  if (seen <= p0 + RB) {
    break;  // (every thread alike)
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the next pass writes partial again
}
