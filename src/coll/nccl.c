/* nccl.c — device collectives through NCCL, one communicator per group.
 *
 * libnccl.so.2 is dlopen'ed on first use (only nccl.h types are used here), so
 * libweft loads without it. Two modes (docs/gpu-runtime.md):
 *
 *  - split (the default): a NON-blocking parent is created first, so its
 *    init is polled against the group deadline; after an all-or-nothing vote
 *    ncclCommSplit(parent, 0, rank) makes a BLOCKING child, the communicator
 *    every call goes to (inline enqueue, no NCCL helper thread per call).
 *    On a non-blocking parent the split itself runs on NCCL's group thread
 *    and is polled the same way; aborting the parent raises the in-flight
 *    child's abort flag and joins that thread, so an expired split is ended
 *    with ncclCommAbort(parent) and then ncclCommAbort(child). The parent
 *    is created with splitShare=1, so the child shares its abort flag: a
 *    blocking call that waits on a peer inside NCCL (lazy connection setup,
 *    finalize) is ended by the watchdog thread, which aborts the parent once
 *    the call's deadline passes; the caller then aborts the child.
 *  - non-blocking (WEFT_NCCL_BLOCKING=0 or blocking=0): the parent is the
 *    communicator; every call may answer ncclInProgress and is polled.
 *
 * Every wait polls ncclCommGetAsyncError against the group's deadline; on a
 * timeout or an error the communicator is aborted (its kernels exit) and the
 * error names the group, the rank and the operation. Arguments are validated
 * before anything is enqueued, so a refused call leaves the state unchanged.
 * Variable-size collectives are grouped broadcasts / reduces / send-recv. */
#include "cuda/cuda_internal.h"
#include "host/cpugroup.h"

#if WEFT_HAVE_CUDA
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FN(name) __typeof__(&name) name
static struct {
  FN(ncclGetVersion);
  FN(ncclGetUniqueId);
  FN(ncclCommInitRankConfig);
  FN(ncclCommSplit);
  FN(ncclCommGetAsyncError);
  FN(ncclGetErrorString);
  FN(ncclGetLastError);
  FN(ncclCommFinalize);
  FN(ncclCommDestroy);
  FN(ncclCommAbort);
  FN(ncclAllReduce);
  FN(ncclAllGather);
  FN(ncclReduceScatter);
  FN(ncclBroadcast);
  FN(ncclReduce);
  FN(ncclSend);
  FN(ncclRecv);
  FN(ncclGroupStart);
  FN(ncclGroupEnd);
} nc;
#undef FN

enum { MODE_NONBLOCKING = 0, MODE_SPLIT = 1 };
#define WD_FIRED ((int64_t)-1)
#define WD_TICK_MS 200

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_rc;
static char g_msg[512];
static int g_check_ptrs;
static int g_mode_default;
static int g_split_share;
static int g_version;

struct weft_nccl {
  ncclComm_t comm;              /* where calls go: the child (split) or the only one */
  ncclComm_t parent;            /* split mode: the non-blocking parent, kept as the
                                   abort handle of the shared abort flag */
  ncclComm_t split_out;         /* written by NCCL's split thread (heap, not stack) */
  char name[64];
  int index, size, dev, timeout_ms;
  int mode;
  int share;                    /* the child shares the parent's abort flag */
  int aborted;                  /* atomic */
  int busy;                     /* one call at a time (atomic) */
  int64_t wd_deadline;          /* atomic: deadline of the blocking call in flight (ms),
                                   0 none, WD_FIRED once the watchdog took over */
  int wd_done;                  /* atomic: the watchdog finished its abort */
  const char *wd_op;
  const char *last_op;          /* for messages after a failed wait */
  int64_t finalized_ms;         /* when destroy's finalize ended (for the log) */
  struct weft_nccl *next;       /* registry of live communicators */
};

static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static weft_nccl *g_reg;

/* Communicators with work in the calling thread's open group (group_end polls them). */
#define MAX_GROUP_COMMS 64
static __thread int tl_group_depth;
static __thread weft_nccl *tl_group[MAX_GROUP_COMMS];
static __thread int tl_group_n;

