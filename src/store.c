/* store.c — TCP key-value rendezvous (the control plane's meeting point).
 *
 * The process that opens with is_server=1 runs the server in one background
 * pthread: non-blocking sockets, one poll() over the listener, a self-pipe
 * and every connection. Waits are server-side: a GET for absent keys parks
 * the connection until the keys are set or its deadline passes, so clients
 * never poll in loops. Every handle (the server's own included) is a client
 * with one blocking socket, guarded by a mutex, with a deadline on every
 * read and write. Wire format and limits: store_proto.h.
 */
#include "internal.h"
#include "sha256.h"
#include "store_proto.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define DEFAULT_TIMEOUT_MS 30000
#define DEFAULT_MAX_VALUE (256L << 20)
#define DEFAULT_READ_TIMEOUT_MS 10000
#define WAIT_GRACE_MS 5000          /* client waits this much past a server-side deadline */
#define BIG_BUFFER (16u << 20)      /* buffers above this are released between calls */

static const char AUTH_CLIENT[] = "weft-store-v1 client";
static const char AUTH_SERVER[] = "weft-store-v1 server";

/* ------------------------------------------------------------------ buffers */

typedef struct wbuf { uint8_t *p; size_t len, cap; int err; } wbuf;

static void wb_reserve(wbuf *b, size_t extra) {
  if (b->err) return;
  if (extra > SIZE_MAX / 2 - b->len) { b->err = 1; return; }
  size_t need = b->len + extra;
  if (need <= b->cap) return;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < need) cap *= 2;
  void *q = realloc(b->p, cap);
  if (!q) { b->err = 1; return; }
  b->p = q;
  b->cap = cap;
}
static void wb_put(wbuf *b, const void *d, size_t n) {
  wb_reserve(b, n);
  if (b->err) return;
  if (n) memcpy(b->p + b->len, d, n);
  b->len += n;
}
static void wb_u8(wbuf *b, uint8_t v) { wb_put(b, &v, 1); }
static void wb_u32(wbuf *b, uint32_t v) { uint8_t t[4]; wf_put_u32(t, v); wb_put(b, t, 4); }
static void wb_u64(wbuf *b, uint64_t v) { uint8_t t[8]; wf_put_u64(t, v); wb_put(b, t, 8); }
static void wb_key(wbuf *b, const void *k, size_t n) { wb_u32(b, (uint32_t)n); wb_put(b, k, n); }
static void wb_val(wbuf *b, const void *v, size_t n) { wb_u64(b, n); wb_put(b, v, n); }
static void wb_free(wbuf *b) { free(b->p); memset(b, 0, sizeof *b); }
static void wb_trim(wbuf *b) { if (b->cap > BIG_BUFFER) wb_free(b); b->len = 0; b->err = 0; }

static void hdr_fill(uint8_t *h, int op, unsigned flags, uint64_t len) {
  wf_put_u32(h, WF_ST_MAGIC);
  h[4] = WF_ST_VERSION;
  h[5] = (uint8_t)op;
  h[6] = (uint8_t)(flags >> 8);
  h[7] = (uint8_t)flags;
  wf_put_u64(h + 8, len);
}

static void random_bytes(uint8_t *p, size_t n) {
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

static size_t env_max_value(void) {
  long v = wf_env_long("WEFT_STORE_MAX_VALUE", DEFAULT_MAX_VALUE);
  if (v <= 0) v = DEFAULT_MAX_VALUE;
  if ((unsigned long)v > (1UL << 40)) v = (long)(1UL << 40);
  return (size_t)v;
}

static void fmt_where(char *out, size_t cap, const char *host, int port) {
  if (strchr(host, ':')) snprintf(out, cap, "[%s]:%d", host, port);
  else snprintf(out, cap, "%s:%d", host, port);
}

/* ================================================================== server */

typedef struct entry {
  struct entry *next;
  uint64_t h;
  uint8_t *key;
  uint32_t klen;
  uint32_t reads;     /* >0: consume-reads left before the key is deleted */
  uint8_t *val;
  size_t vlen;
} entry;

typedef struct kref { const uint8_t *p; uint32_t len; } kref;

enum { C_AUTH, C_READY, C_PARKED };

typedef struct conn {
  int fd, state, dead, close_after;
  uint8_t hdr[WF_ST_HDR];
  size_t hgot;
  int have_hdr;
  int op;
  unsigned flags;
  uint64_t plen;
  wbuf in;             /* payload of the frame being read (kept while parked) */
  int64_t rdeadline;   /* incomplete frame / handshake must progress by then */
  wbuf out;
  size_t out_off;
  int64_t wdeadline;
  kref *keys;          /* GET keys, pointing into in */
  int nkeys, capkeys;
  int cursor;          /* keys before it were present at the last look */
  unsigned gflags;
  int64_t pdeadline;   /* parked GET answers ETIMEOUT then */
  uint8_t snonce[WF_ST_NONCE];
} conn;

typedef struct srv {
  int lfd, wake[2];
  pthread_t th;
  int started;
  int stop;                     /* atomic */
  entry **tab;
  size_t nb, nent;
  conn **c;
  int nc, capc;
  struct pollfd *pfd;
  int cap_pfd;
  size_t max_value;
  int64_t read_to;
  const char *secret;           /* owned by the weft_store */
  size_t slen;
  int64_t accept_pause_until;
  char where[300];
} srv;

static uint64_t key_hash(const uint8_t *k, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) { h ^= k[i]; h *= 1099511628211ULL; }
  return h;
}

static entry **tab_slot(srv *v, const uint8_t *k, uint32_t n, uint64_t h) {
  entry **pp = &v->tab[h & (v->nb - 1)];
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->h == h && (*pp)->klen == n && memcmp((*pp)->key, k, n) == 0) break;
  return pp;
}

static entry *tab_find(srv *v, kref k) {
  return *tab_slot(v, k.p, k.len, key_hash(k.p, k.len));
}

static void entry_free(entry *e) {
  free(e->key);
  free(e->val);
  free(e);
}

static int tab_grow(srv *v) {
  size_t nb = v->nb * 2;
  entry **t = calloc(nb, sizeof *t);
  if (!t) return -1;
  for (size_t i = 0; i < v->nb; i++)
    for (entry *e = v->tab[i], *nx; e; e = nx) {
      nx = e->next;
      e->next = t[e->h & (nb - 1)];
      t[e->h & (nb - 1)] = e;
    }
  free(v->tab);
  v->tab = t;
  v->nb = nb;
  return 0;
}

/* Sets key to a copy of val; 0 ok, -1 out of memory. */
static int tab_set(srv *v, kref k, const void *val, size_t vlen, uint32_t reads) {
  uint64_t h = key_hash(k.p, k.len);
  entry **pp = tab_slot(v, k.p, k.len, h);
  uint8_t *copy = malloc(vlen ? vlen : 1);
  if (!copy) return -1;
  if (vlen) memcpy(copy, val, vlen);
  if (*pp) {
    free((*pp)->val);
    (*pp)->val = copy;
    (*pp)->vlen = vlen;
    (*pp)->reads = reads;
    return 0;
  }
  entry *e = calloc(1, sizeof *e);
  uint8_t *kc = malloc(k.len);
  if (!e || !kc) { free(e); free(kc); free(copy); return -1; }
  memcpy(kc, k.p, k.len);
  e->h = h; e->key = kc; e->klen = k.len; e->val = copy; e->vlen = vlen; e->reads = reads;
  e->next = NULL;
  *pp = e;
  v->nent++;
  if (v->nent > v->nb) tab_grow(v);  /* failure only costs speed */
  return 0;
}

static int tab_del(srv *v, kref k) {
  entry **pp = tab_slot(v, k.p, k.len, key_hash(k.p, k.len));
  if (!*pp) return 0;
  entry *e = *pp;
  *pp = e->next;
  entry_free(e);
  v->nent--;
  return 1;
}

