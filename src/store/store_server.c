/* store_server.c — the store's server: one background pthread in the process
 * that opens with is_server=1. Non-blocking sockets, one poll() over the
 * listener, a self-pipe and every connection: replies, the handshake's claims,
 * the requests, the admission caps and the loop are here; the key table is in
 * store_table.c. Waits are server-side: a GET for absent keys parks the
 * connection until the keys are set or its deadline passes, so clients never
 * poll in loops (store_waiters.c). Liveness: store_server_live.c; reading
 * frames: store_frame_reader.c; what they share: store_server.h. */
#include "core/futex.h"
#include "store_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#define ACCEPT_BATCH 64        /* accepts per loop turn: reads interleave with a flood */

void conn_close(conn *c, const char *why) {
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
void resp_begin(conn *c, int32_t status) {
  c->out.len = 0;
  c->out.err = 0;
  wf_store_wb_reserve(&c->out, WF_ST_HDR);
  c->out.len = c->out.err ? 0 : WF_ST_HDR;
  wf_store_wb_u32(&c->out, (uint32_t)status);
}

void frame_end(srv *v, conn *c, int op) {
  if (c->out.err) { conn_close(c, "out of memory for a reply"); return; }
  wf_store_hdr_fill(c->out.p, op, 0, c->out.len - WF_ST_HDR);
  c->out_off = 0;
  /* Whole-reply deadline: a client reading 1 byte/s does not reset it. */
  c->wdeadline = wf_now_ms() + v->read_to + (int64_t)(c->out.len >> 10) * FRAME_MS_PER_KIB;
  conn_flush(v, c);
}

void resp_error(srv *v, conn *c, int32_t status, const char *msg) {
  resp_begin(c, status);
  wf_store_wb_key(&c->out, msg, strlen(msg));
  frame_end(v, c, WF_OP_RESP);
}

static void resp_ok(srv *v, conn *c) { resp_begin(c, 0); frame_end(v, c, WF_OP_RESP); }

/* The clear refusal of a value (or a frame, of `bytes`) over the total cap. */
void refuse_full(srv *v, conn *c, uint64_t bytes) {
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
void set_refused(srv *v, conn *c, int rc) {
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
void put_rejection_note(srv *v, conn *c) {
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

int handle_frame(srv *v, conn *c) {
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

/* A request arrived and is not read yet: the connection is not idle (closing
 * it would drop the request unanswered). */
static int bytes_waiting(int fd) {
  int n = 0;
  return ioctl(fd, FIONREAD, &n) == 0 && n > 0;
}

static void srv_expire(srv *v, int64_t now) {
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (c->dead) continue;
    if (c->state == C_PARKED && c->pdeadline <= now) get_missing_answer(v, c, WEFT_ETIMEOUT);
    else if (c->rdeadline && c->rdeadline <= now)
      conn_close(c, c->state == C_AUTH ? "handshake timed out" : "incomplete frame timed out");
    else if (c->wdeadline && c->wdeadline <= now) conn_close(c, "client is not reading");
    else if (v->idle_ms && conn_idle(c) && c->t_active + v->idle_ms <= now && !bytes_waiting(c->fd))
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
  int pe = wf_thread_start(&v->th, srv_main, v);
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
