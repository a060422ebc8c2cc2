// y[r, g, n] = sum_k x[r, g, k] * dequant(w[g, n, k]) for forwards of up to 16 rows: the
// FP8 GEMMs of a decode or verify step, each weight byte read once for all rows.
//
// w: MLX `mxfp8` codes [G, N, K / 4] (uint32, four E4M3 bytes each, column order) with
// one E8M0 scale per row and 32 columns, scales [G, N, K / 32]. x: bf16 [rows, G, K]
// (exact: an FP8 fake-quantised activation, or wo_a's bf16 one). Output y: bf16
// [rows, G, N]. G = 1 for a dense GEMM; wo_a's 8 groups otherwise. sizes [4] int32 =
// (rows, N, K, G); rows <= RB. N a multiple of 8 * NW, K of 256.
//
// The arithmetic: an E4M3 code becomes the fp16 of its value / 256 by moving bits
// (fp8_common.h), then a float times its scale * 256 (a power of two: exact). Its
// product with a bf16 value is exact in float32; each lane sums its products in
// float32 in column order, and the 32 lanes' sums are added in a butterfly. Not
// MLX's summation order, so the result is the spec's (quantized_matmul) up to another
// float32 summation order; each row is computed alone (the same bits in any forward).
//
// The work: a threadgroup of 8 simdgroups owns 8 * NW outputs of one group, a
// simdgroup NW consecutive outputs over all of K. Lane l takes columns 8l .. 8l + 7 of
// every 256: per step it reads 8 bytes of each of its NW weight rows (a simdgroup reads
// 256 contiguous bytes of a row) and 8 values of x per row, which serve all NW outputs.
// Template constants: RB (a bound on rows: 8 or 16), NW (outputs per simdgroup).
// CUDA twin: fp8_gemv.cu.

constexpr int WARPS = 8;
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
const uint tiles = uint(N) / (WARPS * NW);
const uint g = threadgroup_position_in_grid.x / tiles;
const uint n0 = (threadgroup_position_in_grid.x % tiles) * (WARPS * NW) + warp * NW;
const uint words = uint(K) / 4;
const uint blocks = uint(K) / 32;

float acc[NW][RB] = {};  // [output][row]
for (uint k = 8 * lane; k < uint(K); k += 256) {  // this lane's 8 columns k .. k + 7
  float wf[NW][8];  // the weights' values (scale folded in), columns in order
  for (int i = 0; i < NW; i++) {
    const ulong n = ulong(g) * N + n0 + i;
    const uint2 q = *((const device uint2*)(w + n * words + k / 4));
    const float sc = as_type<float>((uint(scales[n * blocks + k / 32]) + 8u) << 23);  // 2^(e-127) * 256
    const uint half_words[2] = {q.x, q.y};
    for (int h = 0; h < 2; h++) {
      const uint even = E4M3_EVEN(half_words[h]);  // columns 4h, 4h + 2
      const uint odd = E4M3_ODD(half_words[h]);    // columns 4h + 1, 4h + 3
      wf[i][4 * h + 0] = float(as_type<half>(ushort(even & 0xFFFFu))) * sc;
      wf[i][4 * h + 1] = float(as_type<half>(ushort(odd & 0xFFFFu))) * sc;
      wf[i][4 * h + 2] = float(as_type<half>(ushort(even >> 16))) * sc;
      wf[i][4 * h + 3] = float(as_type<half>(ushort(odd >> 16))) * sc;
    }
  }
  for (int r = 0; r < RB; r++) {
    if (r < rows) {
      const uint4 p = *((const device uint4*)(x + (ulong(r) * G + g) * K + k));
      gemv_lane_accumulate<NW, RB>(p, &wf[0][0], &acc[0][0], r);
    }
  }
}

// each (output, row) sum over the 32 lanes, then one lane writes it
for (int i = 0; i < NW; i++) {
  for (int r = 0; r < RB; r++) {
    const float v = gemv_lane_total(acc[i][r]);
    if (r < rows && lane == uint((i * RB + r) % 32)) {
      y[(ulong(r) * G + g) * N + n0 + i] = bfloat16_t(v);
    }
  }
}
