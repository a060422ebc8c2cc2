// y[r, g, n] = sum_k x[r, g, k] * dequant(w[g, n, k]) for forwards of up to 16 rows on the
// matrix unit: fp8_gemv's GEMMs (the same inputs, outputs and epilogues) for the large dense
// matrices (kernels.fp8_gemv_on_matrix_unit), where decoding each weight code once for all of
// a forward's rows saves more than the scalar kernel's many threads per output gain.
//
// w: MLX `mxfp8` codes [G, N, K / 4] (uint32, four E4M3 bytes each, column order) with one
// E8M0 scale per row and 32 columns, scales [G, N, K / 32]. x: bf16 [rows, G, K] (exact: an
// FP8 fake-quantised activation, or one the kernel quantises: QX). Output y: bf16
// [out_rows, G, N]. sizes [5] int32 = (rows, N, K, G, out_rows): the first `rows` rows are
// computed, the rest of the out_rows (a padded forward's padding, Runner.padded) come out
// zeros; 1 <= rows <= 8 NH. G = 1 for a dense GEMM (the only use: fp8_gemv_on_matrix_unit);
// the layout also takes G matrices, threadgroup i working on matrix i / (N / 32).
// N a multiple of 32, K of 256.
//
// The arithmetic runs on the matrix unit, one block of 32 columns (one weight scale per row) at
// a time. An E4M3 code becomes the fp16 of its value / 256 by moving bits (fp8_common.h): every
// E4M3 value, subnormals included, is exact in fp16. x becomes fp16(x / s), s the FP8 block
// scale of the row's 32 values in the block (fp8_lane.h): a power of two, so for an x FP8
// fake-quantised over the same blocks (QX = 1: by the kernel) x / s has E4M3's few bits and
// range, exact in fp16. A bf16 x that is not quantised keeps its 8 bits in fp16 down to
// x / s = 2^-17 (x / s of the block's largest lies in (224, 448], the 1e-4 floor aside): only
// values below about 2^-25 to 2^-26 of their block's largest would be rounded, to fp16's
// subnormal step 2^-24 (wo_a's input is such an x, but this kernel serves the dense matrices
// alone). The matrix unit multiplies
// those in 8x8 tiles (a product of two fp16 values is exact in float32) and sums each block's
// 32 products in float32, into a fresh sum per block; each block's sums then go into float32
// accumulators times the weight row's scale * 256 and the column's s (powers of two: exact),
// block after block. Each simdgroup does so for its own range of blocks; the threadgroup adds the
// 8 simdgroups' sums in order. Each row's outputs are computed alone (a matrix-unit product
// sums each column on its own): the same bits whatever the other rows, and in forwards of any
// size. The spec is fp8_gemv_reference (MLX's gather_qmm), equal up to the order of the
// float32 sums; nor is it fp8_gemv's order: the two kernels agree up to it, not bit for bit.
//
// The work: a threadgroup of 8 simdgroups per tile of TR outputs of one matrix (TR 32, or 16:
// twice the threadgroups, for a grid of few tiles; tuning.Layout.mma_tile_rows; an output's sums do
// not depend on it). The forward's rows are the columns of the matrix products, COLS = 8 NH of
// them, one pass for all (columns past `rows` repeat the last row's x, their sums never read).
// The 8 simdgroups split K: simdgroup w takes the blocks w * nb / 8 .. (w + 1) * nb / 8 - 1
// (nb = K / 32), in order. Per
// block a simdgroup decodes the tile's TR weight rows (32: a lane per row, its 32 bytes of the
// block; 16: two lanes a row, 16 bytes each) and the rows' x / s (a lane per column of K, a
// row of the buffer per forward row) into its threadgroup memory, multiplies them as TR / 8 x
// NH tiles of 8 weight rows x 8 forward rows, stores the float sums in the weights' place and
// scales its share into its accumulators: lane 4 g + t weight rows 8 mg + g (mg < TR / 8) and
// columns 8 h + 2 t, 8 h + 2 t + 1 (h < NH), the rows and columns CUDA's mma fragments give a
// lane. After its blocks each simdgroup writes its sums to threadgroup memory (which the
// staging buffers give back) and the threadgroup adds them up and writes y, the padding rows'
// zeros included.
// QX = 1: x is a bf16 activation not yet FP8 fake-quantised; the kernel quantises each row's
// blocks of 32 as it reads them (fp8_lane.h), the bits of act_quant followed by QX = 0.
// SW = 1: w is a SwiGLU's gate and up projections with their rows interleaved (row 2p pair p's
// gate, row 2p + 1 its up: checkpoint.stack_gate_up), and y [out_rows, G, N / 2] their SwiGLU
// in bf16, limit swiglu[0] (gemv_lane.h's gemv_swiglu): each sum the same bits as without SW,
// so y is kernels.swiglu_pairs of the SW = 0 output, bit for bit. swiglu: float32 [limit]
// (read only with SW).
// after (kernels.FP8_MMA's last input; not fp8_mma_hc's): any array, never read: one the launch
// is to wait for (kernels.fp8_gemv's `after`; MLX's CUDA graphs order launches by the buffers
// they take).
// AP > 0 (G = 1): each computed row's output is added to AP parts, parts [rows, AP, N] bf16:
// y[r, n] = bf16(((parts[r, 0, n] + parts[r, 1, n]) + ...) + bf16(sum)), in float32 in that
// order (kernels.parts_added is the spec, bit for bit), as fp8_gemv's AP.
// Template constants: NH (the matrix unit's column groups of 8: 1 or 2,
// tuning.Layout.mma_column_groups), QX (0 or 1), SW (0 or 1), AP (0 to 16), TR (16 or 32); a row's
// bits depend on neither NH nor TR.
// CUDA twin: fp8_mma.cu
// This text ends with every simdgroup's sums in red; the kernel's end, what it writes, is
// fp8_mma_y.metal (kernels.FP8_MMA: y as above) or fp8_mma_hc.metal (kernels.FP8_MMA_HC: y
// expanded into the hyper-connection stream and the next sub-layer's mixes begun).