static void conn_close(conn *c, const char *why) {
  if (c->dead) return;
  if (why) wf_log(1, "store server: closing a connection: %s", why);
  close(c->fd);
  c->fd = -1;
  c->dead = 1;
}

static void conn_flush(srv *v, conn *c) {
  while (!c->dead && c->out_off < c->out.len) {
    ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) { c->out_off += (size_t)n; c->wdeadline = wf_now_ms() + v->read_to; continue; }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    conn_close(c, "send failed");
    return;
  }
  if (c->dead) return;
  wb_trim(&c->out);
  c->out_off = 0;
  c->wdeadline = 0;
  if (c->close_after) conn_close(c, NULL);
}

/* Response framing: begin reserves the header, end fills it and sends. */
static void resp_begin(conn *c, int32_t status) {
  c->out.len = 0;
  c->out.err = 0;
  wb_reserve(&c->out, WF_ST_HDR);
  c->out.len = c->out.err ? 0 : WF_ST_HDR;
  wb_u32(&c->out, (uint32_t)status);
}

static void frame_end(srv *v, conn *c, int op) {
  if (c->out.err) { conn_close(c, "out of memory for a reply"); return; }
  hdr_fill(c->out.p, op, 0, c->out.len - WF_ST_HDR);
  c->out_off = 0;
  conn_flush(v, c);
}

static void resp_error(srv *v, conn *c, int32_t status, const char *msg) {
  resp_begin(c, status);
  wb_key(&c->out, msg, strlen(msg));
  frame_end(v, c, WF_OP_RESP);
}

static void resp_ok(srv *v, conn *c) { resp_begin(c, 0); frame_end(v, c, WF_OP_RESP); }

static int rd_key(wf_rd *r, kref *k) {
  k->len = wf_rd_u32(r);
  if (r->bad || k->len == 0 || k->len > WF_ST_MAX_KEY) return -1;
  k->p = wf_rd_take(r, k->len);
  return k->p ? 0 : -1;
}

static int rd_val(wf_rd *r, size_t max, const uint8_t **p, size_t *n) {
  uint64_t len = wf_rd_u64(r);
  if (r->bad || len > max) return -1;
  *n = (size_t)len;
  *p = wf_rd_take(r, *n);
  return (*p || *n == 0) && !r->bad ? 0 : -1;
}

/* ---- GET: answer now, or park until the keys exist ---- */

static int get_missing(srv *v, conn *c) {
  int m = 0;
  for (int i = 0; i < c->nkeys; i++) if (!tab_find(v, c->keys[i])) m++;
  return m;
}

/* Whether every key is present. The cursor makes re-checks on each wake-up
 * O(1) amortized per waiter (a barrier of n ranks costs O(n) per set, not
 * O(n^2)); a full pass confirms before answering, as keys can be deleted. */
static int get_complete(srv *v, conn *c) {
  while (c->cursor < c->nkeys && tab_find(v, c->keys[c->cursor])) c->cursor++;
  if (c->cursor < c->nkeys) return 0;
  for (int i = 0; i < c->nkeys; i++)
    if (!tab_find(v, c->keys[i])) { c->cursor = i; return 0; }
  return 1;
}

static void get_answer(srv *v, conn *c) {
  resp_begin(c, 0);
  if (!(c->gflags & WF_GET_NOVALUES)) {
    wb_u32(&c->out, (uint32_t)c->nkeys);
    for (int i = 0; i < c->nkeys; i++) {
      entry *e = tab_find(v, c->keys[i]);
      wb_val(&c->out, e->val, e->vlen);
    }
  }
  if (c->gflags & WF_GET_CONSUME)
    for (int i = 0; i < c->nkeys; i++) {
      entry *e = tab_find(v, c->keys[i]);
      if (e && e->reads > 0 && --e->reads == 0) tab_del(v, c->keys[i]);
    }
  c->state = C_READY;
  frame_end(v, c, WF_OP_RESP);
}

static void get_missing_answer(srv *v, conn *c, int32_t status) {
  resp_begin(c, status);
  wb_u32(&c->out, (uint32_t)get_missing(v, c));
  for (int i = 0; i < c->nkeys; i++) if (!tab_find(v, c->keys[i])) wb_u32(&c->out, (uint32_t)i);
  c->state = C_READY;
  frame_end(v, c, WF_OP_RESP);
}

/* A key appeared: answer every parked GET that is now complete. */
static void wake_waiters(srv *v) {
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (!c->dead && c->state == C_PARKED && get_complete(v, c)) get_answer(v, c);
  }
}

static int handle_get(srv *v, conn *c, wf_rd *r) {
  int32_t timeout = (int32_t)wf_rd_u32(r);
  int put = (c->flags & WF_GET_PUT) != 0;
  kref pk = {0};
  const uint8_t *pv = NULL;
  size_t pn = 0;
  uint32_t preads = 0;
  if (put) {
    preads = wf_rd_u32(r);
    if (rd_key(r, &pk) || rd_val(r, v->max_value, &pv, &pn)) return -1;
  }
  uint32_t n = wf_rd_u32(r);
  if (r->bad || n == 0 || n > WF_ST_MAX_NKEYS) return -1;
  if ((int)n > c->capkeys) {
    kref *k = realloc(c->keys, n * sizeof *k);
    if (!k) return -1;
    c->keys = k;
    c->capkeys = (int)n;
  }
  for (uint32_t i = 0; i < n; i++) if (rd_key(r, &c->keys[i])) return -1;
  if (r->pos != r->len) return -1;
  c->nkeys = (int)n;
  c->cursor = 0;
  c->gflags = c->flags;
  if (put) {
    if (tab_set(v, pk, pv, pn, preads)) { resp_error(v, c, WEFT_ENOMEM, "server out of memory"); return 0; }
    wake_waiters(v);
  }
  if (get_complete(v, c)) get_answer(v, c);
  else if (timeout <= 0) get_missing_answer(v, c, WEFT_EAGAIN);
  else {
    c->state = C_PARKED;
    c->pdeadline = wf_now_ms() + timeout;
  }
  return 0;
}

static int parse_i64(const uint8_t *p, size_t n, int64_t *out) {
  if (n == 0 || n > 20) return -1;
  char buf[24];
  memcpy(buf, p, n);
  buf[n] = '\0';
  char *end;
  errno = 0;
  long long x = strtoll(buf, &end, 10);
  if (errno || *end || end == buf) return -1;
  *out = x;
  return 0;
}

