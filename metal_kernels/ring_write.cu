// CUDA twin of ring_write.metal (see there for what it computes).

const unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
const unsigned int chunks = D / 8;
if (idx >= S * W * chunks) {
  return;
}
const unsigned int chunk = idx % chunks;
const unsigned int slot = (idx / chunks) % W;
const unsigned int stage = idx / (chunks * W);
const unsigned int m = (unsigned int)span[1];
const unsigned int j = (slot + W - (unsigned int)span[0] % W) % W;  // the row landing in this slot, if j < m
const uint4* src = (j < m)
    ? reinterpret_cast<const uint4*>(rows + ((long)stage * m + j) * D)
    : reinterpret_cast<const uint4*>(rings + ((long)stage * W + slot) * D);
reinterpret_cast<uint4*>(out + ((long)stage * W + slot) * D)[chunk] = src[chunk];
