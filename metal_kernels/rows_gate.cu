// Hold what is queued behind this launch until the host has written a forward's engram rows,
// then pass the rows on. CUDA only (kernels.rows_gate_fits): it has no Metal twin.
//
// A forward built before its token is known (Runner.decode_ahead) reads its engram rows from a
// buffer the host fills once the token is read back (runtime.staged.StagedRows). Its launches
// can be queued on the device before that, each behind this one: this kernel waits until the
// host has released the forward, then copies the rows into its output, which is what the forward
// reads (so every launch that reads the rows depends on this one's output: a CUDA graph
// orders launches by the buffers they share), and the device runs the forward's blocks
// straight after the host's write instead of waiting for the host to encode them then.
//
// flag [3] uint32, written in place (the host writes flag[0]; the device flag[1] and flag[2]):
// flag[0] counts the host's releases, flag[1] the releases the device's gates have taken, and
// flag[2] the gates that gave up. Thread 0 reads flag[0] until it differs from flag[1] (a
// release not yet taken), at most SPINS times with a short sleep between reads, then takes it
// (flag[1] = flag[0]) or, having given up, counts that in flag[2] (the host reports it at its
// next release: the forward ran on rows it had not written). status [2] = (1 if it gave up,
// else 0; the flag[0] it saw). rows [N] uint8 -> out [N]: the 256 threads of the one block
// copy them after thread 0 is done. The flag and the rows are read through volatile: the host
// writes them while this runs. Template constants: SPINS, N.

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