static int handle_frame(srv *v, conn *c) {
  wf_rd r = {c->in.p, c->in.len, 0, 0};
  kref k;
  const uint8_t *a, *b;
  size_t an, bn;
  switch (c->op) {
  case WF_OP_AUTH: {
    const uint8_t *cn = wf_rd_take(&r, WF_ST_NONCE), *mac = wf_rd_take(&r, 32);
    if (!cn || !mac || r.pos != r.len) return -1;
    uint8_t want[32];
    auth_mac(v->secret, v->slen, AUTH_CLIENT, c->snonce, cn, want);
    if (!wf_ct_equal(want, mac, 32)) {
      wf_log(1, "store server: rejected a client with a wrong secret");
      c->close_after = 1;
      resp_error(v, c, WEFT_EAUTH, "the secrets differ");
      return 0;
    }
    c->state = C_READY;
    c->rdeadline = 0;
    c->out.len = 0;
    wb_reserve(&c->out, WF_ST_HDR);
    c->out.len = c->out.err ? 0 : WF_ST_HDR;
    auth_mac(v->secret, v->slen, AUTH_SERVER, c->snonce, cn, want);
    wb_put(&c->out, want, 32);
    frame_end(v, c, WF_OP_AUTH_OK);
    return 0;
  }
  case WF_OP_SET: {
    uint32_t reads = wf_rd_u32(&r);
    if (rd_key(&r, &k) || rd_val(&r, v->max_value, &a, &an) || r.pos != r.len) return -1;
    if (tab_set(v, k, a, an, reads)) { resp_error(v, c, WEFT_ENOMEM, "server out of memory"); return 0; }
    resp_ok(v, c);
    wake_waiters(v);
    return 0;
  }
  case WF_OP_GET:
    return handle_get(v, c, &r);
  case WF_OP_ADD: {
    if (rd_key(&r, &k)) return -1;
    int64_t delta = (int64_t)wf_rd_u64(&r), cur = 0;
    if (r.bad || r.pos != r.len) return -1;
    entry *e = tab_find(v, k);
    if (e && parse_i64(e->val, e->vlen, &cur)) {
      resp_error(v, c, WEFT_EINVAL, "the key holds a value that is not an integer");
      return 0;
    }
    if ((delta > 0 && cur > INT64_MAX - delta) || (delta < 0 && cur < INT64_MIN - delta)) {
      resp_error(v, c, WEFT_EINVAL, "int64 overflow");
      return 0;
    }
    cur += delta;
    char num[24];
    int len = snprintf(num, sizeof num, "%lld", (long long)cur);
    if (tab_set(v, k, num, (size_t)len, 0)) { resp_error(v, c, WEFT_ENOMEM, "server out of memory"); return 0; }
    resp_begin(c, 0);
    wb_u64(&c->out, (uint64_t)cur);
    frame_end(v, c, WF_OP_RESP);
    if (!e) wake_waiters(v);
    return 0;
  }
  case WF_OP_CHECK: {
    uint32_t n = wf_rd_u32(&r);
    if (r.bad || n > WF_ST_MAX_NKEYS) return -1;
    int all = 1;
    for (uint32_t i = 0; i < n; i++) {
      if (rd_key(&r, &k)) return -1;
      if (!tab_find(v, k)) all = 0;
    }
    if (r.pos != r.len) return -1;
    resp_begin(c, 0);
    wb_u8(&c->out, (uint8_t)all);
    frame_end(v, c, WF_OP_RESP);
    return 0;
  }
  case WF_OP_CAS: {
    if (rd_key(&r, &k) || rd_val(&r, v->max_value, &a, &an) ||
        rd_val(&r, v->max_value, &b, &bn) || r.pos != r.len)
      return -1;
    entry *e = tab_find(v, k);
    int swap = e ? (e->vlen == an && memcmp(e->val, a, an) == 0) : an == 0;
    if (swap) {
      if (tab_set(v, k, b, bn, 0)) { resp_error(v, c, WEFT_ENOMEM, "server out of memory"); return 0; }
      e = tab_find(v, k);
    }
    resp_begin(c, 0);
    if (e) wb_val(&c->out, e->val, e->vlen);
    else wb_val(&c->out, NULL, 0);  /* absent and not created: empty */
    frame_end(v, c, WF_OP_RESP);
    if (swap) wake_waiters(v);
    return 0;
  }
  case WF_OP_DELETE: {
    if (rd_key(&r, &k) || r.pos != r.len) return -1;
    int d = tab_del(v, k);
    resp_begin(c, 0);
    wb_u8(&c->out, (uint8_t)d);
    frame_end(v, c, WF_OP_RESP);
    return 0;
  }
  case WF_OP_NUM_KEYS:
    if (r.len != 0) return -1;
    resp_begin(c, 0);
    wb_u64(&c->out, (uint64_t)v->nent);
    frame_end(v, c, WF_OP_RESP);
    return 0;
  }
  return -1;
}

/* Largest payload each op may declare; anything above closes the connection
 * before a byte of it is buffered. */
static uint64_t op_limit(srv *v, int state, int op) {
  uint64_t key = 4 + WF_ST_MAX_KEY, keys = 4 + WF_ST_MAX_KEYBYTES + 4ull * WF_ST_MAX_NKEYS;
  if (state == C_AUTH) return op == WF_OP_AUTH ? 2 * WF_ST_NONCE : 0;
  switch (op) {
  case WF_OP_SET: return 4 + key + 8 + v->max_value;
  case WF_OP_GET: return 4 + 4 + key + 8 + v->max_value + keys;
  case WF_OP_ADD: return key + 8;
  case WF_OP_CHECK: return keys;
  case WF_OP_CAS: return key + 16 + 2ull * v->max_value;
  case WF_OP_DELETE: return key;
  case WF_OP_NUM_KEYS: return 0;
  default: return UINT64_MAX;  /* not a request op */
  }
}

static void conn_read(srv *v, conn *c) {
  if (c->out.len) return;  /* a reply is still going out */
  if (c->state == C_PARKED) {
    /* A parked client only waits; bytes or EOF here end the connection. */
    uint8_t b;
    ssize_t n = recv(c->fd, &b, 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    conn_close(c, n > 0 ? "data from a client that is waiting" : NULL);
    return;
  }
  size_t budget = 8u << 20;  /* fairness between connections */
  while (!c->dead && budget > 0) {
    if (!c->have_hdr) {
      ssize_t n = recv(c->fd, c->hdr + c->hgot, WF_ST_HDR - c->hgot, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) { conn_close(c, c->hgot ? "connection ended inside a frame" : NULL); return; }
      c->hgot += (size_t)n;
      if (c->state == C_READY) c->rdeadline = wf_now_ms() + v->read_to;
      if (c->hgot < WF_ST_HDR) continue;
      c->op = c->hdr[5];
      c->flags = (unsigned)c->hdr[6] << 8 | c->hdr[7];
      c->plen = wf_get_u64(c->hdr + 8);
      if (wf_get_u32(c->hdr) != WF_ST_MAGIC || c->hdr[4] != WF_ST_VERSION) {
        conn_close(c, "bad magic or version (not a weft store client?)");
        return;
      }
      uint64_t lim = op_limit(v, c->state, c->op);
      if (lim == UINT64_MAX || (c->state == C_AUTH && c->op != WF_OP_AUTH)) {
        conn_close(c, "unexpected frame type");
        return;
      }
      if (c->plen > lim) {
        wf_log(1, "store server: frame of %llu bytes over the limit of %llu (WEFT_STORE_MAX_VALUE)",
               (unsigned long long)c->plen, (unsigned long long)lim);
        conn_close(c, "oversized frame");
        return;
      }
      c->have_hdr = 1;
      c->in.len = 0;
      c->in.err = 0;
    }
    if (c->in.len < c->plen) {
      size_t want = (size_t)c->plen - c->in.len;
      if (c->in.cap - c->in.len < want) {
        /* Grow with what arrives, not with what the header claims. */
        size_t step = c->in.cap > (64u << 10) ? c->in.cap : (64u << 10);
        wb_reserve(&c->in, want < step ? want : step);
        if (c->in.err) { conn_close(c, "out of memory for a frame"); return; }
      }
      size_t room = c->in.cap - c->in.len;
      if (room > want) room = want;
      if (room > budget) room = budget;
      ssize_t n = recv(c->fd, c->in.p + c->in.len, room, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) { conn_close(c, "connection ended inside a frame"); return; }
      c->in.len += (size_t)n;
      budget -= (size_t)n;
      if (c->state == C_READY) c->rdeadline = wf_now_ms() + v->read_to;
      if (c->in.len < c->plen) continue;
    }
    c->have_hdr = 0;
    c->hgot = 0;
    if (c->state == C_READY) c->rdeadline = 0;
    if (handle_frame(v, c) < 0) { conn_close(c, "malformed frame"); return; }
    if (c->state != C_PARKED) wb_trim(&c->in);
    if (c->dead || c->state == C_PARKED || c->out.len) return;
  }
}

static void srv_accept(srv *v) {
  for (;;) {
    int fd = accept4(v->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        wf_log(1, "store server: accept: %s; pausing accepts", strerror(errno));
        v->accept_pause_until = wf_now_ms() + 100;
      }
      return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    conn *c = calloc(1, sizeof *c);
    if (c && v->nc == v->capc) {
      int cap = v->capc ? v->capc * 2 : 16;
      conn **nc = realloc(v->c, (size_t)cap * sizeof *nc);
      if (nc) { v->c = nc; v->capc = cap; }
    }
    if (!c || v->nc == v->capc) { free(c); close(fd); continue; }
    c->fd = fd;
    c->state = v->slen ? C_AUTH : C_READY;
    if (v->slen) c->rdeadline = wf_now_ms() + v->read_to;  /* handshake must finish */
    random_bytes(c->snonce, sizeof c->snonce);
    v->c[v->nc++] = c;
    wb_reserve(&c->out, WF_ST_HDR);
    c->out.len = c->out.err ? 0 : WF_ST_HDR;
    wb_u8(&c->out, v->slen ? 1 : 0);
    wb_put(&c->out, c->snonce, WF_ST_NONCE);
    frame_end(v, c, WF_OP_HELLO);
  }
}

static void conn_free(conn *c) {
  if (!c->dead) close(c->fd);
  wb_free(&c->in);
  wb_free(&c->out);
  free(c->keys);
  free(c);
}

static void srv_expire(srv *v, int64_t now) {
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (c->dead) continue;
    if (c->state == C_PARKED && c->pdeadline <= now) get_missing_answer(v, c, WEFT_ETIMEOUT);
    else if (c->rdeadline && c->rdeadline <= now)
      conn_close(c, c->state == C_AUTH ? "handshake timed out" : "incomplete frame timed out");
    else if (c->wdeadline && c->wdeadline <= now) conn_close(c, "client is not reading");
  }
  int j = 0;
  for (int i = 0; i < v->nc; i++) {
    if (v->c[i]->dead) conn_free(v->c[i]);
    else v->c[j++] = v->c[i];
  }
  v->nc = j;
}

