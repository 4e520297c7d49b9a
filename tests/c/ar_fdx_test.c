/* ar_fdx_test.c — the descriptor exchange of src/cuda/vmm_fdx.c (what
 * src/cuda/vmm.c uses to share cuMem POSIX-fd handles), tested with memfds and
 * real processes, no GPU needed:
 *   1. n = 2, 4, 8 processes exchange: every one receives exactly the other
 *      n-1 descriptors, each pointing at the right peer's file;
 *   2. an intruder (same uid, wrong nonce / claiming another index) is
 *      dropped and the real exchange still completes;
 *   3. a peer that never sends: the others fail with WEFT_ETIMEOUT naming
 *      it, within the deadline;
 *   4. 300 exchanges in a row leak no descriptor.
 * Prints "PASS name" / "FAIL name: why"; exit status 0 only if all passed. */
#include "core/internal.h"
#include "cuda/vmm_fdx.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXN 8

typedef struct shared {
  volatile int arrived;       /* barrier arrivals, all generations */
  wf_fdx_id ids[MAXN];
  volatile int result[MAXN]; /* 1 ok, -1 failed */
  volatile int hold_rank1;    /* rank 1 waits until the intruder has sent */
  volatile int intruded;      /* the intruder's message went out */
  char why[MAXN][256];
} shared;

static shared *sh;
static int fails;

/* Every process calls barriers in the same sequence; the k-th call waits
 * until all n processes made their k-th call. */
static int nbarriers;
static void barrier(int n) {
  nbarriers++;
  __atomic_add_fetch(&sh->arrived, 1, __ATOMIC_SEQ_CST);
  int us = 0;
  while (__atomic_load_n(&sh->arrived, __ATOMIC_SEQ_CST) < n * nbarriers) wf_backoff(&us, 2000);
}

static int count_fds(void) {
  int k = 0;
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  while (d && (e = readdir(d)))
    if (e->d_name[0] != '.') k++;
  if (d) closedir(d);
  return k - 1; /* the DIR's own descriptor */
}

static int make_file(int rank, int iter) {
  int fd = memfd_create("weft-fdx-test", MFD_CLOEXEC);
  char buf[64];
  int len = snprintf(buf, sizeof buf, "rank %d iter %d", rank, iter);
  if (fd < 0 || write(fd, buf, (size_t)len) != len) return -1;
  return fd;
}

static int file_says(int fd, int rank, int iter) {
  char buf[64] = "", want[64];
  snprintf(want, sizeof want, "rank %d iter %d", rank, iter);
  ssize_t k = pread(fd, buf, sizeof buf - 1, 0);
  return k > 0 && strcmp(buf, want) == 0;
}

/* One rank of an exchange run: iters exchanges, each with a fresh listener
 * (as src/cuda/vmm.c does per workspace); dead: a rank that publishes its id and
 * then never sends (the others must time out naming it). */
static void child(int n, int me, int iters, int dead, int tmo_ms) {
  int us = 0;
  const int fd0 = count_fds();
  for (int it = 0; it < iters; it++) {
    int ls;
    if (wf_fdx_listen(&sh->ids[me], n, &ls)) {
      snprintf(sh->why[me], 256, "listen: %s", weft_last_error());
      sh->result[me] = -1;
      _exit(1);
    }
    barrier(n); /* ids published */
    if (me == dead) {
      barrier(n);
      sh->result[me] = 1;
      _exit(0);
    }
    while (me == 1 && sh->hold_rank1 && !sh->intruded) wf_backoff(&us, 2000);
    int myfd = make_file(me, it), fds[MAXN];
    int rc = wf_fdx_exchange(sh->ids, n, me, ls, myfd, fds, wf_now_ms() + tmo_ms, "fdx test");
    close(myfd);
    if (dead >= 0) {
      char want[32];
      snprintf(want, sizeof want, "peer(s) %d", dead);
      int ok = rc == WEFT_ETIMEOUT && strstr(weft_last_error(), want) != NULL;
      if (!ok) snprintf(sh->why[me], 256, "rc %d: %s", rc, weft_last_error());
      sh->result[me] = ok ? 1 : -1;
      barrier(n);
      _exit(ok ? 0 : 1);
    }
    if (rc) {
      snprintf(sh->why[me], 256, "iter %d: rc %d: %s", it, rc, weft_last_error());
      sh->result[me] = -1;
      _exit(1);
    }
    for (int r = 0; r < n; r++) {
      if (r == me) continue;
      if (fds[r] < 0 || !file_says(fds[r], r, it)) {
        snprintf(sh->why[me], 256, "iter %d: descriptor from %d wrong", it, r);
        sh->result[me] = -1;
        _exit(1);
      }
      close(fds[r]);
    }
    barrier(n); /* everyone is done with this round's ids and listeners */
    close(ls);
  }
  const int fd1 = count_fds();
  if (fd1 != fd0) {
    snprintf(sh->why[me], 256, "descriptors %d before, %d after %d exchanges", fd0, fd1, iters);
    sh->result[me] = -1;
    _exit(1);
  }
  sh->result[me] = 1;
  _exit(0);
}

