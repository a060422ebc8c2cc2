// CUDA kernel bodies run on the host, as C++ (tests/kernel_emulation.py writes the unit): the
// CUDA built-ins our kernels use, for a machine without a GPU. A block is 256 threads run as
// fibers on one OS thread (fibers.h) and blocks run one after another, so __shared__ memory is
// static storage; a warp's shuffles go through a per-warp exchange between two barriers of the
// warp; mma_m16n8k16 (fp16_bits.cuh's mma.sync m16n8k16, which the unit leaves out) gathers the
// 32 lanes' fragments the same way, in the PTX ISA's fragment layout, and each lane sums its own
// outputs in k order in float (the tensor core's order may differ: within the float32 summation
// bound the tests allow). fp16 and bf16 conversions are done in software (host_floats.h), in
// place of fp16_bits.cuh's asm.
#include <cmath>
#include <cstdint>
#include <cstring>
#include "fibers.h"
#include "host_floats.h"
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim { unsigned int x; };
Dim threadIdx, blockIdx;  // the running thread's (set as fibers.h resumes it)
static const Dim blockDim{256};
static emu::Barrier block_sync{256};
static emu::Barrier warp_sync[8] = {{32}, {32}, {32}, {32}, {32}, {32}, {32}, {32}};
static float exchange_f[8][32];
static unsigned int exchange_u[8][32][6];
inline void __syncthreads() { emu::wait(block_sync); }
inline void __nanosleep(unsigned int) {}
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __syncwarp(unsigned int = 0xffffffffu) { emu::wait(warp_sync[threadIdx.x / 32]); }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __shfl_sync(unsigned int, float v, int src) {
  const unsigned int w = threadIdx.x / 32, l = threadIdx.x % 32;
  exchange_f[w][l] = v;
  emu::wait(warp_sync[w]);
  const float got = exchange_f[w][src & 31];
  emu::wait(warp_sync[w]);
  return got;
}
inline float __shfl_xor_sync(unsigned int m, float v, int offset) { return __shfl_sync(m, v, (threadIdx.x % 32) ^ offset); }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float rintf(float v) { return std::nearbyint(v); }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }  // the GPU's may round otherwise: both sides here alike
#ifndef _LIBCPP_VERSION  // libc++'s <cmath> puts std's isnan in the global namespace already
inline bool isnan(float v) { return std::isnan(v); }
#endif
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
inline uint4 make_uint4(unsigned int a, unsigned int b, unsigned int c, unsigned int d) { return {a, b, c, d}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {  // bytes of {y, x} by selector nibbles
  const uint64_t both = ((uint64_t)y << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; i++) r |= (unsigned int)((both >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(host_f32_to_bf16(f)) {}
  operator float() const { return host_bf16_to_f32(bits); }
};
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float fp16_bits_to_float(unsigned int bits) { return host_f16_to_f32(bits); }
inline unsigned int float_pair_to_fp16_bits(float lo, float hi) {
  return host_f32_to_f16(lo) | ((unsigned int)host_f32_to_f16(hi) << 16);
}
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, d += A B, from the 32 lanes' fragments (PTX ISA's layout)
inline void mma_m16n8k16(float* d, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                         unsigned int b0, unsigned int b1) {
  const unsigned int w = threadIdx.x / 32, l = threadIdx.x % 32;
  unsigned int* mine = exchange_u[w][l];
  mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = b0; mine[5] = b1;
  emu::wait(warp_sync[w]);
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; lane++) {
    const unsigned int g = lane / 4, t = lane % 4, *f = exchange_u[w][lane];
    for (int h = 0; h < 2; h++) {
      A[g][2 * t + h] = fp16_bits_to_float(f[0] >> (16 * h) & 0xffffu);
      A[g + 8][2 * t + h] = fp16_bits_to_float(f[1] >> (16 * h) & 0xffffu);
      A[g][2 * t + 8 + h] = fp16_bits_to_float(f[2] >> (16 * h) & 0xffffu);
      A[g + 8][2 * t + 8 + h] = fp16_bits_to_float(f[3] >> (16 * h) & 0xffffu);
      B[2 * t + h][g] = fp16_bits_to_float(f[4] >> (16 * h) & 0xffffu);
      B[2 * t + 8 + h][g] = fp16_bits_to_float(f[5] >> (16 * h) & 0xffffu);
    }
  }
  emu::wait(warp_sync[w]);
  const unsigned int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; i++) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float acc = d[i];
    for (int k = 0; k < 16; k++) acc += A[row][k] * B[k][col];
    d[i] = acc;
  }
}
template <typename F> void run_blocks(int blocks, F body) {
  for (int b = 0; b < blocks; b++) {
    blockIdx.x = b;
    emu::run_group(256, body, [](unsigned t) { threadIdx.x = t; });
  }
}