static int64_t earliest(int64_t a, int64_t b) { return (a == 0 || (b != 0 && b < a)) ? b : a; }

static void *srv_main(void *arg) {
  srv *v = arg;
  while (!__atomic_load_n(&v->stop, __ATOMIC_ACQUIRE)) {
    if (v->cap_pfd < v->nc + 2) {
      int cap = (v->nc + 2) * 2;
      struct pollfd *p = realloc(v->pfd, (size_t)cap * sizeof *p);
      if (!p) { wf_backoff(&(int){100000}, 100000); continue; }
      v->pfd = p;
      v->cap_pfd = cap;
    }
    int64_t now = wf_now_ms(), next = 0;
    v->pfd[0] = (struct pollfd){.fd = v->wake[0], .events = POLLIN};
    int paused = v->accept_pause_until > now;
    v->pfd[1] = (struct pollfd){.fd = paused ? -1 : v->lfd, .events = POLLIN};
    if (paused) next = v->accept_pause_until;
    int n = v->nc;
    for (int i = 0; i < n; i++) {
      conn *c = v->c[i];
      int sending = c->out.len > 0;
      v->pfd[i + 2] = (struct pollfd){.fd = c->fd, .events = sending ? POLLOUT : POLLIN};
      if (c->state == C_PARKED) next = earliest(next, c->pdeadline);
      next = earliest(next, c->rdeadline);
      if (sending) next = earliest(next, c->wdeadline);
    }
    int timeout = next == 0 ? -1 : (next <= now ? 0 : (int)(next - now > 60000 ? 60000 : next - now));
    int r = poll(v->pfd, (nfds_t)n + 2, timeout);
    if (r < 0 && errno != EINTR) {
      wf_log(1, "store server: poll: %s", strerror(errno));
      wf_backoff(&(int){10000}, 10000);
      continue;
    }
    if (r > 0) {
      if (v->pfd[0].revents) {
        char buf[64];
        while (read(v->wake[0], buf, sizeof buf) > 0) {}
      }
      for (int i = 0; i < n; i++) {
        conn *c = v->c[i];
        short re = v->pfd[i + 2].revents;
        if (!re || c->dead) continue;
        if ((re & POLLOUT) || c->out.len) conn_flush(v, c);  /* errors surface in send */
        else conn_read(v, c);
      }
      if (v->pfd[1].revents) srv_accept(v);
    }
    srv_expire(v, wf_now_ms());
  }
  return NULL;
}

static void srv_free(srv *v) {
  if (!v) return;
  for (int i = 0; i < v->nc; i++) conn_free(v->c[i]);
  free(v->c);
  free(v->pfd);
  if (v->tab)
    for (size_t i = 0; i < v->nb; i++)
      for (entry *e = v->tab[i], *nx; e; e = nx) { nx = e->next; entry_free(e); }
  free(v->tab);
  if (v->lfd >= 0) close(v->lfd);
  if (v->wake[0] >= 0) close(v->wake[0]);
  if (v->wake[1] >= 0) close(v->wake[1]);
  free(v);
}

static void srv_stop(srv *v) {
  if (!v) return;
  if (v->started) {
    __atomic_store_n(&v->stop, 1, __ATOMIC_RELEASE);
    char b = 1;
    while (write(v->wake[1], &b, 1) < 0 && errno == EINTR) {}
    pthread_join(v->th, NULL);
  }
  srv_free(v);
}

static int srv_start(const char *bind_host, int port, const char *secret, srv **out,
                     int *actual_port) {
  char where[300], portstr[16];
  fmt_where(where, sizeof where, bind_host, port);
  srv *v = calloc(1, sizeof *v);
  if (!v) return wf_error(WEFT_ENOMEM, "store open: out of memory for the server");
  v->lfd = v->wake[0] = v->wake[1] = -1;
  v->nb = 64;
  v->tab = calloc(v->nb, sizeof *v->tab);
  v->max_value = env_max_value();
  v->read_to = wf_env_long("WEFT_STORE_READ_TIMEOUT_MS", DEFAULT_READ_TIMEOUT_MS);
  if (v->read_to <= 0) v->read_to = DEFAULT_READ_TIMEOUT_MS;
  v->secret = secret;
  v->slen = secret ? strlen(secret) : 0;
  if (!v->tab) { srv_free(v); return wf_error(WEFT_ENOMEM, "store open: out of memory for the server"); }

  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *ai = NULL;
  snprintf(portstr, sizeof portstr, "%d", port);
  int g = getaddrinfo(bind_host, portstr, &hints, &ai);
  if (g) {
    srv_free(v);
    return wf_error(WEFT_ESYS, "store open: cannot resolve bind address %s: %s", where, gai_strerror(g));
  }
  int err = 0;
  for (struct addrinfo *a = ai; a && v->lfd < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) { err = errno; continue; }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) { v->lfd = fd; break; }
    err = errno;
    close(fd);
  }
  freeaddrinfo(ai);
  if (v->lfd < 0) {
    srv_free(v);
    errno = err;
    if (err == EADDRINUSE)
      return wf_error(WEFT_ESYS, "store open: cannot listen on %s: address already in use "
                                 "(another store running? choose another port)", where);
    return wf_error_errno(WEFT_ESYS, "store open: cannot listen on %s", where);
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(v->lfd, (struct sockaddr *)&ss, &sl) == 0)
    *actual_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                  : ((struct sockaddr_in *)&ss)->sin_port);
  fmt_where(v->where, sizeof v->where, bind_host, *actual_port);
  if (pipe2(v->wake, O_NONBLOCK | O_CLOEXEC) < 0) {
    srv_free(v);
    return wf_error_errno(WEFT_ESYS, "store open: self-pipe for the server");
  }
  /* The server thread takes no signals: they stay with the application. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int pe = pthread_create(&v->th, NULL, srv_main, v);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (pe) {
    srv_free(v);
    errno = pe;
    return wf_error_errno(WEFT_ESYS, "store open: cannot start the server thread");
  }
  v->started = 1;
  wf_log(1, "store server: listening on %s", v->where);
  *out = v;
  return 0;
}

/* ================================================================== client */

