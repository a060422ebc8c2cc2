// FP8 activation fake-quantisation: each block of 32 consecutive values is
// scaled by a power of two, 2^ceil(log2(amax / 448)) with amax floored at 1e-4,
// rounded to the nearest E4M3 value (ties to even) and scaled back; the
// quantize-dequantize the reference applies before every FP8 GEMM.
//
// x [n] of type T (bfloat16 or float32), n (a 1-element int32 input) a multiple of
// 32; y [n] of type O:
// the result rounded to T, then stored as O (float32 feeds the GEMM directly).
// One thread per value; a SIMD group of 32 threads holds one block and takes
// its amax with one reduction. |x / scale| <= 448 by construction, so no saturation is needed.
// Bit for bit the spec, kernels.specs.fp8_fake_quant_reference. Template: T, O (the size
// is an input, so one build serves every activation size).
// CUDA twin: act_quant.cu.

const uint idx = thread_position_in_grid.x;
if (idx >= uint(n[0])) {
  return;  // whole SIMD groups only: n is a multiple of 32
}
const float v = static_cast<float>(x[idx]);
y[idx] = static_cast<O>(static_cast<T>(fp8_fake_quant_lane(v)));  // fp8_lane.h
