/* store_server.c — the store's server: one background pthread in the process
 * that opens with is_server=1. Non-blocking sockets, one poll() over the
 * listener, a self-pipe and every connection; the key table lives here.
 * Waits are server-side: a GET for absent keys parks the connection until
 * the keys are set or its deadline passes, so clients never poll in loops. */
#include "core/futex.h"
#include "store_internal.h"

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
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define ACCEPT_BATCH 64        /* accepts per loop turn: reads interleave with a flood */
#define FRAME_MS_PER_KIB 1     /* whole-frame deadline: read timeout + 1 ms per KiB (~1 MB/s) */
/* The total cap (WEFT_STORE_MAX_TOTAL) refuses big values first: frames of
 * up to SMALL_FRAME bytes (the control plane: registrations, tombstones,
 * abort keys, votes) may go CONTROL_RESERVE past it, so a store filled with
 * data still lets the ranks fail and name why. */
#define SMALL_FRAME (64u << 10)
#define CONTROL_RESERVE (64ull << 20)
/* Reachability of registered ranks (live_reach): their connections carry
 * TCP keepalive probes every second of silence, which the far kernel
 * acknowledges even when the process is stopped or busy; no acknowledgement
 * for REACH_SILENT_MS means its host is cut off. Looked at every
 * REACH_CHECK_MS. */
#define REACH_CHECK_MS 250
#define REACH_SILENT_MS 1500

typedef struct entry {
  struct entry *next;
  uint64_t h;
  uint8_t *key;
  uint32_t klen;
  uint32_t reads;     /* >0: consume-reads left before the key is deleted */
  uint8_t *val;
  size_t vlen;
} entry;

/* What an entry really costs the server, the figure the total cap counts:
 * its key and value plus the entry itself, the malloc chunks of all three
 * (16-byte steps, 32 at least) and its share of the bucket table. Counting
 * only key and value bytes let a client hold ten times the cap in small
 * keys (5 M one-byte values under a 64 MiB cap: 690 MB). */
static uint64_t chunk_cost(size_t n) {
  uint64_t c = ((uint64_t)(n ? n : 1) + 8 + 15) & ~(uint64_t)15;
  return c < 32 ? 32 : c;
}
static uint64_t entry_cost(size_t klen, size_t vlen) {
  return chunk_cost(sizeof(entry)) + chunk_cost(klen) + chunk_cost(vlen) + 2 * sizeof(entry *);
}

enum { C_AUTH, C_READY, C_PARKED };

typedef struct conn {
  int fd, state, dead, close_after;
  uint8_t hdr[WF_ST_HDR];
  size_t hgot;
  int have_hdr;
  int op;
  unsigned flags;
  uint64_t plen;
  wf_store_wbuf in;    /* payload of the frame being read (kept while parked) */
  wf_store_kref pkey;  /* parked with WF_GET_PUT: the key it set (points into in) */
  int has_pkey;
  int64_t rdeadline;   /* incomplete frame / handshake must progress by then */
  wf_store_wbuf out;
  size_t out_off;
  int64_t wdeadline;
  wf_store_kref *keys; /* GET keys, pointing into in */
  int nkeys, capkeys;
  int cursor;          /* keys before it were present at the last look */
  unsigned gflags;
  int64_t pdeadline;   /* parked GET answers ETIMEOUT then */
  uint8_t snonce[WF_ST_NONCE];
  char peer[64];       /* the client's address, for messages */
  wf_store_claim claim;/* who it says it is (AUTH); rank -1 when unknown */
  int64_t t_active;    /* accept or last complete frame: idle policy, LRU */
  uint8_t *live_key;   /* WF_SET_LIVE: the key naming this connection's rank */
  uint32_t live_klen;
  int lost;            /* ended from the client's side (EOF, reset) */
  uint64_t held;       /* what its buffers count in inflight (account below) */
  int discard;         /* the frame is over the total cap: read, dropped, refused */
  uint64_t dgot;       /* payload bytes dropped so far */
  int unreach;         /* "<live key>/unreachable" is set for it */
} conn;

