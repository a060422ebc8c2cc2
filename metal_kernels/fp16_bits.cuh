// fp16 on CUDA without cuda_fp16.h (NVRTC finds no system headers), in inline PTX: conversions
// and the matrix unit's fp16 product.

// fp16 bits -> float.
__device__ __forceinline__ float fp16_bits_to_float(unsigned int bits) {
  float f;
  unsigned short h = (unsigned short)bits;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Two floats -> their fp16 (round to nearest even) packed low | high << 16.
__device__ __forceinline__ unsigned int float_pair_to_fp16_bits(float lo, float hi) {
  unsigned short l, h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(lo));
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(hi));
  return (unsigned int)l | ((unsigned int)h << 16);
}

// The matrix unit: d += A B for one m16n8k16 tile, fp16 in and fp32 accumulate
// (mma.sync.aligned.m16n8k16.row.col; PTX ISA's fragment layout: lane 4g + t holds A's
// a0..a3, B's b0, b1 and C / D's d[0..3]). The host emulation (tests/emulation/cuda_emu.h)
// has a function of the same name and arguments.
__device__ __forceinline__ void mma_m16n8k16(float* d, unsigned int a0, unsigned int a1, unsigned int a2,
                                             unsigned int a3, unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
