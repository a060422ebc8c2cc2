// The drafter's Markov pass over one block in one threadgroup: each position's draft is picked
// from its C candidates, and the draft's Markov embedding feeds the next position's bias.
//
// base [B, C] fp32: the head's logits of each position's candidates; cand [B, C] int32: their
// token ids; head, embed [V, R] bf16 bits (uint16): the Markov head's rows and its embeddings;
// anchor [1] int32: the token before the block; temp [1] fp32; noise [B, C] fp32 (read where
// NOISE is 1). Position k, from e_0 = embed[anchor]:
//   logits[k, c] = base[k, c] + head[cand[k, c]] . e_k  (fp32: R products summed in order)
//   drafts[k] = cand[k, c*], c* the first c with the largest logits[k, c] / temp + noise[k, c]
//   embeds[k] = e_k, e_{k+1} = embed[drafts[k]]
// (temp 1 and NOISE 0: the best logit.) One threadgroup of 256 threads, thread c < C for
// candidate c; the positions go in order, each one's pick made by thread 0. Template
// constants: B (positions), C (candidates, at most 256), R (the Markov rank), NOISE. The spec is markov_drafts_reference (specs.py);
// CUDA twin: markov_drafts.cu.

threadgroup float e[R];
threadgroup float score[C];
threadgroup int prev;
const uint c = thread_position_in_threadgroup.x;
if (c == 0) {
  prev = anchor[0];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int k = 0; k < B; k++) {
  const long token = prev;
  for (uint r = c; r < R; r += 256) {
    const ushort bits = embed[token * R + r];
    e[r] = as_type<float>(uint(bits) << 16);
    embeds[k * R + r] = bits;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c < C) {
    const long row = cand[k * C + c];
    float acc = 0.0f;
    for (int r = 0; r < R; r++) {
      acc = fma(as_type<float>(uint(head[row * R + r]) << 16), e[r], acc);
    }
    const float logit = base[k * C + c] + acc;
    logits[k * C + c] = logit;
    score[c] = logit / temp[0] + (NOISE ? noise[k * C + c] : 0.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (c == 0) {
    uint best = 0;
    for (uint j = 1; j < C; j++) {
      if (score[j] > score[best]) {
        best = j;
      }
    }
    prev = cand[k * C + best];
    drafts[k] = prev;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
