// hc_split_row.h's split spread over a simdgroup (hc_input.metal): the same operations on
// the same values in the same order, so the same bits, with lane i * HC + j holding comb
// entry (i, j) and reading the other entries of its row or column by shuffles, where one
// thread ran the whole Sinkhorn loop alone (ITERS x 2 HC x HC divisions in a row). Lanes
// < HC write pre, lanes HC..2 HC - 1 post, lanes < HC * HC comb; the other lanes repeat
// lanes 0.. and write nothing. mix [(2 + HC) * HC] is threadgroup memory the lanes all
// read. Every lane of the simdgroup calls it. CUDA twin: hc_split_lanes.cuh.
template <int HC, int ITERS, typename ScalePtr, typename BasePtr>
inline void hc_split_lanes(threadgroup const float* mix, ScalePtr scale, BasePtr base, float e, device float* pre,
                           device float* post, device float* comb, const uint lane) {
  static_assert(HC * HC <= 32, "a lane for each comb entry");
  if (lane < uint(HC)) {
    pre[lane] = 1.0f / (1.0f + metal::exp(-(mix[lane] * scale[0] + base[lane]))) + e;
  } else if (lane < uint(2 * HC)) {
    const uint i = lane - HC;
    post[i] = 2.0f * (1.0f / (1.0f + metal::exp(-(mix[HC + i] * scale[1] + base[HC + i]))));
  }
  const ushort first = ushort((lane % (HC * HC)) / HC * HC);  // the lane of this row's entry 0
  const ushort col = ushort(lane % HC);
  float c = mix[2 * HC + first + col] * scale[2] + base[2 * HC + first + col];
  float row_max = simd_shuffle(c, first);  // softmax over the row, then + eps
  for (int j = 1; j < HC; j++) {
    row_max = metal::max(row_max, simd_shuffle(c, ushort(first + j)));
  }
  c = metal::exp(c - row_max);
  float total = 0.0f;
  for (int j = 0; j < HC; j++) {
    total += simd_shuffle(c, ushort(first + j));
  }
  c = c / total + e;
  for (int it = 0; it < ITERS; it++) {
    if (it > 0) {  // rows (the first pass normalised them in the softmax)
      total = 0.0f;
      for (int j = 0; j < HC; j++) {
        total += simd_shuffle(c, ushort(first + j));
      }
      c = c / (total + e);
    }
    total = 0.0f;  // columns
    for (int i = 0; i < HC; i++) {
      total += simd_shuffle(c, ushort(i * HC + col));
    }
    c = c / (total + e);
  }
  if (lane < uint(HC * HC)) {
    comb[lane] = c;
  }
}
