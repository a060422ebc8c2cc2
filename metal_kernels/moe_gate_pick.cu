// CUDA twin of moe_gate_pick.metal (see there for what it computes): appended to
// moe_gate_scores.cu, the last block to finish picks every row's experts, a warp a row.
// The ticket is an input (MLX declares it const): written through a cast.

__shared__ float choice[WARPS][NE];
__shared__ bool last;
unsigned int* count = reinterpret_cast<unsigned int*>(const_cast<uint32_t*>(ticket));
__threadfence();  // this block's scores visible to every block before its ticket is taken
__syncthreads();
if (tid == 0) {
  last = atomicAdd(count, 1u) == (unsigned int)(E - 1);
}
__syncthreads();
if (last) {
  __threadfence();
  for (int r = (int)warp; r < rows; r += WARPS) {
    moe_pick_row<NE, K, NORMALIZE>(scores + r * NE, bias, choice[warp], params[1], lane, weights + r * K, ids + r * K);
  }
  if (tid == 0) {
    atomicExch(count, 0u);
  }
}
