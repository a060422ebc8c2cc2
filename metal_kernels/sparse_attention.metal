// The attention of a decode or verify forward in one launch, for rows that each gather
// their own window (the row-invariant path): a threadgroup per (row, group of G heads).
// What attention.Attention does between its query and output projections, on keys gathered
// first, with about seventeen operations: the query RoPE; per head, scores q . k * scale
// over the row's W window keys and K picked compressed keys (-inf where masked),
// p = exp(score - max(row max, -1e30)), denominator sum(p) + exp(sink - row max), and the
// keys weighted by p rounded to bfloat16, divided by the denominator and rounded to bfloat16
// (attention.sparse_attention's o); then the inverse RoPE of o, rounded to bfloat16 again.
//
// The work: a simdgroup per key for the scores, each lane taking 8-feature chunks of it (one
// 16-byte read each) against its chunks of the G queries held in registers; for the weighted
// keys, thread t a chunk of every (256 / (D / 8))-th key, those subsets' sums then added in
// order. So every key read is 16 bytes a lane. D / 8 must divide 256.
//
// q [S, H, D] bfloat16, not rotated yet; ring [R, D] bfloat16: the layer's window keys,
// index [S, W] int32: each row's window slots, wmask [S, W] bool; kv [T, D] bfloat16: the
// compressed keys, ids [S, K] uint32: each row's picks, pmask [S, K] bool (K = 0: none);
// sink [H] float32; rope_cos, rope_sin [S, D/2, 2] float32: each row's Rope.tables factors;
// params [1] float32 = (scale,); rows [1] int32: the real rows, those before the padding
// (Runner.padded), which alone are computed; a padding row's output is zeros.
// Output: out [S, H, D] bfloat16.
// RoPE as layers.rotate: feature d of the last RD becomes x[d] cos[d] + x[d ^ 1] sin[d] in
// float32 (sin is negated on a pair's first feature), rounded to bfloat16; the inverse
// takes -sin. The attention's sums run in another order than the spec's matmuls, so
// results match it to float32 noise (a probability may round to the neighbouring
// bfloat16), not bit for bit; each row is computed alone, the same bits in any forward.
// Template constants: D, H, G, W, K, RD, WARPS (the simdgroups: 32 * WARPS threads, at least
// 8; more shorten each simdgroup's chain of key reads in the scores, and the same sums are
// made: the same bits at any WARPS). CUDA twin: sparse_attention.cu (the bf16 reads:
// bf16_lane.h).

constexpr int N = W + K;
constexpr int CH = D / 8;            // a key row's chunks of 8 features (16 bytes each)
constexpr int LCH = (CH + 31) / 32;  // the chunks a lane takes in the scores
constexpr int SUM_WARPS = 8;         // the warps of the softmax and the weighted sum (any WARPS >= 8)
constexpr int P = 32 * SUM_WARPS / CH;  // the key subsets of the weighted sum
threadgroup float qs[G][D];
threadgroup float sc[G][N];
threadgroup int key_row[N];
threadgroup float red[SUM_WARPS];
threadgroup float denom[G];
threadgroup float subset_sum[P][G][D];

const uint groups = H / G;
const uint s = threadgroup_position_in_grid.x / groups;
const uint h0 = (threadgroup_position_in_grid.x % groups) * G;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
if (s >= uint(rows[0])) {  // a padding row: zeros (the whole threadgroup)
  for (uint i = tid; i < G * D; i += 32 * WARPS) {
    out[(s * H + h0) * D + i] = bfloat16_t(0.0f);
  }
  return;
}
const float neg_inf = as_type<float>(0xff800000u);
const float scale = params[0];

