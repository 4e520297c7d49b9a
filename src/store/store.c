/* store.c — TCP key-value rendezvous (the control plane's meeting point):
 * the public weft_store_* API, its argument checks and the locked calls that
 * cpugroup.c makes. The server runs in store_server.c, the connection in
 * store_client.c, the handshake in store_auth.c; wire format and limits:
 * store_proto.h. */
#include "store_internal.h"
#include "store_share.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_TIMEOUT_MS 30000

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

/* ---- the exit linger ----
 * A process that serves a store and exits without closing it (a failure
 * and os.exit, an uncaught error) takes the store along. The other ranks
 * usually fail in the same collective a moment later, and their errors
 * need the store (the agreed vote, a tombstone, an unreachable mark), not
 * "store gone". So at exit such a process keeps serving while other ranks
 * are still connected, up to WF_EXIT_LINGER_MS. A clean shutdown closed the
 * store: nothing to wait for. */
#define WF_SERVED_MAX 16
static pthread_mutex_t g_served_mu = PTHREAD_MUTEX_INITIALIZER;
static weft_store *g_served[WF_SERVED_MAX];

static void served_set(weft_store *s, int on) {
  pthread_mutex_lock(&g_served_mu);
  for (int i = 0; i < WF_SERVED_MAX; i++) {
    if (on && !g_served[i]) { g_served[i] = s; break; }
    if (!on && g_served[i] == s) { g_served[i] = NULL; break; }
  }
  pthread_mutex_unlock(&g_served_mu);
}

