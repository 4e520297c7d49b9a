/* store_auth.c — the challenge-response that keeps a store to the ranks that
 * share its secret: nonces, the HMAC-SHA256 proofs of both sides, the
 * server's check of a client and the client's steps of the handshake.
 * Pure computation: the client (store_client.c) and the server call in,
 * this file calls neither. Messages: store_proto.h. */
#include "store_internal.h"
#include "hmac.h"

#include <string.h>
#include <sys/random.h>
#include <unistd.h>

static const char AUTH_CLIENT[] = "weft-store-v1 client";
static const char AUTH_SERVER[] = "weft-store-v1 server";

void wf_store_random_bytes(uint8_t *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(p + got, n - got, 0);
    if (r > 0) { got += (size_t)r; continue; }
    if (r < 0 && errno == EINTR) continue;
    break;
  }
  if (got < n) {  /* no getrandom: fall back to the clock (nonces, not keys) */
    uint64_t x = (uint64_t)wf_now_ns() ^ ((uint64_t)getpid() << 32);
    for (; got < n; got++) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; p[got] = (uint8_t)x; }
  }
}

/* HMAC-SHA256(secret, label || server nonce || client nonce). Nonzero
 * when libcrypto failed: every caller then refuses (fails closed). */
static int auth_mac(const char *secret, size_t slen, const char *label,
                    const uint8_t *sn, const uint8_t *cn, uint8_t out[32]) {
  const wf_bytes parts[] = { { label, strlen(label) }, { sn, WF_ST_NONCE }, { cn, WF_ST_NONCE } };
  return wf_hmac_sha256(secret, slen, parts, 3, out);
}

/* Server side: checks the proof at the front of an AUTH payload (client
 * nonce, HMAC) against the nonce sn the server sent; r is left after it.
 * 0: the client knows the secret, proof_out holds the server's answer;
 * 1: the secrets differ (or libcrypto failed: refused); -1: malformed. */
int wf_store_auth_check(const char *secret, size_t slen, const uint8_t *sn, wf_rd *r,
                        uint8_t proof_out[32]) {
  const uint8_t *cn = wf_rd_take(r, WF_ST_NONCE), *mac = wf_rd_take(r, 32);
  if (!cn || !mac) return -1;
  uint8_t want[32];
  if (auth_mac(secret, slen, AUTH_CLIENT, sn, cn, want) || !wf_ct_equal(want, mac, 32)) return 1;
  return auth_mac(secret, slen, AUTH_SERVER, sn, cn, proof_out) ? 1 : 0;
}

/* Client side, step by step (the client does the I/O, see store_client.c):
 * greet reads HELLO's payload, prove appends the AUTH proof, verify checks
 * the server's AUTH_OK. Nothing here touches a socket. */
int wf_store_auth_greet(wf_store_auth_cl *a, int have_secret, wf_rd *hello) {
  const uint8_t *need = wf_rd_take(hello, 1), *sn = wf_rd_take(hello, WF_ST_NONCE);
  if (!need || !sn) return WF_AUTH_NOT_A_STORE;
  a->need = need[0] != 0;
  memcpy(a->sn, sn, WF_ST_NONCE);
  a->instance = hello->pos + 8 <= hello->len ? wf_rd_u64(hello) : 0;
  if (a->need && !have_secret) return WF_AUTH_SECRET_MISSING;
  if (!a->need && have_secret) return WF_AUTH_SERVER_HAS_NONE;
  return WF_AUTH_OK;
}

void wf_store_auth_prove(wf_store_auth_cl *a, const char *secret, wf_store_wbuf *out) {
  uint8_t mac[32];
  wf_store_random_bytes(a->cn, sizeof a->cn);
  /* on a libcrypto failure the proof is zeros: the server refuses it */
  (void)auth_mac(secret, strlen(secret), AUTH_CLIENT, a->sn, a->cn, mac);
  wf_store_wb_put(out, a->cn, sizeof a->cn);
  wf_store_wb_put(out, mac, sizeof mac);
}

int wf_store_auth_verify(const wf_store_auth_cl *a, const char *secret, wf_rd *auth_ok) {
  uint8_t want[32];
  const uint8_t *proof = wf_rd_take(auth_ok, 32);
  if (auth_mac(secret, strlen(secret), AUTH_SERVER, a->sn, a->cn, want)) return -1;
  return proof && wf_ct_equal(proof, want, 32) ? 0 : -1;
}
