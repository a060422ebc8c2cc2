// CUDA twin of fp8_mma.metal (see there for what it computes and how the work is laid out).
// CUDA spelling of the same steps, as fp4_experts.cu: mma.sync m16n8k16 (fp16 in, fp32
// accumulate) with the fragments in registers, a warp's walk over its blocks in
// mma_warp_sums (mma_x.cuh) with E4m3Codes: lane t takes 8 bytes of each weight row a block
// (physical columns 8t .. 8t + 7) as its logical columns of the block's two k-steps:
//   k-step 0: (2t, 2t+1) <- (8t, 8t+2), (2t+8, 2t+9) <- (8t+1, 8t+3)
//   k-step 1: (2t, 2t+1) <- (8t+4, 8t+6), (2t+8, 2t+9) <- (8t+5, 8t+7)
// so each fp16 pair is E4M3_EVEN or E4M3_ODD of one of the two words, and x the same.

// U (a template constant, tuning.Layout.mma_loads_ahead): the blocks whose loads a warp issues before it uses the first
// TR (tuning.Layout.mma_tile_rows): a tile's weight rows, 32 or 16 (one m group, MGS 1)
constexpr int COLS = 8 * NH;  // the matrix products' columns: the computed rows, padded
constexpr int MGS = TR / 16;  // the tile's m groups of 16 rows
static_assert(TR == 16 || TR == 32, "a tile of 16 or 32 weight rows");
__shared__ float red[MMA_WARPS * TR * COLS];  // each warp's sums [warp][output][row]
__shared__ uint4 staged[MMA_MAX_K / 16];  // the tile's weight scales (mma_tile_scales)
const int rows = sizes[0];
const int N = sizes[1];
const int K = sizes[2];
const int G = sizes[3];
const int out_rows = sizes[4];
const unsigned int tiles = (unsigned int)N / TR;
const unsigned int grp = blockIdx.x / tiles;  // the matrix (wo_a's group; 0 for a dense GEMM)
const unsigned int n0 = (blockIdx.x % tiles) * TR;  // the tile's first output
const unsigned int lane = threadIdx.x % 32;
const unsigned int g = lane / 4;  // lane 4g + t
const unsigned int nb = (unsigned int)K / 32;  // blocks of 32 columns, each with its own scale per row
const unsigned int per_warp = nb / MMA_WARPS;  // K a multiple of 256: the same count for every warp
const unsigned int b0 = threadIdx.x / 32 * per_warp;  // the warp's first block
const unsigned int words = (unsigned int)K / 4;
const size_t row0 = (size_t)grp * N + n0;      // the tile's first weight row

const __nv_bfloat16* xrow[NH];  // B column 8h + g's x row (past the computed rows: the last one, its sums unread)
#pragma unroll
for (int h = 0; h < NH; h++) {
  const int r = min(8 * h + (int)g, rows - 1);
  xrow[h] = x + ((size_t)r * G + grp) * K;
}
const unsigned char* tile_scales = mma_tile_scales<!ONE, TR>(scales, row0, nb, staged);
float acc[MGS][NH][4] = {};  // [m group][column group][C fragment]
mma_warp_sums<E4m3Codes, U, NH, QX, ONE>(w, tile_scales, row0, words, nb, xrow, b0, per_warp, lane, acc);
mma_warp_sums_to<NH>(red, acc, lane);
__syncthreads();
