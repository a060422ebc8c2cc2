// The float conversions both emulations need, in software (round to nearest even): float <->
// bf16 bits and float <-> IEEE binary16 bits, subnormals included (metal_emu.h's half and
// bfloat16_t, cuda_emu.h's __nv_bfloat16 and fp16_bits.cuh's stand-ins).
#include <cmath>
#include <cstdint>
#include <cstring>

inline uint32_t host_float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float host_bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t host_f32_to_bf16(float f) {
  uint32_t u = host_float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // a NaN stays a NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
inline float host_bf16_to_f32(uint16_t bits) { return host_bits_float((uint32_t)bits << 16); }

inline uint16_t host_f32_to_f16(float f) {
  const uint32_t u = host_float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to infinity
  if (a < 0x38800000u) {  // below fp16's least normal: a subnormal, in steps of 2^-24 (exact scaling)
    return (uint16_t)(sign | (uint32_t)std::nearbyint(host_bits_float(a) * 16777216.0f));
  }
  uint32_t m = a - 0x38000000u;  // rebias the exponent by 127 - 15
  m += 0xfffu + ((m >> 13) & 1u);
  return (uint16_t)(sign | (m >> 13));
}
inline float host_f16_to_f32(uint32_t bits) {
  const uint32_t sign = (bits & 0x8000u) << 16, e = (bits >> 10) & 0x1fu, m = bits & 0x3ffu;
  if (e == 0) { const float v = (float)m / 16777216.0f; return sign ? -v : v; }
  if (e == 31) return host_bits_float(sign | 0x7f800000u | (m << 13));
  return host_bits_float(sign | ((e + 112u) << 23) | (m << 13));
}