static void load_once(void) {
  /* NVLink SHARP needs multicast objects, which this project keeps off. */
  if (wf_env_long("WEFT_ALLOW_MULTICAST", 0) != 1) setenv("NCCL_NVLS_ENABLE", "0", 1);
  g_check_ptrs = wf_env_long("WEFT_NCCL_CHECK_POINTERS", 1) != 0;
  g_mode_default = wf_env_long("WEFT_NCCL_BLOCKING", 1) == 0 ? MODE_NONBLOCKING : MODE_SPLIT;
  /* NCCL's own variable overrides the config field; follow it so the
   * watchdog knows whether aborting the parent reaches the child. */
  g_split_share = wf_env_long("NCCL_COMM_SPLIT_SHARE_RESOURCES", 1) != 0;
  const char *want = wf_env_str("WEFT_NCCL_LIB");
  const char *cands[] = {want, "libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2",
                         "/usr/lib/x86_64-linux-gnu/libnccl.so.2"};
  void *h = NULL;
  const char *why = "not found";
  for (size_t i = 0; i < sizeof cands / sizeof *cands && !h; i++) {
    if (!cands[i]) continue;
    h = dlopen(cands[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) why = dlerror();
    if (want) break;          /* an explicit path is not second-guessed */
  }
  if (!h) {
    snprintf(g_msg, sizeof g_msg, "nccl: cannot load %s (%s)", want ? want : "libnccl.so.2", why);
    g_rc = WEFT_ENODEV;
    return;
  }
#define SYM(name)                                                              \
  do {                                                                         \
    void *p_ = dlsym(h, #name);                                                \
    if (!p_) {                                                                 \
      snprintf(g_msg, sizeof g_msg, "nccl: %s missing in libnccl (need >= 2.19)", #name); \
      g_rc = WEFT_ENODEV;                                                      \
      return;                                                                  \
    }                                                                          \
    memcpy(&nc.name, &p_, sizeof p_);                                          \
  } while (0)
  SYM(ncclGetVersion);
  SYM(ncclGetUniqueId);
  SYM(ncclCommInitRankConfig);
  SYM(ncclCommSplit);
  SYM(ncclCommGetAsyncError);
  SYM(ncclGetErrorString);
  SYM(ncclGetLastError);
  SYM(ncclCommFinalize);
  SYM(ncclCommDestroy);
  SYM(ncclCommAbort);
  SYM(ncclAllReduce);
  SYM(ncclAllGather);
  SYM(ncclReduceScatter);
  SYM(ncclBroadcast);
  SYM(ncclReduce);
  SYM(ncclSend);
  SYM(ncclRecv);
  SYM(ncclGroupStart);
  SYM(ncclGroupEnd);
#undef SYM
  nc.ncclGetVersion(&g_version);
  wf_log(1, "nccl: loaded version %d (NCCL_NVLS_ENABLE=%s)", g_version,
         getenv("NCCL_NVLS_ENABLE") ? getenv("NCCL_NVLS_ENABLE") : "unset");
  if (wf_env_str("NCCL_COMM_BLOCKING"))
    wf_log(0, "nccl: NCCL_COMM_BLOCKING=%s overrides weft's communicator modes (=1 makes "
           "init and split unbounded, =0 makes every call non-blocking)",
           wf_env_str("NCCL_COMM_BLOCKING"));
}

static int load(void) {
  int rc = wf_cuda_init();
  if (rc) return rc;
  pthread_once(&g_once, load_once);
  if (g_rc) return wf_error(g_rc, "%s", g_msg);
  return 0;
}

int weft_nccl_version(int *version) {
  WF_CHECK_ARG(version, "nccl version: NULL out-parameter");
  *version = 0;
  int rc = load();
  if (rc) return rc;
  *version = g_version;
  return 0;
}

/* ---- errors, waits, abort ---- */

static int nccl_err(weft_nccl *c, const char *op, ncclResult_t r) {
  const char *detail = (c && c->comm) ? nc.ncclGetLastError(c->comm) : nc.ncclGetLastError(NULL);
  int code = (r == ncclInvalidArgument || r == ncclInvalidUsage) ? WEFT_EINVAL : WEFT_ENCCL;
  if (c)
    return wf_error(code, "nccl %s: group '%s' (rank %d of %d, cuda:%d): %s%s%s", op, c->name,
                    c->index, c->size, c->dev, nc.ncclGetErrorString(r),
                    detail && *detail ? ": " : "", detail ? detail : "");
  return wf_error(code, "nccl %s: %s%s%s", op, nc.ncclGetErrorString(r),
                  detail && *detail ? ": " : "", detail ? detail : "");
}

static int timeout_err(weft_nccl *c, const char *op, const char *where) {
  return wf_error(WEFT_ETIMEOUT, "nccl %s: group '%s' (rank %d of %d): not complete within %d ms "
                  "(%sa peer did not arrive?); communicator aborted", op, c->name, c->index,
                  c->size, c->timeout_ms, where ? where : "");
}

/* Local and final: the child first, then the parent (after a successful
 * split they are independent, or share refcounted resources). */
static void do_abort(weft_nccl *c) {
  if (__atomic_exchange_n(&c->aborted, 1, __ATOMIC_ACQ_REL)) return;
  if (c->comm) nc.ncclCommAbort(c->comm);
  c->comm = NULL;
  if (c->parent) nc.ncclCommAbort(c->parent);
  c->parent = NULL;
}

/* Polls comm until it leaves ncclInProgress; ncclInProgress if the deadline
 * passed first. An enqueue or init step by NCCL's thread takes micro- to
 * milliseconds: yield a while before sleeping (a sleep costs ~60 µs). */
static ncclResult_t poll_until(ncclComm_t comm, int64_t deadline) {
  int us = 0, polls = 0;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = nc.ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (wf_now_ms() > deadline) return ncclInProgress;
    if (++polls <= 500) sched_yield();
    else wf_backoff(&us, 1000);
  }
}

/* Wait until the communicator has no operation in progress (non-blocking calls). */
static int wait_ready(weft_nccl *c, const char *op) {
  ncclResult_t st = poll_until(c->comm, wf_now_ms() + c->timeout_ms);
  if (st == ncclSuccess) return 0;
  int rc = st == ncclInProgress ? timeout_err(c, op, NULL) : nccl_err(c, op, st);
  do_abort(c);
  return st == ncclInProgress ? rc : wf_error_context(rc, "communicator aborted");
}

/* ---- watchdog: bounds blocking calls on a split communicator ----
 * A blocking call arms its deadline (two atomic stores around the call). The
 * watchdog thread wakes every WD_TICK_MS while split communicators exist; a
 * call past its deadline is taken over (CAS to WD_FIRED): the parent is
 * aborted, which raises the abort flag the child shares, so NCCL's waits in
 * the call (bootstrap, connection setup, kernels, finalize) return. The
 * caller sees WD_FIRED when it disarms and aborts the child itself, so no
 * communicator is freed while a call is inside it. */
static pthread_once_t g_wd_once = PTHREAD_ONCE_INIT;
static pthread_cond_t g_wd_cv;
static int g_wd_rc;

static void wd_fire(weft_nccl *c) {   /* g_reg_mu held */
  if (c->parent) {
    wf_log(0, "nccl: group '%s' (rank %d of %d): %s blocked inside NCCL for more than %d ms; "
           "aborting", c->name, c->index, c->size, c->wd_op ? c->wd_op : "call", c->timeout_ms);
    nc.ncclCommAbort(c->parent);
    c->parent = NULL;
  } else {
    wf_log(0, "nccl: group '%s' (rank %d of %d): %s blocked inside NCCL for more than %d ms and "
           "cannot be interrupted (NCCL_COMM_SPLIT_SHARE_RESOURCES=0)", c->name, c->index,
           c->size, c->wd_op ? c->wd_op : "call", c->timeout_ms);
  }
  __atomic_store_n(&c->wd_done, 1, __ATOMIC_RELEASE);
}

static void *wd_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&g_reg_mu);
  for (;;) {
    int any = 0;
    int64_t now = wf_now_ms();
    for (weft_nccl *c = g_reg; c; c = c->next) {
      if (c->mode != MODE_SPLIT) continue;
      any = 1;
      int64_t d = __atomic_load_n(&c->wd_deadline, __ATOMIC_ACQUIRE);
      if (d > 0 && now > d &&
          __atomic_compare_exchange_n(&c->wd_deadline, &d, WD_FIRED, 0, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE))
        wd_fire(c);
    }
    if (!any) {
      pthread_cond_wait(&g_wd_cv, &g_reg_mu);
      continue;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += WD_TICK_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec += 1;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&g_wd_cv, &g_reg_mu, &ts);
  }
  return NULL;
}

