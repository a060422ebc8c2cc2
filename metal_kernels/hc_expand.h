// One value of the stream after a sub-layer, hyper._hc_post's arithmetic (hc_post_mix.metal and
// fp8_mma_hc.metal; CUDA twin: hc_expand.cuh): copy c of a feature of one row,
// post_c * y + sum over i of comb[i, c] * residual[i] in float32, the sum in i order, rounded to
// bfloat16 once. comb: the row's [HC, HC]; res: the row's residual at the feature, its HC copies
// `stride` apart; y: the sub-layer's output at the feature, as bfloat16 holds it.
template <int HC>
inline bfloat16_t hc_expanded(const float y, const float post_c, const device float* comb,
                              const device bfloat16_t* res, const uint stride, const uint c) {
  float mixed = comb[c] * float(res[0]);
  for (int i = 1; i < HC; i++) {
    mixed += comb[i * HC + c] * float(res[i * stride]);
  }
  return bfloat16_t(post_c * y + mixed);
}
