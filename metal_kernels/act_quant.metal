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
// Bit for bit the spec, quant.fp8_fake_quant_reference. Template: T, O (the size
// is an input, so one build serves every activation size).
// CUDA twin: act_quant.cu.

const uint idx = thread_position_in_grid.x;
if (idx >= uint(n[0])) {
  return;  // whole SIMD groups only: n is a multiple of 32
}
const float v = static_cast<float>(x[idx]);
const float amax = metal::max(simd_max(metal::abs(v)), 1e-4f);
const uint t = as_type<uint>(amax * (1.0f / 448.0f));
const uint exponent = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);  // biased ceil(log2)
const float scale = as_type<float>(exponent << 23);
const float q = v / scale;
const uint q_exponent = metal::max((as_type<uint>(q) >> 23) & 0xFFu, 121u);  // E4M3 subnormals: 2^-6's step
const float step = as_type<float>((q_exponent - 3u) << 23);  // 3 mantissa bits
y[idx] = static_cast<O>(static_cast<T>(metal::rint(q / step) * step * scale));