static void wd_start_once(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g_wd_cv, &a);
  pthread_condattr_destroy(&a);
  pthread_t t;
  pthread_attr_t ta;
  pthread_attr_init(&ta);
  pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
  g_wd_rc = pthread_create(&t, &ta, wd_main, NULL);
  pthread_attr_destroy(&ta);
}

static inline void wd_arm(weft_nccl *c, const char *op) {
  if (c->mode != MODE_SPLIT) return;
  c->wd_op = op;
  __atomic_store_n(&c->wd_deadline, wf_now_ms() + c->timeout_ms, __ATOMIC_RELEASE);
}

/* 0: the call ended in time. 1: the watchdog took it over; on return its
 * abort of the parent has finished (or, if that never returns, the child is
 * given up without an abort, so nothing frees memory NCCL still uses). */
static int wd_disarm(weft_nccl *c) {
  if (c->mode != MODE_SPLIT) return 0;
  int64_t d = __atomic_load_n(&c->wd_deadline, __ATOMIC_ACQUIRE);
  while (d != WD_FIRED)
    if (__atomic_compare_exchange_n(&c->wd_deadline, &d, 0, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return 0;
  int64_t limit = wf_now_ms() + c->timeout_ms;
  int us = 0;
  while (!__atomic_load_n(&c->wd_done, __ATOMIC_ACQUIRE) && wf_now_ms() < limit)
    wf_backoff(&us, 10000);
  if (!__atomic_load_n(&c->wd_done, __ATOMIC_ACQUIRE)) {
    __atomic_store_n(&c->aborted, 1, __ATOMIC_RELEASE);
    c->comm = NULL;
  }
  return 1;
}

/* After wd_disarm said 1: abort what is left, report the expired call. */
static int wd_expired(weft_nccl *c, const char *op) {
  do_abort(c);
  return timeout_err(c, op, "blocked inside NCCL; ");
}

int wf_nccl_poll_all(const char *op) {
  if (!nc.ncclCommGetAsyncError) return 0;   /* never loaded: nothing to poll */
  int rc = 0;
  pthread_mutex_lock(&g_reg_mu);
  for (weft_nccl *c = g_reg; c && !rc; c = c->next) {
    /* a communicator inside a call belongs to its caller, who sees the error too */
    if (c->aborted || !c->comm || __atomic_load_n(&c->busy, __ATOMIC_ACQUIRE)) continue;
    ncclResult_t st = ncclSuccess;
    if (nc.ncclCommGetAsyncError(c->comm, &st) != ncclSuccess) continue;
    if (st != ncclSuccess && st != ncclInProgress) {
      rc = nccl_err(c, c->last_op ? c->last_op : "collective", st);
      do_abort(c);
      rc = wf_error_context(rc, "%s: communicator aborted", op);
    }
  }
  pthread_mutex_unlock(&g_reg_mu);
  return rc;
}

static void reg_add(weft_nccl *c) {
  pthread_mutex_lock(&g_reg_mu);
  c->next = g_reg;
  g_reg = c;
  if (c->mode == MODE_SPLIT) pthread_cond_signal(&g_wd_cv);
  pthread_mutex_unlock(&g_reg_mu);
}

static void reg_remove(weft_nccl *c) {
  pthread_mutex_lock(&g_reg_mu);
  for (weft_nccl **pp = &g_reg; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  pthread_mutex_unlock(&g_reg_mu);
}

/* ---- create / destroy ---- */

typedef struct {
  uint32_t magic, ok;
  int32_t size, version;
  ncclUniqueId id;
  char why[256];
} id_msg;
#define ID_MAGIC 0x5746494Eu /* "WFIN" */

/* Test hook: WEFT_NCCL_TEST_STALL="<phase>:<ms>" (phase init or split) makes
 * this rank sleep before that phase of create: a peer that does not arrive. */
static void test_stall(const char *phase) {
  const char *v = wf_env_str("WEFT_NCCL_TEST_STALL");
  size_t n = strlen(phase);
  if (!v || strncmp(v, phase, n) != 0 || v[n] != ':') return;
  long ms = strtol(v + n + 1, NULL, 10);
  if (ms <= 0) return;
  wf_log(1, "nccl: WEFT_NCCL_TEST_STALL: sleeping %ld ms before %s", ms, phase);
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* All proceed or all fail together: 0 only when every rank's rc was 0. */
static int vote(weft_cpugroup *g, const char *gname, int rc, const char *phase) {
  char emsg[1024];
  snprintf(emsg, sizeof emsg, "%s", rc ? weft_last_error() : "");
  int64_t all = rc == 0;
  int vrc = weft_cpugroup_allreduce_i64(g, &all, 1, WEFT_AND);
  if (rc) return wf_error(rc, "%s", emsg);
  if (vrc) return wf_error_context(vrc, "nccl create: group '%s': %s vote", gname, phase);
  if (!all)
    return wf_error(WEFT_ENCCL, "nccl create: group '%s': %s failed on another rank", gname,
                    phase);
  return 0;
}

/* The non-blocking communicator (the parent, or the only one): its init runs
 * on NCCL's thread and is polled against the deadline. */
static int init_nonblocking(weft_nccl *c, const ncclUniqueId *id) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  cfg.commName = c->name;
  /* NCCL decides from the PARENT's splitShare whether a child shares its
   * abort flag and resources (NCCL_COMM_SPLIT_SHARE_RESOURCES overrides) */
  if (c->mode == MODE_SPLIT) cfg.splitShare = c->share;
  ncclComm_t comm = NULL;
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  ncclResult_t r = nc.ncclCommInitRankConfig(&comm, c->size, *id, c->index, &cfg);
  if (r == ncclSuccess || r == ncclInProgress)
    r = comm ? poll_until(comm, deadline) : ncclInternalError;
  if (r == ncclSuccess) {
    c->comm = comm;
    return 0;
  }
  int rc = r == ncclInProgress ? timeout_err(c, "init", NULL) : nccl_err(c, "init", r);
  if (comm) nc.ncclCommAbort(comm);   /* joins NCCL's init thread */
  return rc;
}

/* The blocking child of c->comm. On a non-blocking parent ncclCommSplit
 * answers ncclInProgress and runs on NCCL's group thread: the parent's state
 * says when it ends, and NCCL stores the child then (also when it failed). A
 * split that returns ncclSuccess already ran inline. */
static int split_blocking(weft_nccl *c) {
  ncclComm_t parent = c->comm;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  cfg.commName = c->name;
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  __atomic_store_n(&c->split_out, NULL, __ATOMIC_RELEASE);
  ncclResult_t r = nc.ncclCommSplit(parent, 0, c->index, &c->split_out, &cfg);
  if (r == ncclSuccess || r == ncclInProgress) r = poll_until(parent, deadline);
  ncclComm_t child = __atomic_load_n(&c->split_out, __ATOMIC_ACQUIRE);
  if (r == ncclSuccess && !child) r = ncclInternalError;
  /* a newer NCCL may hand the child out before its own init ends */
  if (r == ncclSuccess) r = poll_until(child, deadline);
  if (r == ncclSuccess) {
    c->parent = parent;
    c->comm = child;
    return 0;
  }
  int rc = r == ncclInProgress ? timeout_err(c, "split", NULL) : nccl_err(c, "split", r);
  /* Parent first: that raises the in-flight child's abort flag and joins the
   * split thread (which then stores the child); the failed child still has
   * the parent pointing at its flag, so it must go second. */
  nc.ncclCommAbort(parent);
  c->comm = NULL;
  child = __atomic_load_n(&c->split_out, __ATOMIC_ACQUIRE);
  if (child) nc.ncclCommAbort(child);
  return rc;
}

static int discard(weft_nccl *c, int rc) {
  do_abort(c);
  free(c);
  return rc;
}

int weft_nccl_create(weft_cpugroup *g, int blocking, weft_nccl **out) {
  WF_CHECK_ARG(out, "nccl create: NULL out-parameter");
  *out = NULL;
  WF_CHECK_ARG(g, "nccl create: NULL cpu group");
  const char *gname = NULL;
  int size = 0, index = -1, timeout_ms = 0;
  int rc = wf_cpugroup_info(g, &gname, &size, &index, NULL, &timeout_ms);
  if (rc) return wf_error_context(rc, "nccl create");
  if (!gname) gname = "?";
  if (timeout_ms <= 0) timeout_ms = 300000;

  /* Everyone must be able to load NCCL before index 0 makes an id: vote. */
  int lrc = load();
  char lmsg[256];
  snprintf(lmsg, sizeof lmsg, "%s", lrc ? weft_last_error() : "");
  int dev = -1;
  if (!lrc) lrc = wf_cuda_device(&dev);
  int mode = blocking < 0 ? g_mode_default : blocking ? MODE_SPLIT : MODE_NONBLOCKING;
  if (!lrc && mode == MODE_SPLIT) {
    pthread_once(&g_wd_once, wd_start_once);
    if (g_wd_rc) {
      lrc = WEFT_ENOMEM;
      snprintf(lmsg, sizeof lmsg, "nccl create: group '%s': cannot start the watchdog thread "
               "(pthread_create: %s)", gname, strerror(g_wd_rc));
    }
  }
  int64_t ok = lrc == 0;
  rc = weft_cpugroup_allreduce_i64(g, &ok, 1, WEFT_AND);
  if (rc) return wf_error_context(rc, "nccl create: group '%s': vote", gname);
  if (lrc) return wf_error(lrc, "nccl create: group '%s': %s", gname, lmsg);
  if (!ok)
    return wf_error(WEFT_ENODEV, "nccl create: group '%s': another rank cannot use CUDA/NCCL",
                    gname);

  /* Index 0 makes the unique id; it travels through the cpu group by pointer. */
  id_msg m;
  memset(&m, 0, sizeof m);
  if (index == 0) {
    m.magic = ID_MAGIC;
    m.size = size;
    m.version = g_version;
    ncclResult_t r = nc.ncclGetUniqueId(&m.id);
    m.ok = r == ncclSuccess;
    if (!m.ok) snprintf(m.why, sizeof m.why, "%s", nc.ncclGetErrorString(r));
  }
  const void *bin = NULL;
  size_t blen = 0;
  rc = weft_cpugroup_broadcast(g, 0, index == 0 ? &m : NULL, index == 0 ? sizeof m : 0, &bin,
                               &blen);
  if (rc) return wf_error_context(rc, "nccl create: group '%s': id broadcast", gname);
  if (blen != sizeof m || ((const id_msg *)bin)->magic != ID_MAGIC)
    return wf_error(WEFT_EPROTO, "nccl create: group '%s': malformed id message (%zu bytes)",
                    gname, blen);
  memcpy(&m, bin, sizeof m);
  if (!m.ok)
    return wf_error(WEFT_ENCCL, "nccl create: group '%s': index 0 could not make an id: %s",
                    gname, m.why);
  if (m.size != size)   /* cannot happen with one cpu group; guards against misuse */
    return wf_error(WEFT_EINVAL, "nccl create: group '%s': index 0 says size %d, this rank "
                    "(index %d) says %d", gname, m.size, index, size);

  weft_nccl *c = calloc(1, sizeof *c);
  if (!c) return wf_error(WEFT_ENOMEM, "nccl create: out of host memory");
  snprintf(c->name, sizeof c->name, "%s", gname);
  c->index = index;
  c->size = size;
  c->dev = dev;
  c->timeout_ms = timeout_ms;
  c->last_op = "init";
  c->mode = mode;
  c->share = g_split_share;

  test_stall("init");
  rc = vote(g, gname, init_nonblocking(c, &m.id), "init");
  if (rc) return discard(c, rc);
  if (c->mode == MODE_SPLIT) {
    test_stall("split");
    rc = vote(g, gname, split_blocking(c), "split");
    if (rc) return discard(c, rc);
    if (!c->share) {   /* the parent cannot interrupt the child: free it now */
      nc.ncclCommAbort(c->parent);
      c->parent = NULL;
    }
  }
  reg_add(c);
  wf_log(1, "nccl: group '%s' rank %d/%d on cuda:%d ready (%s)", c->name, index, size, dev,
         c->mode == MODE_SPLIT ? "blocking, split from a non-blocking parent" : "non-blocking");
  *out = c;
  return 0;
}

int weft_nccl_abort(weft_nccl *c) {
  if (!c) return 0;
  do_abort(c);
  return 0;
}

/* Why destroy ends with ncclCommAbort, not ncclCommDestroy: after a finalize
 * that completed, nothing is left to flush, and the two differ in one thing
 * only. Both are synchronous (NCCL forces a blocking group for them, even on a
 * non-blocking communicator), and the one that drops the last reference to
 * the proxy state joins NCCL's proxy service thread. Without the abort flag
 * that thread keeps serving until every PEER has closed its connection to it,
 * i.e. until the slowest peer destroys too: on 2xH200 (NCCL 2.28.3) a
 * non-blocking destroy returned after 5.02 s, when its peer (5 s late) came
 * to destroy; finalize itself only flushes local streams and asks the proxy
 * to stop. With the abort flag the thread closes those connections
 * itself (cuMem host memory, NCCL's default on a current driver) and exits at
 * its next 500 ms poll: local, bounded. A split child that shares the
 * parent's resources holds no last reference, so it is destroyed normally
 * and the parent's abort does the rest. */
static void release(ncclComm_t comm, int shares_proxy) {
  if (shares_proxy) nc.ncclCommDestroy(comm);
  else nc.ncclCommAbort(comm);
}

/* Non-blocking: finalize is polled; past the deadline the communicator is
 * aborted. Then released by abort (see release()). */
static int finalize_nonblocking(weft_nccl *c) {
  __atomic_store_n(&c->busy, 1, __ATOMIC_RELEASE);   /* keeps poll_all off it */
  ncclResult_t r = nc.ncclCommFinalize(c->comm);
  int rc;
  if (r != ncclSuccess && r != ncclInProgress) {
    rc = nccl_err(c, "destroy", r);
    do_abort(c);
  } else if ((rc = wait_ready(c, "destroy")) == 0) {   /* aborts on timeout */
    c->finalized_ms = wf_now_ms();
    release(c->comm, 0);
    c->comm = NULL;
  }
  __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
  return rc;
}

/* Split: the child's finalize (flush, then meet the other local ranks) is
 * blocking, so the watchdog bounds it; the idle parent is then aborted,
 * which is local (it never ran a collective, so there is nothing to flush). */
static int finalize_split(weft_nccl *c) {
  __atomic_store_n(&c->busy, 1, __ATOMIC_RELEASE);   /* keeps poll_all off it */
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  wd_arm(c, "destroy");
  ncclResult_t r = nc.ncclCommFinalize(c->comm);
  if (r == ncclInProgress) r = poll_until(c->comm, deadline);   /* NCCL_COMM_BLOCKING=0 */
  if (r == ncclSuccess) {
    c->finalized_ms = wf_now_ms();
    release(c->comm, c->share);   /* unshared (NCCL_COMM_SPLIT_SHARE_RESOURCES=0): own proxy */
    c->comm = NULL;   /* gone either way: never abort a half-destroyed communicator */
  }
  int rc = 0;
  if (wd_disarm(c)) rc = wd_expired(c, "destroy");
  else if (r == ncclInProgress) rc = timeout_err(c, "destroy", NULL);
  else if (r != ncclSuccess) rc = nccl_err(c, "destroy", r);
  if (rc) do_abort(c);
  __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
  return rc;
}

int weft_nccl_destroy(weft_nccl *c) {
  if (!c) return 0;
  int rc = 0;
  int64_t t0 = wf_now_ms();
  c->finalized_ms = 0;
  if (!c->aborted && c->comm)
    rc = c->mode == MODE_SPLIT ? finalize_split(c) : finalize_nonblocking(c);
  reg_remove(c);   /* from here on the watchdog does not see c */
  if (!c->aborted) {
    if (c->comm) nc.ncclCommAbort(c->comm);
    if (c->parent) nc.ncclCommAbort(c->parent);
  }
  int64_t t1 = c->finalized_ms ? c->finalized_ms : t0;
  wf_log(1, "nccl: group '%s' rank %d/%d destroyed (%s): finalize %lld ms, then release %lld ms",
         c->name, c->index, c->size, rc ? "with an error" : "ok", (long long)(t1 - t0),
         (long long)(wf_now_ms() - t1));
  free(c);
  return rc;
}

int weft_nccl_set_timeout(weft_nccl *c, int timeout_ms) {
  WF_CHECK_ARG(c, "nccl set_timeout: NULL communicator");
  WF_CHECK_ARG(timeout_ms > 0, "nccl set_timeout: group '%s': timeout must be > 0 ms", c->name);
  c->timeout_ms = timeout_ms;
  return 0;
}

int weft_nccl_info(weft_nccl *c, int *rank, int *size, int *device) {
  WF_CHECK_ARG(c, "nccl info: NULL communicator");
  if (rank) *rank = c->index;
  if (size) *size = c->size;
  if (device) *device = c->dev;
  return 0;
}

int weft_nccl_blocking(weft_nccl *c, int *blocking) {
  WF_CHECK_ARG(c, "nccl blocking: NULL communicator");
  WF_CHECK_ARG(blocking, "nccl blocking: NULL out-parameter");
  *blocking = c->mode == MODE_SPLIT;
  return 0;
}

/* ---- validation and enqueue ---- */

static ncclDataType_t dtype_of(int dtype, size_t *esize) {
  *esize = weft_dtype_size(dtype);
  switch (dtype) {
  case WEFT_F32: return ncclFloat32;
  case WEFT_F16: return ncclFloat16;
  case WEFT_BF16: return ncclBfloat16;
  case WEFT_I32: return ncclInt32;
  case WEFT_I64: return ncclInt64;
  case WEFT_U8: return ncclUint8;
  case WEFT_F64: return ncclFloat64;
  case WEFT_F8E4M3: return ncclFloat8e4m3;
  default: *esize = 0; return ncclNumTypes;
  }
}

static int op_of(int op, ncclRedOp_t *out) {
  switch (op) {
  case WEFT_SUM: *out = ncclSum; return 0;
  case WEFT_MAX: *out = ncclMax; return 0;
  case WEFT_MIN: *out = ncclMin; return 0;
  case WEFT_PROD: *out = ncclProd; return 0;
  default: return -1;
  }
}

/* Per call: communicator usable, thread on its device, one call at a time. */
typedef struct {
  weft_nccl *c;
  const char *op;
  cudaStream_t s;
  ncclDataType_t nt;
  size_t esize;
} call;

static int enter(call *k, weft_nccl *c, const char *op, int dtype, void *stream) {
  k->c = c;
  k->op = op;
  if (!c) return wf_error(WEFT_EINVAL, "nccl %s: NULL communicator (destroyed?)", op);
  if (c->aborted)
    return wf_error(WEFT_ESTATE, "nccl %s: group '%s': the communicator was aborted after an "
                    "earlier failure (%s); recreate the group", op, c->name,
                    c->last_op ? c->last_op : "?");
  k->nt = dtype_of(dtype, &k->esize);
  if (k->nt == ncclNumTypes)
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': unknown dtype %d", op, c->name, dtype);
  int dev, rc = wf_cuda_device(&dev);
  if (rc) return rc;
  if (dev != c->dev)
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': current device is cuda:%d but the "
                    "communicator lives on cuda:%d", op, c->name, dev, c->dev);
  if (__atomic_exchange_n(&c->busy, 1, __ATOMIC_ACQUIRE))
    return wf_error(WEFT_ESTATE, "nccl %s: group '%s': another thread is using this "
                    "communicator (one call at a time)", op, c->name);
  k->s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  wd_arm(c, op);   /* split mode: the watchdog bounds what follows */
  return 0;
}

/* A refused call: nothing was enqueued. */
static void leave(call *k) {
  if (wd_disarm(k->c)) do_abort(k->c);
  __atomic_store_n(&k->c->busy, 0, __ATOMIC_RELEASE);
}

/* count elements at p: non-NULL and on the communicator's device. */
static int check_buf(call *k, const void *p, size_t count, const char *what) {
  if (count == 0) return 0;
  if (count > SIZE_MAX / (k->esize * (size_t)k->c->size))
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': %s count %zu overflows", k->op,
                    k->c->name, what, count);
  if (!p)
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': %s buffer is NULL (%zu elements)", k->op,
                    k->c->name, what, count);
  if (!g_check_ptrs) return 0;
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) cudaGetLastError();
  if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged))
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': %s buffer %p is host memory; NCCL needs "
                    "device memory on cuda:%d", k->op, k->c->name, what, p, k->c->dev);
  if (a.device != k->c->dev)
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': %s buffer is on cuda:%d but the "
                    "communicator lives on cuda:%d", k->op, k->c->name, what, a.device,
                    k->c->dev);
  return 0;
}

