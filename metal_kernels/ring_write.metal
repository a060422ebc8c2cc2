// Write the newly committed rows of every DSpark stage into that stage's ring.
//
// rings [S, W, D] and rows [S, m, D] are bf16 viewed as uint16; row j of a
// stage is position first + j and goes to slot (first + j) % W (m <= W).
// Output: the rings after the write. One thread moves 8 values (16 bytes).
// Template constants: S (stages), W (slots), D (row width, a multiple of 8).
// span = [first, m], int32 (inputs, so one build serves every write). CUDA twin:
// ring_write.cu.

const uint idx = thread_position_in_grid.x;
const uint chunks = D / 8;
if (idx >= S * W * chunks) {
  return;
}
const uint chunk = idx % chunks;
const uint slot = (idx / chunks) % W;
const uint stage = idx / (chunks * W);
const uint m = uint(span[1]);
const uint j = (slot + W - uint(span[0]) % W) % W;  // the row landing in this slot, if j < m
const device uint4* src = (j < m)
    ? (const device uint4*)(rows + ((long)stage * m + j) * D)
    : (const device uint4*)(rings + ((long)stage * W + slot) * D);
((device uint4*)(out + ((long)stage * W + slot) * D))[chunk] = src[chunk];
