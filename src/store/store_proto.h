/* store_proto.h — the store's wire format, and the internal calls that
 * cpugroup.c makes on a store (lock once, several requests, copy results).
 *
 * Frame = 16-byte header + payload, integers big-endian:
 *   u32 magic "WFST" | u8 version | u8 op | u16 flags | u64 payload length
 * Strings/blobs: key = u32 len + bytes, value = u64 len + bytes.
 *
 * Server -> client on accept:  HELLO  u8 auth_required, 32-byte server nonce,
 *                                     u64 server instance (random per server)
 * Client -> server:            AUTH   [auth_required: 32-byte client nonce,
 *                                     HMAC(secret, "weft-store-v1 client" | sn | cn)]
 *                                     claim: i32 rank, i32 world (-1: unknown),
 *                                     u32 pid, key host  (who the client says it is)
 * Server -> client:            AUTH_OK [auth_required: HMAC(secret,
 *                                     "weft-store-v1 server" | sn | cn)]
 *                              or RESP with status WEFT_EAUTH, then close.
 * Until AUTH_OK a connection is pre-auth: it must finish within the read
 * timeout, and the oldest idle ones give way to new ones (docs/store.md).
 * Without a secret a request may also come first (no claim then).
 * Requests (client -> server), each answered by one RESP frame:
 *   SET      u32 reads, key, value            (reads: see WF_GET_CONSUME)
 *   GET      i32 timeout_ms, [PUT: u32 reads, key, value], u32 n, n keys
 *   ADD      key, i64 delta                  -> i64
 *   CHECK    u32 n, n keys                   -> u8 all present
 *   CAS      key, value expected, value desired -> value current
 *   DELETE   key                             -> u8 deleted
 *   NUM_KEYS                                 -> i64
 * RESP payload: i32 status, then the result when status == 0; for GET with
 * WEFT_ETIMEOUT/WEFT_EAGAIN: u32 count + u32 indices of the missing keys, then
 * optionally a u32-length note from the server (e.g. a client rejected for a
 * wrong secret); for other errors: a u32-length message.
 * A frame with a bad magic/version, an unknown op, a payload over the per-op
 * limit, or that does not parse, closes that connection only.
 */
#ifndef WF_STORE_PROTO_H
#define WF_STORE_PROTO_H

#include "weft.h"

#include <stddef.h>
#include <stdint.h>

#define WF_ST_MAGIC 0x57465354u     /* "WFST" */
#define WF_ST_VERSION 2          /* 2: AUTH always sent, with a claim */
#define WF_ST_HDR 16
#define WF_ST_NONCE 32
#define WF_ST_MAX_KEY 4096
#define WF_ST_MAX_NKEYS 65536
#define WF_ST_MAX_KEYBYTES (4u << 20)  /* all keys of one request */
#define WF_ST_MAX_HOST 255          /* host name in a claim */

enum {
  WF_OP_HELLO = 1, WF_OP_AUTH = 2, WF_OP_AUTH_OK = 3, WF_OP_SET = 4, WF_OP_GET = 5,
  WF_OP_ADD = 6, WF_OP_CHECK = 7, WF_OP_CAS = 8, WF_OP_DELETE = 9,
  WF_OP_NUM_KEYS = 10, WF_OP_RESP = 11
};

/* GET flags (header flags field). */
#define WF_GET_CONSUME 1u  /* a completed read counts against each key's budget */
#define WF_GET_NOVALUES 2u /* wait: answer only the status */
#define WF_GET_PUT 4u      /* set a key first: a gather is one round trip */
#define WF_GET_LIVE 8u     /* a slice of a liveness wait (store_live.c): a rank's
                            * death answers it at once with WEFT_EAGAIN */
