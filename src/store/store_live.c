/* store_live.c — which ranks are gone, seen through the store.
 *
 * A rank registers on its connection: "weft/rank/<R>" = "pid=<P> host=<H>",
 * set with WF_SET_LIVE. When that connection ends from the rank's side (the
 * kernel closes the socket of a process that exits or is killed, also on
 * another node) while the key still exists, the server sets the tombstone
 * "weft/rank/<R>/gone". weft_store_close deletes the key first: a clean
 * leave is no death.
 *
 * Waits of a registered handle run in slices of WF_LIVE_SLICE_MS: a slice
 * that ends with keys still missing costs one poll of the tombstones of the
 * ranks that own them (and of the wait's abort key); the server also ends
 * every parked slice (WF_GET_LIVE) with EAGAIN when it writes a tombstone,
 * so a death is named within milliseconds, and a healthy wait that completes inside its first
 * slice costs nothing extra. No thread, no heartbeat: a rank that is stopped
 * (SIGSTOP) keeps its connection, so it is not gone; it stays "did not
 * arrive" until the timeout, described as stopped when it runs on this host.
 * A host that vanishes without closing its sockets (a partition) is not
 * gone: those waits end at the timeout, bounded as a whole (s->cap: never a
 * timeout per request), and the server marks the ranks whose host stopped
 * acknowledging its keepalive probes "weft/rank/<R>/unreachable"
 * (store_server_live.c), which the diagnosis below names. */
#include "core/futex.h"
#include "store_share.h"
#include "store_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WF_ERR_KEEP 1024

static void live_key(char *buf, size_t n, int rank, const char *suffix) {
  snprintf(buf, n, "weft/rank/%d%s", rank, suffix);
}

static void live_value(char *buf, size_t n) {
  snprintf(buf, n, "pid=%d host=%s", (int)getpid(), wf_hostname());
}

/* "pid=P host=H" -> pid, host; 0 when it parses. */
static int parse_value(const void *v, size_t len, int *pid, char *host, size_t hn) {
  char tmp[320];
  if (len >= sizeof tmp) len = sizeof tmp - 1;
  memcpy(tmp, v, len);
  tmp[len] = '\0';
  char h[300];
  if (sscanf(tmp, "pid=%d host=%299s", pid, h) != 2) return -1;
  snprintf(host, hn, "%s", h);
  return 0;
}

/* The tombstones of a clean leave (wf_store_live_leave): the registration
 * value, then " finished" (after weft_store_finish) or " left". */
#define LEFT_MARK " left"
#define FINISHED_MARK " finished"
static int ends_with(const char *v, const char *mark) {
  const size_t n = strlen(v), m = strlen(mark);
  return n >= m && !strcmp(v + n - m, mark);
}

typedef struct { const char *key; const void *val; size_t len; } setreq;

static void describe_value(int rank, const char *v, char *buf, size_t n, int *pid_out,
                           int *same_host);

static void b_live_set(weft_store *s, const void *ctx) {
  const setreq *a = ctx;
  wf_store_wb_u32(&s->rq, 0);
  wf_store_wb_key(&s->rq, a->key, strlen(a->key));
  wf_store_wb_val(&s->rq, a->val, a->len);
}

