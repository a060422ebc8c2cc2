// The routed experts' FP4 GEMMs for forwards of up to 16 rows: y[r, j] = dequant(w[ids[r, j]])
// . x[r, j or 0], each expert's weights read once for all the (row, slot) pairs that picked it.
//
// w: MLX `mxfp4` codes [E, N, K / 8] (uint32, eight E2M1 codes each, the first in the low
// nibble) with one E8M0 scale per row and 32 columns, scales [E, N, K / 32]. ids: uint32
// [rows, KS], each row's experts (distinct within a row). x: bf16 [rows, X, K] (exact:
// FP8 fake-quantised activations); X = 1: all of a row's slots read x[r, 0] (the gate and
// up projection), X = KS: slot j reads x[r, j] (the down projection). Output y: bf16
// [rows, KS, N]. sizes [5] int32 = (rows, KS, N, K, X); rows <= 16. N a multiple of 32, K of
// 256.
//
// The arithmetic runs on the matrix unit, one block of 32 columns (one weight scale per row) at
// a time. An E2M1 code becomes the fp16 of its value / 2^14 by moving bits (fp8_common.h), and
// x becomes fp16(x / s), s the FP8 block scale of the pair's 32 values in the block
// (fp8_lane.h): a power of two, and x is FP8 fake-quantised over the same blocks (QX = 1: by
// the kernel), so x / s has E4M3's few bits and range: exact in fp16. The matrix unit
// multiplies those in 8x8 tiles (their products are exact in float32) and sums each block's 32
// products in float32; each block's sums then go into float32 accumulators times the weight
// row's scale * 2^14 and the column's s (powers of two: exact), block after block. Each
// simdgroup does so for its own range of blocks; the threadgroup adds the 8 simdgroups' sums in
// order. Each pair's outputs are computed alone (a matrix-unit product sums each column on its
// own): the same bits whatever the other rows and their experts. The spec is MLX's gather_qmm
// (kernels.fp4_experts_reference), equal up to the order of the float32 sums.
//
// The work: a threadgroup of 8 simdgroups per (pair, tile of 32 outputs). A pair whose expert an
// earlier pair (in row-major order) also picked leaves at once; the first pair of each expert
// runs all the pairs that picked it (at most one per row, found by a scan of the pairs after
// it; in a one-row launch, whose experts are distinct, each pair is its expert's only one and
// nothing is scanned), COLS = 8 NH at a time: a pass, its pairs the columns of the matrix products (past the
// last pick, columns repeat the pass's first pick's x and their sums are never read; a later
// pass reads the tile's weights again, from cache: with a verify forward's few rows an expert is
// picked by one or two). The 8 simdgroups split K: simdgroup w takes the blocks w * nb / 8 ..
// (w + 1) * nb / 8 - 1 (nb = K / 32), in order. Per block a simdgroup decodes the tile's 32
// weight rows (a lane per row, its 16 bytes of the block) and the pass's x / s (a lane per
// column of K, a row of the buffer per pair) into its threadgroup memory, multiplies them as
// 4 x NH tiles of 8 rows x 8 pairs, stores the float sums in the weights' place and scales
// its share into its accumulators: lane 4 g + t rows 8 mg + g (mg 0 .. 3) and columns
// 8 h + 2 t, 8 h + 2 t + 1 (h < NH), the rows and columns CUDA's mma fragments give a lane.
// After its blocks each simdgroup writes its sums to threadgroup memory (which the staging
// buffers give back) and the threadgroup adds them up and writes y.
// QX = 1: x not yet FP8 fake-quantised, the kernel quantises it as it reads it (fp8_gemv.metal).
// SW = 1: the experts' gate and up projections, rows interleaved (w13), y [rows, KS, N / 2] their SwiGLU
// in bf16, as fp8_gemv's SW; SW = 2: that times the pair's routing weight, float32, before
// the rounding (the MoE's weighted SwiGLU: kernels.swiglu_pairs of the SW = 0 output, bit for
// bit). swiglu: float32 [limit]; weights: float32 [rows * KS], each pair's (read with SW = 2).
// PX = 1: x is mma_x_prep's output for these rows (x / s as fp16 bits, uint16) and xs [.., K /
// 32] its scales s: the x / s and s this kernel would compute, read instead (a verify forward's
// threadgroups each computed them again, 144 tiles an expert); xs is unread with PX = 0.
// Template constants: NH (the matrix unit's column groups of 8 a pass: 1 or 2,
// tuning.Layout.mma_column_groups), QX (0 or 1), SW (0, 1 or 2), PX (0 or 1); a pair's bits
// depend on neither NH nor PX.
// CUDA twin: fp4_experts.cu (mma.sync m16n8k16, the fragments in registers: each lane decodes
// its own weight words and x there, where here they go through threadgroup memory).

