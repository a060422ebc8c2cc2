// Just enough of the Metal Shading Language, declared as C++17, for clang to
// type-check our kernel bodies (tests/test_kernels.py). Nothing here runs.
#pragma once
#include <cstdint>
#include <cstring>

#define device
#define threadgroup
#define thread
#define kernel
#define constant const

typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;

struct half {
  unsigned short bits;
  explicit operator float() const;
};
struct bfloat {
  unsigned short bits;
  explicit operator float() const;
};
typedef bfloat bfloat16_t;
typedef half float16_t;

template <typename T>
struct vec2 {
  T x, y;
};
template <typename T>
struct vec3 {
  T x, y, z;
};
template <typename T>
struct vec4 {
  T x, y, z, w;
  vec4() = default;
  explicit vec4(T v) : x(v), y(v), z(v), w(v) {}
  vec4(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  T& operator[](int i);
  vec4 operator*(T s) const;
};
typedef vec2<float> float2;
typedef vec4<float> float4;
typedef vec2<half> half2;
typedef vec3<uint> uint3;
typedef vec4<uint> uint4;

template <typename To, typename From>
To as_type(From from) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

float fma(float a, float b, float c);
float simd_sum(float x);

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
}
using metal::mem_flags;
void threadgroup_barrier(mem_flags flags);