typedef struct seg { const void *ext; size_t off, len; } seg;  /* ext NULL: in the wbuf */

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
  srv *server;
  int64_t t0;         /* start of the current call, for messages */
  wbuf rq;            /* request: header + small fields */
  seg segs[8];
  int nseg;
  size_t mark;
  uint64_t ext_total;
  wbuf resp;          /* last reply; returned pointers point into it */
  int *mtmp;          /* missing-key indices of public gets */
  int ntmp;
};

static void cl_drop(weft_store *s) {
  if (s->fd >= 0) close(s->fd);
  s->fd = -1;
}

static int64_t ms_left(int64_t deadline) {
  int64_t l = deadline - wf_now_ms();
  return l < 0 ? 0 : l;
}

/* 1 ready, 0 deadline passed, -1 error (errno). */
static int wait_fd(int fd, short ev, int64_t deadline) {
  for (;;) {
    struct pollfd p = {.fd = fd, .events = ev};
    int64_t left = ms_left(deadline);
    int r = poll(&p, 1, left > 600000 ? 600000 : (int)left);
    if (r > 0) return 1;
    if (r == 0 && wf_now_ms() >= deadline) return 0;
    if (r < 0 && errno != EINTR) return -1;
  }
}

static int io_error(weft_store *s, const char *op, int saved_errno, int timed_out) {
  cl_drop(s);
  if (timed_out)
    return wf_error(WEFT_ETIMEOUT, "%s: no reply from the server at %s within %lld ms",
                    op, s->where, (long long)(wf_now_ms() - s->t0));
  if (saved_errno == 0 || saved_errno == ECONNRESET || saved_errno == EPIPE ||
      saved_errno == ENOTCONN || saved_errno == ESHUTDOWN)
    return wf_error(WEFT_ECLOSED, "%s: the server at %s closed the connection (store gone?)",
                    op, s->where);
  errno = saved_errno;
  return wf_error_errno(WEFT_ESYS, "%s: connection to %s", op, s->where);
}

static int cl_recv_all(weft_store *s, const char *op, void *buf, size_t n, int64_t deadline) {
  uint8_t *p = buf;
  while (n > 0) {
    int w = wait_fd(s->fd, POLLIN, deadline);
    if (w <= 0) return io_error(s, op, errno, w == 0);
    ssize_t r = recv(s->fd, p, n, MSG_DONTWAIT);
    if (r > 0) { p += r; n -= (size_t)r; continue; }
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return io_error(s, op, r == 0 ? 0 : errno, 0);
  }
  return 0;
}

/* Reads one frame into s->resp; *op and a reader over the payload. */
static int cl_read_frame(weft_store *s, const char *op, int64_t deadline, int *fop, wf_rd *rd) {
  uint8_t h[WF_ST_HDR];
  int rc = cl_recv_all(s, op, h, sizeof h, deadline);
  if (rc) return rc;
  if (wf_get_u32(h) != WF_ST_MAGIC || h[4] != WF_ST_VERSION) {
    cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: %s is not a weft store of protocol version %d",
                    op, s->where, WF_ST_VERSION);
  }
  uint64_t len = wf_get_u64(h + 8);
  if (len > SIZE_MAX / 4) {
    cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: reply of %llu bytes from %s", op, (unsigned long long)len, s->where);
  }
  s->resp.len = 0;
  s->resp.err = 0;
  wb_reserve(&s->resp, (size_t)len);
  if (s->resp.err) {
    cl_drop(s);
    return wf_error(WEFT_ENOMEM, "%s: no memory for a reply of %llu bytes", op, (unsigned long long)len);
  }
  rc = cl_recv_all(s, op, s->resp.p, (size_t)len, deadline);
  if (rc) return rc;
  s->resp.len = (size_t)len;
  *fop = h[5];
  *rd = (wf_rd){s->resp.p, s->resp.len, 0, 0};
  return 0;
}

/* Request building: small fields go into s->rq, large values are referenced
 * in place (no copy of a 256 MiB value). */
static void rq_begin(weft_store *s) {
  wb_trim(&s->rq);
  wb_reserve(&s->rq, WF_ST_HDR);
  s->rq.len = s->rq.err ? 0 : WF_ST_HDR;
  s->nseg = 0;
  s->mark = 0;
  s->ext_total = 0;
}
static void rq_cut(weft_store *s) {
  if (s->rq.len > s->mark) s->segs[s->nseg++] = (seg){NULL, s->mark, s->rq.len - s->mark};
  s->mark = s->rq.len;
}
static void rq_ext(weft_store *s, const void *p, size_t n) {
  if (n == 0) return;
  rq_cut(s);
  s->segs[s->nseg++] = (seg){p, 0, n};
  s->ext_total += n;
}

static int cl_send(weft_store *s, const char *op, int fop, unsigned flags, int64_t deadline) {
  rq_cut(s);
  if (s->rq.err) return wf_error(WEFT_ENOMEM, "%s: out of memory for a request", op);
  hdr_fill(s->rq.p, fop, flags, s->rq.len - WF_ST_HDR + s->ext_total);
  struct iovec iov[8];
  int n = s->nseg, i0 = 0;
  for (int i = 0; i < n; i++)
    iov[i] = (struct iovec){(void *)(s->segs[i].ext ? s->segs[i].ext : s->rq.p + s->segs[i].off),
                            s->segs[i].len};
  while (i0 < n) {
    int w = wait_fd(s->fd, POLLOUT, deadline);
    if (w <= 0) return io_error(s, op, errno, w == 0);
    struct msghdr mh = {.msg_iov = iov + i0, .msg_iovlen = (size_t)(n - i0)};
    ssize_t r = sendmsg(s->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return io_error(s, op, errno, 0);
    }
    size_t done = (size_t)r;
    while (i0 < n && done >= iov[i0].iov_len) done -= iov[i0++].iov_len;
    if (i0 < n) { iov[i0].iov_base = (uint8_t *)iov[i0].iov_base + done; iov[i0].iov_len -= done; }
  }
  return 0;
}

static int cl_handshake(weft_store *s, const char *op, int64_t deadline) {
  int fop;
  wf_rd r;
  int rc = cl_read_frame(s, op, deadline, &fop, &r);
  if (rc) return rc;
  const uint8_t *auth = wf_rd_take(&r, 1), *sn = wf_rd_take(&r, WF_ST_NONCE);
  if (fop != WF_OP_HELLO || !auth || !sn) {
    cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: %s did not greet like a weft store", op, s->where);
  }
  int need = auth[0] != 0;
  if (need && !s->secret) {
    cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s requires a secret and none was given "
                                "(set WEFT_STORE_SECRET or the secret option)", op, s->where);
  }
  if (!need && s->secret) {
    cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s uses no secret but this client has one; "
                                "refusing an unauthenticated server", op, s->where);
  }
  if (!need) return 0;
  uint8_t snonce[WF_ST_NONCE], cn[WF_ST_NONCE], mac[32], want[32];
  memcpy(snonce, sn, sizeof snonce);
  random_bytes(cn, sizeof cn);
  size_t slen = strlen(s->secret);
  auth_mac(s->secret, slen, AUTH_CLIENT, snonce, cn, mac);
  rq_begin(s);
  wb_put(&s->rq, cn, sizeof cn);
  wb_put(&s->rq, mac, sizeof mac);
  if ((rc = cl_send(s, op, WF_OP_AUTH, 0, deadline))) return rc;
  if ((rc = cl_read_frame(s, op, deadline, &fop, &r))) {
    if (rc == WEFT_ECLOSED) goto rejected;
    return rc;
  }
  if (fop == WF_OP_RESP) {
  rejected:
    cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s rejected this client: the secrets differ "
                                "(check WEFT_STORE_SECRET on every rank)", op, s->where);
  }
  const uint8_t *proof = wf_rd_take(&r, 32);
  auth_mac(s->secret, slen, AUTH_SERVER, snonce, cn, want);
  if (fop != WF_OP_AUTH_OK || !proof || !wf_ct_equal(proof, want, 32)) {
    cl_drop(s);
    return wf_error(WEFT_EAUTH, "%s: the store at %s could not prove it knows the secret", op, s->where);
  }
  return 0;
}

