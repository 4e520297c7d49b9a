/* store_client.c — a handle's connection to the server: one blocking socket,
 * guarded by the handle's mutex, with a deadline on every read and write;
 * connect with backoff, framed send and receive, one reconnect per call.
 * Every handle (the server's own included) is such a client. */
#include "store_share.h"
#include "store_internal.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define WAIT_GRACE_MS 5000          /* client waits this much past a server-side deadline */

void wf_store_cl_drop(weft_store *s) {
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

void wf_store_cl_describe(weft_store *s, char *buf, size_t n) {
  if (s->rank0[0]) snprintf(buf, n, "the store at %s, served by %s,", s->where, s->rank0);
  else snprintf(buf, n, "the store at %s", s->where);
}

static int io_error(weft_store *s, const char *op, int saved_errno, int timed_out) {
  wf_store_cl_drop(s);
  if (timed_out) {
    /* no reply at all: the server's host cannot be reached (a partition, a
     * vanished host) or is too busy to answer; liveness waits say which */
    char st[560];
    wf_store_cl_describe(s, st, sizeof st);
    s->unreachable = wf_now_ms();
    return wf_error(WEFT_ETIMEOUT, "%s: %s is unreachable: no reply within %lld ms",
                    op, st, (long long)(wf_now_ms() - s->t0));
  }
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
int wf_store_cl_read_frame(weft_store *s, const char *op, int64_t deadline, int *fop, wf_rd *rd) {
  uint8_t h[WF_ST_HDR];
  int rc = cl_recv_all(s, op, h, sizeof h, deadline);
  if (rc) return rc;
  if (wf_get_u32(h) != WF_ST_MAGIC || h[4] != WF_ST_VERSION) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: %s is not a weft store of protocol version %d",
                    op, s->where, WF_ST_VERSION);
  }
  uint64_t len = wf_get_u64(h + 8);
  if (len > SIZE_MAX / 4) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: reply of %llu bytes from %s", op, (unsigned long long)len, s->where);
  }
  s->resp.len = 0;
  s->resp.err = 0;
  wf_store_wb_reserve(&s->resp, (size_t)len);
  if (s->resp.err) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_ENOMEM, "%s: no memory for a reply of %llu bytes", op, (unsigned long long)len);
  }
  rc = cl_recv_all(s, op, s->resp.p, (size_t)len, deadline);
  if (rc) return rc;
  s->resp.len = (size_t)len;
  s->unreachable = 0;
  *fop = h[5];
  *rd = (wf_rd){s->resp.p, s->resp.len, 0, 0};
  return 0;
}

/* Request building: small fields go into s->rq, large values are referenced
 * in place (no copy of a 256 MiB value). */
void wf_store_rq_begin(weft_store *s) {
  wf_store_wb_trim(&s->rq);
  wf_store_wb_reserve(&s->rq, WF_ST_HDR);
  s->rq.len = s->rq.err ? 0 : WF_ST_HDR;
  s->nseg = 0;
  s->mark = 0;
  s->ext_total = 0;
}
static void rq_cut(weft_store *s) {
  if (s->rq.len > s->mark) s->segs[s->nseg++] = (wf_store_seg){NULL, s->mark, s->rq.len - s->mark};
  s->mark = s->rq.len;
}
void wf_store_rq_ext(weft_store *s, const void *p, size_t n) {
  if (n == 0) return;
  rq_cut(s);
  s->segs[s->nseg++] = (wf_store_seg){p, 0, n};
  s->ext_total += n;
}

