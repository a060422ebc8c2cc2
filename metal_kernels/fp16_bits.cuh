// fp16 bits -> float on CUDA without cuda_fp16.h (NVRTC finds no system headers).
__device__ __forceinline__ float fp16_bits_to_float(unsigned int bits) {
  float f;
  unsigned short h = (unsigned short)bits;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