/* Connect to rank 0's listener claiming index 1, wrong nonce, and send a fd. */
static void intruder(int n) {
  int us = 0;
  while (__atomic_load_n(&sh->arrived, __ATOMIC_SEQ_CST) < n) wf_backoff(&us, 2000);
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  char *p = a.sun_path + 1;
  p += sprintf(p, "weft-vmm-");
  for (int i = 0; i < WF_FDX_NONCE; i++) p += sprintf(p, "%02x", sh->ids[0].nonce[i]);
  socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)(p - a.sun_path));
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  if (connect(s, (struct sockaddr *)&a, len) != 0) _exit(1);
  struct { uint32_t magic; int32_t index; unsigned char nonce[WF_FDX_NONCE]; } m;
  memset(&m, 0x5a, sizeof m);
  m.magic = 0x77666478u;
  m.index = 1;
  int fd = make_file(1, 0); /* looks like the real thing */
  struct iovec iov = {.iov_base = &m, .iov_len = sizeof m};
  union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } c;
  memset(&c, 0, sizeof c);
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf, .msg_controllen = sizeof c.buf};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  if (sendmsg(s, &mh, MSG_NOSIGNAL) == (ssize_t)sizeof m) sh->intruded = 1;
  else sh->intruded = -1;
  close(s);
  _exit(0);
}

static void run(const char *name, int n, int iters, int dead, int with_intruder, int tmo_ms) {
  memset((void *)sh, 0, sizeof *sh);
  sh->hold_rank1 = with_intruder;
  pid_t pids[MAXN + 1];
  int np = 0;
  if (with_intruder) {
    /* the intruder starts first and races the real rank 1 */
    pid_t ip = fork();
    if (ip == 0) intruder(n);
    pids[np++] = ip;
  }
  for (int r = 0; r < n; r++) {
    pid_t p = fork();
    if (p == 0) child(n, r, iters, dead, tmo_ms);
    pids[np++] = p;
  }
  int64_t t0 = wf_now_ms();
  for (int i = 0; i < np; i++) waitpid(pids[i], NULL, 0);
  int64_t dt = wf_now_ms() - t0;
  int ok = 1;
  char why[600] = "";
  for (int r = 0; r < n; r++)
    if (sh->result[r] != 1) {
      ok = 0;
      snprintf(why, sizeof why, "rank %d: %s", r, sh->why[r][0] ? sh->why[r] : "died");
      break;
    }
  if (with_intruder && sh->intruded != 1) {
    ok = 0;
    snprintf(why, sizeof why, "the intruder could not send (%d): nothing was tested", sh->intruded);
  }
  if (dead >= 0 && dt > tmo_ms + 3000) {
    ok = 0;
    snprintf(why, sizeof why, "took %lld ms with a %d ms deadline", (long long)dt, tmo_ms);
  }
  if (ok) printf("PASS %s\n", name);
  else { printf("FAIL %s: %s\n", name, why); fails++; }
  fflush(stdout);
}

int main(void) {
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) { perror("mmap"); return 2; }
  run("exchange among 2 processes", 2, 3, -1, 0, 10000);
  run("exchange among 4 processes", 4, 3, -1, 0, 10000);
  run("exchange among 8 processes", 8, 2, -1, 0, 10000);
  run("an intruder with a wrong nonce is dropped", 2, 1, -1, 1, 10000);
  run("a peer that never sends: timeout names it", 3, 1, 2, 0, 1500);
  run("300 exchanges leak no descriptor", 2, 300, -1, 0, 10000);
  printf("%s\n", fails ? "SOME FAILED" : "ALL PASSED");
  return fails ? 1 : 0;
}
