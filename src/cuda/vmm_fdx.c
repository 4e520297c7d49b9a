/* vmm_fdx.c — descriptor exchange among the processes of a group on one
 * node (see vmm_fdx.h).
 *
 * Each process listens on "\0weft-vmm-<32 hex>" (abstract namespace: no file
 * to clean up, and the random name is known only to those who read it from
 * the store). Every process first connects to every peer's listener and
 * sends {magic, index, own nonce} + SCM_RIGHTS(fd) — a Unix stream socket
 * accepts data before accept(), so nobody blocks on anybody — then accepts
 * n-1 connections on its own listener. Both ends check SO_PEERCRED: same uid
 * and the pid the peer announced; the receiver also checks the sender's
 * nonce, index and that it has not heard from that index yet. Anything that
 * fails a check is dropped and the wait goes on, up to the deadline. */
#include "vmm_fdx.h"
#include "core/internal.h"

#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define FDX_MAGIC 0x77666478u /* "xdfw" */

typedef struct fdx_msg {
  uint32_t magic;
  int32_t index;
  unsigned char nonce[WF_FDX_NONCE];
} fdx_msg;

static void sock_name(struct sockaddr_un *a, socklen_t *len, const unsigned char *nonce) {
  static const char hex[] = "0123456789abcdef";
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  char *p = a->sun_path + 1; /* leading NUL: abstract namespace */
  p += sprintf(p, "weft-vmm-");
  for (int i = 0; i < WF_FDX_NONCE; i++) {
    *p++ = hex[nonce[i] >> 4];
    *p++ = hex[nonce[i] & 15];
  }
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)(p - a->sun_path));
}

static int remaining_ms(int64_t deadline) {
  int64_t r = deadline - wf_now_ms();
  return r < 0 ? 0 : (int)(r > 1000000 ? 1000000 : r);
}

/* 0 when the socket's other end runs as our uid (and as want_pid if > 0). */
static int check_cred(int fd, pid_t want_pid, const char *op, int peer) {
  struct ucred cr;
  socklen_t cl = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0)
    return wf_error_errno(WEFT_ESYS, "%s: SO_PEERCRED of peer %d", op, peer);
  if (cr.uid != getuid())
    return wf_error(WEFT_EAUTH, "%s: peer %d runs as uid %u, not %u: refused", op, peer,
                    (unsigned)cr.uid, (unsigned)getuid());
  if (want_pid > 0 && cr.pid != want_pid)
    return wf_error(WEFT_EAUTH, "%s: socket of peer %d belongs to pid %d, expected %d: refused",
                    op, peer, (int)cr.pid, (int)want_pid);
  return 0;
}

int wf_fdx_listen(wf_fdx_id *id, int backlog, int *listen_fd) {
  *listen_fd = -1;
  memset(id, 0, sizeof *id);
  id->pid = (int32_t)getpid();
  id->uid = (uint32_t)getuid();
  if (getrandom(id->nonce, WF_FDX_NONCE, 0) != WF_FDX_NONCE)
    return wf_error_errno(WEFT_ESYS, "fd exchange: getrandom");
  struct sockaddr_un a;
  socklen_t alen;
  sock_name(&a, &alen, id->nonce);
  int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (ls < 0) return wf_error_errno(WEFT_ESYS, "fd exchange: socket");
  if (bind(ls, (struct sockaddr *)&a, alen) != 0 || listen(ls, backlog) != 0) {
    int rc = wf_error_errno(WEFT_ESYS, "fd exchange: listen on an abstract unix socket");
    close(ls);
    return rc;
  }
  *listen_fd = ls;
  return 0;
}

/* Connect to peer's listener (bounded retries: its backlog may be full)
 * and send our descriptor with our index and nonce. */
