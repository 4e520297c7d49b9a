/* store_auth.c — the challenge-response that keeps a store to the ranks that
 * share its secret: nonces, the HMAC-SHA256 proofs of both sides, the
 * server's check of a client and the client's side of the handshake.
 * Messages: store_proto.h. */
#include "store_internal.h"
#include "sha256.h"

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

static void auth_mac(const char *secret, size_t slen, const char *label,
                     const uint8_t *sn, const uint8_t *cn, uint8_t out[32]) {
  wf_hmac h;
  wf_hmac_init(&h, secret, slen);
  wf_hmac_update(&h, label, strlen(label));
  wf_hmac_update(&h, sn, WF_ST_NONCE);
  wf_hmac_update(&h, cn, WF_ST_NONCE);
  wf_hmac_final(&h, out);
  memset(&h, 0, sizeof h);
}

/* Server side: checks an AUTH payload (client nonce, proof) against the nonce
 * sn the server sent. 0: the client knows the secret, proof_out holds the
 * server's answer; 1: the secrets differ; -1: malformed. */
int wf_store_auth_check(const char *secret, size_t slen, const uint8_t *sn, wf_rd *r,
                        uint8_t proof_out[32]) {
  const uint8_t *cn = wf_rd_take(r, WF_ST_NONCE), *mac = wf_rd_take(r, 32);
  if (!cn || !mac || r->pos != r->len) return -1;
  uint8_t want[32];
  auth_mac(secret, slen, AUTH_CLIENT, sn, cn, want);
  if (!wf_ct_equal(want, mac, 32)) return 1;
  auth_mac(secret, slen, AUTH_SERVER, sn, cn, proof_out);
  return 0;
}

/* Client side, right after connect: HELLO tells whether the server wants a
 * secret; both sides must agree on having one, then each proves it. */
int wf_store_cl_handshake(weft_store *s, const char *op, int64_t deadline) {
  int fop;
  wf_rd r;
  int rc = wf_store_cl_read_frame(s, op, deadline, &fop, &r);
  if (rc) return rc;
  const uint8_t *auth = wf_rd_take(&r, 1), *sn = wf_rd_take(&r, WF_ST_NONCE);
  if (fop != WF_OP_HELLO || !auth || !sn) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: %s did not greet like a weft store", op, s->where);
  }
  int need = auth[0] != 0;
  if (need && !s->secret) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s requires a secret and none was given "
                                "(set WEFT_STORE_SECRET or the secret option)", op, s->where);
  }
  if (!need && s->secret) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s uses no secret but this client has one; "
                                "refusing an unauthenticated server", op, s->where);
  }
  if (!need) return 0;
  uint8_t snonce[WF_ST_NONCE], cn[WF_ST_NONCE], mac[32], want[32];
  memcpy(snonce, sn, sizeof snonce);
  wf_store_random_bytes(cn, sizeof cn);
  size_t slen = strlen(s->secret);
  auth_mac(s->secret, slen, AUTH_CLIENT, snonce, cn, mac);
  wf_store_rq_begin(s);
  wf_store_wb_put(&s->rq, cn, sizeof cn);
  wf_store_wb_put(&s->rq, mac, sizeof mac);
  if ((rc = wf_store_cl_send(s, op, WF_OP_AUTH, 0, deadline))) return rc;
  if ((rc = wf_store_cl_read_frame(s, op, deadline, &fop, &r))) {
    if (rc == WEFT_ECLOSED) goto rejected;
    return rc;
  }
  if (fop == WF_OP_RESP) {
  rejected:
    wf_store_cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s rejected this client: the secrets differ "
                                "(check WEFT_STORE_SECRET on every rank)", op, s->where);
  }
  const uint8_t *proof = wf_rd_take(&r, 32);
  auth_mac(s->secret, slen, AUTH_SERVER, snonce, cn, want);
  if (fop != WF_OP_AUTH_OK || !proof || !wf_ct_equal(proof, want, 32)) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s could not prove it knows the secret", op, s->where);
  }
  return 0;
}
