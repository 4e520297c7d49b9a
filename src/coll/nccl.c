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
 *
 * This file: loading libnccl, errors, and the communicator life cycle
 * (create, split, abort, destroy). The collectives are in nccl_coll.c, the
 * bounded waits and the watchdog in nccl_watch.c, what they share in
 * nccl_internal.h. */
#include "nccl_internal.h"
#include "host/cpugroup.h"

#if WEFT_HAVE_CUDA
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

wf_nccl_api wf_nc;
int wf_nccl_check_ptrs;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_rc;
static char g_msg[512];
static int g_mode_default;
static int g_split_share;
static int g_version;

static void load_once(void) {
  /* NVLink SHARP needs multicast objects, which this project keeps off. */
  if (wf_env_long("WEFT_ALLOW_MULTICAST", 0) != 1) setenv("NCCL_NVLS_ENABLE", "0", 1);
  wf_nccl_check_ptrs = wf_env_long("WEFT_NCCL_CHECK_POINTERS", 1) != 0;
  g_mode_default =
      wf_env_long("WEFT_NCCL_BLOCKING", 1) == 0 ? WF_NCCL_NONBLOCKING : WF_NCCL_SPLIT;
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
    memcpy(&wf_nc.name, &p_, sizeof p_);                                          \
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
  wf_nc.ncclGetVersion(&g_version);
  wf_log(1, "nccl: loaded version %d (NCCL_NVLS_ENABLE=%s)", g_version,
         getenv("NCCL_NVLS_ENABLE") ? getenv("NCCL_NVLS_ENABLE") : "unset");
  if (wf_env_str("NCCL_COMM_BLOCKING"))
    wf_log(0, "nccl: NCCL_COMM_BLOCKING=%s overrides weft's communicator modes (=1 makes "
           "init and split unbounded, =0 makes every call non-blocking)",
           wf_env_str("NCCL_COMM_BLOCKING"));
}

int wf_nccl_load(void) {
  int rc = wf_cuda_init();
  if (rc) return rc;
  pthread_once(&g_once, load_once);
  if (g_rc) return wf_error(g_rc, "%s", g_msg);
  return 0;
}

int weft_nccl_version(int *version) {
  WF_CHECK_ARG(version, "nccl version: NULL out-parameter");
  *version = 0;
  int rc = wf_nccl_load();
  if (rc) return rc;
  *version = g_version;
  return 0;
}

/* ---- errors, abort ---- */

int wf_nccl_err(weft_nccl *c, const char *op, ncclResult_t r) {
  const char *detail = wf_nc.ncclGetLastError(c && c->comm ? c->comm : NULL);
  int code = (r == ncclInvalidArgument || r == ncclInvalidUsage) ? WEFT_EINVAL : WEFT_ENCCL;
  if (c)
    return wf_error(code, "nccl %s: group '%s' (rank %d of %d, cuda:%d): %s%s%s", op, c->name,
                    c->index, c->size, c->dev, wf_nc.ncclGetErrorString(r),
                    detail && *detail ? ": " : "", detail ? detail : "");
  return wf_error(code, "nccl %s: %s%s%s", op, wf_nc.ncclGetErrorString(r),
                  detail && *detail ? ": " : "", detail ? detail : "");
}

int wf_nccl_timeout_err(weft_nccl *c, const char *op, const char *where) {
  return wf_error(WEFT_ETIMEOUT, "nccl %s: group '%s' (rank %d of %d): not complete within %d ms "
                  "(%sa peer did not arrive?); communicator aborted", op, c->name, c->index,
                  c->size, c->timeout_ms, where ? where : "");
}

/* Local and final: the child first, then the parent (after a successful
 * split they are independent, or share refcounted resources). */
void wf_nccl_abort_local(weft_nccl *c) {
  if (__atomic_exchange_n(&c->aborted, 1, __ATOMIC_ACQ_REL)) return;
  if (c->comm) wf_nc.ncclCommAbort(c->comm);
  c->comm = NULL;
  if (c->parent) wf_nc.ncclCommAbort(c->parent);
  c->parent = NULL;
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
  if (c->mode == WF_NCCL_SPLIT) cfg.splitShare = c->share;
  ncclComm_t comm = NULL;
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  ncclResult_t r = wf_nc.ncclCommInitRankConfig(&comm, c->size, *id, c->index, &cfg);
  if (r == ncclSuccess || r == ncclInProgress)
    r = comm ? wf_nccl_poll_until(comm, deadline) : ncclInternalError;
  if (r == ncclSuccess) {
    c->comm = comm;
    return 0;
  }
  int rc = r == ncclInProgress ? wf_nccl_timeout_err(c, "init", NULL) : wf_nccl_err(c, "init", r);
  if (comm) wf_nc.ncclCommAbort(comm);   /* joins NCCL's init thread */
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
  ncclResult_t r = wf_nc.ncclCommSplit(parent, 0, c->index, &c->split_out, &cfg);
  if (r == ncclSuccess || r == ncclInProgress) r = wf_nccl_poll_until(parent, deadline);
  ncclComm_t child = __atomic_load_n(&c->split_out, __ATOMIC_ACQUIRE);
  if (r == ncclSuccess && !child) r = ncclInternalError;
  /* a newer NCCL may hand the child out before its own init ends */
  if (r == ncclSuccess) r = wf_nccl_poll_until(child, deadline);
  if (r == ncclSuccess) {
    c->parent = parent;
    c->comm = child;
    return 0;
  }
  int rc = r == ncclInProgress ? wf_nccl_timeout_err(c, "split", NULL) : wf_nccl_err(c, "split", r);
  /* Parent first: that raises the in-flight child's abort flag and joins the
   * split thread (which then stores the child); the failed child still has
   * the parent pointing at its flag, so it must go second. */
  wf_nc.ncclCommAbort(parent);
  c->comm = NULL;
  child = __atomic_load_n(&c->split_out, __ATOMIC_ACQUIRE);
  if (child) wf_nc.ncclCommAbort(child);
  return rc;
}