int weft_store_register_rank(weft_store *s, int rank, int world) {
  static const char op[] = "store register_rank";
  WF_CHECK_ARG(world >= 1 && world <= 1048576, "%s: world %d outside 1..1048576", op, world);
  WF_CHECK_ARG(rank >= 0 && rank < world, "%s: rank %d outside 0..%d", op, rank, world - 1);
  int rc = wf_store_lock(s, op);
  if (rc) return rc;
  char key[64], val[320];
  live_key(key, sizeof key, rank, "");
  live_value(val, sizeof val);
  setreq a = {key, val, strlen(val)};
  int32_t st = 0;
  wf_rd r;
  rc = wf_store_cl_request(s, op, WF_OP_SET, WF_SET_LIVE, 0, b_live_set, &a, &st, &r);
  if (!rc && !s->live_reg) s->live_reg = calloc((size_t)world, sizeof *s->live_reg);
  if (!rc && !s->live_reg) rc = wf_error(WEFT_ENOMEM, "%s: out of memory", op);
  if (!rc) { s->live_rank = rank; s->live_world = world; s->live_finished = 0; }
  /* rank 0 hosts the store: who it is must be known before it can vanish
   * (it registers right after starting the server) */
  if (!rc && rank != 0) {
    char k0[64], v0[320];
    live_key(k0, sizeof k0, 0, "");
    const void *v = NULL;
    size_t len = 0;
    int miss;
    const char *keys[1] = {k0};
    wf_get_req q = {.keys = keys, .n = 1, .timeout_ms = s->timeout_ms, .vals = &v, .lens = &len,
                    .missing = &miss};
    if (wf_store_get_locked(s, op, &q) == 0) {
      if (len >= sizeof v0) len = sizeof v0 - 1;
      memcpy(v0, v, len);
      v0[len] = '\0';
      int same;
      describe_value(0, v0, s->rank0, sizeof s->rank0, NULL, &same);
      s->live_reg[0] = strdup(v0);
    }
    wf_clear_error();
  }
  wf_store_unlock(s);
  return rc;
}

int wf_store_live_rebind(weft_store *s, const char *op, int64_t deadline) {
  if (s->live_rank < 0 || s->sibling) return 0;
  char key[64], val[320];
  live_key(key, sizeof key, s->live_rank, "");
  live_value(val, sizeof val);
  setreq a = {key, val, strlen(val)};
  wf_store_rq_begin(s);
  b_live_set(s, &a);
  int rc = wf_store_cl_send(s, op, WF_OP_SET, WF_SET_LIVE, deadline);
  int fop;
  wf_rd r;
  if (!rc) rc = wf_store_cl_read_frame(s, op, deadline, &fop, &r);
  return rc;
}

static void b_key(weft_store *s, const void *ctx) {
  const char *key = ctx;
  wf_store_wb_key(&s->rq, key, strlen(key));
}

/* A clean leave: the tombstone "<key>/gone" = "<registration> finished"
 * (weft_store_finish was called) or "... left", then the key deleted (so the
 * server writes no death when the connection closes). A peer still waiting
 * for this rank's part of a call then fails within a slice, naming it,
 * instead of at its timeout (a script that ended or raised without the
 * call); a wait that does not know whose key it waits for (weft.shutdown's
 * own) goes on past a finished rank, and ends on one that left. */
void wf_store_live_leave(weft_store *s) {
  if (s->live_rank < 0 || s->fd < 0 || s->sibling) return;
  char key[64], gone[64], val[340];
  live_key(key, sizeof key, s->live_rank, "");
  live_key(gone, sizeof gone, s->live_rank, "/gone");
  live_value(val, sizeof val - sizeof FINISHED_MARK);
  strcat(val, s->live_finished ? FINISHED_MARK : LEFT_MARK);
  int timeout = s->timeout_ms;
  s->timeout_ms = 1000;  /* best effort: a gone server must not hold close() */
  int32_t st = 0;
  wf_rd r;
  setreq a = {gone, val, strlen(val)};
  if (wf_store_cl_request(s, "store close", WF_OP_SET, 0, 0, b_live_set, &a, &st, &r) == 0)
    wf_store_cl_request(s, "store close", WF_OP_DELETE, 0, 0, b_key, key, &st, &r);
  s->timeout_ms = timeout;
  s->live_rank = -1;
  wf_clear_error();
}

/* One poll (no wait) of `n` keys: present[i] = 1 when key i exists; values
 * of present keys point into s->resp until the next request. */
