/* store_internal.h — what the store's files share; nothing here is exported.
 *   store_proto.c   write buffers, frame header, field decoders, limits
 *   store_auth.c    challenge-response: nonces, HMAC proofs, both sides' checks
 *                   (pure: called by client and server, calls neither)
 *   store_server.c  the server thread: connections, requests, the loop; its
 *                   parts share store_server.h: store_table.c (key table,
 *                   total cap), store_waiters.c (parked GETs),
 *                   store_server_live.c (tombstones), store_frame_reader.c
 *   store_client.c  a handle's connection: connect, handshake, framed I/O
 *   store.c         the public weft_store_* API and cpugroup's locked calls
 *   store_thread.c  a connection of its own for each progress worker
 * Wire format and limits: store_proto.h. */
#ifndef WF_STORE_INTERNAL_H
#define WF_STORE_INTERNAL_H

#include "core/internal.h"
#include "store_proto.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* ---- store_proto.c: frames ---- */

/* Growable buffer; err sticks after a failed allocation until trimmed. */
typedef struct wf_store_wbuf { uint8_t *p; size_t len, cap; int err; } wf_store_wbuf;

void wf_store_wb_reserve(wf_store_wbuf *b, size_t extra);
void wf_store_wb_put(wf_store_wbuf *b, const void *d, size_t n);
void wf_store_wb_u8(wf_store_wbuf *b, uint8_t v);
void wf_store_wb_u32(wf_store_wbuf *b, uint32_t v);
void wf_store_wb_u64(wf_store_wbuf *b, uint64_t v);
void wf_store_wb_key(wf_store_wbuf *b, const void *k, size_t n);  /* u32 len + bytes */
void wf_store_wb_val(wf_store_wbuf *b, const void *v, size_t n);  /* u64 len + bytes */
void wf_store_wb_free(wf_store_wbuf *b);
/* Empties b for the next frame; a big buffer is released. */
void wf_store_wb_trim(wf_store_wbuf *b);
void wf_store_hdr_fill(uint8_t *h, int op, unsigned flags, uint64_t len);

/* A key inside a received payload (not NUL-terminated). */
typedef struct wf_store_kref { const uint8_t *p; uint32_t len; } wf_store_kref;
/* Field decoders: 0, or -1 when the field is malformed or over its limit. */
int wf_store_rd_key(wf_rd *r, wf_store_kref *k);
int wf_store_rd_val(wf_rd *r, size_t max, const uint8_t **p, size_t *n);

/* Who a client says it is (AUTH's claim); rank/world -1 when unknown. */
typedef struct wf_store_claim { int rank, world; uint32_t pid; char host[WF_ST_MAX_HOST + 1]; } wf_store_claim;
void wf_store_claim_self(wf_store_claim *c);                 /* this process */
void wf_store_wb_claim(wf_store_wbuf *b, const wf_store_claim *c);
int wf_store_rd_claim(wf_rd *r, wf_store_claim *c);          /* 0, or -1 malformed */
/* "rank 1 of 2, pid 4242 on node7" (or "pid 4242 on node7"). */
void wf_store_fmt_claim(char *out, size_t cap, const wf_store_claim *c);

size_t wf_store_env_max_value(void);  /* WEFT_STORE_MAX_VALUE, bounded */
/* "host:port", or "[host]:port" for IPv6 literals. */
void wf_store_fmt_where(char *out, size_t cap, const char *host, int port);

/* ---- store_server.c: the server thread ---- */

typedef struct wf_store_srv wf_store_srv;
/* Listens on bind_host:port (0: any free port, written to *actual_port) and
 * starts the thread; secret (may be NULL) must outlive the server. */
int wf_store_srv_start(const char *bind_host, int port, const char *secret, wf_store_srv **out,
                       int *actual_port);
void wf_store_srv_stop(wf_store_srv *v);  /* joins the thread, frees; NULL ok */
/* Registered ranks of other processes still connected (store.c's exit linger). */
int wf_store_srv_others(wf_store_srv *v);

/* ---- store_client.c: a handle and its connection ---- */

typedef struct wf_store_seg { const void *ext; size_t off, len; } wf_store_seg;  /* ext NULL: in rq */

struct weft_store {
  pthread_mutex_t mu;
  int refs;           /* atomic: the owner + each cpu group */
  int closed;
  int fd;
  char host[256];
  int port;
  char where[300];
  char *secret;
  int timeout_ms;
  size_t max_value;
  wf_store_srv *server;
  int64_t t0;         /* start of the current call, for messages */
  wf_store_wbuf rq;   /* request: header + small fields */
  wf_store_seg segs[8];
  int nseg;
  size_t mark;
  uint64_t ext_total;
  wf_store_wbuf resp; /* last reply; returned pointers point into it */
  int *mtmp;          /* missing-key indices of public gets */
  int ntmp;
  char note[600];     /* the server's note on the last unfinished GET */
  uint64_t instance;  /* the server met first: a reconnect must meet the same */
  int live_rank;      /* weft_store_register_rank, -1: not registered */
  int live_finished;  /* weft_store_finish: the leave's tombstone says "finished" */
  int live_world;
  char rank0[200];    /* "rank 0 (pid P, host H)", the store's host */
  char **live_reg;    /* [live_world] registration values seen (store_live.c) */
  int no_reconnect;   /* weft_store_wait_closed: a closed connection is the answer */
  int sibling;        /* a worker thread's own connection (store_thread.c): never
                         speaks for the rank (no registration, rebind or leave) */
  int64_t cap;        /* no request waits past this (0: none): a liveness wait or a
                       * diagnosis bounds its whole run, not each request (store_live.c) */
  int64_t unreachable; /* when a request last found the server unreachable (no reply,
                        * no connection); 0 once it answers again */
};