/* One connection attempt (all resolved addresses); 0 or an errno. */
static int cl_try_connect(weft_store *s, int64_t deadline, const char **detail) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_NUMERICSERV}, *ai = NULL;
  char portstr[16];
  snprintf(portstr, sizeof portstr, "%d", s->port);
  int g = getaddrinfo(s->host, portstr, &hints, &ai);
  if (g) { *detail = gai_strerror(g); return EHOSTUNREACH; }
  int err = ECONNREFUSED;
  *detail = NULL;
  for (struct addrinfo *a = ai; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) { err = errno; continue; }
    int r = connect(fd, a->ai_addr, a->ai_addrlen);
    if (r < 0 && errno == EINPROGRESS) {
      int w = wait_fd(fd, POLLOUT, deadline);
      socklen_t el = sizeof err;
      if (w <= 0) { err = w == 0 ? ETIMEDOUT : errno; r = -1; }
      else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0 || err) r = -1;
      else r = 0;
    } else if (r < 0) err = errno;
    if (r == 0) {
      int one = 1, fl = fcntl(fd, F_GETFL);
      fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);  /* blocking; every wait polls first */
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      freeaddrinfo(ai);
      s->fd = fd;
      return 0;
    }
    close(fd);
  }
  freeaddrinfo(ai);
  return err;
}

/* retry: keep trying with backoff until the deadline (open); otherwise one
 * attempt (a reconnect after a lost connection: a refusal means gone). */
static int cl_connect(weft_store *s, const char *op, int64_t deadline, int retry) {
  int us = 0, attempts = 0;
  for (;;) {
    const char *detail = NULL;
    int err = cl_try_connect(s, deadline, &detail);
    attempts++;
    if (err == 0) {
      int rc = cl_handshake(s, op, deadline);
      if (rc == 0) return 0;
      if (rc != WEFT_ECLOSED || !retry) return rc;  /* auth/protocol: final */
      detail = "closed during the handshake";
    }
    char why[160];
    snprintf(why, sizeof why, "%s", detail ? detail : strerror(err));
    if (!retry)
      return wf_error(WEFT_ECLOSED, "%s: cannot reach the store at %s (%s)", op, s->where, why);
    if (wf_now_ms() >= deadline)
      return wf_error(WEFT_ETIMEOUT, "%s: could not connect to the store at %s within %lld ms "
                                     "after %d attempts (last error: %s)",
                      op, s->where, (long long)(deadline - s->t0), attempts, why);
    int max_us = (int)(ms_left(deadline) * 1000 < 200000 ? ms_left(deadline) * 1000 + 1 : 200000);
    wf_backoff(&us, max_us);
  }
}

/* Sends the built request and reads the reply. Returns 0 with *status and a
 * reader positioned after it for status 0, ETIMEOUT and EAGAIN; other server
 * statuses become errors carrying the server's message. */
static int cl_call(weft_store *s, const char *op, int fop, unsigned flags, int64_t deadline,
                   int32_t *status, wf_rd *r) {
  if (s->fd < 0) {
    int rc = cl_connect(s, op, deadline, 0);
    if (rc) return rc;
    /* handshake may have used rq: the caller's request is rebuilt by retrying */
    return 1;
  }
  int rc = cl_send(s, op, fop, flags, deadline);
  if (rc) return rc;
  int rop;
  if ((rc = cl_read_frame(s, op, deadline, &rop, r))) return rc;
  *status = (int32_t)wf_rd_u32(r);
  if (rop != WF_OP_RESP || r->bad) {
    cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: unexpected reply from %s", op, s->where);
  }
  if (*status == 0 || *status == WEFT_ETIMEOUT || *status == WEFT_EAGAIN) return 0;
  uint32_t ml = wf_rd_u32(r);
  const uint8_t *m = wf_rd_take(r, ml);
  return wf_error(*status < 0 ? *status : WEFT_EPROTO, "%s: %.*s (store at %s)", op,
                  m ? (int)(ml > 400 ? 400 : ml) : 0, m ? (const char *)m : "", s->where);
}

static int64_t deadline_for(weft_store *s, int wait_ms) {
  s->t0 = wf_now_ms();
  return s->t0 + (wait_ms > 0 ? (int64_t)wait_ms + WAIT_GRACE_MS : s->timeout_ms);
}

/* Builders per operation; the call is retried once after a reconnect. */
typedef void (*build_fn)(weft_store *s, const void *ctx);

static int cl_request(weft_store *s, const char *op, int fop, unsigned flags, int wait_ms,
                      build_fn build, const void *ctx, int32_t *status, wf_rd *r) {
  int64_t deadline = deadline_for(s, wait_ms);
  wb_trim(&s->resp);
  for (int attempt = 0;; attempt++) {
    rq_begin(s);
    build(s, ctx);
    int rc = cl_call(s, op, fop, flags, deadline, status, r);
    if (rc != 1) return rc;
    if (attempt > 0) return wf_error(WEFT_ECLOSED, "%s: lost the store at %s", op, s->where);
  }
}

/* ---- argument checks ---- */

static int check_key(const char *op, const char *key) {
  if (!key) return wf_error(WEFT_EINVAL, "%s: key is NULL", op);
  size_t n = strnlen(key, WF_ST_MAX_KEY + 1);
  if (n == 0) return wf_error(WEFT_EINVAL, "%s: empty key", op);
  if (n > WF_ST_MAX_KEY)
    return wf_error(WEFT_EINVAL, "%s: key '%.40s...' is longer than %d bytes", op, key, WF_ST_MAX_KEY);
  return 0;
}

static int check_value(weft_store *s, const char *op, const char *key, const void *v, size_t n) {
  if (!v && n) return wf_error(WEFT_EINVAL, "%s: value is NULL with length %zu", op, n);
  if (n > s->max_value)
    return wf_error(WEFT_EINVAL, "%s: value of %zu bytes for key '%.80s' exceeds the limit of %zu "
                                 "bytes (WEFT_STORE_MAX_VALUE)", op, n, key, s->max_value);
  return 0;
}

static int check_keys(const char *op, const char *const *keys, int n) {
  if (!keys || n <= 0 || n > WF_ST_MAX_NKEYS)
    return wf_error(WEFT_EINVAL, "%s: need 1..%d keys, got %d", op, WF_ST_MAX_NKEYS, keys ? n : 0);
  size_t total = 0;
  for (int i = 0; i < n; i++) {
    int rc = check_key(op, keys[i]);
    if (rc) return rc;
    total += strlen(keys[i]);
  }
  if (total > WF_ST_MAX_KEYBYTES)
    return wf_error(WEFT_EINVAL, "%s: %zu bytes of keys in one request (limit %u)", op, total,
                    WF_ST_MAX_KEYBYTES);
  return 0;
}

/* "'a', 'b'" for messages: at most 8 keys, each cut at 80 bytes. */
static void fmt_keys(char *out, size_t cap, const char *const *keys, const int *idx, int n) {
  size_t len = 0;
  out[0] = '\0';
  for (int i = 0; i < n && len + 1 < cap; i++) {
    if (i == 8) { snprintf(out + len, cap - len, " and %d more", n - 8); return; }
    const char *k = keys[idx ? idx[i] : i];
    int w = snprintf(out + len, cap - len, "%s'%.80s%s'", i ? ", " : "", k, strlen(k) > 80 ? "..." : "");
    if (w < 0) return;
    len += (size_t)w;
  }
}