int wf_store_cl_send(weft_store *s, const char *op, int fop, unsigned flags, int64_t deadline) {
  rq_cut(s);
  if (s->rq.err) return wf_error(WEFT_ENOMEM, "%s: out of memory for a request", op);
  wf_store_hdr_fill(s->rq.p, fop, flags, s->rq.len - WF_ST_HDR + s->ext_total);
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

static int hs_fail(weft_store *s, int code, const char *op, const char *what) {
  wf_store_cl_drop(s);
  return wf_error(code, "%s: the store at %s %s", op, s->where, what);
}

/* Right after connect: HELLO tells whether the server wants a secret; both
 * sides must agree on having one, then each proves it (store_auth.c). */
static int cl_handshake(weft_store *s, const char *op, int64_t deadline) {
  int fop;
  wf_rd r;
  wf_store_auth_cl a;
  int rc = wf_store_cl_read_frame(s, op, deadline, &fop, &r);
  if (rc) return rc;
  int g = fop == WF_OP_HELLO ? wf_store_auth_greet(&a, s->secret != NULL, &r) : WF_AUTH_NOT_A_STORE;
  if (g == WF_AUTH_NOT_A_STORE) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: %s did not greet like a weft store", op, s->where);
  }
  if (g == WF_AUTH_SECRET_MISSING)
    return hs_fail(s, WEFT_EAUTH, op, "requires a secret and none was given "
                                      "(set WEFT_STORE_SECRET or the secret option)");
  if (g == WF_AUTH_SERVER_HAS_NONE)
    return hs_fail(s, WEFT_EAUTH, op, "uses no secret but this client has one; "
                                      "refusing an unauthenticated server");
  /* AUTH always goes (it ends the pre-auth state); the claim says who we are. */
  wf_store_claim me;
  wf_store_claim_self(&me);
  wf_store_rq_begin(s);
  if (a.need) wf_store_auth_prove(&a, s->secret, &s->rq);
  wf_store_wb_claim(&s->rq, &me);
  if ((rc = wf_store_cl_send(s, op, WF_OP_AUTH, 0, deadline))) return rc;
  rc = wf_store_cl_read_frame(s, op, deadline, &fop, &r);
  /* A rejection is a RESP; a bare close (e.g. the server shedding pre-auth
   * connections in a flood) is ECLOSED, which open retries. */
  if (a.need && !rc && fop == WF_OP_RESP)
    return hs_fail(s, WEFT_EAUTH, op, "rejected this client: the secrets differ "
                                      "(check WEFT_STORE_SECRET on every rank)");
  if (rc) return rc;
  if (fop != WF_OP_AUTH_OK) {
    wf_store_cl_drop(s);
    return wf_error(WEFT_EPROTO, "%s: unexpected reply to the handshake from %s", op, s->where);
  }
  if (a.need && wf_store_auth_verify(&a, s->secret, &r))
    return hs_fail(s, WEFT_EAUTH, op, "could not prove it knows the secret");
  /* A reconnect must reach the server it knew: a new store on the same port
   * has none of the old keys (and a rank that shut down must not join it). */
  if (s->instance && a.instance != s->instance)
    return hs_fail(s, WEFT_ECLOSED, op, "is a new server: the one this handle used closed (store gone?)");
  s->instance = a.instance;
  return 0;
}

/* retry: keep trying with backoff until the deadline (open); otherwise one
 * attempt (a reconnect after a lost connection: a refusal means gone). */