static int check_index(call *k, int i, const char *what) {
  if (i < 0 || i >= k->c->size)
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': %s %d outside the group (size %d)", k->op,
                    k->c->name, what, i, k->c->size);
  return 0;
}

static void group_note(weft_nccl *c) {
  for (int i = 0; i < tl_group_n; i++)
    if (tl_group[i] == c) return;
  if (tl_group_n < MAX_GROUP_COMMS) tl_group[tl_group_n++] = c;
}

/* After an NCCL call: success, in progress (poll now, or at group end),
 * failure, or (split mode) taken over by the watchdog. */
static int done(call *k, ncclResult_t r) {
  weft_nccl *c = k->c;
  c->last_op = k->op;
  int rc = 0;
  if (wd_disarm(c)) {
    rc = wd_expired(c, k->op);
  } else if (r == ncclInProgress) {
    if (tl_group_depth > 0) group_note(c);
    else rc = wait_ready(c, k->op);
  } else if (r != ncclSuccess) {
    rc = nccl_err(c, k->op, r);
    /* argument errors leave the communicator usable; anything else does not */
    if (rc != WEFT_EINVAL) {
      do_abort(c);
      rc = wf_error_context(rc, "communicator aborted");
    }
  } else if (tl_group_depth > 0) {
    group_note(c);
  }
  __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
  return rc;
}

