// Split one sub-layer's hyper-connection mixes into pre, post and the
// Sinkhorn-normalised comb matrix, one thread per row (a row's HC*HC comb
// entries stay in registers through all ITERS alternations).
//
// mixes [S, (2 + HC) * HC] float32: the projected, RMS-scaled stream; scale [3],
// base [(2 + HC) * HC], eps [1] float32. Outputs: pre [S, HC], post [S, HC],
// comb [S, HC, HC] (row i, column j). Same operations in the same order as
// kernels.hc_split_reference; sums run in index order.
// rows: a 1-element int32 input (the row count S, not a template constant, so
// one build serves every S). Template constants: HC (copies), ITERS.
// CUDA twin: hc_split.cu.

const uint row = thread_position_in_grid.x;
if (row >= uint(rows[0])) {
  return;
}
float mix[(2 + HC) * HC];
for (int k = 0; k < (2 + HC) * HC; k++) {
  mix[k] = mixes[row * (2 + HC) * HC + k];
}
hc_split_row<HC, ITERS>(mix, scale, base, eps[0], pre + row * HC, post + row * HC, comb + row * HC * HC);