static int poll_keys(weft_store *s, const char *op, char **keys, int n, const void **vals,
                     size_t *lens, int *missing, uint8_t *present) {
  wf_get_req q = {.keys = (const char *const *)keys, .n = n, .timeout_ms = 0, .vals = vals,
                  .lens = lens, .missing = missing};
  int rc = wf_store_get_locked(s, op, &q);
  if (rc == 0) { memset(present, 1, (size_t)n); return 0; }
  if (rc != WEFT_EAGAIN) return rc;
  /* EAGAIN carries no values: ask again for the present ones only when needed */
  memset(present, 1, (size_t)n);
  for (int i = 0; i < q.nmissing; i++) present[missing[i]] = 0;
  for (int i = 0; i < n; i++) vals[i] = NULL;
  return 0;
}

/* The value of one key right now, copied into buf; 0 when present. */
static int read_now(weft_store *s, const char *op, const char *key, char *buf, size_t n) {
  const void *v = NULL;
  size_t len = 0;
  int miss;
  const char *keys[1] = {key};
  wf_get_req q = {.keys = keys, .n = 1, .timeout_ms = 0, .vals = &v, .lens = &len, .missing = &miss};
  if (wf_store_get_locked(s, op, &q)) return -1;
  if (len >= n) len = n - 1;
  memcpy(buf, v, len);
  buf[len] = '\0';
  return 0;
}

/* "rank R (pid P, host H[, stopped])" from registration value v. */
static void describe_value(int rank, const char *v, char *buf, size_t n, int *pid_out,
                           int *same_host) {
  int pid = 0;
  char host[300];
  *same_host = 0;
  if (parse_value(v, strlen(v), &pid, host, sizeof host)) { snprintf(buf, n, "rank %d", rank); return; }
  *same_host = strcmp(host, wf_hostname()) == 0;
  if (pid_out) *pid_out = pid;
  int stopped = *same_host && wf_pid_stopped(pid);
  snprintf(buf, n, "rank %d (pid %d, host %s%s)", rank, pid, host,
           stopped ? ", stopped: SIGSTOP or a debugger" : "");
}

void wf_store_live_describe(weft_store *s, const char *op, int rank, char *buf, size_t n) {
  char key[64], v[320];
  snprintf(buf, n, "rank %d", rank);
  if (s->live_rank < 0) return;
  live_key(key, sizeof key, rank, "");
  /* a message's lookup: one round trip at most, none to a store just found
   * unreachable (a caller may describe several ranks in a row) */
  int64_t cap0 = s->cap, lim = wf_now_ms() + WF_LIVE_RTT_MS;
  if (!s->cap || s->cap > lim) s->cap = lim;
  int known = rank >= 0 && rank < s->live_world && s->live_reg[rank];
  int miss = !known && (s->unreachable || read_now(s, op, key, v, sizeof v));
  s->cap = cap0;
  if (known) {
    snprintf(v, sizeof v, "%s", s->live_reg[rank]);
  } else if (miss && s->unreachable) {
    wf_clear_error();
    return;   /* "rank R": who it is cannot be asked now */
  } else if (miss) {
    snprintf(buf, n, "rank %d (never connected to the store: not started, or died before weft.init)",
             rank);
    wf_clear_error();
    return;
  }
  else if (rank >= 0 && rank < s->live_world) s->live_reg[rank] = strdup(v);
  int same;
  describe_value(rank, v, buf, n, NULL, &same);
  wf_clear_error();
}

/* The error for gone rank `rank` whose registration value is v. */
static int gone_error(const char *op, int rank, const char *v) {
  char who[400];
  int pid = 0, same = 0;
  describe_value(rank, v, who, sizeof who, &pid, &same);
  if (ends_with(v, FINISHED_MARK))
    return wf_error(WEFT_ECLOSED, "%s: %s finished (it called weft.shutdown()) while this rank waited for "
                    "it", op, who);
  if (ends_with(v, LEFT_MARK))
    return wf_error(WEFT_ECLOSED, "%s: %s left without weft.shutdown() (its script ended or raised an "
                    "error, and its store handle closed) while this rank waited for it", op, who);
  /* a killed process closes its sockets a moment before it is a zombie */
  int alive = same && pid > 0 && !wf_pid_dead(pid);
  for (int i = 0; alive && i < 20; i++) {
    int us = 5000;
    wf_backoff(&us, 5000);
    alive = !wf_pid_dead(pid);
  }
  if (alive)
    return wf_error(WEFT_ECLOSED, "%s: %s closed its store connection without weft.shutdown() "
                    "(the process still runs) while this rank waited for it", op, who);
  return wf_error(WEFT_ECLOSED, "%s: %s died (exited or was killed without weft.shutdown(): its "
                  "connection to the store closed) while this rank waited for it", op, who);
}