/* ---- lock / lifetime ---- */

int wf_store_lock(weft_store *s, const char *op) {
  if (!s) return wf_error(WEFT_EINVAL, "%s: store is NULL", op);
  pthread_mutex_lock(&s->mu);
  if (s->closed) {
    pthread_mutex_unlock(&s->mu);
    return wf_error(WEFT_ESTATE, "%s: the store was closed", op);
  }
  return 0;
}

void wf_store_unlock(weft_store *s) { pthread_mutex_unlock(&s->mu); }

int wf_store_default_timeout(weft_store *s) { return s->timeout_ms; }

void wf_store_ref(weft_store *s) { __atomic_add_fetch(&s->refs, 1, __ATOMIC_ACQ_REL); }

static void store_free(weft_store *s) {
  srv_stop(s->server);
  cl_drop(s);
  wb_free(&s->rq);
  wb_free(&s->resp);
  free(s->mtmp);
  if (s->secret) {
    memset(s->secret, 0, strlen(s->secret));
    free(s->secret);
  }
  pthread_mutex_destroy(&s->mu);
  free(s);
}

void wf_store_unref(weft_store *s) {
  if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) == 0) store_free(s);
}

int weft_store_open(const weft_store_opts *opts, weft_store **out) {
  WF_CHECK_ARG(opts && out, "store open: opts and out must not be NULL");
  *out = NULL;
  const char *host = opts->host && *opts->host ? opts->host : "127.0.0.1";
  WF_CHECK_ARG(strlen(host) < 256, "store open: host name too long");
  WF_CHECK_ARG(opts->port >= 0 && opts->port <= 65535, "store open: port %d out of range", opts->port);
  WF_CHECK_ARG(opts->port > 0 || opts->is_server,
               "store open: port 0 (pick a free one) only makes sense with is_server");
  weft_store *s = calloc(1, sizeof *s);
  if (!s) return wf_error(WEFT_ENOMEM, "store open: out of memory");
  pthread_mutex_init(&s->mu, NULL);
  s->refs = 1;
  s->fd = -1;
  snprintf(s->host, sizeof s->host, "%s", host);
  s->port = opts->port;
  s->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
  s->max_value = env_max_value();
  const char *secret = opts->secret && *opts->secret ? opts->secret : wf_env_str("WEFT_STORE_SECRET");
  if (secret && !(s->secret = strdup(secret))) { store_free(s); return wf_error(WEFT_ENOMEM, "store open: out of memory"); }
  int rc = 0;
  if (opts->is_server) {
    const char *bind_host = opts->bind_host && *opts->bind_host ? opts->bind_host : host;
    rc = srv_start(bind_host, opts->port, s->secret, &s->server, &s->port);
    /* Without an explicit host the server's own client uses the bind address,
     * or loopback when that is a wildcard. */
    if (!(opts->host && *opts->host) && opts->bind_host && *opts->bind_host &&
        strcmp(bind_host, "0.0.0.0") && strcmp(bind_host, "::") && strlen(bind_host) < sizeof s->host)
      snprintf(s->host, sizeof s->host, "%s", bind_host);
  }
  fmt_where(s->where, sizeof s->where, s->host, s->port);
  if (rc == 0) {
    s->t0 = wf_now_ms();
    rc = cl_connect(s, "store open", s->t0 + s->timeout_ms, 1);
  }
  if (rc) { store_free(s); return rc; }
  wf_log(2, "store: connected to %s%s", s->where, opts->is_server ? " (own server)" : "");
  *out = s;
  return 0;
}

int weft_store_close(weft_store *s) {
  if (!s) return 0;
  pthread_mutex_lock(&s->mu);
  int was = s->closed;
  s->closed = 1;
  pthread_mutex_unlock(&s->mu);
  if (was) return 0;
  /* The server goes first: clients of other ranks see ECLOSED at once. */
  srv_stop(s->server);
  pthread_mutex_lock(&s->mu);
  s->server = NULL;
  cl_drop(s);
  pthread_mutex_unlock(&s->mu);
  wf_store_unref(s);
  return 0;
}

int weft_store_port(weft_store *s, int *port) {
  WF_CHECK_ARG(s && port, "store port: NULL argument");
  *port = s->port;
  return 0;
}

/* ---- operations ---- */

typedef struct kv { const char *key; const void *val; size_t len; uint32_t reads; int64_t i; } kv;

static void b_set(weft_store *s, const void *ctx) {
  const kv *a = ctx;
  wb_u32(&s->rq, a->reads);
  wb_key(&s->rq, a->key, strlen(a->key));
  wb_u64(&s->rq, a->len);
  rq_ext(s, a->val, a->len);
}

int wf_store_set_locked(weft_store *s, const char *op, const char *key, const void *val,
                        size_t len, uint32_t reads) {
  int rc = check_key(op, key);
  if (!rc) rc = check_value(s, op, key, val, len);
  if (rc) return rc;
  kv a = {key, val, len, reads, 0};
  int32_t st = 0;
  wf_rd r;
  return cl_request(s, op, WF_OP_SET, 0, 0, b_set, &a, &st, &r);
}

int weft_store_set(weft_store *s, const char *key, const void *val, size_t len) {
  int rc = wf_store_lock(s, "store set");
  if (rc) return rc;
  rc = wf_store_set_locked(s, "store set", key, val, len, 0);
  wf_store_unlock(s);
  return rc;
}

static void b_get(weft_store *s, const void *ctx) {
  const wf_get_req *q = ctx;
  wb_u32(&s->rq, (uint32_t)q->timeout_ms);
  if (q->flags & WF_GET_PUT) {
    wb_u32(&s->rq, q->put_reads);
    wb_key(&s->rq, q->put_key, strlen(q->put_key));
    wb_u64(&s->rq, q->put_len);
    rq_ext(s, q->put_val, q->put_len);
  }
  wb_u32(&s->rq, (uint32_t)q->n);
  for (int i = 0; i < q->n; i++) wb_key(&s->rq, q->keys[i], strlen(q->keys[i]));
}

int wf_store_get_locked(weft_store *s, const char *op, wf_get_req *q) {
  int rc = check_keys(op, q->keys, q->n);
  if (rc) return rc;
  if (q->flags & WF_GET_PUT) {
    if ((rc = check_key(op, q->put_key)) || (rc = check_value(s, op, q->put_key, q->put_val, q->put_len)))
      return rc;
  }
  if (q->timeout_ms < 0) q->timeout_ms = s->timeout_ms;
  q->nmissing = 0;
  int32_t st = 0;
  wf_rd r;
  rc = cl_request(s, op, WF_OP_GET, q->flags, q->timeout_ms, b_get, q, &st, &r);
  if (rc) return rc;
  if (st == 0) {
    if (q->flags & WF_GET_NOVALUES) return 0;
    if (wf_rd_u32(&r) != (uint32_t)q->n) goto bad;
    for (int i = 0; i < q->n; i++) {
      uint64_t len = wf_rd_u64(&r);
      const uint8_t *p = wf_rd_take(&r, (size_t)len);
      if (r.bad) goto bad;
      if (q->vals) q->vals[i] = p ? p : (const void *)s->resp.p;
      if (q->lens) q->lens[i] = (size_t)len;
    }
    return 0;
  }
  uint32_t m = wf_rd_u32(&r);
  if (r.bad || m > (uint32_t)q->n) goto bad;
  for (uint32_t i = 0; i < m; i++) {
    uint32_t ix = wf_rd_u32(&r);
    if (r.bad || ix >= (uint32_t)q->n) goto bad;
    if (q->missing) q->missing[i] = (int)ix;
  }
  q->nmissing = (int)m;
  char names[700];
  if (q->missing) fmt_keys(names, sizeof names, q->keys, q->missing, (int)m);
  else fmt_keys(names, sizeof names, q->keys, NULL, q->n);
  if (st == WEFT_EAGAIN)
    return wf_error(WEFT_EAGAIN, "%s: key(s) %s not set yet at %s", op, names, s->where);
  return wf_error(WEFT_ETIMEOUT, "%s: timed out after %d ms waiting for key(s) %s at %s",
                  op, q->timeout_ms, names, s->where);
bad:
  cl_drop(s);
  return wf_error(WEFT_EPROTO, "%s: malformed reply from %s", op, s->where);
}