// the queries, their last RD features rotated (rounded to bf16, as the spec's rotated q is)
const uint q0 = (s * H + h0) * D;
for (uint i = tid; i < G * D; i += 32 * WARPS) {
  const uint d = i % D;
  float v = float(q[q0 + i]);
  if (d >= D - RD) {
    v = float(bfloat16_t(v * rope_cos[s * D + d] + float(q[q0 + (i ^ 1)]) * rope_sin[s * D + d]));
  }
  qs[i / D][d] = v;
}
for (uint j = tid; j < N; j += 32 * WARPS) {
  key_row[j] = (j < W) ? int(index[s * W + j]) : int(ids[s * K + (j - W)]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// scores: simdgroup w takes keys w, w + 8, ...; lane l the chunks l, l + 32, ... of each (its queries' in registers)
float qr[G][LCH][8];
for (int g = 0; g < G; g++) {
  for (int c = 0; c < LCH; c++) {
    for (int e = 0; e < 8; e++) {
      qr[g][c][e] = int(lane) + 32 * c < CH ? qs[g][8 * (lane + 32 * c) + e] : 0.0f;
    }
  }
}
for (uint j = warp; j < N; j += WARPS) {
  const device bfloat16_t* key = ((j < W) ? ring : kv) + ulong(key_row[j]) * D;
  const bool valid = (j < W) ? wmask[s * W + j] : pmask[s * K + (j - W)];
  float dot[G] = {};
  for (int c = 0; c < LCH; c++) {
    if (int(lane) + 32 * c < CH) {
      float kf[8];
      bf16x8_floats(*((const device uint4*)(key + 8 * (lane + 32 * c))), kf);
      for (int g = 0; g < G; g++) {
        for (int e = 0; e < 8; e++) {
          dot[g] = fma(qr[g][c][e], kf[e], dot[g]);
        }
      }
    }
  }
  for (int g = 0; g < G; g++) {
    float a = dot[g];
    for (int offset = 16; offset > 0; offset /= 2) {
      a += simd_shuffle_xor(a, ushort(offset));
    }
    if (lane == 0) {
      sc[g][j] = valid ? a * scale : neg_inf;
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// per head: the row max, the probabilities (kept rounded to bf16) and their sum, by the first
// SUM_WARPS warps whatever WARPS is, so that the sum runs in one order
for (int g = 0; g < G; g++) {
  if (warp < SUM_WARPS) {
    float m = neg_inf;
    for (uint j = tid; j < N; j += 32 * SUM_WARPS) {
      m = metal::max(m, sc[g][j]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      m = metal::max(m, simd_shuffle_xor(m, ushort(offset)));
    }
    if (lane == 0) {
      red[warp] = m;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float row_max = red[0];
  for (int w = 1; w < SUM_WARPS; w++) {
    row_max = metal::max(row_max, red[w]);
  }
  row_max = metal::max(row_max, -1e30f);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // everyone has read red
  if (warp < SUM_WARPS) {
    float sum = 0.0f;
    for (uint j = tid; j < N; j += 32 * SUM_WARPS) {
      const float p = metal::exp(sc[g][j] - row_max);
      sum += p;
      sc[g][j] = float(bfloat16_t(p));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += simd_shuffle_xor(sum, ushort(offset));
    }
    if (lane == 0) {
      red[warp] = sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float total = red[0];
    for (int w = 1; w < SUM_WARPS; w++) {
      total += red[w];
    }
    denom[g] = total + metal::exp(sink[h0 + g] - row_max);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// the weighted keys: thread t < 256 takes chunk t % CH of keys t / CH, t / CH + P, ... (window
// keys first, then picked ones), the P subsets' sums then added in order
if (tid < P * CH) {
  const uint ch = tid % CH;
  const uint subset = tid / CH;
  float acc[G][8] = {};
  for (uint j = subset; j < N; j += P) {
    const device bfloat16_t* key = ((j < W) ? ring : kv) + ulong(key_row[j]) * D;
    float kf[8];
    bf16x8_floats(*((const device uint4*)(key + 8 * ch)), kf);
    for (int g = 0; g < G; g++) {
      const float p = sc[g][j];
      for (int e = 0; e < 8; e++) {
        acc[g][e] = fma(p, kf[e], acc[g][e]);
      }
    }
  }
  for (int g = 0; g < G; g++) {
    for (int e = 0; e < 8; e++) {
      subset_sum[subset][g][8 * ch + e] = acc[g][e];
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint i = tid; i < G * D; i += 32 * WARPS) {
  float t = subset_sum[0][i / D][i % D];
  for (int p = 1; p < P; p++) {
    t += subset_sum[p][i / D][i % D];
  }
  qs[i / D][i % D] = float(bfloat16_t(t / denom[i / D]));  // the spec's o; qs is free
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// the inverse RoPE of o: a pair's two features were written by two threads
for (uint i = tid; i < G * D; i += 32 * WARPS) {
  const uint d = i % D;
  float v = qs[i / D][d];
  if (d >= D - RD) {
    v = v * rope_cos[s * D + d] + qs[i / D][d ^ 1] * -rope_sin[s * D + d];
  }
  out[q0 + i] = bfloat16_t(v);
}