/* The value of polled key i into v: from the poll's reply when it brought
 * values, else read now (a gone rank's registration when that fails). */
static void value_of(weft_store *s, const char *op, const void **vals, const size_t *lens,
                     const int *rank, char **keys, int i, char *v, size_t n) {
  if (vals[i]) {  /* every key was present: the poll brought the values */
    size_t l = lens[i] < n - 1 ? lens[i] : n - 1;
    memcpy(v, vals[i], l);
    v[l] = '\0';
  } else if (read_now(s, op, keys[i], v, n)) {
    wf_clear_error();
    int r = rank[i];
    snprintf(v, n, "%s", r >= 0 && r < s->live_world && s->live_reg[r] ? s->live_reg[r] : "");
  }
}

/* Between slices: 0 to go on waiting, else the error that ends the wait. */
static int check_between(weft_store *s, const char *op, wf_get_req *q) {
  char why[160];
  if (wf_interrupted(why, sizeof why)) {
    if (q->abort_key) {
      char msg[600], who[400];
      if (s->live_rank >= 0) wf_store_live_describe(s, op, s->live_rank, who, sizeof who);
      else snprintf(who, sizeof who, "a rank (pid %d, host %s)", (int)getpid(), wf_hostname());
      int len = snprintf(msg, sizeof msg, "%s was %s during %s", who, why, op);
      setreq a = {q->abort_key, msg, (size_t)(len < 0 ? 0 : len)};
      int32_t st = 0;
      wf_rd r;
      wf_store_cl_request(s, op, WF_OP_SET, 0, 0, b_live_set, &a, &st, &r);
    }
    return wf_error(WEFT_EABORT, "%s: %s", op, why);
  }
  if (s->live_rank < 0) return 0;
  /* the owners of the missing keys (all ranks of the world when unknown) */
  const int *owners = q->missing ? q->owners : NULL;
  int n = owners ? q->nmissing : s->live_world;
  int nk = n + (q->abort_key ? 1 : 0);
  if (nk == 0) return 0;
  int *rank = malloc((size_t)nk * sizeof *rank);
  char **keys = malloc((size_t)nk * sizeof *keys);
  char *kb = malloc((size_t)nk * 64);
  const void **vals = malloc((size_t)nk * sizeof *vals);
  size_t *lens = malloc((size_t)nk * sizeof *lens);
  int *miss = malloc((size_t)nk * sizeof *miss);
  uint8_t *present = malloc((size_t)nk);
  int rc = 0;
  if (!rank || !keys || !kb || !vals || !lens || !miss || !present) goto done;  /* check next slice */
  int k = 0;
  for (int i = 0; i < n; i++) {
    int r = owners ? owners[q->missing[i]] : i;
    if (r == s->live_rank && !owners) continue;
    rank[k] = r;
    keys[k] = kb + (size_t)k * 64;
    live_key(keys[k], 64, r, "/gone");
    k++;
  }
  int ai = -1;
  if (q->abort_key) { ai = k; rank[k] = -1; keys[k++] = (char *)q->abort_key; }
  if (k == 0) goto done;
  rc = poll_keys(s, op, keys, k, vals, lens, miss, present);
  if (rc) goto done;  /* the store itself failed: that error ends the wait */
  /* The abort first: a member that gave up (timed out, say) publishes it,
   * takes its key back and often exits a moment later, and so may the
   * members its abort reached: their tombstones are consequences, the
   * abort's message (whom its author waited for, or who died) the cause. */
  if (ai >= 0 && present[ai]) {
    char v[600];
    value_of(s, op, vals, lens, rank, keys, ai, v, sizeof v);
    rc = wf_error(WEFT_EABORT, "%s: aborted: %s", op, v[0] ? v : "another rank gave up");
    goto done;
  }
  for (int i = 0; i < k && !rc; i++) {
    if (!present[i]) {
      int r = rank[i];
      if (r >= 0 && r < s->live_world && !s->live_reg[r]) {
        /* learn who it is while it is alive: its tombstone may be
         * unreadable later (the store's host may be shutting down too) */
        char who[400];
        wf_store_live_describe(s, op, r, who, sizeof who);
      }
      continue;
    }
    if (i == ai) continue;
    char v[600];
    value_of(s, op, vals, lens, rank, keys, i, v, sizeof v);
    /* a rank that finished (weft.shutdown) ends only the waits for its own
     * keys: a wait whose owner is unknown (a store get) goes on past it */
    if (!owners && ends_with(v, FINISHED_MARK)) continue;
    rc = gone_error(op, rank[i], v);
  }
done:
  free(rank); free(keys); free(kb); free(vals); free(lens); free(miss); free(present);
  return rc;
}