/* The server's state; wf_store_srv outside this file. */
typedef struct wf_store_srv {
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
  uint64_t max_total;           /* WEFT_STORE_MAX_TOTAL */
  uint64_t stored;              /* what the table's entries cost (entry_cost) */
  uint64_t inflight;            /* connections' buffers: frames being read, parked GETs */
  int64_t read_to;
  long max_conns, max_preauth;  /* admission caps (resolved at start) */
  int64_t idle_ms;              /* 0: idle authenticated connections stay */
  const char *secret;           /* owned by the weft_store */
  size_t slen;
  int64_t accept_pause_until;
  char where[300];
  uint64_t instance;            /* sent in HELLO: reconnects detect a new server */
  /* Rejections for a wrong secret, for the waiting ranks' messages. */
  int nrej;
  int64_t rej_t;
  char rej_text[480];           /* the last one */
  wf_store_claim rej_claim;
  int world;                    /* from the first authenticated claim; 0 unknown */
  uint8_t *joined;              /* [world]: ranks that authenticated */
  int blocked_rank;             /* a never-joined rank was rejected: waits fail */
  char block_msg[640];
  int64_t reach_next;           /* the next reachability look (live_reach) */
  int nothers;                  /* atomic: registered connections of other processes */
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

static entry *tab_find(srv *v, wf_store_kref k) {
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

/* Whether holding `add` more bytes would pass the total cap (small frames
 * may use the control reserve). */
static int over_total(const srv *v, uint64_t add) {
  uint64_t cap = v->max_total + (add <= SMALL_FRAME ? CONTROL_RESERVE : 0);
  return v->stored + v->inflight + add > cap;
}

/* The same for `add` more bytes of buffer for a frame of plen bytes (the
 * reserve is the small frames', whatever the step). */
static int over_total_frame(const srv *v, uint64_t plen, uint64_t add) {
  uint64_t cap = v->max_total + (plen <= SMALL_FRAME ? CONTROL_RESERVE : 0);
  return v->stored + v->inflight + add > cap;
}

/* The total cap counts every buffer a connection holds for a frame, not
 * only the table (issue 37): the body of a frame being read as it arrives
 * (never what its header claims: a header alone holds nothing), and a
 * parked GET's request and key list for as long as it waits. Between
 * frames a connection keeps at most SMALL_FRAME bytes of request buffer
 * and 1024 key slots (shed), bounded by the connection caps. */
static void account(srv *v, conn *c) {
  uint64_t now = (c->state == C_PARKED || c->have_hdr)
                     ? (uint64_t)c->in.cap + (uint64_t)c->capkeys * sizeof *c->keys : 0;
  v->inflight = v->inflight - c->held + now;
  c->held = now;
}

/* A request is done with (answered, or parked no more): drop big buffers. */
static void shed(conn *c) {
  if (c->in.cap > SMALL_FRAME) wf_store_wb_free(&c->in);
  else wf_store_wb_trim(&c->in);
  if (c->capkeys > 1024) { free(c->keys); c->keys = NULL; c->capkeys = 0; c->nkeys = 0; }
  c->has_pkey = 0;
}

/* Sets key to a copy of val; 0 ok, -1 out of memory, -2 over the total cap. */
static int tab_set(srv *v, wf_store_kref k, const void *val, size_t vlen, uint32_t reads) {
  uint64_t h = key_hash(k.p, k.len);
  entry **pp = tab_slot(v, k.p, k.len, h);
  /* a new key is always checked, an empty value included: its key and
   * entry are held too */
  uint64_t old = *pp ? entry_cost((*pp)->klen, (*pp)->vlen) : 0, cost = entry_cost(k.len, vlen);
  if (cost > old && over_total(v, cost - old)) return -2;
  uint8_t *copy = malloc(vlen ? vlen : 1);
  if (!copy) return -1;
  if (vlen) memcpy(copy, val, vlen);
  if (*pp) {
    free((*pp)->val);
    (*pp)->val = copy;
    (*pp)->vlen = vlen;
    (*pp)->reads = reads;
    v->stored = v->stored - old + cost;
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
  v->stored += cost;
  if (v->nent > v->nb) tab_grow(v);  /* failure only costs speed */
  return 0;
}

static int tab_del(srv *v, wf_store_kref k) {
  entry **pp = tab_slot(v, k.p, k.len, key_hash(k.p, k.len));
  if (!*pp) return 0;
  entry *e = *pp;
  *pp = e->next;
  v->stored -= entry_cost(e->klen, e->vlen);
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
  (void)v;
  while (!c->dead && c->out_off < c->out.len) {
    ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) { c->out_off += (size_t)n; continue; }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    c->lost = errno == EPIPE || errno == ECONNRESET;
    conn_close(c, "send failed");
    return;
  }
  if (c->dead) return;
  wf_store_wb_trim(&c->out);
  c->out_off = 0;
  c->wdeadline = 0;
  if (c->close_after) conn_close(c, NULL);
}

/* Response framing: begin reserves the header, end fills it and sends. */
static void resp_begin(conn *c, int32_t status) {
  c->out.len = 0;
  c->out.err = 0;
  wf_store_wb_reserve(&c->out, WF_ST_HDR);
  c->out.len = c->out.err ? 0 : WF_ST_HDR;
  wf_store_wb_u32(&c->out, (uint32_t)status);
}

static void frame_end(srv *v, conn *c, int op) {
  if (c->out.err) { conn_close(c, "out of memory for a reply"); return; }
  wf_store_hdr_fill(c->out.p, op, 0, c->out.len - WF_ST_HDR);
  c->out_off = 0;
  /* Whole-reply deadline: a client reading 1 byte/s does not reset it. */
  c->wdeadline = wf_now_ms() + v->read_to + (int64_t)(c->out.len >> 10) * FRAME_MS_PER_KIB;
  conn_flush(v, c);
}

static void resp_error(srv *v, conn *c, int32_t status, const char *msg) {
  resp_begin(c, status);
  wf_store_wb_key(&c->out, msg, strlen(msg));
  frame_end(v, c, WF_OP_RESP);
}

static void resp_ok(srv *v, conn *c) { resp_begin(c, 0); frame_end(v, c, WF_OP_RESP); }

/* The clear refusal of a value (or a frame, of `bytes`) over the total cap. */
static void refuse_full(srv *v, conn *c, uint64_t bytes) {
  char msg[400];
  snprintf(msg, sizeof msg, "the store is full: %llu more bytes would pass its total limit of %llu "
           "bytes (it holds %llu bytes of keys, values and their entries, %llu more for requests "
           "being received or waiting; "
           "WEFT_STORE_MAX_TOTAL, docs/store.md)", (unsigned long long)bytes,
           (unsigned long long)v->max_total, (unsigned long long)v->stored,
           (unsigned long long)v->inflight);
  wf_log(1, "store server: %s", msg);
  resp_error(v, c, WEFT_ENOMEM, msg);
}

/* A failed tab_set (rc -1: no memory, -2: over the total cap) of the frame just read. */
static void set_refused(srv *v, conn *c, int rc) {
  if (rc == -2) refuse_full(v, c, c->in.len);
  else resp_error(v, c, WEFT_ENOMEM, "server out of memory");
}

/* ---- claims and rejections: what the waiting ranks are told ----
 * A client rejected for a wrong secret is recorded (address and claimed
 * rank) and named in every later GET timeout. When it claimed a rank of the
 * world that has not joined yet (the misconfigured rank itself, as far as
 * anyone can tell), that rank can never arrive: parked and later waits fail
 * at once with the reason instead of after the timeout. A claim of a rank
 * that already joined only goes into the messages, so a stranger with a
 * wrong secret cannot abort a running world (docs/store.md). */

static void fail_parked(srv *v, conn *c);

/* Whether the last rejected claim names a rank of the world that has not
 * joined; then every wait fails. Checked at the rejection and when the world
 * becomes known (the rejected rank may have been quicker than rank 0). */
static void rejection_blocks(srv *v) {
  int r = v->rej_claim.rank;
  if (!v->nrej || r < 0 || v->world == 0 || v->rej_claim.world != v->world || v->joined[r]) return;
  v->blocked_rank = r;
  snprintf(v->block_msg, sizeof v->block_msg,
           "%s, so rank %d cannot join and this wait cannot complete "
           "(set the same WEFT_STORE_SECRET on every rank)", v->rej_text, r);
  for (int i = 0; i < v->nc; i++)
    if (!v->c[i]->dead && v->c[i]->state == C_PARKED) fail_parked(v, v->c[i]);
}

static void claim_joined(srv *v, const wf_store_claim *cl) {
  if (cl->rank < 0) return;
  int first = v->world == 0;
  if (first && (v->joined = calloc((size_t)cl->world, 1))) v->world = cl->world;
  if (cl->world != v->world) return;
  v->joined[cl->rank] = 1;
  if (v->blocked_rank == cl->rank) v->blocked_rank = -1;
  if (first) rejection_blocks(v);
}

static void claim_rejected(srv *v, conn *c) {
  char who[320];
  wf_store_fmt_claim(who, sizeof who, &c->claim);
  snprintf(v->rej_text, sizeof v->rej_text,
           "a client from %s (%s) was rejected for a wrong WEFT_STORE_SECRET", c->peer, who);
  v->rej_t = wf_now_ms();
  v->rej_claim = c->claim;
  v->nrej++;
  wf_log(1, "store server: %s", v->rej_text);
  rejection_blocks(v);
}

/* The note appended to a GET that timed out or was not ready. */
static void put_rejection_note(srv *v, conn *c) {
  if (!v->nrej) return;
  char note[600];
  double ago = (double)(wf_now_ms() - v->rej_t) / 1000.0;
  int n = v->nrej > 1
    ? snprintf(note, sizeof note, "%s %.1f s ago (%d rejections in all)", v->rej_text, ago, v->nrej)
    : snprintf(note, sizeof note, "%s %.1f s ago", v->rej_text, ago);
  wf_store_wb_key(&c->out, note, n < 0 ? 0 : (size_t)n < sizeof note ? (size_t)n : sizeof note - 1);
}

/* AUTH: [proof,] claim. Ends the pre-auth state or rejects. */
static int handle_auth(srv *v, conn *c, wf_rd *r) {
  uint8_t proof[32];
  int a = v->slen ? wf_store_auth_check(v->secret, v->slen, c->snonce, r, proof) : 0;
  if (a < 0 || wf_store_rd_claim(r, &c->claim) || r->pos != r->len) return -1;
  if (a > 0) {
    claim_rejected(v, c);
    c->close_after = 1;
    resp_error(v, c, WEFT_EAUTH, "the secrets differ");
    return 0;
  }
  c->state = C_READY;
  c->rdeadline = 0;
  claim_joined(v, &c->claim);
  c->out.len = 0;
  wf_store_wb_reserve(&c->out, WF_ST_HDR);
  c->out.len = c->out.err ? 0 : WF_ST_HDR;
  if (v->slen) wf_store_wb_put(&c->out, proof, 32);
  frame_end(v, c, WF_OP_AUTH_OK);
  return 0;
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
    wf_store_wb_u32(&c->out, (uint32_t)c->nkeys);
    for (int i = 0; i < c->nkeys; i++) {
      entry *e = tab_find(v, c->keys[i]);
      wf_store_wb_val(&c->out, e->val, e->vlen);
    }
  }
  if (c->gflags & WF_GET_CONSUME)
    for (int i = 0; i < c->nkeys; i++) {
      entry *e = tab_find(v, c->keys[i]);
      if (e && e->reads > 0 && --e->reads == 0) tab_del(v, c->keys[i]);
    }
  int was_parked = c->state == C_PARKED;
  c->state = C_READY;
  frame_end(v, c, WF_OP_RESP);
  if (was_parked) { shed(c); account(v, c); }
}

static void get_missing_answer(srv *v, conn *c, int32_t status) {
  int was_parked = c->state == C_PARKED;
  resp_begin(c, status);
  wf_store_wb_u32(&c->out, (uint32_t)get_missing(v, c));
  for (int i = 0; i < c->nkeys; i++) if (!tab_find(v, c->keys[i])) wf_store_wb_u32(&c->out, (uint32_t)i);
  put_rejection_note(v, c);
  c->state = C_READY;
  frame_end(v, c, WF_OP_RESP);
  if (was_parked) { shed(c); account(v, c); }
}

/* A wait that cannot complete: a rank of the world was rejected (above). */
static void fail_parked(srv *v, conn *c) {
  int was_parked = c->state == C_PARKED;
  c->state = C_READY;
  resp_error(v, c, WEFT_EAUTH, v->block_msg);
  if (was_parked) { shed(c); account(v, c); }
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
  wf_store_kref pk = {0};
  const uint8_t *pv = NULL;
  size_t pn = 0;
  uint32_t preads = 0;
  if (put) {
    preads = wf_rd_u32(r);
    if (wf_store_rd_key(r, &pk) || wf_store_rd_val(r, v->max_value, &pv, &pn)) return -1;
  }
  uint32_t n = wf_rd_u32(r);
  if (r->bad || n == 0 || n > WF_ST_MAX_NKEYS) return -1;
  if ((int)n > c->capkeys) {
    wf_store_kref *k = realloc(c->keys, n * sizeof *k);
    if (!k) return -1;
    c->keys = k;
    c->capkeys = (int)n;
  }
  for (uint32_t i = 0; i < n; i++) if (wf_store_rd_key(r, &c->keys[i])) return -1;
  if (r->pos != r->len) return -1;
  c->nkeys = (int)n;
  c->cursor = 0;
  c->gflags = c->flags;
  int giveup = put && (c->flags & WF_GET_GIVEUP);
  if (put && !giveup) {
    int rc = tab_set(v, pk, pv, pn, preads);
    if (rc) { set_refused(v, c, rc); return 0; }
    wake_waiters(v);
  }
  if (get_complete(v, c)) get_answer(v, c);
  else if (giveup) {
    /* the collective's keys go and its abort key comes in one step: no
     * member arriving later completes it (WF_GET_GIVEUP) */
    for (int i = 0; i < c->nkeys; i++) tab_del(v, c->keys[i]);
    int rc = tab_set(v, pk, pv, pn, preads);
    if (rc) { set_refused(v, c, rc); return 0; }
    wake_waiters(v);
    get_missing_answer(v, c, WEFT_EAGAIN);
  }
  else if (timeout <= 0) get_missing_answer(v, c, WEFT_EAGAIN);
  else if (v->blocked_rank >= 0) fail_parked(v, c);
  else {
    c->state = C_PARKED;
    c->pdeadline = wf_now_ms() + timeout;
    c->pkey = pk;
    c->has_pkey = put;
  }
  return 0;
}

/* ---- liveness (store_live.c): a rank's key and its tombstone ---- */

/* Removes c's "<live key>/unreachable" mark. */
static void live_unmark(srv *v, conn *c) {
  uint8_t key[WF_ST_MAX_KEY + 16];
  if (!c->live_key || c->live_klen + 12 > sizeof key) return;
  memcpy(key, c->live_key, c->live_klen);
  memcpy(key + c->live_klen, "/unreachable", 12);
  tab_del(v, (wf_store_kref){key, c->live_klen + 12});
}

/* c now speaks for the rank that key names (a reconnect takes it over). */
static void live_bind(srv *v, conn *c, wf_store_kref k) {
  for (int i = 0; i < v->nc; i++) {
    conn *o = v->c[i];
    if (o != c && o->live_key && o->live_klen == k.len && !memcmp(o->live_key, k.p, k.len)) {
      free(o->live_key);
      o->live_key = NULL;
    }
  }
  uint8_t *copy = malloc(k.len + 5);
  if (!copy) return;  /* only costs the early death report */
  memcpy(copy, k.p, k.len);
  memcpy(copy + k.len, "/gone", 5);
  tab_del(v, (wf_store_kref){copy, k.len + 5});  /* alive again */
  free(c->live_key);
  c->live_key = copy;
  c->live_klen = k.len;
  live_unmark(v, c);
  c->unreach = 0;
  /* probes on every second of silence; given up only after ~2 minutes,
   * when the kernel ends the connection (then a tombstone) */
  int one = 1, idle = 1, intvl = 1, cnt = 120;
  setsockopt(c->fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(c->fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(c->fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(c->fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

/* The rank of c is cut off from this host: "<key>/unreachable" holds its
 * registration value while no acknowledgement comes (store_live.c reads it
 * for messages; nothing waits on it). */
static void live_reach(srv *v, int64_t now) {
  if (now < v->reach_next) return;
  v->reach_next = now + REACH_CHECK_MS;
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (c->dead || !c->live_key) continue;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue;
    int silent = ti.tcpi_last_ack_recv > REACH_SILENT_MS;
    if (silent == c->unreach) continue;
    if (!silent) { live_unmark(v, c); c->unreach = 0; continue; }
    entry *e = tab_find(v, (wf_store_kref){c->live_key, c->live_klen});
    if (!e) continue;  /* left cleanly */
    uint8_t key[WF_ST_MAX_KEY + 16];
    if (c->live_klen + 12 > sizeof key) continue;
    memcpy(key, c->live_key, c->live_klen);
    memcpy(key + c->live_klen, "/unreachable", 12);
    wf_log(1, "store server: no TCP acknowledgement from the rank of '%.*s' (%.*s, %s) for %u ms",
           (int)c->live_klen, c->live_key, (int)e->vlen, e->val, c->peer, ti.tcpi_last_ack_recv);
    uint8_t *val = malloc(e->vlen ? e->vlen : 1);
    if (!val) continue;
    memcpy(val, e->val, e->vlen);
    if (!tab_set(v, (wf_store_kref){key, c->live_klen + 12}, val, e->vlen, 0)) c->unreach = 1;
    free(val);
  }
}

/* c ended from the rank's side while its key exists (a clean close deletes
 * the key first): the rank is gone; "<key>/gone" tells every waiter. */
static void live_gone(srv *v, conn *c) {
  entry *e = tab_find(v, (wf_store_kref){c->live_key, c->live_klen});
  if (!e) return;
  wf_log(1, "store server: the rank of '%.*s' is gone (%.*s)", (int)c->live_klen, c->live_key,
         (int)e->vlen, e->val);
  uint8_t *val = malloc(e->vlen ? e->vlen : 1);
  if (!val) return;
  memcpy(val, e->val, e->vlen);
  size_t vlen = e->vlen;
  if (!tab_set(v, (wf_store_kref){c->live_key, c->live_klen + 5}, val, vlen, 0)) wake_waiters(v);
  free(val);
  /* liveness waits look at the tombstones now, not at the end of their slice
   * (the store's host may fail and close the store right after) */
  for (int i = 0; i < v->nc; i++) {
    conn *o = v->c[i];
    if (!o->dead && o->state == C_PARKED && (o->gflags & WF_GET_LIVE)) get_missing_answer(v, o, WEFT_EAGAIN);
  }
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

/* A request that changes the table, from a client that has closed its
 * connection by now (its end of file is queued behind the frame): the
 * client gave up on it (no reply within its bound: this server was stopped
 * or starved) and told its caller it failed, so running it now would make
 * that failure a lie. A cpu group member that gave up so while the store's
 * host was stopped had its key of the collective set when the server
 * resumed, and the others completed the collective it failed (issue 24).
 * Every client waits for the reply of each request, so a closed connection
 * never carries one that is still wanted. A DELETE still runs: it only
 * takes back (a rank's leave, a member's own key), which stays right late,
 * and a leave dropped would mark a rank that shut down as dead. */
static int left_before_run(conn *c) {
  int mutating = c->op == WF_OP_SET || c->op == WF_OP_ADD || c->op == WF_OP_CAS ||
                 (c->op == WF_OP_GET && (c->flags & WF_GET_PUT));
  if (!mutating) return 0;
  char b;
  return recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

static int handle_frame(srv *v, conn *c) {
  wf_rd r = {c->in.p, c->in.len, 0, 0};
  wf_store_kref k;
  const uint8_t *a, *b;
  size_t an, bn;
  switch (c->op) {
  case WF_OP_AUTH:
    return handle_auth(v, c, &r);
  case WF_OP_SET: {
    uint32_t reads = wf_rd_u32(&r);
    if (wf_store_rd_key(&r, &k) || wf_store_rd_val(&r, v->max_value, &a, &an) || r.pos != r.len) return -1;
    int rc = tab_set(v, k, a, an, reads);
    if (rc) { set_refused(v, c, rc); return 0; }
    if (c->flags & WF_SET_LIVE) live_bind(v, c, k);
    resp_ok(v, c);
    wake_waiters(v);
    return 0;
  }
  case WF_OP_GET:
    return handle_get(v, c, &r);
  case WF_OP_ADD: {
    if (wf_store_rd_key(&r, &k)) return -1;
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
    int rc = tab_set(v, k, num, (size_t)len, 0);
    if (rc) { set_refused(v, c, rc); return 0; }
    resp_begin(c, 0);
    wf_store_wb_u64(&c->out, (uint64_t)cur);
    frame_end(v, c, WF_OP_RESP);
    if (!e) wake_waiters(v);
    return 0;
  }
  case WF_OP_CHECK: {
    uint32_t n = wf_rd_u32(&r);
    if (r.bad || n > WF_ST_MAX_NKEYS) return -1;
    int all = 1;
    for (uint32_t i = 0; i < n; i++) {
      if (wf_store_rd_key(&r, &k)) return -1;
      if (!tab_find(v, k)) all = 0;
    }
    if (r.pos != r.len) return -1;
    resp_begin(c, 0);
    wf_store_wb_u8(&c->out, (uint8_t)all);
    frame_end(v, c, WF_OP_RESP);
    return 0;
  }
  case WF_OP_CAS: {
    if (wf_store_rd_key(&r, &k) || wf_store_rd_val(&r, v->max_value, &a, &an) ||
        wf_store_rd_val(&r, v->max_value, &b, &bn) || r.pos != r.len)
      return -1;
    entry *e = tab_find(v, k);
    int swap = e ? (e->vlen == an && memcmp(e->val, a, an) == 0) : an == 0;
    if (swap) {
      int rc = tab_set(v, k, b, bn, 0);
      if (rc) { set_refused(v, c, rc); return 0; }
      e = tab_find(v, k);
    }
    resp_begin(c, 0);
    if (e) wf_store_wb_val(&c->out, e->val, e->vlen);
    else wf_store_wb_val(&c->out, NULL, 0);  /* absent and not created: empty */
    frame_end(v, c, WF_OP_RESP);
    if (swap) wake_waiters(v);
    return 0;
  }
  case WF_OP_DELETE: {
    if (wf_store_rd_key(&r, &k) || r.pos != r.len) return -1;
    int d = tab_del(v, k);
    resp_begin(c, 0);
    wf_store_wb_u8(&c->out, (uint8_t)d);
    frame_end(v, c, WF_OP_RESP);
    return 0;
  }
  case WF_OP_NUM_KEYS:
    if (r.len != 0) return -1;
    resp_begin(c, 0);
    wf_store_wb_u64(&c->out, (uint64_t)v->nent);
    frame_end(v, c, WF_OP_RESP);
    return 0;
  }
  return -1;
}

/* Largest payload each op may declare; anything above closes the connection
 * before a byte of it is buffered. */
static uint64_t op_limit(srv *v, int state, int op) {
  uint64_t key = 4 + WF_ST_MAX_KEY, keys = 4 + WF_ST_MAX_KEYBYTES + 4ull * WF_ST_MAX_NKEYS;
  uint64_t claim = 12 + 4 + WF_ST_MAX_HOST;
  if (state == C_AUTH && op == WF_OP_AUTH) return (v->slen ? 2 * WF_ST_NONCE : 0) + claim;
  if (state == C_AUTH && v->slen) return 0;  /* nothing but AUTH before the proof */
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

/* A frame must arrive whole by its deadline, set when its first byte comes
 * (plen 0) and extended once the header tells the size: a sender trickling
 * 1 byte/s does not move it. Pre-auth connections keep the handshake's. */
static void frame_deadline(srv *v, conn *c, uint64_t plen) {
  if (plen == 0) c->rdeadline = wf_now_ms() + v->read_to;
  else c->rdeadline += (int64_t)(plen >> 10) * FRAME_MS_PER_KIB;
}

static void conn_read(srv *v, conn *c) {
  if (c->out.len) return;  /* a reply is still going out */
  if (c->state == C_PARKED) {
    /* A parked client only waits; bytes or EOF here end the connection. */
    uint8_t b;
    ssize_t n = recv(c->fd, &b, 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) c->lost = 1;
    /* It gave up on its collective (no reply within its bound: this server
     * was stopped or starved) and told its caller so: the key it set goes
     * too, or a member arriving later would complete that collective. */
    if (c->has_pkey) tab_del(v, c->pkey);
    c->has_pkey = 0;
    conn_close(c, n > 0 ? "data from a client that is waiting" : NULL);
    return;
  }
  size_t budget = 8u << 20;  /* fairness between connections */
  while (!c->dead && budget > 0) {
    if (!c->have_hdr) {
      ssize_t n = recv(c->fd, c->hdr + c->hgot, WF_ST_HDR - c->hgot, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) { c->lost = 1; conn_close(c, c->hgot ? "connection ended inside a frame" : NULL); return; }
      if (c->hgot == 0 && c->state == C_READY) frame_deadline(v, c, 0);
      c->hgot += (size_t)n;
      if (c->hgot < WF_ST_HDR) continue;
      c->op = c->hdr[5];
      c->flags = (unsigned)c->hdr[6] << 8 | c->hdr[7];
      c->plen = wf_get_u64(c->hdr + 8);
      if (wf_get_u32(c->hdr) != WF_ST_MAGIC || c->hdr[4] != WF_ST_VERSION) {
        conn_close(c, "bad magic or version (not a weft store client?)");
        return;
      }
      uint64_t lim = op_limit(v, c->state, c->op);
      if (lim == UINT64_MAX || (c->state == C_AUTH && c->op != WF_OP_AUTH && v->slen)) {
        conn_close(c, "unexpected frame type");
        return;
      }
      /* Without a secret a request may come first: a client without a claim. */
      if (c->state == C_AUTH && c->op != WF_OP_AUTH) c->state = C_READY;
      if (c->plen > lim) {
        wf_log(1, "store server: frame of %llu bytes over the limit of %llu (WEFT_STORE_MAX_VALUE)",
               (unsigned long long)c->plen, (unsigned long long)lim);
        conn_close(c, "oversized frame");
        return;
      }
      c->have_hdr = 1;
      c->in.len = 0;
      c->in.err = 0;
      if (c->state == C_READY) frame_deadline(v, c, c->plen);
      /* a big frame that would pass the total cap is read and dropped, then
       * refused: the client gets a clear answer, the server holds nothing */
      if (c->state == C_READY && c->plen > SMALL_FRAME && over_total(v, c->plen)) {
        c->discard = 1;
        c->dgot = 0;
      }
    }
    if (c->discard) {
      if (c->dgot < c->plen) {
        uint8_t junk[16384];
        size_t room = sizeof junk;
        if (room > c->plen - c->dgot) room = (size_t)(c->plen - c->dgot);
        if (room > budget) room = budget;
        ssize_t n = recv(c->fd, junk, room, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n <= 0) { c->lost = 1; conn_close(c, "connection ended inside a frame"); return; }
        c->dgot += (uint64_t)n;
        budget -= (size_t)n;
        if (c->dgot < c->plen) continue;
      }
      c->discard = 0;
      c->have_hdr = 0;
      c->hgot = 0;
      account(v, c);
      c->t_active = wf_now_ms();
      c->rdeadline = 0;
      refuse_full(v, c, c->plen);
      return;
    }
    if (c->in.len < c->plen) {
      size_t want = (size_t)c->plen - c->in.len;
      if (c->in.cap - c->in.len < want) {
        /* Grow with what arrives, not with what the header claims. */
        size_t step = c->in.cap > (64u << 10) ? c->in.cap : (64u << 10);
        size_t grow = want < step ? want : step;
        /* the cap counts the buffer as it grows: another frame, or a
         * sender that never finishes, may have taken the room the header
         * check saw; then the rest is read and dropped, and refused */
        size_t target = c->in.len + grow;  /* exactly: never past the frame's size */
        if (c->state == C_READY && over_total_frame(v, c->plen, target - c->in.cap)) {
          c->discard = 1;
          c->dgot = c->in.len;
          wf_store_wb_free(&c->in);
          account(v, c);
          continue;
        }
        uint8_t *q = realloc(c->in.p, target);
        if (!q) { conn_close(c, "out of memory for a frame"); return; }
        c->in.p = q;
        c->in.cap = target;
        account(v, c);
      }
      size_t room = c->in.cap - c->in.len;
      if (room > want) room = want;
      if (room > budget) room = budget;
      ssize_t n = recv(c->fd, c->in.p + c->in.len, room, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) { c->lost = 1; conn_close(c, "connection ended inside a frame"); return; }
      c->in.len += (size_t)n;
      budget -= (size_t)n;
      if (c->in.len < c->plen) continue;
    }
    c->have_hdr = 0;
    c->hgot = 0;
    c->t_active = wf_now_ms();
    if (c->state == C_READY) c->rdeadline = 0;
    account(v, c);  /* the frame is whole: from here the table counts what it keeps */
    if (left_before_run(c)) {
      c->lost = 1;
      conn_close(c, "the client gave up and closed its connection before its request ran: dropped");
      return;
    }
    if (handle_frame(v, c) < 0) { conn_close(c, "malformed frame"); return; }
    if (c->state != C_PARKED) shed(c);
    account(v, c);  /* a parked GET holds its request and keys while it waits */
    if (c->dead || c->state == C_PARKED || c->out.len) return;
  }
}

/* ---- admission: caps on connections, oldest idle pre-auth shed first ----
 * Pre-auth connections (no AUTH yet; honest clients send it within a round
 * trip) are capped at max_preauth and must finish within the read timeout;
 * all connections are capped at max_conns. At a cap the oldest idle
 * pre-auth connection is closed first, then the least recently active idle
 * authenticated one (the client reconnects on its next call); parked
 * waiters and frames in flight are never shed. docs/store.md. */

static void count_conns(srv *v, int *live, int *preauth) {
  *live = *preauth = 0;
  for (int i = 0; i < v->nc; i++)
    if (!v->c[i]->dead) { (*live)++; if (v->c[i]->state == C_AUTH) (*preauth)++; }
}

/* 1 bytes are waiting, 0 nothing yet, -1 the peer is gone. */
static int conn_pending(conn *c) {
  uint8_t b;
  ssize_t n = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return 1;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  return -1;
}

/* Frees one pre-auth slot: reads a client whose AUTH is already waiting
 * (it may leave pre-auth that way), else closes the oldest idle one, else
 * the oldest. 1 when a slot was freed. */
static int shed_preauth(srv *v) {
  conn *oldest = NULL;
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (c->dead || c->state != C_AUTH) continue;
    int p = conn_pending(c);
    if (p > 0) {
      conn_read(v, c);
      if (c->dead || c->state != C_AUTH) return 1;
    } else if (p < 0 || (c->hgot == 0 && !c->have_hdr)) {
      conn_close(c, p < 0 ? NULL : "oldest idle pre-auth connection shed (WEFT_STORE_MAX_PREAUTH)");
      return 1;
    }
    if (!oldest) oldest = c;
  }
  if (!oldest) return 0;
  conn_close(oldest, "oldest pre-auth connection shed (WEFT_STORE_MAX_PREAUTH)");
  return 1;
}

static int conn_idle(const conn *c) {
  return c->state == C_READY && c->hgot == 0 && !c->have_hdr && c->out.len == 0;
}

/* Frees one connection slot: a pre-auth one, else the least recently
 * active idle authenticated one. 1 when one was closed. */
static int shed_any(srv *v, int preauth) {
  if (preauth > 0 && shed_preauth(v)) return 1;
  conn *lru = NULL;
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (!c->dead && conn_idle(c) && (!lru || c->t_active < lru->t_active)) lru = c;
  }
  if (!lru) return 0;
  conn_close(lru, "least recently active idle connection shed (WEFT_STORE_MAX_CONNS)");
  return 1;
}

static void peer_name(char *out, size_t cap, const struct sockaddr_storage *ss, socklen_t sl) {
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (getnameinfo((const struct sockaddr *)ss, sl, h, sizeof h, p, sizeof p,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) { snprintf(out, cap, "?"); return; }
  wf_store_fmt_where(out, cap, h, atoi(p));
}

static void conn_add(srv *v, int fd, const struct sockaddr_storage *ss, socklen_t sl);

static void srv_accept(srv *v) {
  int live, preauth;
  count_conns(v, &live, &preauth);
  for (int k = 0; k < ACCEPT_BATCH; k++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(v->lfd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int e = errno;
      if (e == EINTR || e == ECONNABORTED) continue;
      if ((e == EMFILE || e == ENFILE) && shed_any(v, preauth)) {  /* out of fds: make one */
        count_conns(v, &live, &preauth);
        continue;
      }
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        wf_log(1, "store server: accept: %s; pausing accepts", strerror(e));
        v->accept_pause_until = wf_now_ms() + 100;
      }
      return;
    }
    if (preauth >= v->max_preauth || live >= v->max_conns) {
      if (preauth >= v->max_preauth) shed_preauth(v);
      if (live >= v->max_conns) shed_any(v, preauth);
      count_conns(v, &live, &preauth);
      if (live >= v->max_conns) {
        wf_log(1, "store server: %d connections (WEFT_STORE_MAX_CONNS), none idle: refusing one", live);
        close(fd);
        continue;
      }
    }
    conn_add(v, fd, &ss, sl);
    live++;
    preauth++;
  }
}

static void conn_add(srv *v, int fd, const struct sockaddr_storage *ss, socklen_t sl) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  conn *c = calloc(1, sizeof *c);
  if (c && v->nc == v->capc) {
    int cap = v->capc ? v->capc * 2 : 16;
    conn **nc = realloc(v->c, (size_t)cap * sizeof *nc);
    if (nc) { v->c = nc; v->capc = cap; }
  }
  if (!c || v->nc == v->capc) { free(c); close(fd); return; }
  c->fd = fd;
  c->state = C_AUTH;  /* until AUTH, in both modes */
  c->t_active = wf_now_ms();
  c->rdeadline = c->t_active + v->read_to;  /* the handshake must finish */
  c->claim.rank = c->claim.world = -1;
  peer_name(c->peer, sizeof c->peer, ss, sl);
  wf_store_random_bytes(c->snonce, sizeof c->snonce);
  v->c[v->nc++] = c;
  wf_store_wb_reserve(&c->out, WF_ST_HDR);
  c->out.len = c->out.err ? 0 : WF_ST_HDR;
  wf_store_wb_u8(&c->out, v->slen ? 1 : 0);
  wf_store_wb_put(&c->out, c->snonce, WF_ST_NONCE);
  wf_store_wb_u64(&c->out, v->instance);
  frame_end(v, c, WF_OP_HELLO);
}

static void conn_free(conn *c) {
  if (!c->dead) close(c->fd);
  wf_store_wb_free(&c->in);
  wf_store_wb_free(&c->out);
  free(c->keys);
  free(c->live_key);
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
    else if (v->idle_ms && conn_idle(c) && c->t_active + v->idle_ms <= now)
      conn_close(c, "idle past WEFT_STORE_IDLE_MS");
  }
  for (int i = 0; i < v->nc; i++)
    if (v->c[i]->dead && v->c[i]->lost && v->c[i]->live_key) live_gone(v, v->c[i]);
  for (int i = 0; i < v->nc; i++)
    if (v->c[i]->dead && v->c[i]->unreach) live_unmark(v, v->c[i]);
  live_reach(v, now);
  int j = 0;
  for (int i = 0; i < v->nc; i++) {
    if (v->c[i]->dead) { v->inflight -= v->c[i]->held; conn_free(v->c[i]); }
    else v->c[j++] = v->c[i];
  }
  v->nc = j;
  int others = 0;
  uint32_t me = (uint32_t)getpid();
  for (int i = 0; i < v->nc; i++) {
    const conn *c = v->c[i];
    if (c->live_key && !(c->claim.pid == me && !strcmp(c->claim.host, wf_hostname()))) others++;
  }
  __atomic_store_n(&v->nothers, others, __ATOMIC_RELEASE);
}

int wf_store_srv_others(wf_store_srv *v) {
  return v ? __atomic_load_n(&v->nothers, __ATOMIC_ACQUIRE) : 0;
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
      if (v->idle_ms && conn_idle(c)) next = earliest(next, c->t_active + v->idle_ms);
      if (c->live_key) next = earliest(next, v->reach_next);
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
      /* parked waiters first: after this server was stopped, the clients
       * that gave up meanwhile take their keys back before a late member's
       * frame could complete their collective with them */
      for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
          conn *c = v->c[i];
          short re = v->pfd[i + 2].revents;
          if (!re || c->dead || (c->state == C_PARKED) != (pass == 0)) continue;
          if ((re & POLLOUT) || c->out.len) conn_flush(v, c);  /* errors surface in send */
          else conn_read(v, c);
        }
      if (v->pfd[1].revents) srv_accept(v);
    }
    srv_expire(v, wf_now_ms());
  }
  return NULL;
}

/* The fd budget: the soft RLIMIT_NOFILE goes up to the hard one (a flood
 * must meet the caps below, not EMFILE), and the total cap leaves an eighth
 * of it (at least 64) to the rest of the process. */
static long raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < rl.rlim_max) {
    rlim_t want = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_max;
    struct rlimit nr = {want, rl.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &nr) == 0) {
      wf_log(1, "store server: raised the open-file limit from %llu to %llu",
             (unsigned long long)rl.rlim_cur, (unsigned long long)want);
      rl.rlim_cur = want;
    }
  }
  return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 20) ? 1L << 20 : (long)rl.rlim_cur;
}