#define ENTER(op, dtype)                                  \
  call k;                                                 \
  int rc = enter(&k, c, op, dtype, stream);               \
  if (rc) return rc;
#define BAIL(expr)                                        \
  do {                                                    \
    if ((rc = (expr))) { leave(&k); return rc; }          \
  } while (0)

int weft_nccl_all_reduce(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                         int op, void *stream) {
  ENTER("all_reduce", dtype);
  ncclRedOp_t rop = ncclSum;
  if (op_of(op, &rop)) BAIL(wf_error(WEFT_EINVAL, "nccl all_reduce: group '%s': op %d is not "
                                     "sum/max/min/prod", c->name, op));
  BAIL(check_buf(&k, in, count, "input"));
  if (out != in) BAIL(check_buf(&k, out, count, "output"));
  return done(&k, nc.ncclAllReduce(in, out, count, k.nt, rop, c->comm, k.s));
}

int weft_nccl_all_gather(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                         void *stream) {
  ENTER("all_gather", dtype);
  BAIL(check_buf(&k, in, count, "input"));
  BAIL(check_buf(&k, out, count * (size_t)c->size, "output"));
  return done(&k, nc.ncclAllGather(in, out, count, k.nt, c->comm, k.s));
}

int weft_nccl_reduce_scatter(weft_nccl *c, const void *in, void *out, size_t count_out,
                             int dtype, int op, void *stream) {
  ENTER("reduce_scatter", dtype);
  ncclRedOp_t rop = ncclSum;
  if (op_of(op, &rop)) BAIL(wf_error(WEFT_EINVAL, "nccl reduce_scatter: group '%s': op %d is "
                                     "not sum/max/min/prod", c->name, op));
  BAIL(check_buf(&k, in, count_out * (size_t)c->size, "input"));
  BAIL(check_buf(&k, out, count_out, "output"));
  return done(&k, nc.ncclReduceScatter(in, out, count_out, k.nt, rop, c->comm, k.s));
}

