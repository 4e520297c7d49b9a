/* quick_codec_arith_test — the float facts kernels/quick_codec.cuh rests on,
 * checked exhaustively with the CPU's IEEE single arithmetic (round to
 * nearest even, fmaf fused, subnormals kept: the kernels' __fadd_rn,
 * __fmul_rn, __fmaf_rn). No GPU: the GPU suite holds the kernels to the CPU
 * reference bit for bit; this says why the cheaper forms can be. int8
 * takes 1-3; int4 keeps the conversion unit and the division (its forms
 * below are exact too, and measured slower on a GPU); fp8 takes none.
 *  1. rounding by one FADD: for every float v with |v| <= 128, the bits of
 *     v + 1.5 * 2^23 are 0x4B400000 + rint(v) (ties to even), so the low byte
 *     / nibble is the int8 / int4 code;
 *  2. back from a code: 2^23 + (c + 2^(b-1)) under 2^23's exponent, minus
 *     2^23 + 2^(b-1), is c exactly, every int8 and int4 code; the byte
 *     permutes pack / unpack the wire's layouts (byte i = code i; nibble i
 *     at bits 4i);
 *  3. a / QM as the kernels compute it (q0 = a * RN(1/QM), then
 *     fma(fma(-q0, QM, a), RN(1/QM), q0)) equals a / QM for every positive
 *     finite float a, QM = 127 and 7 (int8, int4; fp8's 448 is not exact
 *     below 2^-120 and keeps the division).
 *   make quick-codec-arith-test-c  (about 15 s) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int passed, failed;
static void check(int ok, const char *what) {
  if (ok) passed++;
  else { failed++; printf("FAIL %s\n", what); }
}
static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* PTX prmt.b32 (CUDA's __byte_perm): byte i of the result is byte s_i of y:x */
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; i++) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
static uint32_t low_bytes(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
  return byte_perm(byte_perm(a0, a1, 0x0040u), byte_perm(a2, a3, 0x0040u), 0x5410u);
}
static float under_two23(uint32_t x, int b) { return from_bits(byte_perm(x, 0x4B000000u, 0x7540u | (uint32_t)b)); }

static void rounding(void) {
  long bad = 0;
  for (uint32_t u = 0; u <= bits(128.0f); u++)
    for (int neg = 0; neg < 2; neg++) {
      const float v = from_bits(u | (neg ? 0x80000000u : 0u));
      volatile float sum = v + 12582912.0f;
      const int c = (int)rintf(v);
      if (bits(sum) != 0x4B400000u + (uint32_t)c) bad++;
    }
  check(bad == 0, "v + 1.5 * 2^23 is 0x4B400000 + rint(v) for every |v| <= 128");
}

static void codes(void) {
  long bad = 0;
  for (int c = -128; c < 128; c++) {
    const uint32_t u = ((uint32_t)(c & 0xff) * 0x01010101u) ^ 0x80808080u;
    for (int b = 0; b < 4; b++)
      if (under_two23(u, b) - 8388736.0f != (float)c) bad++;
  }
  check(bad == 0, "every int8 code decodes exactly");
  bad = 0;
  for (int c = -8; c < 8; c++) {
    const uint32_t u = ((uint32_t)(c & 0xf) * 0x11111111u) ^ 0x88888888u;
    const uint32_t even = u & 0x0f0f0f0fu, odd = (u >> 4) & 0x0f0f0f0fu;
    for (int i = 0; i < 8; i++)
      if (under_two23(i & 1 ? odd : even, i >> 1) - 8388616.0f != (float)c) bad++;
  }
  check(bad == 0, "every int4 code decodes exactly");
  long bad8 = 0, bad4 = 0;
  uint32_t st = 12345;
  for (int t = 0; t < 1000000; t++) {
    int c8[8], c4[8];
    uint32_t m8[8], m4[8], w8[2] = {0, 0}, w4 = 0;
    for (int i = 0; i < 8; i++) {
      st = st * 1664525u + 1013904223u;
      c8[i] = (int)(st >> 24) - 128;
      c4[i] = c8[i] % 8;
      m8[i] = 0x4B400000u + (uint32_t)c8[i];
      m4[i] = 0x4B400000u + (uint32_t)c4[i];
      w8[i >> 2] |= ((uint32_t)c8[i] & 0xffu) << (8 * (i & 3));
      w4 |= ((uint32_t)c4[i] & 0xfu) << (4 * i);
    }
    if (low_bytes(m8[0], m8[1], m8[2], m8[3]) != w8[0] || low_bytes(m8[4], m8[5], m8[6], m8[7]) != w8[1]) bad8++;
    const uint32_t even = low_bytes(m4[0], m4[2], m4[4], m4[6]), odd = low_bytes(m4[1], m4[3], m4[5], m4[7]);
    if (((even & 0x0f0f0f0fu) | ((odd << 4) & 0xf0f0f0f0u)) != w4) bad4++;
  }
  check(bad8 == 0, "int8 packing: byte i is code i (10^6 random vectors)");
  check(bad4 == 0, "int4 packing: nibble i at bits 4i (10^6 random vectors)");
}

static void scale(float qm, float rq, const char *what) {
  volatile float one = 1.0f;
  check(bits(one / qm) == bits(rq), what);
  long bad = 0;
  for (uint32_t u = 1; u < 0x7f800000u; u++) {
    const float a = from_bits(u);
    volatile float want = a / qm;
    const float q0 = a * rq;
    const float got = fmaf(fmaf(-q0, qm, a), rq, q0);
    if (bits(got) != bits(want)) bad++;
  }
  check(bad == 0, what);
}

int main(void) {
  rounding();
  codes();
  scale(127.0f, 0x1.020408p-7f, "a / 127 by the reciprocal and one FMA, every positive float");
  scale(7.0f, 0x1.24924ap-3f, "a / 7 by the reciprocal and one FMA, every positive float");
  printf("quick_codec_arith: %d passed, %d failed\n", passed, failed);
  return failed != 0;
}
