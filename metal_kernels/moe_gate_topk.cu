// CUDA twin of moe_gate_topk.metal (see there for what it computes). One warp a block.

__shared__ float choice[E];

const unsigned int row = blockIdx.x;
if (row >= (unsigned int)rows[0]) {
  return;  // the whole block
}
moe_pick_row<E, K, NORMALIZE>(scores + row * E, bias, choice, params[0], threadIdx.x, weights + row * K, ids + row * K);
