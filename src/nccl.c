/* nccl.c — device collectives through NCCL, one communicator per group.
 *
 * libnccl.so.2 is dlopen'ed on first use (only nccl.h types are used here), so
 * libweft loads without it. Communicators are created non-blocking by
 * default (blocking=1 on request: NCCL's non-blocking mode runs each call on
 * a helper thread, which eager callers may not want): every NCCL call may
 * answer ncclInProgress, and every wait polls ncclCommGetAsyncError against
 * the group's deadline; on a timeout or an error the communicator is aborted
 * (its kernels exit) and the error names the group, the rank and the
 * operation. Arguments are validated before
 * anything is enqueued, so a refused call leaves the state unchanged.
 * Variable-size collectives are grouped broadcasts / reduces / send-recv. */
#include "cuda_internal.h"
#include "cpugroup.h"

#if WEFT_HAVE_CUDA
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FN(name) __typeof__(&name) name
static struct {
  FN(ncclGetVersion);
  FN(ncclGetUniqueId);
  FN(ncclCommInitRankConfig);
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

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_rc;
static char g_msg[512];
static int g_check_ptrs;
static int g_blocking_default;
static int g_version;

struct weft_nccl {
  ncclComm_t comm;
  char name[64];
  int index, size, dev, timeout_ms;
  int aborted;
  int blocking;
  int busy;                     /* one call at a time (atomic) */
  const char *last_op;          /* for messages after a failed wait */
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
  g_blocking_default = wf_env_long("WEFT_NCCL_BLOCKING", 0) == 1;
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

static void do_abort(weft_nccl *c) {
  if (c->aborted) return;
  c->aborted = 1;
  if (c->comm) nc.ncclCommAbort(c->comm);
  c->comm = NULL;
}

/* Wait until the communicator has no operation in progress (non-blocking mode). */
static int wait_ready(weft_nccl *c, const char *op) {
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  int us = 0, polls = 0;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = nc.ncclCommGetAsyncError(c->comm, &st);
    if (r != ncclSuccess) st = r;
    if (st == ncclSuccess) return 0;
    if (st != ncclInProgress) {
      int rc = nccl_err(c, op, st);
      do_abort(c);
      return wf_error_context(rc, "communicator aborted");
    }
    if (wf_now_ms() > deadline) {
      do_abort(c);
      return wf_error(WEFT_ETIMEOUT, "nccl %s: group '%s' (rank %d of %d): not complete within "
                      "%d ms (a peer did not arrive?); communicator aborted", op, c->name,
                      c->index, c->size, c->timeout_ms);
    }
    /* An enqueue by NCCL's helper thread takes microseconds: yield a while
     * before sleeping (a sleep costs ~60 µs with the default timer slack). */
    if (++polls <= 500) sched_yield();
    else wf_backoff(&us, 1000);
  }
}

int wf_nccl_poll_all(const char *op) {
  if (!nc.ncclCommGetAsyncError) return 0;   /* never loaded: nothing to poll */
  int rc = 0;
  pthread_mutex_lock(&g_reg_mu);
  for (weft_nccl *c = g_reg; c && !rc; c = c->next) {
    if (c->aborted || !c->comm) continue;
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

  c->blocking = blocking < 0 ? g_blocking_default : blocking != 0;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = c->blocking;
  cfg.commName = c->name;
  ncclResult_t r = nc.ncclCommInitRankConfig(&c->comm, size, m.id, index, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    rc = nccl_err(c, "init", r);
    if (c->comm) nc.ncclCommAbort(c->comm);
    c->comm = NULL;
  } else {
    rc = c->comm ? wait_ready(c, "init") : nccl_err(c, "init", ncclInternalError);
  }
  /* All proceed or all fail together. */
  char emsg[1024];
  snprintf(emsg, sizeof emsg, "%s", rc ? weft_last_error() : "");
  int64_t all = rc == 0;
  int vrc = weft_cpugroup_allreduce_i64(g, &all, 1, WEFT_AND);
  if (rc || vrc || !all) {
    if (c->comm) nc.ncclCommAbort(c->comm);
    free(c);
    if (rc) return wf_error(rc, "%s", emsg);
    if (vrc) return wf_error_context(vrc, "nccl create: group '%s': final vote", gname);
    return wf_error(WEFT_ENCCL, "nccl create: group '%s': init failed on another rank", gname);
  }
  reg_add(c);
  wf_log(1, "nccl: group '%s' rank %d/%d on cuda:%d ready (%s)", c->name, index, size, dev,
         c->blocking ? "blocking" : "non-blocking");
  *out = c;
  return 0;
}

int weft_nccl_abort(weft_nccl *c) {
  if (!c) return 0;
  do_abort(c);
  return 0;
}

int weft_nccl_destroy(weft_nccl *c) {
  if (!c) return 0;
  reg_remove(c);
  int rc = 0;
  if (!c->aborted && c->comm) {
    ncclResult_t r = nc.ncclCommFinalize(c->comm);
    if (r != ncclSuccess && r != ncclInProgress) {
      rc = nccl_err(c, "destroy", r);
      do_abort(c);
    } else {
      rc = wait_ready(c, "destroy");   /* aborts on timeout */
    }
    if (!c->aborted) {
      r = nc.ncclCommDestroy(c->comm);
      if (r != ncclSuccess && !rc) rc = nccl_err(c, "destroy", r);
    }
  }
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
  return 0;
}

static void leave(call *k) { __atomic_store_n(&k->c->busy, 0, __ATOMIC_RELEASE); }

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

/* After an NCCL call: success, in progress (poll now, or at group end), or failure. */
static int done(call *k, ncclResult_t r) {
  weft_nccl *c = k->c;
  c->last_op = k->op;
  int rc = 0;
  if (r == ncclInProgress) {
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
  leave(k);
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
  ncclResult_t r = nc.ncclGroupEnd();
  if (--tl_group_depth > 0) return r == ncclSuccess ? 0 : nccl_err(NULL, "group_end", r);
  int n = tl_group_n;
  tl_group_n = 0;
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
    if (e == cudaSuccess) return 0;
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
