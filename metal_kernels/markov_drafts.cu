// CUDA twin of markov_drafts.metal (see there for what it computes and how the work is laid
// out): the same steps, a block of 256 threads.

__shared__ float e[R];
__shared__ float score[C];
__shared__ int prev;
const unsigned int c = threadIdx.x;
if (c == 0) {
  prev = anchor[0];
}
__syncthreads();
for (int k = 0; k < B; k++) {
  const long long token = prev;
  for (unsigned int r = c; r < R; r += 256) {
    const unsigned short bits = embed[token * R + r];
    e[r] = __uint_as_float((unsigned int)bits << 16);
    embeds[k * R + r] = bits;
  }
  __syncthreads();
  if (c < C) {
    const long long row = cand[k * C + c];
    float acc = 0.0f;
    for (int r = 0; r < R; r++) {
      acc = fmaf(__uint_as_float((unsigned int)head[row * R + r] << 16), e[r], acc);
    }
    const float logit = base[k * C + c] + acc;
    logits[k * C + c] = logit;
    score[c] = logit / temp[0] + (NOISE ? noise[k * C + c] : 0.0f);
  }
  __syncthreads();
  if (c == 0) {
    unsigned int best = 0;
    for (unsigned int j = 1; j < C; j++) {
      if (score[j] > score[best]) {
        best = j;
      }
    }
    prev = cand[k * C + best];
    drafts[k] = prev;
  }
  __syncthreads();
}