int wf_store_live_wait(weft_store *s, const char *op, wf_get_req *q, wf_store_get_fn get_once) {
  const int total = q->timeout_ms;
  const unsigned flags = q->flags;
  const int64_t t_end = wf_now_ms() + total;
  /* the whole wait, every slice and check included, ends by t_end plus a
   * grace: a store that stops answering (a partition) costs no more */
  const int64_t cap0 = s->cap;
  if (!s->cap || s->cap > t_end + WF_LIVE_WAIT_GRACE_MS) s->cap = t_end + WF_LIVE_WAIT_GRACE_MS;
  int rc;
  for (;;) {
    int64_t left = t_end - wf_now_ms();
    q->timeout_ms = (int)(left < WF_LIVE_SLICE_MS ? (left > 0 ? left : 1) : WF_LIVE_SLICE_MS);
    q->flags |= WF_GET_LIVE;
    rc = get_once(s, op, q, total);
    q->flags &= ~WF_GET_PUT;  /* the own key is set once; later slices only wait */
    /* ETIMEOUT: the slice ended; EAGAIN: the server saw a rank die */
    if ((rc != WEFT_ETIMEOUT && rc != WEFT_EAGAIN) || q->nmissing == 0) break;
    if (rc == WEFT_ETIMEOUT && wf_now_ms() >= t_end) break;  /* (EAGAIN then: one more 1 ms slice) */
    /* keep the missing list: the check below reuses the reply buffer */
    int nm = q->nmissing;
    rc = check_between(s, op, q);
    q->nmissing = nm;
    if (rc) break;
  }
  q->flags = flags;
  q->timeout_ms = total;
  if (rc == WEFT_EABORT && (flags & WF_GET_PUT)) {
    /* take back this rank's key, so that no member that comes later pairs it
     * with a fresh one: it waits, sees the abort key and fails too */
    char keep[WF_ERR_KEEP];
    snprintf(keep, sizeof keep, "%s", weft_last_error());
    int32_t st = 0;
    wf_rd r;
    wf_store_cl_request(s, op, WF_OP_DELETE, 0, 0, b_key, q->put_key, &st, &r);
    wf_error(rc, "%s", keep);
  }
  s->cap = cap0;
  /* the store's host stays a moment after its own wait timed out: the
   * others' waits of the same collective end about now, and they should
   * read why (their own timeout, who is cut off), not find the store gone
   * with this process */
  if (rc == WEFT_ETIMEOUT && s->server) usleep(WF_LIVE_LINGER_MS * 1000);
  if (rc == WEFT_ECLOSED && s->live_rank >= 0 && !s->server && s->fd < 0)
    rc = wf_error_context(rc, "%s, which hosts the store, is gone (died, or shut down before "
                          "this rank)", s->rank0[0] ? s->rank0 : "rank 0");
  return rc;
}

