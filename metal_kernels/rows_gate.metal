// Hold what is queued behind this launch until the host has written a forward's engram rows,
// then pass the rows on.
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
// release not yet taken), at most SPINS times, then takes it (flag[1] = flag[0]) or, having
// given up, counts that in flag[2] (the host reports it at its next release: the forward ran
// on rows it had not written). status [2] = (1 if it gave up, else 0; the flag[0] it saw).
// rows [N] uint8 -> out [N]: the 256 threads of the one threadgroup copy them after thread 0
// is done. Template constants: SPINS, N. CUDA twin: rows_gate.cu (it sleeps between reads).

const uint t = thread_position_in_threadgroup.x;
if (t == 0) {
  device atomic_uint* f = (device atomic_uint*)(flag);
  const uint seen = atomic_load_explicit(&f[1], memory_order_relaxed);
  uint now = atomic_load_explicit(&f[0], memory_order_relaxed);
  for (uint spins = 0; now == seen && spins < SPINS; spins++) {
    now = atomic_load_explicit(&f[0], memory_order_relaxed);
  }
  if (now != seen) {
    atomic_store_explicit(&f[1], now, memory_order_relaxed);
  } else {
    atomic_fetch_add_explicit(&f[2], 1u, memory_order_relaxed);
  }
  status[0] = now == seen ? 1u : 0u;
  status[1] = now;
}
threadgroup_barrier(mem_flags::mem_device);
for (uint i = t; i < N; i += 256) {
  out[i] = rows[i];
}
