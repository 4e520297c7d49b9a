/* nccl_coll.c — the collectives of weft's NCCL binding (src/coll/nccl.c binds
 * the life cycle; src/coll/nccl_internal.h is what the parts share): each call
 * checks that the communicator is usable, the thread is on its device, the
 * buffers are device memory of the right size, and that no other call is in
 * it, BEFORE anything is enqueued, so a refused call leaves the state
 * unchanged. Variable-size collectives are grouped broadcasts / reduces /
 * send-recv. Then user groups (group_start/end) and the bounded synchronize. */
#include "nccl_internal.h"

#if WEFT_HAVE_CUDA
#include <sched.h>

/* Communicators with work in the calling thread's open group (group_end polls them). */
#define MAX_GROUP_COMMS 64
static __thread int tl_group_depth;
static __thread weft_nccl *tl_group[MAX_GROUP_COMMS];
static __thread int tl_group_n;

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
  wf_nccl_wd_arm(c, op);   /* split mode: the watchdog bounds what follows */
  return 0;
}

/* A refused call: nothing was enqueued. */
static void leave(call *k) {
  if (wf_nccl_wd_disarm(k->c)) wf_nccl_abort_local(k->c);
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
  if (!wf_nccl_check_ptrs) return 0;
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
  if (wf_nccl_wd_disarm(c)) {
    rc = wf_nccl_wd_expired(c, k->op);
  } else if (r == ncclInProgress) {
    if (tl_group_depth > 0) group_note(c);
    else rc = wf_nccl_wait_ready(c, k->op);
  } else if (r != ncclSuccess) {
    rc = wf_nccl_err(c, k->op, r);
    /* argument errors leave the communicator usable; anything else does not */
    if (rc != WEFT_EINVAL) {
      wf_nccl_abort_local(c);
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
  return done(&k, wf_nc.ncclAllReduce(in, out, count, k.nt, rop, c->comm, k.s));
}

int weft_nccl_all_gather(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                         void *stream) {
  ENTER("all_gather", dtype);
  BAIL(check_buf(&k, in, count, "input"));
  BAIL(check_buf(&k, out, count * (size_t)c->size, "output"));
  return done(&k, wf_nc.ncclAllGather(in, out, count, k.nt, c->comm, k.s));
}

int weft_nccl_reduce_scatter(weft_nccl *c, const void *in, void *out, size_t count_out,
                             int dtype, int op, void *stream) {
  ENTER("reduce_scatter", dtype);
  ncclRedOp_t rop = ncclSum;
  if (op_of(op, &rop)) BAIL(wf_error(WEFT_EINVAL, "nccl reduce_scatter: group '%s': op %d is "
                                     "not sum/max/min/prod", c->name, op));
  BAIL(check_buf(&k, in, count_out * (size_t)c->size, "input"));
  BAIL(check_buf(&k, out, count_out, "output"));
  return done(&k, wf_nc.ncclReduceScatter(in, out, count_out, k.nt, rop, c->comm, k.s));
}

int weft_nccl_broadcast(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                        int root, void *stream) {
  ENTER("broadcast", dtype);
  BAIL(check_index(&k, root, "root"));
  if (!in) in = out;
  if (c->index == root) BAIL(check_buf(&k, in, count, "input"));
  BAIL(check_buf(&k, out, count, "output"));
  return done(&k, wf_nc.ncclBroadcast(in, out, count, k.nt, root, c->comm, k.s));
}

int weft_nccl_send(weft_nccl *c, const void *buf, size_t count, int dtype, int peer,
                   void *stream) {
  ENTER("send", dtype);
  BAIL(check_index(&k, peer, "peer"));
  BAIL(check_buf(&k, buf, count, "send"));
  return done(&k, wf_nc.ncclSend(buf, count, k.nt, peer, c->comm, k.s));
}

int weft_nccl_recv(weft_nccl *c, void *buf, size_t count, int dtype, int peer, void *stream) {
  ENTER("recv", dtype);
  BAIL(check_index(&k, peer, "peer"));
  BAIL(check_buf(&k, buf, count, "recv"));
  return done(&k, wf_nc.ncclRecv(buf, count, k.nt, peer, c->comm, k.s));
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
  ncclResult_t e = wf_nc.ncclGroupEnd();
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
  ncclResult_t r = wf_nc.ncclGroupStart();
  size_t off = 0;
  for (int i = 0; i < c->size && r == ncclSuccess; i++) {
    if (counts[i])
      r = wf_nc.ncclBroadcast(i == c->index ? in : o + off * k.esize, o + off * k.esize, counts[i],
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
  ncclResult_t r = wf_nc.ncclGroupStart();
  size_t off = 0;
  for (int i = 0; i < c->size && r == ncclSuccess; i++) {
    if (counts[i])
      r = wf_nc.ncclReduce(p + off * k.esize, i == c->index ? out : (void *)(p + off * k.esize),
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
    r = wf_nc.ncclGroupStart();
    for (int i = 0; i < c->size && r == ncclSuccess; i++)
      if (i != root) r = wf_nc.ncclRecv(o + (size_t)i * bytes, count, k.nt, i, c->comm, k.s);
    r = group_end_wait(r);
  } else {
    r = wf_nc.ncclSend(in, count, k.nt, root, c->comm, k.s);
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
  ncclResult_t r = wf_nc.ncclGroupStart();
  for (int i = 0; i < c->size && r == ncclSuccess; i++) {
    size_t sc = send_counts ? send_counts[i] : each, rcnt = recv_counts ? recv_counts[i] : each;
    if (sc) r = wf_nc.ncclSend(ip + soff * k.esize, sc, k.nt, i, c->comm, k.s);
    if (r == ncclSuccess && rcnt)
      r = wf_nc.ncclRecv(op + roff * k.esize, rcnt, k.nt, i, c->comm, k.s);
    soff += sc;
    roff += rcnt;
  }
  return done(&k, group_end_wait(r));
}

/* ---- user groups and waits ---- */

int weft_nccl_group_start(void) {
  int rc = wf_nccl_load();
  if (rc) return rc;
  ncclResult_t r = wf_nc.ncclGroupStart();
  if (r != ncclSuccess) return wf_nccl_err(NULL, "group_start", r);
  if (tl_group_depth++ == 0) tl_group_n = 0;
  return 0;
}

int weft_nccl_group_end(void) {
  int rc = wf_nccl_load();
  if (rc) return rc;
  if (tl_group_depth <= 0)
    return wf_error(WEFT_ESTATE, "nccl group_end: no group_start on this thread");
  if (tl_group_depth > 1) {   /* an inner end launches nothing */
    tl_group_depth--;
    ncclResult_t r = wf_nc.ncclGroupEnd();
    return r == ncclSuccess ? 0 : wf_nccl_err(NULL, "group_end", r);
  }
  int n = tl_group_n;
  /* the outermost end launches everything: blocking communicators may wait
   * on peers in here, so the watchdog bounds it */
  for (int i = 0; i < n; i++) wf_nccl_wd_arm(tl_group[i], "group_end");
  ncclResult_t r = wf_nc.ncclGroupEnd();
  tl_group_depth = 0;
  tl_group_n = 0;
  weft_nccl *expired = NULL;
  for (int i = 0; i < n; i++)
    if (wf_nccl_wd_disarm(tl_group[i]) && !expired) expired = tl_group[i];
  if (expired) {
    rc = wf_nccl_wd_expired(expired, "group_end");
    for (int i = 0; i < n; i++) wf_nccl_abort_local(tl_group[i]);
    return rc;
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    rc = wf_nccl_err(n ? tl_group[0] : NULL, "group_end", r);
    for (int i = 0; i < n; i++) wf_nccl_abort_local(tl_group[i]);
    return n ? wf_error_context(rc, "communicator(s) in the group aborted") : rc;
  }
  for (int i = 0; i < n && !rc; i++) rc = wf_nccl_wait_ready(tl_group[i], "group_end");
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
    if (e == cudaSuccess) return wf_cuda_check_done("nccl synchronize");  /* weft's kernels too */
    if (e != cudaErrorNotReady) return wf_cuda_err(__FILE__, __LINE__, "nccl synchronize", e);
    ncclResult_t st = ncclSuccess;
    wf_nc.ncclCommGetAsyncError(c->comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) {
      int rc = wf_nccl_err(c, c->last_op ? c->last_op : "synchronize", st);
      wf_nccl_abort_local(c);
      return wf_error_context(rc, "communicator aborted");
    }
    if (wf_now_ms() > deadline) {
      wf_nccl_abort_local(c);
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
