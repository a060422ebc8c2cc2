// Copies from memory into shared memory by the copy engine (cp.async, sm_80 and later): a
// thread issues them, commits them as a group and later waits until at most N of its groups
// are still in flight; the copies hold no registers meanwhile. The host emulation
// (tests/emulation/cuda_emu.h) has functions of the same names that copy at once.
__device__ __forceinline__ void cp_async16(void* to, const void* from) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"((unsigned int)__cvta_generic_to_shared(to)), "l"(from) : "memory");
}

__device__ __forceinline__ void cp_async4(void* to, const void* from) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
               :: "r"((unsigned int)__cvta_generic_to_shared(to)), "l"(from) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
