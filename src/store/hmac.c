/* hmac.c — HMAC-SHA256 over parts and a constant-time compare, through
 * OpenSSL's libcrypto (EVP_MAC, CRYPTO_memcmp): the store's handshake
 * (store_auth.c) uses a well-kept implementation, not its own. */
#include "hmac.h"

#include <openssl/crypto.h>
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <string.h>

int wf_hmac_sha256(const void *key, size_t klen, const wf_bytes *parts, int n, uint8_t out[32]) {
  static const unsigned char nokey = 0;   /* EVP_MAC_init needs a key pointer, even for "" */
  EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
  EVP_MAC_CTX *ctx = mac ? EVP_MAC_CTX_new(mac) : NULL;
  OSSL_PARAM params[] = {
    OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, (char *)"SHA256", 0),
    OSSL_PARAM_construct_end(),
  };
  size_t len = 0;
  int ok = ctx && EVP_MAC_init(ctx, klen ? key : &nokey, klen, params);
  for (int i = 0; ok && i < n; i++) ok = EVP_MAC_update(ctx, parts[i].p, parts[i].n);
  ok = ok && EVP_MAC_final(ctx, out, &len, 32) && len == 32;
  EVP_MAC_CTX_free(ctx);
  EVP_MAC_free(mac);
  if (!ok) memset(out, 0, 32);
  return ok ? 0 : -1;
}

int wf_ct_equal(const void *a, const void *b, size_t n) {
  return CRYPTO_memcmp(a, b, n) == 0;
}