int weft_nccl_broadcast(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                        int root, void *stream) {
  ENTER("broadcast", dtype);
  BAIL(check_index(&k, root, "root"));
  if (!in) in = out;
  if (c->index == root) BAIL(check_buf(&k, in, count, "input"));
  BAIL(check_buf(&k, out, count, "output"));
  return done(&k, nc.ncclBroadcast(in, out, count, k.nt, root, c->comm, k.s));
}

int weft_nccl_send(weft_nccl *c, const void *buf, size_t count, int dtype, int peer,
                   void *stream) {
  ENTER("send", dtype);
  BAIL(check_index(&k, peer, "peer"));
  BAIL(check_buf(&k, buf, count, "send"));
  return done(&k, nc.ncclSend(buf, count, k.nt, peer, c->comm, k.s));
}

int weft_nccl_recv(weft_nccl *c, void *buf, size_t count, int dtype, int peer, void *stream) {
  ENTER("recv", dtype);
  BAIL(check_index(&k, peer, "peer"));
  BAIL(check_buf(&k, buf, count, "recv"));
  return done(&k, nc.ncclRecv(buf, count, k.nt, peer, c->comm, k.s));
}

/* Sum of counts[0..n), refusing overflow. */
static int total_of(call *k, const size_t *counts, size_t *total, const char *what) {
  if (!counts)
    return wf_error(WEFT_EINVAL, "nccl %s: group '%s': NULL %s array", k->op, k->c->name, what);
  size_t t = 0;
  for (int i = 0; i < k->c->size; i++) {
    if (counts[i] > SIZE_MAX / k->esize - t)
      return wf_error(WEFT_EINVAL, "nccl %s: group '%s': %s overflow", k->op, k->c->name, what);
    t += counts[i];
  }
  *total = t;
  return 0;
}

