// The MoE router's choice for a decode or verify forward, a simdgroup per row:
// moe_pick_row.h (the K experts of largest score_e + bias_e, in ascending id order,
// weighted by their unbiased scores). The scores come from moe_gate_scores.metal
// (moe_gate.metal does both in one launch).
//
// scores [rows, E] float32, bias [E] float32, params [1] float32 = (route scale,),
// rows [1] int32. Outputs: weights [rows, K] float32, ids [rows, K] uint32. Template
// constants: E, K, NORMALIZE. 32 threads. CUDA twin: moe_gate_topk.cu.

threadgroup float choice[E];

const uint row = threadgroup_position_in_grid.x;
if (row >= uint(rows[0])) {
  return;  // the whole threadgroup
}
moe_pick_row<E, K, NORMALIZE>(scores + row * E, bias, choice, params[0], thread_index_in_simdgroup, weights + row * K,
                              ids + row * K);