__attribute__((destructor)) static void served_linger(void) {
  int64_t end = wf_now_ms() + WF_EXIT_LINGER_MS;
  for (;;) {
    int busy = 0;
    if (pthread_mutex_trylock(&g_served_mu) != 0) return;  /* exiting mid-open/close: not worth a risk */
    for (int i = 0; i < WF_SERVED_MAX; i++)
      if (g_served[i] && g_served[i]->server && wf_store_srv_others(g_served[i]->server) > 0) busy = 1;
    pthread_mutex_unlock(&g_served_mu);
    if (!busy || wf_now_ms() >= end) return;
    usleep(10 * 1000);
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

int wf_store_serves(weft_store *s) { return s && s->server != NULL; }

const char *wf_store_note(weft_store *s) { return s->note; }

void wf_store_ref(weft_store *s) { __atomic_add_fetch(&s->refs, 1, __ATOMIC_ACQ_REL); }

static void store_free(weft_store *s) {
  if (s->server) served_set(s, 0);
  wf_store_srv_stop(s->server);
  wf_store_cl_drop(s);
  wf_store_wb_free(&s->rq);
  wf_store_wb_free(&s->resp);
  free(s->mtmp);
  if (s->live_reg)
    for (int i = 0; i < s->live_world; i++) free(s->live_reg[i]);
  free(s->live_reg);
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
  s->live_rank = -1;
  snprintf(s->host, sizeof s->host, "%s", host);
  s->port = opts->port;
  s->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
  s->max_value = wf_store_env_max_value();
  const char *secret = opts->secret && *opts->secret ? opts->secret : wf_env_str("WEFT_STORE_SECRET");
  if (secret && !(s->secret = strdup(secret))) { store_free(s); return wf_error(WEFT_ENOMEM, "store open: out of memory"); }
  int rc = 0;
  if (opts->is_server) {
    const char *bind_host = opts->bind_host && *opts->bind_host ? opts->bind_host : host;
    rc = wf_store_srv_start(bind_host, opts->port, s->secret, &s->server, &s->port);
    /* Without an explicit host the server's own client uses the bind address,
     * or loopback when that is a wildcard. */
    if (!(opts->host && *opts->host) && opts->bind_host && *opts->bind_host &&
        strcmp(bind_host, "0.0.0.0") && strcmp(bind_host, "::") && strlen(bind_host) < sizeof s->host)
      snprintf(s->host, sizeof s->host, "%s", bind_host);
  }
  wf_store_fmt_where(s->where, sizeof s->where, s->host, s->port);
  if (rc == 0) {
    s->t0 = wf_now_ms();
    rc = wf_store_cl_connect(s, "store open", s->t0 + s->timeout_ms, 1);
  }
  if (rc) { store_free(s); return rc; }
  if (s->server) served_set(s, 1);
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
  /* A registered rank says it leaves, so its closed connection is no death. */
  pthread_mutex_lock(&s->mu);
  if (!s->server) wf_store_live_leave(s);
  pthread_mutex_unlock(&s->mu);
  /* The server goes first: clients of other ranks see ECLOSED at once. */
  served_set(s, 0);
  wf_store_srv_stop(s->server);
  pthread_mutex_lock(&s->mu);
  s->server = NULL;
  wf_store_cl_drop(s);
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
  wf_store_wb_u32(&s->rq, a->reads);
  wf_store_wb_key(&s->rq, a->key, strlen(a->key));
  wf_store_wb_u64(&s->rq, a->len);
  wf_store_rq_ext(s, a->val, a->len);
}

int wf_store_set_locked(weft_store *s, const char *op, const char *key, const void *val,
                        size_t len, uint32_t reads) {
  int rc = check_key(op, key);
  if (!rc) rc = check_value(s, op, key, val, len);
  if (rc) return rc;
  kv a = {key, val, len, reads, 0};
  int32_t st = 0;
  wf_rd r;
  return wf_store_cl_request(s, op, WF_OP_SET, 0, 0, b_set, &a, &st, &r);
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
  wf_store_wb_u32(&s->rq, (uint32_t)q->timeout_ms);
  if (q->flags & WF_GET_PUT) {
    wf_store_wb_u32(&s->rq, q->put_reads);
    wf_store_wb_key(&s->rq, q->put_key, strlen(q->put_key));
    wf_store_wb_u64(&s->rq, q->put_hlen + q->put_len);
    if (q->put_hlen) wf_store_wb_put(&s->rq, q->put_hdr, q->put_hlen);
    wf_store_rq_ext(s, q->put_val, q->put_len);
  }
  wf_store_wb_u32(&s->rq, (uint32_t)q->n);
  for (int i = 0; i < q->n; i++) wf_store_wb_key(&s->rq, q->keys[i], strlen(q->keys[i]));
}

/* One GET; a timeout is reported as report_ms (the whole wait when sliced). */
static int get_once(weft_store *s, const char *op, wf_get_req *q, int report_ms) {
  int rc;
  q->nmissing = 0;
  s->note[0] = '\0';
  int32_t st = 0;
  wf_rd r;
  rc = wf_store_cl_request(s, op, WF_OP_GET, q->flags, q->timeout_ms, b_get, q, &st, &r);
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
  if (r.pos < r.len) {  /* the server's note, e.g. a client rejected for a wrong secret */
    uint32_t nl = wf_rd_u32(&r);
    const uint8_t *np = wf_rd_take(&r, nl);
    if (!np) goto bad;
    snprintf(s->note, sizeof s->note, "%.*s", (int)(nl < sizeof s->note ? nl : sizeof s->note - 1), np);
  }
  char names[700];
  if (q->missing) fmt_keys(names, sizeof names, q->keys, q->missing, (int)m);
  else fmt_keys(names, sizeof names, q->keys, NULL, q->n);
  const char *sep = s->note[0] ? "; " : "";
  if (st == WEFT_EAGAIN)
    return wf_error(WEFT_EAGAIN, "%s: key(s) %s not set yet at %s%s%s", op, names, s->where, sep, s->note);
  return wf_error(WEFT_ETIMEOUT, "%s: timed out after %d ms waiting for key(s) %s at %s%s%s",
                  op, report_ms, names, s->where, sep, s->note);
bad:
  wf_store_cl_drop(s);
  return wf_error(WEFT_EPROTO, "%s: malformed reply from %s", op, s->where);
}

int wf_store_get_locked(weft_store *s, const char *op, wf_get_req *q) {
  int rc = check_keys(op, q->keys, q->n);
  if (rc) return rc;
  if (q->flags & WF_GET_PUT) {
    if (q->put_len > SIZE_MAX - q->put_hlen)
      return wf_error(WEFT_EINVAL, "%s: value of %zu bytes is too large", op, q->put_len);
    if ((rc = check_key(op, q->put_key)) ||
        (rc = check_value(s, op, q->put_key, q->put_len ? q->put_val : q->put_hdr,
                          q->put_hlen + q->put_len)))
      return rc;
  }
  if (q->timeout_ms < 0) q->timeout_ms = s->timeout_ms;
  /* a long wait of a registered handle (or under an armed interrupt) looks
   * for gone ranks between slices; a short or plain one is one request */
  if (q->timeout_ms > WF_LIVE_SLICE_MS && (s->live_rank >= 0 || wf_interrupt_armed()))
    return wf_store_live_wait(s, op, q, get_once);
  return get_once(s, op, q, q->timeout_ms);
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

int weft_store_wait_closed(weft_store *s, int timeout_ms) {
  int rc = wf_store_lock(s, "store wait_closed");
  if (rc) return rc;
  s->no_reconnect = 1;
  wf_store_unlock(s);
  /* a key nobody sets: the wait ends as the server closes the connection */
  const char *keys[1] = {"weft/store/wait_closed"};
  rc = get_common(s, "store wait_closed", keys, 1, timeout_ms, WF_GET_NOVALUES, NULL, NULL);
  if (rc == WEFT_ECLOSED && s->fd < 0) return 0;
  if (rc == 0)
    return wf_error(WEFT_EPROTO, "store wait_closed: the key weft/store/wait_closed was set by someone");
  return rc;
}

static void b_add(weft_store *s, const void *ctx) {
  const kv *a = ctx;
  wf_store_wb_key(&s->rq, a->key, strlen(a->key));
  wf_store_wb_u64(&s->rq, (uint64_t)a->i);
}

int wf_store_add_locked(weft_store *s, const char *op, const char *key, int64_t delta,
                        int64_t *result) {
  int rc = check_key(op, key);
  if (rc) return rc;
  kv a = {.key = key, .i = delta};
  int32_t st = 0;
  wf_rd r;
  if ((rc = wf_store_cl_request(s, op, WF_OP_ADD, 0, 0, b_add, &a, &st, &r))) return rc;
  int64_t v = (int64_t)wf_rd_u64(&r);
  if (r.bad) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: malformed reply from %s", op, s->where);
  }
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
  wf_store_wb_u32(&s->rq, (uint32_t)k->n);
  for (int i = 0; i < k->n; i++) wf_store_wb_key(&s->rq, k->keys[i], strlen(k->keys[i]));
}

int weft_store_check(weft_store *s, const char *const *keys, int n, int *all_present) {
  WF_CHECK_ARG(all_present, "store check: all_present must not be NULL");
  int rc = check_keys("store check", keys, n);
  if (rc) return rc;
  if ((rc = wf_store_lock(s, "store check"))) return rc;
  keyset k = {keys, n};
  int32_t st = 0;
  wf_rd r;
  rc = wf_store_cl_request(s, "store check", WF_OP_CHECK, 0, 0, b_check, &k, &st, &r);
  if (!rc) {
    const uint8_t *b = wf_rd_take(&r, 1);
    if (!b) {
      wf_store_cl_drop(s);
      rc = wf_error(WEFT_EPROTO, "store check: malformed reply from %s", s->where);
    }
    else *all_present = b[0];
  }
  wf_store_unlock(s);
  return rc;
}

typedef struct cas { const char *key; const void *e, *d; size_t el, dl; } cas;

static void b_cas(weft_store *s, const void *ctx) {
  const cas *c = ctx;
  wf_store_wb_key(&s->rq, c->key, strlen(c->key));
  wf_store_wb_u64(&s->rq, c->el);
  wf_store_rq_ext(s, c->e, c->el);
  wf_store_wb_u64(&s->rq, c->dl);
  wf_store_rq_ext(s, c->d, c->dl);
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
  rc = wf_store_cl_request(s, op, WF_OP_CAS, 0, 0, b_cas, &c, &st, &r);
  if (!rc) {
    uint64_t len = wf_rd_u64(&r);
    const uint8_t *p = wf_rd_take(&r, (size_t)len);
    if (r.bad) {
      wf_store_cl_drop(s);
      rc = wf_error(WEFT_EPROTO, "%s: malformed reply from %s", op, s->where);
    }
    else { *current = p ? p : (const void *)s->resp.p; *clen = (size_t)len; }
  }
  wf_store_unlock(s);
  return rc;
}

static void b_key(weft_store *s, const void *ctx) {
  const char *key = ctx;
  wf_store_wb_key(&s->rq, key, strlen(key));
}

int wf_store_delete_locked(weft_store *s, const char *op, const char *key) {
  int rc = check_key(op, key);
  if (rc) return rc;
  int32_t st = 0;
  wf_rd r;
  return wf_store_cl_request(s, op, WF_OP_DELETE, 0, 0, b_key, key, &st, &r);
}

int weft_store_delete(weft_store *s, const char *key, int *deleted) {
  int rc = check_key("store delete", key);
  if (rc || (rc = wf_store_lock(s, "store delete"))) return rc;
  int32_t st = 0;
  wf_rd r;
  rc = wf_store_cl_request(s, "store delete", WF_OP_DELETE, 0, 0, b_key, key, &st, &r);
  if (!rc) {
    const uint8_t *b = wf_rd_take(&r, 1);
    if (!b) {
      wf_store_cl_drop(s);
      rc = wf_error(WEFT_EPROTO, "store delete: malformed reply from %s", s->where);
    }
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
  rc = wf_store_cl_request(s, "store num_keys", WF_OP_NUM_KEYS, 0, 0, b_none, NULL, &st, &r);
  if (!rc) {
    int64_t v = (int64_t)wf_rd_u64(&r);
    if (r.bad) {
      wf_store_cl_drop(s);
      rc = wf_error(WEFT_EPROTO, "store num_keys: malformed reply from %s", s->where);
    }
    else *n = v;
  }
  wf_store_unlock(s);
  return rc;
}
