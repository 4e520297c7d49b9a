/* sha256.h — SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), internal.
 * Used by the store's challenge-response; self-contained so tests/c can
 * compile it alone for the known-answer test. */
#ifndef WF_SHA256_H
#define WF_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct wf_sha256_ctx {
  uint32_t h[8];
  uint64_t bytes;     /* total message length so far */
  uint8_t buf[64];
  size_t fill;        /* bytes in buf */
} wf_sha256_ctx;

void wf_sha256_init(wf_sha256_ctx *c);
void wf_sha256_update(wf_sha256_ctx *c, const void *data, size_t len);
void wf_sha256_final(wf_sha256_ctx *c, uint8_t out[32]);
void wf_sha256(const void *data, size_t len, uint8_t out[32]);

typedef struct wf_hmac {
  wf_sha256_ctx inner, outer;
} wf_hmac;

void wf_hmac_init(wf_hmac *h, const void *key, size_t klen);
void wf_hmac_update(wf_hmac *h, const void *data, size_t len);
void wf_hmac_final(wf_hmac *h, uint8_t out[32]);
void wf_hmac_sha256(const void *key, size_t klen, const void *msg, size_t mlen,
                    uint8_t out[32]);

/* Constant-time comparison: 1 when equal. */
int wf_ct_equal(const void *a, const void *b, size_t n);

#endif