constexpr int WARPS = 8;
constexpr int COLS = 8 * NH;  // the matrix products' columns: the computed rows, padded
constexpr int RGS = TR / 8;   // the tile's row groups of 8 (the CUDA twin's m groups are 16 rows)
static_assert(TR == 16 || TR == 32, "a tile of 16 or 32 weight rows");
// Per simdgroup while it runs its blocks: the decoded weights [TR rows][32 k] as half (then the
// block's sums [TR rows][COLS] as float, in the same place: the products have read the weights)
// and x / s [COLS][32 k] as half. After the blocks: each simdgroup's sums [warp][row][column].
constexpr int WBUF_FLOATS = TR * 32 / 2;
constexpr int XBUF_FLOATS = COLS * 32 / 2;
static_assert(TR * COLS <= WBUF_FLOATS, "a block's sums fit in the weights' place");
constexpr int STAGE_FLOATS = WARPS * (WBUF_FLOATS + XBUF_FLOATS);
constexpr int RED_FLOATS = WARPS * TR * COLS;
constexpr int TG_FLOATS = STAGE_FLOATS > RED_FLOATS ? STAGE_FLOATS : RED_FLOATS;
threadgroup float tg_mem[TG_FLOATS];
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const int out_rows = sizes[4];
const uint tiles = uint(N) / TR;
const uint grp = threadgroup_position_in_grid.x / tiles;  // the matrix (0 for a dense GEMM)
const uint n0 = (threadgroup_position_in_grid.x % tiles) * TR;  // the tile's first output
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const uint g = lane / 4;
const uint t = lane % 4;
const uint nb = uint(K) / 32;            // blocks of 32 columns, each with its own scale per row
const uint per_warp = nb / WARPS;        // K a multiple of 256: the same count for every simdgroup
const uint b0 = warp * per_warp;         // the simdgroup's first block
const uint words = uint(K) / 4;
const ulong row0 = ulong(grp) * N + n0;  // the tile's first weight row
threadgroup half* wbuf = (threadgroup half*)tg_mem + warp * 2 * WBUF_FLOATS;  // [TR rows][32 k]
threadgroup float* dbuf = tg_mem + warp * WBUF_FLOATS;  // [TR rows][COLS], in wbuf's place
threadgroup half* xbuf = (threadgroup half*)(tg_mem + WARPS * WBUF_FLOATS) + warp * 2 * XBUF_FLOATS;  // [COLS][32 k]
threadgroup float* red = tg_mem;  // [WARPS][TR rows][COLS], in the staging buffers' place

