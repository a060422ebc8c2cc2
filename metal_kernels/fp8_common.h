// Arithmetic shared by the Metal and CUDA kernels (plain integer expressions,
// valid in both languages).
//
// E4M3 -> fp16 bits: an E4M3 byte s.eeee.mmm placed as fp16 s.0eeee.mmm0000000
// is the same number times 2^-8 (the exponent bias is 15 instead of 7), for
// normal and subnormal codes alike. The factor 2^8 is folded into the tile
// scale. Four bytes of a 32-bit word become two fp16 pairs:
//   E4M3_EVEN(w): bytes 0 and 2 (low and high half), E4M3_ODD(w): bytes 1 and 3.
#define E4M3_EVEN(w) ((((w) & 0x00800080u) << 8) | (((w) & 0x007F007Fu) << 7))
#define E4M3_ODD(w) (((w) & 0x80008000u) | (((w) & 0x7F007F00u) >> 1))

// E2M1 code s.ee.m (an FP4 nibble) -> fp16 bits: placed as fp16 s.000ee.m000000000 it is the
// same number times 2^-14 (0.5, the one subnormal code, lands on the fp16 subnormal 2^-15),
// the factor 2^14 folded into the block scale.
#define E2M1_HALF(c) ((((c) & 0x8u) << 12) | (((c) & 0x7u) << 9))
// The eight codes of a 32-bit word by parity: code 2b is byte b of E2M1_EVEN_CODES(w), code
// 2b + 1 byte b of E2M1_ODD_CODES(w) (two masks for eight codes).
#define E2M1_EVEN_CODES(w) ((w) & 0x0F0F0F0Fu)
#define E2M1_ODD_CODES(w) (((w) >> 4) & 0x0F0F0F0Fu)
// Codes i and i + 4 of a 32-bit word (bits 4i and 4i + 16) as an fp16 pair, low | high << 16,
// each E2M1_HALF: the matrix unit's operand for two columns at once.
#define E2M1_HALF_PAIR(w, i) (((((w) >> (4 * (i))) & 0x00080008u) << 12) | ((((w) >> (4 * (i))) & 0x00070007u) << 9))

// E8M0 byte e -> float bits of its scale 2^(e-127). Valid for e >= 1 (e = 0, a
// scale of 2^-127, would need a subnormal; the FP8 head builder never emits it).
#define E8M0_BITS(e) ((unsigned int)(e) << 23)

// Bitonic order of (value, id) pairs: larger value first, smaller id on ties.
#define PAIR_BEFORE(va, ia, vb, ib) ((va) > (vb) || ((va) == (vb) && (ia) < (ib)))
