// The C (and D) fragment of mma_m16n8k16 (fp16_bits.cuh) as a lane of the CUDA matrix-unit
// kernels holds it, in their accumulators acc [MGS m groups][NH column groups][4] (MGS 2 for a
// 32-row tile, 1 for fp8_mma's 16-row one): f(row, col, value) for each of the lane's values,
// row 16 mg + g or 16 mg + g + 8 of the tile and
// column 8 h + 2 t or 8 h + 2 t + 1 (lane = 4 g + t; PTX ISA's fragment layout). CUDA only,
// with every CUDA kernel's headers (kernels.KernelSpec.header).
template <int NH, int MGS, class F>
__device__ __forceinline__ void mma_c_each(const float (&acc)[MGS][NH][4], unsigned int lane, F f) {
#pragma unroll
  for (int mg = 0; mg < MGS; mg++) {
#pragma unroll
    for (int h = 0; h < NH; h++) {
#pragma unroll
      for (int i = 0; i < 4; i++) {
        f(16 * mg + lane / 4 + 8 * (i / 2), 8 * h + 2 * (lane % 4) + i % 2, acc[mg][h][i]);
      }
    }
  }
}
