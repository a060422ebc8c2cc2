// CUDA twin of rows_gate.metal (see there for what it does): the flag read through volatile
// (system memory order: the host writes it while this runs), a short sleep between reads.

if (blockIdx.x == 0 && threadIdx.x == 0) {
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
  out[0] = now == seen ? 1u : 0u;
  out[1] = now;
}
