// Asynchronous copies from device memory into shared memory (cp.async, sm_80 on), in inline
// PTX: a copy is issued now and lands by a later copy_async_wait<N>, which waits for every
// group the thread has committed but the newest N; copy_async_commit closes the thread's
// current group. A copy is the thread's own: other threads read what it wrote only after its
// wait and a barrier between them. The host emulation (tests/emulation/cuda_emu.h) has
// functions of the same names and arguments, which hold each copy back until its wait.
__device__ __forceinline__ unsigned int shared_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned int)a;
}

// 16 bytes (both addresses 16-byte aligned), cached in L2 only
__device__ __forceinline__ void copy_async16(void* to, const void* from) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(to)), "l"(from) : "memory");
}

// 4 bytes (both addresses 4-byte aligned)
__device__ __forceinline__ void copy_async4(void* to, const void* from) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(to)), "l"(from) : "memory");
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
