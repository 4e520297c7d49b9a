/* sha256.c — SHA-256 and HMAC-SHA256, small and dependency-free, for the
 * store's mutual challenge-response (the secret itself never goes on the
 * wire). Checked by tests/c/store_sha256_test.c against FIPS/RFC vectors. */
#include "sha256.h"

#include <string.h>

static const uint32_t K[64] = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
  0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
  0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
  0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
  0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
  0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
  0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
  0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
  0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress(uint32_t h[8], const uint8_t *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
           (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
  uint32_t e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
    uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g; g = f; f = e; e = d + t1;
    d = c; c = b; b = a; a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d;
  h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

void wf_sha256_init(wf_sha256_ctx *c) {
  static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(c->h, iv, sizeof iv);
  c->bytes = 0;
  c->fill = 0;
}

void wf_sha256_update(wf_sha256_ctx *c, const void *data, size_t len) {
  const uint8_t *p = data;
  c->bytes += len;
  if (c->fill) {
    size_t take = 64 - c->fill < len ? 64 - c->fill : len;
    memcpy(c->buf + c->fill, p, take);
    c->fill += take; p += take; len -= take;
    if (c->fill < 64) return;
    compress(c->h, c->buf);
    c->fill = 0;
  }
  for (; len >= 64; p += 64, len -= 64) compress(c->h, p);
  memcpy(c->buf, p, len);
  c->fill = len;
}

void wf_sha256_final(wf_sha256_ctx *c, uint8_t out[32]) {
  uint64_t bits = c->bytes * 8;
  uint8_t pad[72] = {0x80};
  size_t padlen = (c->fill < 56) ? 56 - c->fill : 120 - c->fill;
  for (int i = 0; i < 8; i++) pad[padlen + i] = (uint8_t)(bits >> (56 - 8 * i));
  wf_sha256_update(c, pad, padlen + 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(c->h[i] >> 24); out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(c->h[i] >> 8); out[4 * i + 3] = (uint8_t)c->h[i];
  }
  memset(c, 0, sizeof *c);
}

void wf_sha256(const void *data, size_t len, uint8_t out[32]) {
  wf_sha256_ctx c;
  wf_sha256_init(&c);
  wf_sha256_update(&c, data, len);
  wf_sha256_final(&c, out);
}

void wf_hmac_init(wf_hmac *h, const void *key, size_t klen) {
  uint8_t k[64] = {0}, pad[64];
  if (klen > 64) wf_sha256(key, klen, k);      /* long keys are hashed first */
  else if (klen) memcpy(k, key, klen);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
  wf_sha256_init(&h->inner);
  wf_sha256_update(&h->inner, pad, 64);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
  wf_sha256_init(&h->outer);
  wf_sha256_update(&h->outer, pad, 64);
  memset(k, 0, sizeof k);
  memset(pad, 0, sizeof pad);
}

void wf_hmac_update(wf_hmac *h, const void *data, size_t len) {
  wf_sha256_update(&h->inner, data, len);
}

void wf_hmac_final(wf_hmac *h, uint8_t out[32]) {
  uint8_t ih[32];
  wf_sha256_final(&h->inner, ih);
  wf_sha256_update(&h->outer, ih, 32);
  wf_sha256_final(&h->outer, out);
}

void wf_hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen,
                    uint8_t out[32]) {
  wf_hmac h;
  wf_hmac_init(&h, key, klen);
  wf_hmac_update(&h, msg, mlen);
  wf_hmac_final(&h, out);
}

int wf_ct_equal(const void *a, const void *b, size_t n) {
  const volatile uint8_t *x = a, *y = b;
  uint8_t d = 0;
  for (size_t i = 0; i < n; i++) d |= (uint8_t)(x[i] ^ y[i]);
  return d == 0;
}