static int send_fd(const wf_fdx_id *peer_id, int peer, const wf_fdx_id *mine, int me, int fd,
                   int64_t deadline, const char *op) {
  struct sockaddr_un a;
  socklen_t alen;
  sock_name(&a, &alen, peer_id->nonce);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) return wf_error_errno(WEFT_ESYS, "%s: socket", op);
  int us = 0, rc = 0;
  while (connect(s, (struct sockaddr *)&a, alen) != 0) {
    const int e = errno;
    if ((e != EAGAIN && e != ECONNREFUSED && e != EINTR) || remaining_ms(deadline) == 0) {
      errno = e;
      rc = wf_error_errno(e == EAGAIN || e == ECONNREFUSED ? WEFT_ETIMEOUT : WEFT_ESYS,
                          "%s: connect to peer %d", op, peer);
      goto out;
    }
    wf_backoff(&us, 20000);
  }
  rc = check_cred(s, (pid_t)peer_id->pid, op, peer);
  if (rc) goto out;
  fdx_msg m;
  memset(&m, 0, sizeof m);
  m.magic = FDX_MAGIC;
  m.index = me;
  memcpy(m.nonce, mine->nonce, WF_FDX_NONCE);
  struct iovec iov = {.iov_base = &m, .iov_len = sizeof m};
  union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } c;
  memset(&c, 0, sizeof c);
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf,
                      .msg_controllen = sizeof c.buf};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  for (;;) {
    ssize_t k = sendmsg(s, &mh, MSG_NOSIGNAL);
    if (k == (ssize_t)sizeof m) break;
    if (k >= 0) { rc = wf_error(WEFT_ESYS, "%s: short send to peer %d", op, peer); goto out; }
    if (errno != EAGAIN && errno != EINTR) {
      rc = wf_error_errno(WEFT_ESYS, "%s: sendmsg to peer %d", op, peer);
      goto out;
    }
    struct pollfd pf = {.fd = s, .events = POLLOUT};
    if (poll(&pf, 1, remaining_ms(deadline)) == 0) {
      rc = wf_error(WEFT_ETIMEOUT, "%s: send to peer %d timed out", op, peer);
      goto out;
    }
  }
out:
  close(s); /* the message and the descriptor stay queued for the peer */
  return rc;
}

/* Read one message + descriptor from an accepted connection; -1 if none. */
static int read_msg(int c, fdx_msg *m, int64_t deadline) {
  union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } cb;
  struct iovec iov = {.iov_base = m, .iov_len = sizeof *m};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.buf,
                      .msg_controllen = sizeof cb.buf};
  ssize_t k;
  for (;;) {
    k = recvmsg(c, &mh, MSG_CMSG_CLOEXEC);
    if (k >= 0 || (errno != EAGAIN && errno != EINTR)) break;
    struct pollfd cp = {.fd = c, .events = POLLIN};
    if (poll(&cp, 1, remaining_ms(deadline)) <= 0) break;
  }
  int fd = -1;
  for (struct cmsghdr *cm = k > 0 ? CMSG_FIRSTHDR(&mh) : NULL; cm; cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < nfd; i++) {  /* keep the first, close any extra */
      int x;
      memcpy(&x, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      if (fd < 0) fd = x;
      else close(x);
    }
  }
  if (k != (ssize_t)sizeof *m || (mh.msg_flags & MSG_CTRUNC)) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

static int recv_fds(int ls, const wf_fdx_id *ids, int n, int me, int *fds, int64_t deadline,
                    const char *op) {
  int got = 0;
  while (got < n - 1) {
    struct pollfd pf = {.fd = ls, .events = POLLIN};
    int pr = poll(&pf, 1, remaining_ms(deadline));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) {
      char missing[256] = "";
      size_t o = 0;
      for (int r = 0; r < n && o < sizeof missing - 12; r++)
        if (r != me && fds[r] < 0)
          o += (size_t)snprintf(missing + o, sizeof missing - o, "%s%d", o ? "," : "", r);
      return wf_error(WEFT_ETIMEOUT, "%s: descriptor exchange timed out: nothing from peer(s) %s",
                      op, missing);
    }
    int c = accept4(ls, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      return wf_error_errno(WEFT_ESYS, "%s: accept", op);
    }
    if (check_cred(c, 0, op, -1)) {
      wf_log(1, "%s: dropped a connection: %s", op, weft_last_error());
      close(c);
      continue;
    }
    fdx_msg m;
    int fd = read_msg(c, &m, deadline);
    const int valid = fd >= 0 && m.magic == FDX_MAGIC && m.index >= 0 && m.index < n &&
                      m.index != me && fds[m.index] < 0 &&
                      memcmp(m.nonce, ids[m.index].nonce, WF_FDX_NONCE) == 0 &&
                      check_cred(c, (pid_t)ids[m.index].pid, op, m.index) == 0;
    close(c);
    if (!valid) {
      if (fd >= 0) close(fd);
      wf_log(1, "%s: dropped an unverified descriptor message", op);
      continue;
    }
    fds[m.index] = fd;
    got++;
  }
  return 0;
}

int wf_fdx_exchange(const wf_fdx_id *ids, int n, int me, int listen_fd, int myfd, int *fds,
                    int64_t deadline_ms, const char *op) {
  for (int r = 0; r < n; r++)
    if (r != me) fds[r] = -1;
  int rc = 0;
  for (int k = 1; k < n && !rc; k++) {
    const int r = (me + k) % n;
    rc = send_fd(&ids[r], r, &ids[me], me, myfd, deadline_ms, op);
  }
  if (!rc) rc = recv_fds(listen_fd, ids, n, me, fds, deadline_ms, op);
  if (rc)
    for (int r = 0; r < n; r++)
      if (r != me && fds[r] >= 0) { close(fds[r]); fds[r] = -1; }
  return rc;
}
