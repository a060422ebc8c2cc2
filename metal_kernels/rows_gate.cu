// CUDA twin of rows_gate.metal (see there for what it does): the flag and the rows read
// through volatile (the host writes them while this runs), a short sleep between reads.

const unsigned int t = threadIdx.x;
if (t == 0) {
  volatile unsigned int* f = const_cast<volatile unsigned int*>(flag);
  const unsigned int seen = f[1];
  unsigned int now = f[0];
  for (unsigned int spins = 0; now == seen && spins < SPINS; spins++) {
    __nanosleep(256);
    now = f[0];
  }
  __threadfence_system();
  if (now != seen) {
    f[1] = now;
  } else {
    f[2] = f[2] + 1u;
  }
  status[0] = now == seen ? 1u : 0u;
  status[1] = now;
}
__syncthreads();
for (unsigned int i = t; i < N; i += 256) {
  out[i] = reinterpret_cast<const volatile uint8_t*>(rows)[i];
}
