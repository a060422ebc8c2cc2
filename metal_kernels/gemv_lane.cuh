// CUDA twin of gemv_lane.h (see there for what it computes).
template <int T, int RB>  // wf: [T][8], acc: [T][RB]
__device__ __forceinline__ void gemv_lane_accumulate(const uint4 p, const float* wf, float* acc, const int r) {
  float xf[8];
  bf16x8_floats(p, xf);
#pragma unroll
  for (int i = 0; i < T; i++) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
      acc[i * RB + r] = fmaf(wf[i * 8 + c], xf[c], acc[i * RB + r]);
    }
  }
}

template <int T, int RB>  // every thread of the block must call it; acc: [T][RB], partial: [8 warps][T * RB]
__device__ __forceinline__ void gemv_warp_totals(const float* acc, float* partial) {
  const unsigned int lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 0; o < T * RB; o++) {
    float v = acc[o];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    if (lane == (unsigned int)(o % 32)) {
      partial[(threadIdx.x / 32) * T * RB + o] = v;
    }
  }
  __syncthreads();
}

template <int T, int RB, int C>  // the total of (output, row) o of thread group grp
__device__ __forceinline__ float gemv_group_total(const float* partial, const unsigned int grp, const unsigned int o) {
  float v = partial[grp * (C / 32) * T * RB + o];
  for (int s = 1; s < C / 32; s++) {
    v += partial[(grp * (C / 32) + s) * T * RB + o];
  }
  return v;
}

__device__ __forceinline__ float gemv_amax16(const uint4 p0, const uint4 p1) {  // max |v| of 16 bf16 values
  const unsigned int pairs[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; j++) {
    amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(pairs[j] << 16)), fabsf(__uint_as_float(pairs[j] & 0xFFFF0000u))));
  }
  return amax;
}

__device__ __forceinline__ uint4 gemv_fake_quant8(const uint4 p, const float scale) {  // 8 bf16 values, E4M3-rounded
  unsigned int pairs[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float lo = fp8_fake_quant_value(__uint_as_float(pairs[j] << 16), scale);
    const float hi = fp8_fake_quant_value(__uint_as_float(pairs[j] & 0xFFFF0000u), scale);
    pairs[j] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);  // exact in bf16
  }
  return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

// the FP8 scale of the block of 32 inputs holding this thread's 16 at xr (its neighbour, lane ^ 1,
// holds the other 16); every lane of the warp must call it, inactive ones (past K) too
__device__ __forceinline__ float gemv_input_block_scale(const __nv_bfloat16* xr, const bool active) {
  float amax = 0.0f;
  if (active) {
    amax = gemv_amax16(__ldg(reinterpret_cast<const uint4*>(xr)), __ldg(reinterpret_cast<const uint4*>(xr + 8)));
  }
  return fp8_block_scale(fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1)));
}


__device__ __forceinline__ float gemv_swiglu(const float gate_sum, const float up_sum, const float limit) {
  float gate = __bfloat162float(__float2bfloat16(gate_sum));
  float up = __bfloat162float(__float2bfloat16(up_sum));
  if (limit > 0.0f) {
    up = isnan(up) ? up : fminf(fmaxf(up, -limit), limit);
    gate = isnan(gate) ? gate : fminf(gate, limit);
  }
  return gate / (1.0f + expf(-gate)) * up;  // no fast math: IEEE division, precise expf
}


// gemv_lane.h's gemv_parts_added
template <int AP>
__device__ __forceinline__ float gemv_parts_added(const __nv_bfloat16* pr, const unsigned int stride, const float v) {
  float t = __bfloat162float(pr[0]);
  for (int j = 1; j < AP; j++) {
    t += __bfloat162float(pr[(size_t)j * stride]);
  }
  return t + __bfloat162float(__float2bfloat16(v));
}

// Where output n of row r of matrix g goes in y: [out_rows, G, NY] (SPLIT 0); with SPLIT > 0 (G 1) two matrices
// stacked, their outputs apart: the first SPLIT outputs' [out_rows, SPLIT], then the rest's [out_rows, NY - SPLIT]
template <int SPLIT>
__device__ __forceinline__ size_t gemv_y_index(const unsigned int r, const unsigned int n, const unsigned int g,
                                               const int G, const unsigned int NY, const int out_rows) {
  if (SPLIT == 0) {
    return ((size_t)r * G + g) * NY + n;
  }
  return n < (unsigned int)SPLIT ? (size_t)r * SPLIT + n
                                 : (size_t)out_rows * SPLIT + (size_t)r * (NY - SPLIT) + (n - SPLIT);
}