/* The grouped ops below: all pieces between one group start/end, so NCCL
 * runs them as one launch and they capture into a graph together. */
static ncclResult_t group_end_wait(ncclResult_t r) {
  ncclResult_t e = nc.ncclGroupEnd();
  return r != ncclSuccess ? r : e;
}

int weft_nccl_all_gatherv(weft_nccl *c, const void *in, void *out, const size_t *counts,
                          int dtype, void *stream) {
  ENTER("all_gatherv", dtype);
  size_t total;
  BAIL(total_of(&k, counts, &total, "counts"));
  BAIL(check_buf(&k, in, counts[c->index], "input"));
  BAIL(check_buf(&k, out, total, "output"));
  char *o = out;
  ncclResult_t r = nc.ncclGroupStart();
  size_t off = 0;
  for (int i = 0; i < c->size && r == ncclSuccess; i++) {
    if (counts[i])
      r = nc.ncclBroadcast(i == c->index ? in : o + off * k.esize, o + off * k.esize, counts[i],
                           k.nt, i, c->comm, k.s);
    off += counts[i];
  }
  return done(&k, group_end_wait(r));
}

int weft_nccl_reduce_scatterv(weft_nccl *c, const void *in, void *out, const size_t *counts,
                              int dtype, int op, void *stream) {
  ENTER("reduce_scatterv", dtype);
  ncclRedOp_t rop = ncclSum;
  if (op_of(op, &rop)) BAIL(wf_error(WEFT_EINVAL, "nccl reduce_scatterv: group '%s': op %d is "
                                     "not sum/max/min/prod", c->name, op));
  size_t total;
  BAIL(total_of(&k, counts, &total, "counts"));
  BAIL(check_buf(&k, in, total, "input"));
  BAIL(check_buf(&k, out, counts[c->index], "output"));
  const char *p = in;
  ncclResult_t r = nc.ncclGroupStart();
  size_t off = 0;
  for (int i = 0; i < c->size && r == ncclSuccess; i++) {
    if (counts[i])
      r = nc.ncclReduce(p + off * k.esize, i == c->index ? out : (void *)(p + off * k.esize),
                        counts[i], k.nt, rop, i, c->comm, k.s);
    off += counts[i];
  }
  return done(&k, group_end_wait(r));
}

