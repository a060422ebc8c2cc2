// fp16 bits -> float on CUDA without cuda_fp16.h (NVRTC finds no system headers).
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