/* Public multi-key gets: the missing-index scratch lives in the handle. */
static int get_common(weft_store *s, const char *op, const char *const *keys, int n,
                      int timeout_ms, unsigned flags, const void **vals, size_t *lens) {
  int rc = wf_store_lock(s, op);
  if (rc) return rc;
  if (n > s->ntmp && n <= WF_ST_MAX_NKEYS) {
    int *m = realloc(s->mtmp, (size_t)n * sizeof *m);
    if (!m) { wf_store_unlock(s); return wf_error(WEFT_ENOMEM, "%s: out of memory", op); }
    s->mtmp = m;
    s->ntmp = n;
  }
  wf_get_req q = {.keys = keys, .n = n, .timeout_ms = timeout_ms, .flags = flags,
                  .vals = vals, .lens = lens, .missing = s->mtmp};
  rc = wf_store_get_locked(s, op, &q);
  wf_store_unlock(s);
  return rc;
}

int weft_store_get(weft_store *s, const char *key, int timeout_ms, const void **val, size_t *len) {
  WF_CHECK_ARG(val && len, "store get: val and len must not be NULL");
  const char *keys[1] = {key};
  return get_common(s, "store get", keys, 1, timeout_ms, 0, val, len);
}

int weft_store_multi_get(weft_store *s, const char *const *keys, int n, int timeout_ms,
                         const void **vals, size_t *lens) {
  WF_CHECK_ARG(vals && lens, "store multi_get: vals and lens must not be NULL");
  return get_common(s, "store multi_get", keys, n, timeout_ms, 0, vals, lens);
}

int weft_store_wait(weft_store *s, const char *const *keys, int n, int timeout_ms) {
  return get_common(s, "store wait", keys, n, timeout_ms, WF_GET_NOVALUES, NULL, NULL);
}

static void b_add(weft_store *s, const void *ctx) {
  const kv *a = ctx;
  wb_key(&s->rq, a->key, strlen(a->key));
  wb_u64(&s->rq, (uint64_t)a->i);
}

int wf_store_add_locked(weft_store *s, const char *op, const char *key, int64_t delta,
                        int64_t *result) {
  int rc = check_key(op, key);
  if (rc) return rc;
  kv a = {.key = key, .i = delta};
  int32_t st = 0;
  wf_rd r;
  if ((rc = cl_request(s, op, WF_OP_ADD, 0, 0, b_add, &a, &st, &r))) return rc;
  int64_t v = (int64_t)wf_rd_u64(&r);
  if (r.bad) { cl_drop(s); return wf_error(WEFT_EPROTO, "%s: malformed reply from %s", op, s->where); }
  if (result) *result = v;
  return 0;
}

int weft_store_add(weft_store *s, const char *key, int64_t delta, int64_t *result) {
  int rc = wf_store_lock(s, "store add");
  if (rc) return rc;
  rc = wf_store_add_locked(s, "store add", key, delta, result);
  wf_store_unlock(s);
  return rc;
}

typedef struct keyset { const char *const *keys; int n; } keyset;

static void b_check(weft_store *s, const void *ctx) {
  const keyset *k = ctx;
  wb_u32(&s->rq, (uint32_t)k->n);
  for (int i = 0; i < k->n; i++) wb_key(&s->rq, k->keys[i], strlen(k->keys[i]));
}

int weft_store_check(weft_store *s, const char *const *keys, int n, int *all_present) {
  WF_CHECK_ARG(all_present, "store check: all_present must not be NULL");
  int rc = check_keys("store check", keys, n);
  if (rc) return rc;
  if ((rc = wf_store_lock(s, "store check"))) return rc;
  keyset k = {keys, n};
  int32_t st = 0;
  wf_rd r;
  rc = cl_request(s, "store check", WF_OP_CHECK, 0, 0, b_check, &k, &st, &r);
  if (!rc) {
    const uint8_t *b = wf_rd_take(&r, 1);
    if (!b) { cl_drop(s); rc = wf_error(WEFT_EPROTO, "store check: malformed reply from %s", s->where); }
    else *all_present = b[0];
  }
  wf_store_unlock(s);
  return rc;
}

typedef struct cas { const char *key; const void *e, *d; size_t el, dl; } cas;

static void b_cas(weft_store *s, const void *ctx) {
  const cas *c = ctx;
  wb_key(&s->rq, c->key, strlen(c->key));
  wb_u64(&s->rq, c->el);
  rq_ext(s, c->e, c->el);
  wb_u64(&s->rq, c->dl);
  rq_ext(s, c->d, c->dl);
}

int weft_store_compare_set(weft_store *s, const char *key, const void *expected, size_t elen,
                           const void *desired, size_t dlen, const void **current, size_t *clen) {
  const char *op = "store compare_set";
  WF_CHECK_ARG(current && clen, "%s: current and clen must not be NULL", op);
  int rc = check_key(op, key);
  if (!rc) rc = check_value(s, op, key, expected, elen);
  if (!rc) rc = check_value(s, op, key, desired, dlen);
  if (rc || (rc = wf_store_lock(s, op))) return rc;
  cas c = {key, expected, desired, elen, dlen};
  int32_t st = 0;
  wf_rd r;
  rc = cl_request(s, op, WF_OP_CAS, 0, 0, b_cas, &c, &st, &r);
  if (!rc) {
    uint64_t len = wf_rd_u64(&r);
    const uint8_t *p = wf_rd_take(&r, (size_t)len);
    if (r.bad) { cl_drop(s); rc = wf_error(WEFT_EPROTO, "%s: malformed reply from %s", op, s->where); }
    else { *current = p ? p : (const void *)s->resp.p; *clen = (size_t)len; }
  }
  wf_store_unlock(s);
  return rc;
}

static void b_key(weft_store *s, const void *ctx) {
  const char *key = ctx;
  wb_key(&s->rq, key, strlen(key));
}

int weft_store_delete(weft_store *s, const char *key, int *deleted) {
  int rc = check_key("store delete", key);
  if (rc || (rc = wf_store_lock(s, "store delete"))) return rc;
  int32_t st = 0;
  wf_rd r;
  rc = cl_request(s, "store delete", WF_OP_DELETE, 0, 0, b_key, key, &st, &r);
  if (!rc) {
    const uint8_t *b = wf_rd_take(&r, 1);
    if (!b) { cl_drop(s); rc = wf_error(WEFT_EPROTO, "store delete: malformed reply from %s", s->where); }
    else if (deleted) *deleted = b[0];
  }
  wf_store_unlock(s);
  return rc;
}

static void b_none(weft_store *s, const void *ctx) { (void)s; (void)ctx; }

int weft_store_num_keys(weft_store *s, int64_t *n) {
  WF_CHECK_ARG(n, "store num_keys: n must not be NULL");
  int rc = wf_store_lock(s, "store num_keys");
  if (rc) return rc;
  int32_t st = 0;
  wf_rd r;
  rc = cl_request(s, "store num_keys", WF_OP_NUM_KEYS, 0, 0, b_none, NULL, &st, &r);
  if (!rc) {
    int64_t v = (int64_t)wf_rd_u64(&r);
    if (r.bad) { cl_drop(s); rc = wf_error(WEFT_EPROTO, "store num_keys: malformed reply from %s", s->where); }
    else *n = v;
  }
  wf_store_unlock(s);
  return rc;
}
