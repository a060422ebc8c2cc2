// bf16x8_floats: 8 bf16 values read as one 16-byte word (a uint4, the first value in the low
// half of .x) as floats f[0..7], in order: a bf16 is a float's upper 16 bits. CUDA twin:
// bf16_lane.cuh.
inline void bf16x8_floats(const uint4 p, thread float* f) {
  const uint pairs[4] = {p.x, p.y, p.z, p.w};
  for (int j = 0; j < 4; j++) {
    f[2 * j] = as_type<float>(pairs[j] << 16);
    f[2 * j + 1] = as_type<float>(pairs[j] & 0xFFFF0000u);
  }
}