/* For engines outside the store (Gloo) and the Lua layer: after one of their
 * calls failed, who is gone or cut off? One multi-key poll of every rank's
 * tombstone and unreachable mark per round, repeated for up to wait_ms
 * while nothing is found (the server may see a closed connection a moment
 * after the engine did); the whole diagnosis, connecting included, ends
 * within wait_ms + WF_LIVE_RTT_MS (WF_LIVE_RETRY_MS when the store was just
 * found unreachable): a store that cannot be reached is reported as such,
 * never waited for. */
static void append(char *buf, size_t n, size_t *used, const char *s) {
  int w = snprintf(buf + *used, n - *used, "%s%s", *used ? ", " : "", s);
  if (w > 0) *used = *used + (size_t)w < n ? *used + (size_t)w : n - 1;
}

/* Ranks per poll (two keys each: well under a request's limits), and ranks
 * per list whose pid and host are looked up (the rest go by number: the
 * lookups share the round's bound). */
#define DIAG_CHUNK 2048
#define DIAG_DESCRIBE 8

static void diag_round(weft_store *s, char **keys, const void **vals, size_t *lens, int *miss,
                       uint8_t *present, wf_store_diag *d) {
  size_t gu = 0, uu = 0;
  int W = s->live_world;
  d->gone = d->unreachable = 0;
  d->gone_who[0] = d->unreach_who[0] = '\0';
  for (int r0 = 0; r0 < W; r0 += DIAG_CHUNK) {
    int n = W - r0 < DIAG_CHUNK ? W - r0 : DIAG_CHUNK;
    for (int i = 0; i < n; i++) {
      live_key(keys[i], 48, r0 + i, "/gone");
      live_key(keys[n + i], 48, r0 + i, "/unreachable");
    }
    int rc = poll_keys(s, "liveness", keys, 2 * n, vals, lens, miss, present);
    if (rc) {
      d->store_lost = 1;
      const char *m = weft_last_error();
      if (!strncmp(m, "liveness: ", 10)) m += 10;
      snprintf(d->store_why, sizeof d->store_why, "%s", m);
      return;
    }
    for (int i = 0; i < 2 * n; i++) {
      if (!present[i]) continue;
      int r = r0 + i % n, gone = i < n;
      if (!gone && present[i - n]) continue;   /* gone and cut off: gone */
      int *count = gone ? &d->gone : &d->unreachable;
      char v[320], one[400];
      if (*count < DIAG_DESCRIBE) {
        /* a mark's value is the rank's registration ("pid=P host=H") */
        if (!s->live_reg[r] && read_now(s, "liveness", keys[i], v, sizeof v) == 0)
          s->live_reg[r] = strdup(v);
        snprintf(v, sizeof v, "%s", s->live_reg[r] ? s->live_reg[r] : "");
        int same;
        describe_value(r, v, one, sizeof one, NULL, &same);
      } else {
        snprintf(one, sizeof one, "rank %d", r);
      }
      if (gone) append(d->gone_who, sizeof d->gone_who, &gu, one);
      else append(d->unreach_who, sizeof d->unreach_who, &uu, one);
      (*count)++;
    }
  }
}

/* The diagnosis with s locked by the caller (a cpu group's failed wait). */
int wf_store_diagnose_locked(weft_store *s, int wait_ms, wf_store_diag *d) {
  memset(d, 0, sizeof *d);
  if (!s || s->live_rank < 0) return 0;
  int K = 2 * (s->live_world < DIAG_CHUNK ? s->live_world : DIAG_CHUNK);
  char **keys = malloc((size_t)K * sizeof *keys);
  char *kb = malloc((size_t)K * 48);
  const void **vals = malloc((size_t)K * sizeof *vals);
  size_t *lens = malloc((size_t)K * sizeof *lens);
  int *miss = malloc((size_t)K * sizeof *miss);
  uint8_t *present = malloc((size_t)K);
  if (keys && kb && vals && lens && miss && present) {
    for (int i = 0; i < K; i++) keys[i] = kb + (size_t)i * 48;
    int64_t wait_end = wf_now_ms() + (wait_ms > 0 ? wait_ms : 0);
    int64_t cap0 = s->cap;
    for (;;) {
      /* each round one round trip at most, so the last ends by wait_end + it */
      s->cap = wf_now_ms() + (s->unreachable ? WF_LIVE_RETRY_MS : WF_LIVE_RTT_MS);
      if (cap0 && cap0 < s->cap) s->cap = cap0;
      diag_round(s, keys, vals, lens, miss, present, d);
      if (d->store_lost || d->gone || wf_now_ms() >= wait_end) break;
      int64_t left = wait_end - wf_now_ms();
      usleep((useconds_t)(left < 50 ? left : 50) * 1000);
    }
    s->cap = cap0;
  }
  free(keys); free(kb); free(vals); free(lens); free(miss); free(present);
  wf_clear_error();
  return d->gone;
}