#define WF_GET_GIVEUP 16u  /* with PUT, timeout 0 (a cpu group member giving up on
                            * a collective): keys all set -> answered as usual;
                            * else the ones set are deleted and the put key (the
                            * group's abort key) set, in one step, so a
                            * collective never completes for some members after
                            * another gave up on it */

/* SET flag: the key describes this connection's owner (store_live.c); when
 * the connection ends from the client's side while the key still exists,
 * the server sets "<key>/gone" to its value. */
#define WF_SET_LIVE 1u

/* Keys set with reads > 0 are deleted by the server once that many CONSUME
 * reads have completed (cpugroup's cleanup; see cpugroup.c). 0: kept. */

static inline void wf_put_u32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static inline void wf_put_u64(uint8_t *p, uint64_t v) {
  wf_put_u32(p, (uint32_t)(v >> 32)); wf_put_u32(p + 4, (uint32_t)v);
}
static inline uint32_t wf_get_u32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t wf_get_u64(const uint8_t *p) {
  return (uint64_t)wf_get_u32(p) << 32 | wf_get_u32(p + 4);
}

/* Bounds-checked reader over a payload: any overrun sets bad. */
typedef struct wf_rd { const uint8_t *p; size_t len, pos; int bad; } wf_rd;
static inline const uint8_t *wf_rd_take(wf_rd *r, size_t n) {
  if (r->bad || n > r->len - r->pos) { r->bad = 1; return NULL; }
  const uint8_t *q = r->p + r->pos;
  r->pos += n;
  return q;
}
static inline uint32_t wf_rd_u32(wf_rd *r) { const uint8_t *q = wf_rd_take(r, 4); return q ? wf_get_u32(q) : 0; }
static inline uint64_t wf_rd_u64(wf_rd *r) { const uint8_t *q = wf_rd_take(r, 8); return q ? wf_get_u64(q) : 0; }

/* ---- internal store calls for cpugroup.c (caller holds wf_store_lock) ---- */
typedef struct wf_get_req {
  const char *const *keys;  /* n keys to wait for */
  int n;
  int timeout_ms;           /* >0 wait, 0 poll */
  unsigned flags;           /* WF_GET_* */
  const char *put_key;      /* with WF_GET_PUT */
  const void *put_hdr;      /* sent before put_val, one value with it (cpugroup's */
  size_t put_hlen;          /* agreement word: no copy of the payload to prefix it) */
  const void *put_val;
  size_t put_len;
  uint32_t put_reads;
  const void **vals;        /* out, n entries (unless WF_GET_NOVALUES) */
  size_t *lens;
  int *missing;             /* out on ETIMEOUT/EAGAIN: indices, n entries */
  int nmissing;
  /* liveness (store_live.c; used when the handle is registered or an
   * interrupt is armed): the global rank that sets each key (NULL: any rank
   * of the world may), and a key whose presence aborts the wait (NULL:
   * none), which this rank sets itself when it is interrupted */
  const int *owners;
  const char *abort_key;
} wf_get_req;

/* Locks the handle; WEFT_ESTATE (with a message naming op) when closed. */
int wf_store_lock(weft_store *s, const char *op);
void wf_store_unlock(weft_store *s);
int wf_store_get_locked(weft_store *s, const char *op, wf_get_req *r);
int wf_store_set_locked(weft_store *s, const char *op, const char *key,
                        const void *val, size_t len, uint32_t reads);
int wf_store_delete_locked(weft_store *s, const char *op, const char *key);
int wf_store_add_locked(weft_store *s, const char *op, const char *key,
                        int64_t delta, int64_t *result);
int wf_store_default_timeout(weft_store *s);
/* The server's note on the last GET that timed out or was not ready ("" if
 * none): e.g. a client rejected for a wrong secret. For the caller's message. */
const char *wf_store_note(weft_store *s);
/* "rank R (pid P, host H[, stopped ...])", or "(never connected ...)", from
 * the rank's registration (store_live.c); just "rank R" when this handle is
 * not registered. For timeout messages. */
void wf_store_live_describe(weft_store *s, const char *op, int rank, char *buf, size_t n);

#endif
