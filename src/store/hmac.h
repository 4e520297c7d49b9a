/* hmac.h — the store's HMAC-SHA256 and constant-time compare, from OpenSSL's
 * libcrypto (libssl-dev at build time, libcrypto.so.3 at run time). Internal;
 * tests/c/store_hmac_test.c checks it against RFC 4231's known answers. */
#ifndef WF_HMAC_H
#define WF_HMAC_H

#include <stddef.h>
#include <stdint.h>

/* HMAC-SHA256(key, the n parts one after the other). 0, or -1 when
 * libcrypto fails (out is then zeroed: it matches no proof). */
typedef struct wf_bytes { const void *p; size_t n; } wf_bytes;
int wf_hmac_sha256(const void *key, size_t klen, const wf_bytes *parts, int n, uint8_t out[32]);

/* Constant-time comparison (CRYPTO_memcmp): 1 when equal. */
int wf_ct_equal(const void *a, const void *b, size_t n);

#endif