static int discard(weft_nccl *c, int rc) {
  wf_nccl_abort_local(c);
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
  int lrc = wf_nccl_load();
  char lmsg[256];
  snprintf(lmsg, sizeof lmsg, "%s", lrc ? weft_last_error() : "");
  int dev = -1;
  if (!lrc) lrc = wf_cuda_device(&dev);
  int mode = blocking < 0 ? g_mode_default : blocking ? WF_NCCL_SPLIT : WF_NCCL_NONBLOCKING;
  if (!lrc && mode == WF_NCCL_SPLIT) {
    int wrc = wf_nccl_wd_start();
    if (wrc) {
      lrc = WEFT_ENOMEM;
      snprintf(lmsg, sizeof lmsg, "nccl create: group '%s': cannot start the watchdog thread "
               "(pthread_create: %s)", gname, strerror(wrc));
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
    ncclResult_t r = wf_nc.ncclGetUniqueId(&m.id);
    m.ok = r == ncclSuccess;
    if (!m.ok) snprintf(m.why, sizeof m.why, "%s", wf_nc.ncclGetErrorString(r));
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
  if (c->mode == WF_NCCL_SPLIT) {
    test_stall("split");
    rc = vote(g, gname, split_blocking(c), "split");
    if (rc) return discard(c, rc);
    if (!c->share) {   /* the parent cannot interrupt the child: free it now */
      wf_nc.ncclCommAbort(c->parent);
      c->parent = NULL;
    }
  }
  wf_nccl_reg_add(c);
  wf_log(1, "nccl: group '%s' rank %d/%d on cuda:%d ready (%s)", c->name, index, size, dev,
         c->mode == WF_NCCL_SPLIT ? "blocking, split from a non-blocking parent" : "non-blocking");
  *out = c;
  return 0;
}

int weft_nccl_abort(weft_nccl *c) {
  if (!c) return 0;
  wf_nccl_abort_local(c);
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
  if (shares_proxy) wf_nc.ncclCommDestroy(comm);
  else wf_nc.ncclCommAbort(comm);
}

/* Non-blocking: finalize is polled; past the deadline the communicator is
 * aborted. Then released by abort (see release()). */
static int finalize_nonblocking(weft_nccl *c) {
  __atomic_store_n(&c->busy, 1, __ATOMIC_RELEASE);   /* keeps poll_all off it */
  ncclResult_t r = wf_nc.ncclCommFinalize(c->comm);
  int rc;
  if (r != ncclSuccess && r != ncclInProgress) {
    rc = wf_nccl_err(c, "destroy", r);
    wf_nccl_abort_local(c);
  } else if ((rc = wf_nccl_wait_ready(c, "destroy")) == 0) {   /* aborts on timeout */
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
  wf_nccl_wd_arm(c, "destroy");
  ncclResult_t r = wf_nc.ncclCommFinalize(c->comm);
  if (r == ncclInProgress) r = wf_nccl_poll_until(c->comm, deadline);   /* NCCL_COMM_BLOCKING=0 */
  if (r == ncclSuccess) {
    c->finalized_ms = wf_now_ms();
    release(c->comm, c->share);   /* unshared (NCCL_COMM_SPLIT_SHARE_RESOURCES=0): own proxy */
    c->comm = NULL;   /* gone either way: never abort a half-destroyed communicator */
  }
  int rc = 0;
  if (wf_nccl_wd_disarm(c)) rc = wf_nccl_wd_expired(c, "destroy");
  else if (r == ncclInProgress) rc = wf_nccl_timeout_err(c, "destroy", NULL);
  else if (r != ncclSuccess) rc = wf_nccl_err(c, "destroy", r);
  if (rc) wf_nccl_abort_local(c);
  __atomic_store_n(&c->busy, 0, __ATOMIC_RELEASE);
  return rc;
}

int weft_nccl_destroy(weft_nccl *c) {
  if (!c) return 0;
  int rc = 0;
  int64_t t0 = wf_now_ms();
  c->finalized_ms = 0;
  if (!c->aborted && c->comm)
    rc = c->mode == WF_NCCL_SPLIT ? finalize_split(c) : finalize_nonblocking(c);
  wf_nccl_reg_remove(c);   /* from here on the watchdog does not see c */
  if (!c->aborted) {
    if (c->comm) wf_nc.ncclCommAbort(c->comm);
    if (c->parent) wf_nc.ncclCommAbort(c->parent);
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
  *blocking = c->mode == WF_NCCL_SPLIT;
  return 0;
}

#endif /* WEFT_HAVE_CUDA */