constexpr int WARPS = 8;
constexpr int COLS = 8 * NH;  // pass columns
// Per simdgroup while it runs its blocks: the decoded weights [32 rows][32 k] as half (then the
// block's sums [32 rows][COLS] as float, in the same place: the products have read the weights)
// and x / s [COLS][32 k] as half. After the blocks: each simdgroup's sums [warp][row][column].
constexpr int WBUF_FLOATS = 32 * 32 / 2;
constexpr int XBUF_FLOATS = COLS * 32 / 2;
static_assert(32 * COLS <= WBUF_FLOATS, "a block's sums fit in the weights' place");
constexpr int STAGE_FLOATS = WARPS * (WBUF_FLOATS + XBUF_FLOATS);
constexpr int RED_FLOATS = WARPS * 32 * COLS;
constexpr int TG_FLOATS = STAGE_FLOATS > RED_FLOATS ? STAGE_FLOATS : RED_FLOATS;
threadgroup float tg_mem[TG_FLOATS];
threadgroup int picks[16];  // the pairs (r * KS + j, in order) that picked this expert: at most one a row
threadgroup int n_picks;
const int rows = sizes[0];
const int KS = sizes[1];  // experts per row (top-k)
const int N = sizes[2];
const int K = sizes[3];
const int X = sizes[4];   // 1: a row's slots share x[r, 0]; KS: slot j reads x[r, j]
const uint tiles = uint(N) / 32;
const int pair = int(threadgroup_position_in_grid.x / tiles);
const uint n0 = (threadgroup_position_in_grid.x % tiles) * 32;  // the tile's first output
const uint expert = ids[pair];
// a one-row launch: the row's experts are distinct, so `pair` is its expert's one pick, found without
// reading ids again (each read before the walk, and the barrier behind them, delays every simdgroup's first loads)
const bool alone = rows == 1;
if (!alone) {
  for (int q = 0; q < pair; q++) {
    if (ids[q] == expert) {
      return;  // the whole threadgroup: the expert's first pair does all of its pairs
    }
  }
}
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const uint g = lane / 4;
const uint t = lane % 4;
if (!alone) {
  if (tid == 0) {
    int m = 0;
    for (int p = pair; p < rows * KS; p++) {  // the pairs before `pair` did not pick it
      if (ids[p] == expert) {
        picks[m++] = p;
      }
    }
    n_picks = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
const int m = alone ? 1 : n_picks;
const float limit = SW ? swiglu[0] : 0.0f;                         // read now, used after the walk
const float own_weight = SW == 2 && alone ? weights[pair] : 0.0f;  // likewise, a one-row launch's weight
const uint nb = uint(K) / 32;            // blocks of 32 columns, each with its own scale per row
const uint per_warp = nb / WARPS;        // K a multiple of 256: the same count for every simdgroup
const uint b0 = warp * per_warp;         // the simdgroup's first block
const uint words = uint(K) / 8;
const ulong row0 = ulong(expert) * N + n0;  // the tile's first weight row
const uint NY = SW ? uint(N) / 2 : uint(N);  // outputs a pair has in y
threadgroup half* wbuf = (threadgroup half*)tg_mem + warp * 2 * WBUF_FLOATS;  // [32 rows][32 k]
threadgroup float* dbuf = tg_mem + warp * WBUF_FLOATS;  // [32 rows][COLS], in wbuf's place
threadgroup half* xbuf = (threadgroup half*)(tg_mem + WARPS * WBUF_FLOATS) + warp * 2 * XBUF_FLOATS;  // [COLS][32 k]
threadgroup float* red = tg_mem;  // [WARPS][32 rows][COLS], in the staging buffers' place

for (int p0 = 0; p0 < m; p0 += COLS) {  // a pass: picks p0 .. p0 + COLS - 1
  uint xr[COLS];  // column j's x row (past the last pick: the pass's first pick's, its sums unread)
  for (int j = 0; j < COLS; j++) {
    const int p = alone ? pair : p0 + j < m ? picks[p0 + j] : picks[p0];
    xr[j] = uint(X > 1 ? p : p / KS);
  }
  float acc[4][NH][2] = {};  // [row group mg][column group h][c]: row 8 mg + g, column 8 h + 2 t + c
  for (uint i = 0; i < per_warp; i++) {
    const uint b = b0 + i;
    // the tile's weights: lane l decodes row n0 + l's 32 codes of the block (one 16-byte read),
    // column c of wbuf code c, two codes (one byte) a 32-bit store
    const uint4 q = *((const device uint4*)(w + (row0 + lane) * words + 4 * b));
    const uint qw[4] = {q.x, q.y, q.z, q.w};
    threadgroup uint* wrow = (threadgroup uint*)wbuf + lane * 16;
    for (int c = 0; c < 4; c++) {
      for (int k = 0; k < 4; k++) {
        const uint codes = (qw[c] >> (8 * k)) & 0xFFu;  // codes 8c + 2k (low nibble) and 8c + 2k + 1
        wrow[4 * c + k] = E2M1_HALF(codes & 0xFu) | (E2M1_HALF(codes >> 4) << 16);
      }
    }
    float f[4];  // the scale * 2^14 of rows 8 mg + g: 2^(e-127) * 2^14
    for (int mg = 0; mg < 4; mg++) {
      f[mg] = as_type<float>((uint(scales[(row0 + 8 * mg + g) * nb + b]) + 14u) << 23);
    }
    // the pass's x: lane l column 32 b + l of every pair's row, divided by the block's scale
    float sx[NH][2] = {};  // the scale s of columns 8 h + 2 t + c, those this lane's sums belong to
    for (int j = 0; j < COLS; j++) {
      if (p0 + j < m) {  // (every lane alike) the block's 32 values, one a lane (mma_x.h)
        float s;
        if (PX) {  // x / s and s, as mma_x_prep made them
          xbuf[j * 32 + lane] = as_type<half>(x[ulong(xr[j]) * K + 32 * b + lane]);
          s = xs[ulong(xr[j]) * nb + b];
        } else {
          xbuf[j * 32 + lane] = half(mma_x_column<QX>(float(x[ulong(xr[j]) * K + 32 * b + lane]), &s));  // exact in fp16
        }
        if (uint(j % 8) / 2 == t) {
          sx[j / 8][j % 2] = s;
        }
      } else {  // a padding column: zeros, its sums unread
        xbuf[j * 32 + lane] = half(0.0f);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane's stores before the tiles' loads

    simdgroup_float8x8 d[4][NH];  // the block's sums alone: rows 8 mg .. 8 mg + 7 x columns 8 h .. 8 h + 7
    for (int mg = 0; mg < 4; mg++) {
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
      for (int mg = 0; mg < 4; mg++) {
        simdgroup_half8x8 a;
        simdgroup_load(a, wbuf + (8 * mg) * 32 + k8, 32);
        for (int h = 0; h < NH; h++) {
          simdgroup_multiply_accumulate(d[mg][h], a, bx[h], d[mg][h]);
        }
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // the loads of wbuf are done: dbuf takes its place
    for (int mg = 0; mg < 4; mg++) {
      for (int h = 0; h < NH; h++) {
        simdgroup_store(d[mg][h], dbuf + (8 * mg) * COLS + 8 * h, COLS);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // the sums stored before any lane reads them
    for (int mg = 0; mg < 4; mg++) {
      for (int h = 0; h < NH; h++) {
        for (int c = 0; c < 2; c++) {
          acc[mg][h][c] = fma(dbuf[(8 * mg + g) * COLS + 8 * h + 2 * t + c], f[mg] * sx[h][c], acc[mg][h][c]);
        }
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // read before the next block writes wbuf again
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with its staging buffers
  for (int mg = 0; mg < 4; mg++) {
    for (int h = 0; h < NH; h++) {
      for (int c = 0; c < 2; c++) {
        red[(warp * 32 + 8 * mg + g) * COLS + 8 * h + 2 * t + c] = acc[mg][h][c];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint o = tid; o < (SW ? 16u : 32u) * COLS; o += WARPS * 32) {
    const uint col = o % COLS;
    const uint out = o / COLS;  // with SW, pair `out`: rows 2 out (gate) and 2 out + 1 (up)
    if (p0 + int(col) < m) {
      float sum[2] = {0.0f, 0.0f};
      for (int j = 0; j < (SW ? 2 : 1); j++) {  // each row's total over the simdgroups, in order
        const uint row = SW ? 2 * out + j : out;
        sum[j] = red[row * COLS + col];
        for (int v = 1; v < WARPS; v++) {
          sum[j] += red[(v * 32 + row) * COLS + col];
        }
      }
      const int pr = alone ? pair : picks[p0 + col];
      float v = SW ? gemv_swiglu(sum[0], sum[1], limit) : sum[0];
      if (SW == 2) {
        v = v * (alone ? own_weight : weights[pr]);  // the pair's routing weight
      }
      y[ulong(pr) * NY + (SW ? n0 / 2 : n0) + out] = bfloat16_t(v);
    }
  }
  if (p0 + COLS < m) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next pass's staging writes red's place again
  }
}