static void srv_limits(srv *v) {
  wf_store_limits l;
  wf_env_store_limits(&l);
  long fds = raise_nofile(), reserve = fds / 8 > 64 ? fds / 8 : 64;
  long derived = fds - reserve > 16 ? fds - reserve : 16;
  v->read_to = l.read_ms;
  v->idle_ms = l.idle_ms;
  v->max_conns = l.max_conns > 0 ? l.max_conns : derived;
  v->max_preauth = l.max_preauth;
  if (l.max_total > 0) v->max_total = (uint64_t)l.max_total;
  else {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    uint64_t quarter = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 4 : 0;
    v->max_total = quarter > (1ull << 30) ? quarter : (1ull << 30);
  }
  wf_log(2, "store server: at most %ld connections, %ld pre-auth, handshake %lld ms, %llu bytes held",
         v->max_conns, v->max_preauth, (long long)v->read_to, (unsigned long long)v->max_total);
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
  free(v->joined);
  if (v->lfd >= 0) close(v->lfd);
  if (v->wake[0] >= 0) close(v->wake[0]);
  if (v->wake[1] >= 0) close(v->wake[1]);
  free(v);
}

void wf_store_srv_stop(wf_store_srv *v) {
  if (!v) return;
  if (v->started) {
    __atomic_store_n(&v->stop, 1, __ATOMIC_RELEASE);
    char b = 1;
    while (write(v->wake[1], &b, 1) < 0 && errno == EINTR) {}
    pthread_join(v->th, NULL);
  }
  srv_free(v);
}

int wf_store_srv_start(const char *bind_host, int port, const char *secret, wf_store_srv **out,
                       int *actual_port) {
  char where[300], portstr[16];
  wf_store_fmt_where(where, sizeof where, bind_host, port);
  srv *v = calloc(1, sizeof *v);
  if (!v) return wf_error(WEFT_ENOMEM, "store open: out of memory for the server");
  v->lfd = v->wake[0] = v->wake[1] = -1;
  v->nb = 64;
  v->tab = calloc(v->nb, sizeof *v->tab);
  v->max_value = wf_store_env_max_value();
  srv_limits(v);
  v->blocked_rank = -1;
  wf_store_random_bytes((uint8_t *)&v->instance, sizeof v->instance);
  v->instance |= 1;  /* never 0 (0: not said) */
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
  wf_store_fmt_where(v->where, sizeof v->where, bind_host, *actual_port);
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