int wf_store_cl_connect(weft_store *s, const char *op, int64_t deadline, int retry) {
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
    if (!retry && (err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH)) {
      char st[560];
      wf_store_cl_describe(s, st, sizeof st);
      s->unreachable = wf_now_ms();
      return wf_error(WEFT_ECLOSED, "%s: %s is unreachable (%s within %lld ms)", op, st, why,
                      (long long)(wf_now_ms() - s->t0));
    }
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

/* Whether the server closed this idle connection (it may, under pressure or
 * after WEFT_STORE_IDLE_MS): seen before sending, a reconnect is safe. The
 * server never speaks unasked, so any readable state means the end. */
static int cl_peer_closed(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  return poll(&p, 1, 0) > 0;
}

/* Sends the built request and reads the reply. Returns 0 with *status and a
 * reader positioned after it for status 0, ETIMEOUT and EAGAIN; other server
 * statuses become errors carrying the server's message. */
static int cl_call(weft_store *s, const char *op, int fop, unsigned flags, int64_t deadline,
                   int32_t *status, wf_rd *r) {
  int was_closed = 0;
  if (s->fd >= 0 && cl_peer_closed(s->fd)) {
    wf_log(2, "store: %s closed an idle connection; reconnecting", s->where);
    wf_store_cl_drop(s);
    was_closed = 1;
  }
reconnect:
  if (s->fd < 0) {
    if (s->no_reconnect)
      return wf_error(WEFT_ECLOSED, "%s: the server at %s closed the connection", op, s->where);
    int rc = wf_store_cl_connect(s, op, deadline, 0);
    if (rc == WEFT_ECLOSED && was_closed)  /* the store is gone, not just our connection */
      return wf_error(WEFT_ECLOSED, "%s: the server at %s closed the connection (store gone?)",
                      op, s->where);
    if (rc) return rc;
    rc = wf_store_live_rebind(s, op, deadline);  /* a new connection speaks for the rank */
    if (rc == WEFT_ECLOSED) {
      /* the new connection (the handshake done: the store is there) closed
       * before its first request was answered: this process stalled past
       * WEFT_STORE_IDLE_MS between the handshake and the rebind, and the
       * server closed it as idle. Another one, within the caller's count of
       * reconnects. */
      wf_log(2, "store: %s closed a new connection before its first request; reconnecting", s->where);
      wf_store_cl_drop(s);
      return 1;
    }
    if (rc) return rc;
    /* handshake may have used rq: the caller's request is rebuilt by retrying */
    return 1;
  }
  int rc = wf_store_cl_send(s, op, fop, flags, deadline);
  int rop = 0;
  if (!rc) rc = wf_store_cl_read_frame(s, op, deadline, &rop, r);
  if (rc == WEFT_ECLOSED && !was_closed && !s->no_reconnect) {
    /* closed with no reply: the server closed this connection as idle (or
     * shed it) as the request went out, between the look above and the
     * send, and never read it. A new connection takes the request again
     * (the caller retries, MAX_RECONNECTS at most); a store that is gone
     * refuses it. */
    wf_log(2, "store: %s closed the connection as a request went out; reconnecting", s->where);
    wf_store_cl_drop(s);
    was_closed = 1;
    goto reconnect;
  }
  if (rc) return rc;
  *status = (int32_t)wf_rd_u32(r);
  if (rop != WF_OP_RESP || r->bad) {
    wf_store_cl_drop(s);
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
  /* the grace never exceeds the handle's timeout: a short wait on a store
   * that stopped answering ends within the timeout, like any request */
  int64_t grace = WAIT_GRACE_MS < s->timeout_ms ? WAIT_GRACE_MS : s->timeout_ms;
  int64_t d = s->t0 + (wait_ms > 0 ? (int64_t)wait_ms + grace : s->timeout_ms);
  return s->cap && s->cap < d ? s->cap : d;
}

/* Reconnects one request may take: each follows a connection the server
 * closed unasked with the request unread (idle, shed), so resending is safe;
 * a process descheduled past WEFT_STORE_IDLE_MS right after reconnecting
 * can see its new connection closed too. More than this is not chance. */
#define MAX_RECONNECTS 4

/* Builds, sends and reads one request; rebuilt and sent again after each
 * reconnect (up to MAX_RECONNECTS, within the request's deadline). */
int wf_store_cl_request(weft_store *s, const char *op, int fop, unsigned flags, int wait_ms,
                        wf_store_build_fn build, const void *ctx, int32_t *status, wf_rd *r) {
  int64_t deadline = deadline_for(s, wait_ms);
  wf_store_wb_trim(&s->resp);
  for (int attempt = 0;; attempt++) {
    wf_store_rq_begin(s);
    build(s, ctx);
    int rc = cl_call(s, op, fop, flags, deadline, status, r);
    if (rc != 1) return rc;
    if (attempt >= MAX_RECONNECTS)
      return wf_error(WEFT_ECLOSED, "%s: lost the store at %s (it closed %d new connections in turn)",
                      op, s->where, attempt + 1);
  }
}

/* The local address of this handle's connection ("10.1.2.3"): the interface
 * that reaches the store's host, where engines that need an address of
 * their own (Gloo) listen. 0, or WEFT_ESTATE when not connected. */
int wf_store_local_addr(weft_store *s, char *buf, size_t n) {
  int rc = wf_store_lock(s, "store local address");
  if (rc) return rc;
  struct sockaddr_storage a;
  socklen_t len = sizeof a;
  rc = s->fd < 0 ? wf_error(WEFT_ESTATE, "store local address: not connected")
       : getsockname(s->fd, (struct sockaddr *)&a, &len) != 0
       ? wf_error_errno(WEFT_ESYS, "store local address: getsockname")
       : getnameinfo((struct sockaddr *)&a, len, buf, (socklen_t)n, NULL, 0, NI_NUMERICHOST) != 0
       ? wf_error(WEFT_ESYS, "store local address: getnameinfo failed") : 0;
  wf_store_unlock(s);
  return rc;
}