void wf_store_cl_drop(weft_store *s);
/* "the store at ADDR (rank 0, pid P, host H)" for messages. */
void wf_store_cl_describe(weft_store *s, char *buf, size_t n);
/* retry: keep trying with backoff until the deadline; otherwise one attempt. */
int wf_store_cl_connect(weft_store *s, const char *op, int64_t deadline, int retry);
int wf_store_cl_read_frame(weft_store *s, const char *op, int64_t deadline, int *fop, wf_rd *rd);
void wf_store_rq_begin(weft_store *s);
void wf_store_rq_ext(weft_store *s, const void *p, size_t n);  /* sent in place, not copied */
int wf_store_cl_send(weft_store *s, const char *op, int fop, unsigned flags, int64_t deadline);

/* Builds a request's payload into s->rq (and wf_store_rq_ext); the request
 * is sent, the reply read, and the whole retried once after a reconnect. */
typedef void (*wf_store_build_fn)(weft_store *s, const void *ctx);
int wf_store_cl_request(weft_store *s, const char *op, int fop, unsigned flags, int wait_ms,
                        wf_store_build_fn build, const void *ctx, int32_t *status, wf_rd *r);

/* ---- store_live.c: which ranks are gone ---- */

/* A GET, waited for in slices of WF_LIVE_SLICE_MS when the handle is
 * registered or an interrupt is armed; between slices, the owners of the
 * missing keys are checked for a tombstone, the abort key and the interrupt.
 * get_once: one plain GET whose timeout message says report_ms. */
#define WF_LIVE_SLICE_MS 200
/* A liveness wait or a diagnosis ends this long after its own deadline at
 * most (one round trip to a store that answers); a diagnosis right after
 * the store was found unreachable gives it WF_LIVE_RETRY_MS. */
#define WF_LIVE_RTT_MS 300
/* A liveness wait's last reply may come this late (the server answers at the
 * deadline; a loaded client thread reads it a moment later). */
#define WF_LIVE_WAIT_GRACE_MS 500
#define WF_LIVE_RETRY_MS 150
/* The store's host waits this long before reporting its own timed-out wait
 * (store_live.c) or Gloo call (gloo_shim.cc: the same figure). */
#define WF_LIVE_LINGER_MS 200
/* A process that exits serving a store others still use keeps serving up to
 * this long (store.c). */
#define WF_EXIT_LINGER_MS 500
typedef int (*wf_store_get_fn)(weft_store *s, const char *op, wf_get_req *q, int report_ms);
int wf_store_live_wait(weft_store *s, const char *op, wf_get_req *q, wf_store_get_fn get_once);
/* Re-announces a registered handle on a new connection (after a reconnect). */
int wf_store_live_rebind(weft_store *s, const char *op, int64_t deadline);
/* weft_store_close: a clean leave is no death (best effort, short). */
void wf_store_live_leave(weft_store *s);

/* ---- store_auth.c: challenge-response ---- */

void wf_store_random_bytes(uint8_t *p, size_t n);
int wf_store_auth_check(const char *secret, size_t slen, const uint8_t *sn, wf_rd *r,
                        uint8_t proof_out[32]);
/* Client side, as steps the client runs (no I/O in store_auth.c). */
typedef struct wf_store_auth_cl {
  int need;                   /* the server wants a secret */
  uint8_t sn[WF_ST_NONCE];    /* server nonce from HELLO */
  uint8_t cn[WF_ST_NONCE];    /* client nonce, chosen by prove */
  uint64_t instance;          /* which server process this is (0: not said) */
} wf_store_auth_cl;
enum { WF_AUTH_OK = 0, WF_AUTH_NOT_A_STORE, WF_AUTH_SECRET_MISSING, WF_AUTH_SERVER_HAS_NONE };
/* Reads HELLO's payload; WF_AUTH_* (both sides must agree on having a secret). */
int wf_store_auth_greet(wf_store_auth_cl *a, int have_secret, wf_rd *hello);
/* Appends the AUTH proof (client nonce, HMAC) to out. */
void wf_store_auth_prove(wf_store_auth_cl *a, const char *secret, wf_store_wbuf *out);
/* 0 when AUTH_OK's payload proves the server knows the secret, else -1. */
int wf_store_auth_verify(const wf_store_auth_cl *a, const char *secret, wf_rd *auth_ok);

#endif