ulong xr[COLS];  // column j's x row (past the computed rows: the last one, its sums unread)
for (int j = 0; j < COLS; j++) {
  xr[j] = (ulong(metal::min(j, rows - 1)) * G + grp) * K;
}
float acc[RGS][NH][2] = {};  // [row group mg][column group h][c]: row 8 mg + g, column 8 h + 2 t + c
constexpr uint LW = TR / 4;  // the 32-bit words of codes a lane decodes a block: 8 (a row's 32), or 4 (16)
const uint wr = lane * TR / 32;  // the tile row this lane decodes
const uint part = lane % (32 / TR);  // its half of the row (TR 16), or 0
for (uint i = 0; i < per_warp; i++) {
  const uint b = b0 + i;
  // the tile's weights: lane l decodes row wr's LW words (4 LW codes) of the block (one or two
  // 16-byte reads), column c of wbuf code c, two codes a 32-bit store: word i's even pair
  // (codes 4i, 4i + 2) and odd pair (4i + 1, 4i + 3) regrouped as columns (4i, 4i + 1) and
  // (4i + 2, 4i + 3)
  const device uint4* wp = (const device uint4*)(w + (row0 + wr) * words + 8 * b + LW * part);
  const uint4 q0 = wp[0];
  const uint4 q1 = TR == 32 ? wp[1] : q0;
  const uint qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
  threadgroup uint* wrow = (threadgroup uint*)wbuf + wr * 16 + 2 * LW * part;
  for (uint c = 0; c < LW; c++) {
    const uint even = E4M3_EVEN(qw[c]);  // codes 4c (low half), 4c + 2 (high)
    const uint odd = E4M3_ODD(qw[c]);    // codes 4c + 1, 4c + 3
    wrow[2 * c] = (even & 0xFFFFu) | (odd << 16);
    wrow[2 * c + 1] = (even >> 16) | (odd & 0xFFFF0000u);
  }
  float f[RGS];  // the scale * 256 of rows 8 mg + g: 2^(e-127) * 256
  for (int mg = 0; mg < RGS; mg++) {
    f[mg] = as_type<float>((uint(scales[(row0 + 8 * mg + g) * nb + b]) + 8u) << 23);
  }
  // the rows' x: lane l column 32 b + l of every row, divided by the block's scale
  float sx[NH][2] = {};  // the scale s of columns 8 h + 2 t + c, those this lane's sums belong to
  for (int j = 0; j < COLS; j++) {
    if (j < rows) {  // (every lane alike) the block's 32 values, one a lane (mma_x.h)
      float s;
      xbuf[j * 32 + lane] = half(mma_x_column<QX>(float(x[xr[j] + 32 * b + lane]), &s));  // exact in fp16
      if (uint(j % 8) / 2 == t) {
        sx[j / 8][j % 2] = s;
      }
    } else {  // a padding column: zeros, its sums unread
      xbuf[j * 32 + lane] = half(0.0f);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane's stores before the tiles' loads

  simdgroup_float8x8 d[RGS][NH];  // the block's sums alone: rows 8 mg .. 8 mg + 7 x columns 8 h .. 8 h + 7
  for (int mg = 0; mg < RGS; mg++) {
    for (int h = 0; h < NH; h++) {
      d[mg][h] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  for (int k8 = 0; k8 < 32; k8 += 8) {
    simdgroup_half8x8 bx[NH];
    for (int h = 0; h < NH; h++) {
      // xbuf is [column][k]: loaded transposed, the tile is k x column
      simdgroup_load(bx[h], xbuf + (8 * h) * 32 + k8, 32, ulong2(0, 0), true);
    }
    for (int mg = 0; mg < RGS; mg++) {
      simdgroup_half8x8 a;
      simdgroup_load(a, wbuf + (8 * mg) * 32 + k8, 32);
      for (int h = 0; h < NH; h++) {
        simdgroup_multiply_accumulate(d[mg][h], a, bx[h], d[mg][h]);
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // the loads of wbuf are done: dbuf takes its place
  for (int mg = 0; mg < RGS; mg++) {
    for (int h = 0; h < NH; h++) {
      simdgroup_store(d[mg][h], dbuf + (8 * mg) * COLS + 8 * h, COLS);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // the sums stored before any lane reads them
  for (int mg = 0; mg < RGS; mg++) {
    for (int h = 0; h < NH; h++) {
      for (int c = 0; c < 2; c++) {
        acc[mg][h][c] = fma(dbuf[(8 * mg + g) * COLS + 8 * h + 2 * t + c], f[mg] * sx[h][c], acc[mg][h][c]);
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // read before the next block writes wbuf again
}

threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with its staging buffers
for (int mg = 0; mg < RGS; mg++) {
  for (int h = 0; h < NH; h++) {
    for (int c = 0; c < 2; c++) {
      red[(warp * TR + 8 * mg + g) * COLS + 8 * h + 2 * t + c] = acc[mg][h][c];
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
