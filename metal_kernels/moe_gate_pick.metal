// moe_gate: the router of a decode or verify forward in one launch. This end, appended to
// moe_gate_scores.metal (whose threadgroups write the scores [rows, E] as that kernel
// does), lets the threadgroup that finishes last pick every row's experts from all the
// scores, a simdgroup a row (moe_pick_row.h: moe_gate_topk's picks, the same bits), so
// that the forward's routed experts wait for one launch instead of two.
//
// Inputs beyond the scores kernel's: params [2] float32 = (temperature, route scale),
// bias [E] float32, ticket [8] uint32: element 0 counts the threadgroups that have written
// their scores. It must be 0 before a launch; the last threadgroup sets it back to 0, so one
// array serves every launch of one router, one launch at a time (kernels.moe_gate: a
// Gate's own; 8 elements so that MLX binds it in device memory, which a kernel may write).
// Outputs: scores [rows, E] float32, weights [rows, K] float32, ids [rows, K] uint32.
// Metal 3.2 (macOS 15): device memory is coherent within a threadgroup unless a pointer says
// coherent(device), so each threadgroup stores its scores again through such a pointer and
// fences (device scope) before it takes its ticket; the one that takes the last fences again
// and reads them through one.
// Template constants beyond the scores kernel's: NE (= E), K, NORMALIZE; NE <= 512 (eight
// simdgroups' choices in threadgroup memory). CUDA twin: moe_gate_pick.cu.

threadgroup float choice[WARPS][NE];
threadgroup uint last;
coherent(device) device float* published = (coherent(device) device float*)scores;
if (int(tid) < rows) {
  published[int(tid) * E + e] = scores[int(tid) * E + e];  // this thread's own store, read back
}
atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  last = atomic_fetch_add_explicit((device atomic_uint*)ticket, 1u, memory_order_relaxed) == uint(E - 1);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (last) {
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
  for (int r = int(warp); r < rows; r += WARPS) {
    moe_pick_row<NE, K, NORMALIZE>(published + r * NE, bias, choice[warp], params[1], lane, weights + r * K, ids + r * K);
  }
  if (tid == 0) {
    atomic_store_explicit((device atomic_uint*)ticket, 0u, memory_order_relaxed);
  }
}
