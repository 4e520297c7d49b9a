/* nccl_watch.c — the bounded waits of weft's NCCL binding (src/coll/nccl.c
 * binds the API; src/coll/nccl_internal.h is what the parts share): polling a
 * communicator's ncclCommGetAsyncError against a deadline, the watchdog
 * thread that ends a blocking call on a split communicator once its deadline
 * passed, and the registry of live communicators that the watchdog and
 * wf_nccl_poll_all (every host wait, src/cuda/cuda.c) walk. */
#include "nccl_internal.h"

#if WEFT_HAVE_CUDA
#include <pthread.h>
#include <sched.h>
#include <time.h>

#define WD_TICK_MS 200

static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static weft_nccl *g_reg;

/* ---- waits ---- */

/* Polls comm until it leaves ncclInProgress; ncclInProgress if the deadline
 * passed first. An enqueue or init step by NCCL's thread takes micro- to
 * milliseconds: yield a while before sleeping (a sleep costs ~60 µs). */
ncclResult_t wf_nccl_poll_until(ncclComm_t comm, int64_t deadline) {
  int us = 0, polls = 0;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = wf_nc.ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (wf_now_ms() > deadline) return ncclInProgress;
    if (++polls <= 500) sched_yield();
    else wf_backoff(&us, 1000);
  }
}

/* Wait until the communicator has no operation in progress (non-blocking calls). */
int wf_nccl_wait_ready(weft_nccl *c, const char *op) {
  ncclResult_t st = wf_nccl_poll_until(c->comm, wf_now_ms() + c->timeout_ms);
  if (st == ncclSuccess) return 0;
  int rc = st == ncclInProgress ? wf_nccl_timeout_err(c, op, NULL) : wf_nccl_err(c, op, st);
  wf_nccl_abort_local(c);
  return st == ncclInProgress ? rc : wf_error_context(rc, "communicator aborted");
}

/* ---- watchdog: bounds blocking calls on a split communicator ----
 * A blocking call arms its deadline (two atomic stores around the call). The
 * watchdog thread wakes every WD_TICK_MS while split communicators exist; a
 * call past its deadline is taken over (CAS to WF_NCCL_WD_FIRED): the parent
 * is aborted, which raises the abort flag the child shares, so NCCL's waits
 * in the call (bootstrap, connection setup, kernels, finalize) return. The
 * caller sees WF_NCCL_WD_FIRED when it disarms and aborts the child itself,
 * so no communicator is freed while a call is inside it. */
static pthread_once_t g_wd_once = PTHREAD_ONCE_INIT;
static pthread_cond_t g_wd_cv;
static int g_wd_rc;

static void wd_fire(weft_nccl *c) {   /* g_reg_mu held */
  if (c->parent) {
    wf_log(0, "nccl: group '%s' (rank %d of %d): %s blocked inside NCCL for more than %d ms; "
           "aborting", c->name, c->index, c->size, c->wd_op ? c->wd_op : "call", c->timeout_ms);
    wf_nc.ncclCommAbort(c->parent);
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
      if (c->mode != WF_NCCL_SPLIT) continue;
      any = 1;
      int64_t d = __atomic_load_n(&c->wd_deadline, __ATOMIC_ACQUIRE);
      if (d > 0 && now > d &&
          __atomic_compare_exchange_n(&c->wd_deadline, &d, WF_NCCL_WD_FIRED, 0,
                                      __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
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

int wf_nccl_wd_start(void) {
  pthread_once(&g_wd_once, wd_start_once);
  return g_wd_rc;
}

/* The watchdog took the call over (wf_nccl_wd_disarm in nccl_internal.h):
 * wait, bounded, for its abort of the parent to finish. */
int wf_nccl_wd_taken(weft_nccl *c) {
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

/* After wf_nccl_wd_disarm said 1: abort what is left, report the expired call. */
int wf_nccl_wd_expired(weft_nccl *c, const char *op) {
  wf_nccl_abort_local(c);
  return wf_nccl_timeout_err(c, op, "blocked inside NCCL; ");
}

int wf_nccl_poll_all(const char *op) {
  if (!wf_nc.ncclCommGetAsyncError) return 0;   /* never loaded: nothing to poll */
  int rc = 0;
  pthread_mutex_lock(&g_reg_mu);
  for (weft_nccl *c = g_reg; c && !rc; c = c->next) {
    /* a communicator inside a call belongs to its caller, who sees the error too */
    if (c->aborted || !c->comm || __atomic_load_n(&c->busy, __ATOMIC_ACQUIRE)) continue;
    ncclResult_t st = ncclSuccess;
    if (wf_nc.ncclCommGetAsyncError(c->comm, &st) != ncclSuccess) continue;
    if (st != ncclSuccess && st != ncclInProgress) {
      rc = wf_nccl_err(c, c->last_op ? c->last_op : "collective", st);
      wf_nccl_abort_local(c);
      rc = wf_error_context(rc, "%s: communicator aborted", op);
    }
  }
  pthread_mutex_unlock(&g_reg_mu);
  return rc;
}

void wf_nccl_reg_add(weft_nccl *c) {
  wf_cuda_set_wait_checks(wf_nccl_poll_all, NULL);   /* every host wait polls NCCL errors */
  pthread_mutex_lock(&g_reg_mu);
  c->next = g_reg;
  g_reg = c;
  if (c->mode == WF_NCCL_SPLIT) pthread_cond_signal(&g_wd_cv);
  pthread_mutex_unlock(&g_reg_mu);
}

void wf_nccl_reg_remove(weft_nccl *c) {
  pthread_mutex_lock(&g_reg_mu);
  for (weft_nccl **pp = &g_reg; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  pthread_mutex_unlock(&g_reg_mu);
}

#endif /* WEFT_HAVE_CUDA */
