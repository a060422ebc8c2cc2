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
  half() = default;
  explicit half(float f);
  explicit operator float() const;
};
struct bfloat {
  unsigned short bits;
  bfloat() = default;
  explicit bfloat(float f);
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
typedef unsigned long ulong;
template <typename T>
struct vec2c {
  T x, y;
  vec2c(T a, T b) : x(a), y(b) {}
};
typedef vec2c<ulong> ulong2;
typedef vec2<float> float2;
typedef vec4<float> float4;
typedef vec2<half> half2;
typedef vec2<uint> uint2;
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

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal);
};
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value);
template <typename T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false);
template <typename T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false);
template <typename TD, typename TA, typename TB, typename TC, int C, int R, int K>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, C, R>& d, const simdgroup_matrix<TA, K, R>& a,
                                   const simdgroup_matrix<TB, C, K>& b, const simdgroup_matrix<TC, C, R>& c);
float simd_sum(float x);
float simd_max(float x);
float simd_shuffle_xor(float x, ushort mask);
int simd_shuffle_xor(int x, ushort mask);
float simd_shuffle(float x, ushort lane);  // the value lane `lane` of the simdgroup holds

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
float exp(float x);
float log(float x);
float sqrt(float x);
float rsqrt(float x);
float max(float a, float b);
float min(float a, float b);
int min(int a, int b);  // metal::min is overloaded for every scalar type
uint min(uint a, uint b);
float rint(float x);
float abs(float x);
uint max(uint a, uint b);
bool isnan(float x);
namespace precise {
float exp(float x);
float divide(float x, float y);
}
}
using metal::mem_flags;
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);