int wf_store_diagnose(weft_store *s, int wait_ms, wf_store_diag *d) {
  memset(d, 0, sizeof *d);
  if (!s || s->live_rank < 0) return 0;
  if (wf_store_lock(s, "liveness") != 0) { wf_clear_error(); return 0; }
  int gone = wf_store_diagnose_locked(s, wait_ms, d);
  wf_store_unlock(s);
  return gone;
}

/* What a failure adds beyond its own cause, in the same words on every
 * route (the store's cpu group waits, Gloo, the hierarchy): the ranks cut
 * off from the store's host, and the store itself when it could not be
 * asked. "" when the store saw nothing; else starts with "; ". */
void wf_store_diag_note(const wf_store_diag *d, char *buf, size_t n) {
  size_t used = 0;
  if (!n) return;
  buf[0] = '\0';
  if (d->unreachable) {
    int w = snprintf(buf, n, "; unreachable from the store's host (no TCP acknowledgement, a "
                     "partition?): %s", d->unreach_who);
    used = w < 0 ? 0 : (size_t)w < n ? (size_t)w : n - 1;
  }
  if (d->store_lost && used < n - 1) snprintf(buf + used, n - used, "; %s", d->store_why);
}

int wf_store_gone_among(weft_store *s, const int *ranks, int n, int wait_ms, char *who,
                        size_t whon) {
  (void)ranks; (void)n;  /* every rank of the world: the first death may be outside the group */
  wf_store_diag d;
  int gone = wf_store_diagnose(s, wait_ms, &d);
  if (whon) snprintf(who, whon, "%s", d.gone_who);
  return gone;
}

int weft_store_diagnose(weft_store *s, int wait_ms, char *gone, size_t gone_len, int *n_gone,
                        char *cut, size_t cut_len, int *n_cut) {
  WF_CHECK_ARG(s && gone && gone_len > 0 && n_gone && cut && cut_len > 0 && n_cut,
               "store diagnose: NULL argument");
  wf_store_diag d;
  *n_gone = wf_store_diagnose(s, wait_ms, &d);
  *n_cut = d.unreachable;
  snprintf(gone, gone_len, "%s", d.gone_who);
  snprintf(cut, cut_len, "%s", d.unreach_who);
  if (d.store_lost) return wf_error(WEFT_ECLOSED, "store diagnose: %s", d.store_why);
  return 0;
}

int weft_store_gone_ranks(weft_store *s, int wait_ms, char *buf, size_t len, int *n) {
  WF_CHECK_ARG(s && buf && len > 0 && n, "store gone_ranks: NULL argument");
  buf[0] = '\0';
  wf_store_diag d;
  *n = wf_store_diagnose(s, wait_ms, &d);
  if (d.gone) snprintf(buf, len, "%s", d.gone_who);
  else if (d.unreachable) snprintf(buf, len, "%s", d.unreach_who);
  if (d.store_lost)
    return wf_error(WEFT_ECLOSED, "store gone_ranks: %s", d.store_why);
  return 0;
}

int wf_store_live_registered(weft_store *s) { return s && s->live_rank >= 0; }

int weft_store_finish(weft_store *s) {
  WF_CHECK_ARG(s, "store finish: NULL handle");
  s->live_finished = 1;
  return 0;
}
