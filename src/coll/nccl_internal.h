/* nccl_internal.h — what the three parts of weft's NCCL binding share:
 * src/coll/nccl.c (loading libnccl, errors, communicator life cycle),
 * src/coll/nccl_coll.c (validation and enqueue of the collectives, user
 * groups, synchronize) and src/coll/nccl_watch.c (bounded waits: the
 * async-error polls, the watchdog of blocking calls, the registry of live
 * communicators). Internal: nothing here is exported; CUDA builds only. */
#ifndef WEFT_NCCL_INTERNAL_H
#define WEFT_NCCL_INTERNAL_H

#include "cuda/cuda_internal.h"

#if WEFT_HAVE_CUDA
#include <nccl.h>
#include <stdint.h>

/* The entry points of the dlopen'ed libnccl.so.2 (nccl.c fills them once). */
#define FN(name) __typeof__(&name) name
typedef struct wf_nccl_api {
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
} wf_nccl_api;
#undef FN
extern wf_nccl_api wf_nc;

enum { WF_NCCL_NONBLOCKING = 0, WF_NCCL_SPLIT = 1 };
#define WF_NCCL_WD_FIRED ((int64_t)-1)

extern int wf_nccl_check_ptrs;   /* WEFT_NCCL_CHECK_POINTERS (default 1) */

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
                                   0 none, WF_NCCL_WD_FIRED once the watchdog took over */
  int wd_done;                  /* atomic: the watchdog finished its abort */
  const char *wd_op;
  const char *last_op;          /* for messages after a failed wait */
  int64_t finalized_ms;         /* when destroy's finalize ended (for the log) */
  struct weft_nccl *next;       /* registry of live communicators */
};

/* ---- nccl.c ---- */
/* CUDA, then libnccl once (0, or the load error again on every call). */
int wf_nccl_load(void);
/* The error of NCCL result r in op (EINVAL for argument errors, else ENCCL). */
int wf_nccl_err(weft_nccl *c, const char *op, ncclResult_t r);
/* op not done within c's timeout; where says what blocked ("" or "...; "). */
int wf_nccl_timeout_err(weft_nccl *c, const char *op, const char *where);
/* Aborts c's communicators once (local and final). */
void wf_nccl_abort_local(weft_nccl *c);

/* ---- nccl_watch.c ---- */
/* Polls comm until it leaves ncclInProgress; ncclInProgress if the deadline
 * passed first. */
ncclResult_t wf_nccl_poll_until(ncclComm_t comm, int64_t deadline);
/* Waits until c has no operation in progress (non-blocking calls); aborts c
 * on a timeout or an error. */
int wf_nccl_wait_ready(weft_nccl *c, const char *op);
/* Starts the watchdog thread once: 0, or pthread_create's error. */
int wf_nccl_wd_start(void);
/* Registry of live communicators (the watchdog and wf_nccl_poll_all walk it);
 * the first add installs wf_nccl_poll_all as the CUDA layer's pending-wait check. */
void wf_nccl_reg_add(weft_nccl *c);
/* Poll every live communicator for an asynchronous error; a failed one is
 * aborted and its error returned under op. 0 when all are fine. */
int wf_nccl_poll_all(const char *op);
void wf_nccl_reg_remove(weft_nccl *c);
/* The slow end of wf_nccl_wd_disarm: the watchdog took the call over. */
int wf_nccl_wd_taken(weft_nccl *c);
/* After wf_nccl_wd_disarm said 1: abort what is left, report the expired call. */
int wf_nccl_wd_expired(weft_nccl *c, const char *op);

/* A blocking call on a split communicator arms its deadline before it and
 * disarms after it (two atomic stores: inline, on every call). */
static inline void wf_nccl_wd_arm(weft_nccl *c, const char *op) {
  if (c->mode != WF_NCCL_SPLIT) return;
  c->wd_op = op;
  __atomic_store_n(&c->wd_deadline, wf_now_ms() + c->timeout_ms, __ATOMIC_RELEASE);
}

/* 0: the call ended in time. 1: the watchdog took it over; on return its
 * abort of the parent has finished (or, if that never returns, the child is
 * given up without an abort, so nothing frees memory NCCL still uses). */
static inline int wf_nccl_wd_disarm(weft_nccl *c) {
  if (c->mode != WF_NCCL_SPLIT) return 0;
  int64_t d = __atomic_load_n(&c->wd_deadline, __ATOMIC_ACQUIRE);
  while (d != WF_NCCL_WD_FIRED)
    if (__atomic_compare_exchange_n(&c->wd_deadline, &d, 0, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return 0;
  return wf_nccl_wd_taken(c);
}

#endif /* WEFT_HAVE_CUDA */
#endif
