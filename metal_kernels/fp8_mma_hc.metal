// fp8_mma.metal's end for kernels.FP8_MMA_HC: a sub-layer's last GEMM (attention's wo_b, the
// MoE's shared down projection with the routed parts added: AP) whose output y goes straight
// into the stream, as hc_post_mix would take it, so that no launch of its own expands it.
// Each simdgroup takes rows warp, warp + 8, .., a lane each of the tile's 32 features d:
// y[r, d] (bfloat16, the bits fp8_mma_y.metal writes; the padding rows' zeros), then the new
// stream's HC copies h[r, c, d] = hc_expanded (hc_expand.h: hyper._hc_post's arithmetic, the
// bits hc_post_mix gives), written out, and the tile's share of the next sub-layer's mix
// projection: for each mix m, sum over c of h[r, c, d] * fn[m, c * N + d], and sum over c of
// h[r, c, d]^2, each then summed over the tile's 32 features in a butterfly, into
// mix_parts[r, tile, ..] (the parts hc_input adds up), MG mixes a pass.
// Extra inputs: residual [out_rows, HC, N] bfloat16 (the stream the sub-layer ran on), post
// [out_rows, HC] and comb [out_rows, HC, HC] float32 (its mixes), fn [M, HC * N] float32 (the
// next sub-layer's mix projection, M = (2 + HC) * HC). Outputs: h [out_rows, HC, N] bfloat16,
// mix_parts [out_rows, N / 32, M + 1] float32. Template constant HC; SW 0 and G 1 (a dense
// GEMM). CUDA twin: fp8_mma_hc.cu.
static_assert(TR == 32, "the mix parts are a 32-feature tile's, a lane each");
constexpr int M = (2 + HC) * HC;
// mixes a pass: their loads of fn are issued together, MG * HC a lane; all M at once would hold
// about twice the GEMM's registers a thread on CUDA, halving the threadgroups a core holds
constexpr int MG = 8;
const uint d = n0 + lane;  // this lane's feature
for (uint r = warp; r < uint(out_rows); r += WARPS) {
  float v = 0.0f;  // y[r, d]
  if (int(r) < rows) {
    v = mma_warps_total<COLS>(red, lane, r);
    if (AP > 0) {  // the row's AP parts, in order, then this output as bf16
      v = gemv_parts_added<AP>(parts + ulong(r) * AP * N + d, N, v);
    }
  }
  const float yv = float(bfloat16_t(v));
  float hv[HC];
  for (int c = 0; c < HC; c++) {
    const bfloat16_t b = hc_expanded<HC>(yv, post[r * HC + c], comb + r * HC * HC, residual + ulong(r) * HC * N + d,
                                         N, c);
    h[(ulong(r) * HC + c) * N + d] = b;
    hv[c] = float(b);
  }
  float sq = hv[0] * hv[0];  // the tile's sum of squares, then its share of each mix, in butterflies over the features
  for (int c = 1; c < HC; c++) {
    sq += hv[c] * hv[c];
  }
  for (ushort offset = 16; offset > 0; offset /= 2) {
    sq += simd_shuffle_xor(sq, offset);
  }
  const ulong out = (ulong(r) * tiles + n0 / 32) * (M + 1);  // this row's and tile's parts
  if (lane == 0) {
    mix_parts[out + M] = sq;
  }
  for (int m0 = 0; m0 < M; m0 += MG) {
    float acc[MG];
    for (int j = 0; j < MG; j++) {
      const ulong m = m0 + j < M ? m0 + j : M - 1;  // (past M: a repeat, not written)
      acc[j] = hv[0] * fn[m * HC * N + d];
      for (int c = 1; c < HC; c++) {
        acc[j] += hv[c] * fn[(m * HC + c) * N + d];
      }
    }
    for (int j = 0; j < MG; j++) {
      for (ushort offset = 16; offset > 0; offset /= 2) {
        acc[j] += simd_shuffle_xor(acc[j], offset);
      }
      if (lane == 0 && m0 + j < M) {
        mix_parts[out + m0 + j] = acc[j];
      }
    }
  }
}