int weft_nccl_gather(weft_nccl *c, const void *in, void *out, size_t count, int dtype, int root,
                     void *stream) {
  ENTER("gather", dtype);
  BAIL(check_index(&k, root, "root"));
  BAIL(check_buf(&k, in, count, "input"));
  if (c->index == root) BAIL(check_buf(&k, out, count * (size_t)c->size, "output"));
  size_t bytes = count * k.esize;
  if (count == 0) return done(&k, ncclSuccess);
  ncclResult_t r = ncclSuccess;
  if (c->index == root) {
    char *o = out;
    if (o + (size_t)root * bytes != (const char *)in) {
      cudaError_t e = cudaMemcpyAsync(o + (size_t)root * bytes, in, bytes,
                                      cudaMemcpyDeviceToDevice, k.s);
      if (e != cudaSuccess) BAIL(wf_cuda_err(__FILE__, __LINE__, "gather: cudaMemcpyAsync", e));
    }
    r = nc.ncclGroupStart();
    for (int i = 0; i < c->size && r == ncclSuccess; i++)
      if (i != root) r = nc.ncclRecv(o + (size_t)i * bytes, count, k.nt, i, c->comm, k.s);
    r = group_end_wait(r);
  } else {
    r = nc.ncclSend(in, count, k.nt, root, c->comm, k.s);
  }
  return done(&k, r);
}

int weft_nccl_all_to_all(weft_nccl *c, const void *in, void *out, size_t count,
                         const size_t *send_counts, const size_t *recv_counts, int dtype,
                         void *stream) {
  ENTER("all_to_all", dtype);
  size_t stotal, rtotal, each = 0;
  if (!send_counts != !recv_counts)
    BAIL(wf_error(WEFT_EINVAL, "nccl all_to_all: group '%s': give both send and receive "
                  "counts, or neither (equal splits)", c->name));
  if (!send_counts) {
    if (count % (size_t)c->size)
      BAIL(wf_error(WEFT_EINVAL, "nccl all_to_all: group '%s': %zu elements do not split "
                    "equally over %d ranks", c->name, count, c->size));
    each = count / (size_t)c->size;
    stotal = rtotal = count;
  } else {
    BAIL(total_of(&k, send_counts, &stotal, "send counts"));
    BAIL(total_of(&k, recv_counts, &rtotal, "receive counts"));
  }
  BAIL(check_buf(&k, in, stotal, "input"));
  BAIL(check_buf(&k, out, rtotal, "output"));
  const char *ip = in;
  char *op = out;
  size_t soff = 0, roff = 0;
  ncclResult_t r = nc.ncclGroupStart();
  for (int i = 0; i < c->size && r == ncclSuccess; i++) {
    size_t sc = send_counts ? send_counts[i] : each, rcnt = recv_counts ? recv_counts[i] : each;
    if (sc) r = nc.ncclSend(ip + soff * k.esize, sc, k.nt, i, c->comm, k.s);
    if (r == ncclSuccess && rcnt) r = nc.ncclRecv(op + roff * k.esize, rcnt, k.nt, i, c->comm, k.s);
    soff += sc;
    roff += rcnt;
  }
  return done(&k, group_end_wait(r));
}

/* ---- user groups and waits ---- */

int weft_nccl_group_start(void) {
  int rc = load();
  if (rc) return rc;
  ncclResult_t r = nc.ncclGroupStart();
  if (r != ncclSuccess) return nccl_err(NULL, "group_start", r);
  if (tl_group_depth++ == 0) tl_group_n = 0;
  return 0;
}

int weft_nccl_group_end(void) {
  int rc = load();
  if (rc) return rc;
  if (tl_group_depth <= 0)
    return wf_error(WEFT_ESTATE, "nccl group_end: no group_start on this thread");
  if (tl_group_depth > 1) {   /* an inner end launches nothing */
    tl_group_depth--;
    ncclResult_t r = nc.ncclGroupEnd();
    return r == ncclSuccess ? 0 : nccl_err(NULL, "group_end", r);
  }
  int n = tl_group_n;
  /* the outermost end launches everything: blocking communicators may wait
   * on peers in here, so the watchdog bounds it */
  for (int i = 0; i < n; i++) wd_arm(tl_group[i], "group_end");
  ncclResult_t r = nc.ncclGroupEnd();
  tl_group_depth = 0;
  tl_group_n = 0;
  weft_nccl *expired = NULL;
  for (int i = 0; i < n; i++)
    if (wd_disarm(tl_group[i]) && !expired) expired = tl_group[i];
  if (expired) {
    rc = wd_expired(expired, "group_end");
    for (int i = 0; i < n; i++) do_abort(tl_group[i]);
    return rc;
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    rc = nccl_err(n ? tl_group[0] : NULL, "group_end", r);
    for (int i = 0; i < n; i++) do_abort(tl_group[i]);
    return n ? wf_error_context(rc, "communicator(s) in the group aborted") : rc;
  }
  for (int i = 0; i < n && !rc; i++) rc = wait_ready(tl_group[i], "group_end");
  return rc;
}

int weft_nccl_synchronize(weft_nccl *c, void *stream) {
  WF_CHECK_ARG(c, "nccl synchronize: NULL communicator (destroyed?)");
  if (c->aborted)
    return wf_error(WEFT_ESTATE, "nccl synchronize: group '%s': the communicator was aborted "
                    "(%s)", c->name, c->last_op ? c->last_op : "?");
  if (wf_tl_capture_depth > 0)
    return wf_error(WEFT_ESTATE, "nccl synchronize: group '%s': refused while this thread "
                    "captures a CUDA graph", c->name);
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  int us = 0, polls = 0;
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return wf_dc_poll_all("nccl synchronize");  /* weft's kernels too */
    if (e != cudaErrorNotReady) return wf_cuda_err(__FILE__, __LINE__, "nccl synchronize", e);
    ncclResult_t st = ncclSuccess;
    nc.ncclCommGetAsyncError(c->comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) {
      int rc = nccl_err(c, c->last_op ? c->last_op : "synchronize", st);
      do_abort(c);
      return wf_error_context(rc, "communicator aborted");
    }
    if (wf_now_ms() > deadline) {
      do_abort(c);
      return wf_error(WEFT_ETIMEOUT, "nccl %s: group '%s' (rank %d of %d): stream not done "
                      "within %d ms (a peer did not arrive?); communicator aborted",
                      c->last_op ? c->last_op : "synchronize", c->name, c->index, c->size,
                      c->timeout_ms);
    }
    if (++polls <= 100) sched_yield();
    else wf_backoff(&us, 200);
  }
}

#endif /* WEFT_HAVE_CUDA */
