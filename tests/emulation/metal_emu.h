// Metal kernel bodies run on the host, as C++ (tests/kernel_emulation.py writes the unit): the
// Metal types and built-ins our kernels use, for a machine without Metal. A threadgroup is 256
// threads (8 simdgroups of 32) run as fibers on one OS thread (fibers.h), and threadgroups run
// one after another, so threadgroup memory is static storage; a simdgroup's reductions go
// through an exchange between two barriers of its 32 lanes, and simdgroup_barrier waits for
// those 32 lanes; a simdgroup matrix is held whole by every lane, each lane computing the
// product itself and lane 0 storing it. Sums inside a product run in k order in float: the
// matrix unit's own order may differ, which is within the float32 summation bound the tests
// allow. half and bfloat16_t convert in software (host_floats.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include "fibers.h"
#include "host_floats.h"
typedef uint32_t uint;
typedef uint16_t ushort;
typedef uint64_t ulong;
typedef uint8_t uchar;
struct uint2 { uint x, y; };
struct uint4 { uint x, y, z, w; uint4() = default; uint4(uint a, uint b, uint c, uint d) : x(a), y(b), z(c), w(d) {} };
struct ulong2 { ulong x, y; ulong2(ulong a, ulong b) : x(a), y(b) {} };
template <typename T, typename S> inline T as_type(S s) { static_assert(sizeof(T) == sizeof(S)); T t; std::memcpy(&t, &s, sizeof(T)); return t; }
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) : bits(host_f32_to_bf16(f)) {}
  explicit operator float() const { return host_bf16_to_f32(bits); }
};
struct half {  // IEEE binary16
  uint16_t bits;
  half() = default;
  half(float f) : bits(host_f32_to_f16(f)) {}
  operator float() const { return host_f16_to_f32(bits); }
};
template <> inline half as_type<half, ushort>(ushort s) { half h; h.bits = s; return h; }
uint tid_in_tg, tg_in_grid, lane_id, sg_id;  // the running thread's (set as fibers.h resumes it)
struct Pos { uint x; };
#define thread_position_in_threadgroup (Pos{tid_in_tg})
#define threadgroup_position_in_grid (Pos{tg_in_grid})
#define thread_position_in_grid (Pos{tg_in_grid * 256 + tid_in_tg})
#define thread_index_in_simdgroup (lane_id)
#define simdgroup_index_in_threadgroup (sg_id)
static emu::Barrier tg_sync{256};
// a simdgroup's own barrier: its reductions need only its lanes
static emu::Barrier sg_sync[8] = {{32}, {32}, {32}, {32}, {32}, {32}, {32}, {32}};
static float xch[8][32];
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline float abs(float a) { return std::fabs(a); }
inline float rint(float a) { return std::nearbyint(a); }
inline float exp(float a) { return std::exp(a); }
inline float log(float a) { return std::log(a); }
inline float sqrt(float a) { return std::sqrt(a); }
inline float rsqrt(float a) { return 1.0f / std::sqrt(a); }  // the GPU's may round otherwise: both sides here alike
inline bool isnan(float a) { return std::isnan(a); }
namespace precise {
inline float exp(float a) { return std::exp(a); }
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
}  // namespace metal
using metal::mem_flags;
using metal::min;
using metal::max;
#ifndef _LIBCPP_VERSION  // libc++'s <cmath> puts std's float fma in the global namespace already
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
#endif
inline void threadgroup_barrier(mem_flags) { emu::wait(tg_sync); }
inline void simdgroup_barrier(mem_flags) { emu::wait(sg_sync[sg_id]); }
inline float simd_exchange(float v, uint src) {
  xch[sg_id][lane_id] = v;
  emu::wait(sg_sync[sg_id]);
  const float got = xch[sg_id][src & 31];
  emu::wait(sg_sync[sg_id]);
  return got;
}
inline float simd_shuffle_xor(float v, ushort offset) { return simd_exchange(v, lane_id ^ offset); }
inline float simd_shuffle(float v, ushort src) { return simd_exchange(v, src); }
inline float simd_max(float v) {
  xch[sg_id][lane_id] = v;
  emu::wait(sg_sync[sg_id]);
  float m = xch[sg_id][0];
  for (int l = 1; l < 32; l++) m = std::fmax(m, xch[sg_id][l]);
  emu::wait(sg_sync[sg_id]);
  return m;
}
template <typename T, int R, int C> struct simdgroup_matrix { T m[R][C]; };
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
template <typename T, int R, int C> simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> s;
  for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) s.m[i][j] = v;
  return s;
}
template <typename T> void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const T* src, ulong stride,
                                          ulong2 origin = ulong2(0, 0), bool transpose = false) {
  for (int i = 0; i < 8; i++) for (int j = 0; j < 8; j++)
    d.m[i][j] = transpose ? src[(j + origin.y) * stride + i + origin.x] : src[(i + origin.y) * stride + j + origin.x];
}
template <typename T> void simdgroup_store(const simdgroup_matrix<T, 8, 8>& s, T* dst, ulong stride,
                                           ulong2 origin = ulong2(0, 0), bool transpose = false) {
  if (lane_id != 0) return;
  for (int i = 0; i < 8; i++) for (int j = 0; j < 8; j++)
    (transpose ? dst[(j + origin.y) * stride + i + origin.x] : dst[(i + origin.y) * stride + j + origin.x]) = s.m[i][j];
}
template <typename A, typename B> void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_matrix<A, 8, 8>& a,
                                                                    const simdgroup_matrix<B, 8, 8>& b, const simdgroup_float8x8& c) {
  simdgroup_float8x8 r;
  for (int i = 0; i < 8; i++) for (int j = 0; j < 8; j++) {
    float acc = c.m[i][j];
    for (int k = 0; k < 8; k++) acc += (float)a.m[i][k] * (float)b.m[k][j];
    r.m[i][j] = acc;
  }
  d = r;
}
template <typename F> void run_threadgroups(uint groups, F body) {
  for (uint g = 0; g < groups; g++) {
    tg_in_grid = g;
    emu::run_group(256, body, [](unsigned t) { tid_in_tg = t; lane_id = t % 32; sg_id = t / 32; });
  }
}
