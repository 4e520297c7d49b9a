/* async.c — non-blocking collectives: a per-queue progress worker that runs
 * submitted operations in order through the public weft_* calls.
 *
 * Why a thread and not a state machine per backend: every blocking call of
 * the library (store round trips, shm barriers, mq futex waits, NCCL stream
 * polls) is already bounded and correct; running it on a worker gives each
 * of them a non-blocking form at once, and keeps one operation in flight per
 * communicator (the worker is the only caller while the queue is used).
 *
 * The worker is created lazily on the first submit, with all signals
 * blocked (nginx and the launcher keep their signal handling on the main
 * thread). Its error messages are thread-local to it, so each operation's
 * message is copied into the handle and re-raised on the caller's thread. */
#include "async_internal.h"
#include "host/cpugroup.h"
#include "store/store_share.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- handles */

static void handle_unref(weft_async *h) {
  if (atomic_fetch_sub_explicit(&h->refs, 1, memory_order_acq_rel) != 1) return;
  pthread_mutex_destroy(&h->mu);
  pthread_cond_destroy(&h->cv);
  free(h->key);
  free(h->res);
  free(h->lens);
  free(h);
}

static const char *kind_name(int kind) {
  switch (kind) {
  case WEFT_ASYNC_NOP: return "nop";
  case WEFT_ASYNC_SLEEP: return "sleep";
  case WEFT_ASYNC_SHM_ALL_REDUCE: return "shm all_reduce";
  case WEFT_ASYNC_SHM_ALL_GATHER: return "shm all_gather";
  case WEFT_ASYNC_SHM_REDUCE_SCATTER: return "shm reduce_scatter";
  case WEFT_ASYNC_SHM_BROADCAST: return "shm broadcast";
  case WEFT_ASYNC_SHM_BARRIER: return "shm barrier";
  case WEFT_ASYNC_CPU_BARRIER: return "cpugroup barrier";
  case WEFT_ASYNC_CPU_BROADCAST: return "cpugroup broadcast";
  case WEFT_ASYNC_CPU_ALLGATHER: return "cpugroup allgather";
  case WEFT_ASYNC_CPU_ALLREDUCE_I64: return "cpugroup allreduce_i64";
  case WEFT_ASYNC_CPU_SEND: return "cpugroup send";
  case WEFT_ASYNC_CPU_RECV: return "cpugroup recv";
  case WEFT_ASYNC_NCCL_ALL_REDUCE: return "nccl all_reduce";
  case WEFT_ASYNC_NCCL_ALL_GATHER: return "nccl all_gather";
  case WEFT_ASYNC_NCCL_REDUCE_SCATTER: return "nccl reduce_scatter";
  case WEFT_ASYNC_NCCL_BROADCAST: return "nccl broadcast";
  case WEFT_ASYNC_NCCL_SYNC: return "nccl synchronize";
  case WEFT_ASYNC_MQ_ENQUEUE: return "mq enqueue";
  case WEFT_ASYNC_MQ_DEQUEUE: return "mq dequeue";
  case WEFT_ASYNC_STORE_GET: return "store get";
  default: return NULL;
  }
}

/* Keep a copy of a result the callee lends only until its next call. */
static int keep(weft_async *h, const void *p, size_t n) {
  if (n > h->res_cap || !h->res) {
    uint8_t *q = realloc(h->res, n ? n : 1);
    if (!q) return wf_error(WEFT_ENOMEM, "async %s: out of memory for a %zu-byte result",
                            kind_name(h->d.kind), n);
    h->res = q;
    h->res_cap = n ? n : 1;
  }
  if (n) memcpy(h->res, p, n);
  h->res_len = n;
  return 0;
}

static void sleep_ms(size_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* Runs one operation on the worker thread. */
static int run(weft_async *h) {
  weft_async_desc *d = &h->d;
  const void *p = NULL;
  size_t n = 0;
  int rc;
  if (d->device >= 0 && d->kind >= WEFT_ASYNC_NCCL_ALL_REDUCE && d->kind <= WEFT_ASYNC_NCCL_SYNC) {
    rc = weft_cuda_set_device(d->device);
    if (rc) return rc;
  }
  switch (d->kind) {
  case WEFT_ASYNC_NOP: return 0;
  case WEFT_ASYNC_SLEEP: sleep_ms(d->count); return 0;
  case WEFT_ASYNC_SHM_ALL_REDUCE:
    weft_shm_set_call(d->comm, d->shape, d->args);
    return weft_shm_all_reduce(d->comm, d->in, d->out, d->count, d->dtype, d->op);
  case WEFT_ASYNC_SHM_ALL_GATHER:
    weft_shm_set_call(d->comm, d->shape, d->args);
    return weft_shm_all_gather(d->comm, d->in, d->out, d->count);
  case WEFT_ASYNC_SHM_REDUCE_SCATTER:
    weft_shm_set_call(d->comm, d->shape, d->args);
    return weft_shm_reduce_scatter(d->comm, d->in, d->out, d->count, d->dtype, d->op);
  case WEFT_ASYNC_SHM_BROADCAST:
    weft_shm_set_call(d->comm, d->shape, d->args);
    return weft_shm_broadcast(d->comm, d->out, d->count, d->root);
  case WEFT_ASYNC_SHM_BARRIER:
    return weft_shm_barrier(d->comm);
  case WEFT_ASYNC_CPU_BARRIER:
    return weft_cpugroup_barrier(d->comm);
  case WEFT_ASYNC_CPU_BROADCAST:
    rc = weft_cpugroup_broadcast(d->comm, d->root, d->in, d->count, &p, &n);
    return rc ? rc : keep(h, p, n);
  case WEFT_ASYNC_CPU_ALLGATHER: {
    const size_t *lens = NULL;
    int size = 0;
    if (d->announce) { /* the blocking object collectives' barrier (weft.group.objects) */
      weft_shm_set_call(d->announce, 0, d->args);
      if ((rc = weft_shm_barrier(d->announce))) return rc;
    }
    rc = wf_cpugroup_info(d->comm, NULL, &size, NULL, NULL, NULL);
    if (!rc) rc = weft_cpugroup_allgather(d->comm, d->in, d->count, &p, &lens);
    if (rc) return rc;
    size_t total = 0;
    for (int i = 0; i < size; i++) total += lens[i];
    h->lens = malloc((size_t)(size ? size : 1) * sizeof *h->lens);
    if (!h->lens) return wf_error(WEFT_ENOMEM, "async cpugroup allgather: out of memory");
    memcpy(h->lens, lens, (size_t)size * sizeof *lens);
    h->nlens = size;
    return keep(h, p, total);
  }
  case WEFT_ASYNC_CPU_ALLREDUCE_I64:
    return weft_cpugroup_allreduce_i64(d->comm, d->out, (int)d->count, d->op);
  case WEFT_ASYNC_CPU_SEND:
    return weft_cpugroup_send(d->comm, d->root, d->in, d->count);
  case WEFT_ASYNC_CPU_RECV:
    rc = weft_cpugroup_recv(d->comm, d->root, &p, &n);
    return rc ? rc : keep(h, p, n);
  case WEFT_ASYNC_NCCL_ALL_REDUCE:
    rc = weft_nccl_all_reduce(d->comm, d->in, d->out, d->count, d->dtype, d->op, d->stream);
    return rc ? rc : weft_nccl_synchronize(d->comm, d->stream);
  case WEFT_ASYNC_NCCL_ALL_GATHER:
    rc = weft_nccl_all_gather(d->comm, d->in, d->out, d->count, d->dtype, d->stream);
    return rc ? rc : weft_nccl_synchronize(d->comm, d->stream);
  case WEFT_ASYNC_NCCL_REDUCE_SCATTER:
    rc = weft_nccl_reduce_scatter(d->comm, d->in, d->out, d->count, d->dtype, d->op, d->stream);
    return rc ? rc : weft_nccl_synchronize(d->comm, d->stream);
  case WEFT_ASYNC_NCCL_BROADCAST:
    rc = weft_nccl_broadcast(d->comm, d->in, d->out, d->count, d->dtype, d->root, d->stream);
    return rc ? rc : weft_nccl_synchronize(d->comm, d->stream);
  case WEFT_ASYNC_NCCL_SYNC:
    return weft_nccl_synchronize(d->comm, d->stream);
  case WEFT_ASYNC_MQ_ENQUEUE:
    return weft_mq_enqueue(d->comm, d->in, d->count);
  case WEFT_ASYNC_MQ_DEQUEUE:
    rc = weft_mq_dequeue(d->comm, d->timeout_ms, &p, &n);
    if (rc) return rc;
    rc = keep(h, p, n);
    weft_mq_release(d->comm);
    return rc;
  case WEFT_ASYNC_STORE_GET: {
    weft_store *s;
    rc = wf_store_here(d->comm, "async store get", &s);
    if (!rc) rc = weft_store_get(s, h->key, d->timeout_ms, &p, &n);
    return rc ? rc : keep(h, p, n);
  }
  }
  return wf_error(WEFT_EINVAL, "async: unknown operation kind %d", d->kind);
}

static void complete(weft_async *h, int rc) {
  if (rc) {
    const char *m = weft_last_error();
    snprintf(h->msg, sizeof h->msg, "%s", (m && *m) ? m : "failed (no message)");
  }
  h->t_end_ns = wf_now_ns();
  pthread_mutex_lock(&h->mu);
  h->rc = rc;
  atomic_store_explicit(&h->state, WF_ASYNC_DONE, memory_order_release);
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

/* ---------------------------------------------------------------- exit
 * Every queue is on one list, so that exit() can stop the workers before
 * the static destructors of the CUDA runtime and NCCL run (registered with
 * atexit when the first worker starts, i.e. after CUDA was initialised by
 * the process, so it runs BEFORE cudart's own handler): a worker left inside
 * a CUDA/NCCL call while those tear down crashes the process at exit.
 * Queued operations are failed without running; the running one is awaited
 * for at most WEFT_ASYNC_EXIT_MS (default 10000); a worker still busy then is
 * abandoned (its queue is never freed). */
static pthread_mutex_t g_qmu = PTHREAD_MUTEX_INITIALIZER;
static weft_async_queue *g_queues;
static _Atomic pid_t g_exit_pid;   /* the process that registered the handler (fork) */

static void reg_add(weft_async_queue *q) {
  pthread_mutex_lock(&g_qmu);
  q->reg_next = g_queues;
  g_queues = q;
  pthread_mutex_unlock(&g_qmu);
}

static void reg_remove(weft_async_queue *q) {
  pthread_mutex_lock(&g_qmu);
  for (weft_async_queue **pp = &g_queues; *pp; pp = &(*pp)->reg_next)
    if (*pp == q) { *pp = q->reg_next; break; }
  pthread_mutex_unlock(&g_qmu);
}

/* Caller holds q->mu: fail everything queued (it will never run). */
static void fail_queued(weft_async_queue *q, const char *why) {
  weft_async *h = q->head;
  q->head = q->tail = NULL;
  while (h) {
    weft_async *next = h->next;
    h->next = NULL;
    wf_error(WEFT_ESTATE, "async %s on queue '%s': %s", kind_name(h->d.kind), q->name, why);
    complete(h, WEFT_ESTATE);
    q->completed++;
    q->failed++;
    handle_unref(h);
    h = next;
  }
}

static void exit_stop_workers(void) {
  long ms = wf_env_long("WEFT_ASYNC_EXIT_MS", 10000);
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);   /* pthread_timedjoin_np: CLOCK_REALTIME */
  dl.tv_sec += ms / 1000;
  dl.tv_nsec += (ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
  pid_t me = getpid();
  if (atomic_load(&g_exit_pid) != me) return;   /* inherited by a child of fork() */
  pthread_mutex_lock(&g_qmu);   /* held throughout: a concurrent destroy waits */
  for (weft_async_queue *q = g_queues; q; q = q->reg_next) {
    if (q->pid != me) continue;   /* the parent's: its mutex may be held since the fork */
    pthread_mutex_lock(&q->mu);
    int stop = q->started && !q->joined && q->pid == me;
    if (stop) {
      q->closing = 1;
      fail_queued(q, "the process is exiting");
      pthread_cond_broadcast(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    if (!stop) continue;
    int e = pthread_timedjoin_np(q->th, NULL, &dl);
    if (e == 0) {
      q->joined = 1;
    } else {
      q->joined = 1;     /* never join it again */
      q->abandoned = 1;  /* and never free what it still uses */
      wf_log(0, "async queue '%s': the progress worker is still inside an operation at exit "
             "after %ld ms; abandoned", q->name, ms);
    }
  }
  pthread_mutex_unlock(&g_qmu);
}

/* Before memory or a communicator goes: a worker's running operation whose
 * input or output starts in [lo, lo + len), or whose handle is comm, is
 * waited for (bounded by WEFT_ASYNC_EXIT_MS). When a Lua state closes, its
 * finalizers run in any order: a tensor pinned by a pending operation, or
 * the group's shm segment, can be freed while the worker still reads it
 * (SIGSEGV at the exit on an error with host all-reduces in flight). Returns
 * 0 when nothing uses it (any more), -1 when it is still in use: the caller
 * then leaks it rather than free it under the worker. */
static int wait_unused(const void *lo, size_t len, const void *comm) {
  const char *a = lo;
  long ms = wf_env_long("WEFT_ASYNC_EXIT_MS", 10000);
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += ms / 1000;
  dl.tv_nsec += (ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
  int busy = 0;
  pid_t me = getpid();
  pthread_mutex_lock(&g_qmu);   /* held throughout: no queue is freed meanwhile */
  for (weft_async_queue *q = g_queues; q; q = q->reg_next) {
    if (q->pid != me) continue;
    pthread_mutex_lock(&q->mu);
    /* asked from this queue's own worker (its operation frees memory): it
     * cannot wait for itself, and what it frees is its own to free */
    if (q->started && pthread_equal(q->th, pthread_self())) {
      pthread_mutex_unlock(&q->mu);
      continue;
    }
    for (;;) {
      weft_async *h = q->running;
      if (!h) break;
      const char *in = h->d.in, *out = h->d.out;
      int uses = (comm && (h->d.comm == comm || h->d.announce == comm)) ||
                 (a && len && ((in >= a && in < a + len) || (out >= a && out < a + len)));
      if (!uses) break;
      if (pthread_cond_timedwait(&q->idle, &q->mu, &dl) == ETIMEDOUT) {
        busy = q->running == h;
        break;
      }
    }
    pthread_mutex_unlock(&q->mu);
    if (busy) break;
  }
  pthread_mutex_unlock(&g_qmu);
  return busy ? -1 : 0;
}

/* Once per process (a child of fork() registers its own). */
static void exit_register(void) {
  pid_t me = getpid(), old = atomic_load(&g_exit_pid);
  if (old != me && atomic_compare_exchange_strong(&g_exit_pid, &old, me)) atexit(exit_stop_workers);
}

/* ---------------------------------------------------------------- worker */

/* The worker's store round trips go through connections of its own
 * (store_thread.c): a wait it runs for one group never queues behind one
 * the caller's thread runs for another on the shared connection. */
static void *worker_main(void *arg) {
  weft_async_queue *q = arg;
  wf_store_thread_private();
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head && !q->closing) pthread_cond_wait(&q->cv, &q->mu);
    weft_async *h = q->head;
    if (!h) break;  /* closing and nothing left */
    q->head = h->next;
    if (!q->head) q->tail = NULL;
    h->next = NULL;
    q->running = h;
    __atomic_fetch_add(&wf_in_use_running, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&q->mu);

    h->t_start_ns = wf_now_ns();
    atomic_store_explicit(&h->state, WF_ASYNC_RUNNING, memory_order_release);
    wf_clear_error();
    int rc = run(h);
    pthread_mutex_lock(&q->mu);  /* counters first: a caller that sees DONE sees them */
    q->completed++;
    if (rc) q->failed++;
    pthread_mutex_unlock(&q->mu);
    complete(h, rc);

    pthread_mutex_lock(&q->mu);
    q->running = NULL;
    __atomic_fetch_sub(&wf_in_use_running, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&q->idle);
    handle_unref(h);  /* the worker's reference */
  }
  pthread_mutex_unlock(&q->mu);
  wf_store_thread_release();
  return NULL;
}

/* Caller holds q->mu. The worker takes no signals (wf_thread_start). */
static int start_worker(weft_async_queue *q) {
  int e = wf_thread_start(&q->th, worker_main, q);
  if (e) {
    errno = e;
    return wf_error_errno(WEFT_ESYS, "async queue '%s': cannot start the progress worker", q->name);
  }
  q->started = 1;
  q->pid = getpid();
  exit_register();
  return 0;
}

/* ---------------------------------------------------------------- queue */

int weft_async_queue_create(const char *name, weft_async_queue **out) {
  WF_CHECK_ARG(out, "async queue create: out must not be NULL");
  *out = NULL;
  weft_async_queue *q = calloc(1, sizeof *q);
  if (!q) return wf_error(WEFT_ENOMEM, "async queue create: out of memory");
  snprintf(q->name, sizeof q->name, "%s", (name && *name) ? name : "?");
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->cv, NULL);
  pthread_cond_init(&q->idle, NULL);
  q->pid = getpid();
  wf_in_use_register(wait_unused);
  reg_add(q);
  *out = q;
  return 0;
}

int weft_async_queue_destroy(weft_async_queue *q) {
  if (!q) return 0;
  if (q->started && q->pid != getpid()) {
    /* A child of fork(): the worker lives in the parent only, and the
     * mutex may have been held at the fork. Leak rather than touch it. */
    return 0;
  }
  reg_remove(q);   /* waits for a running exit handler; it then sees q no more */
  pthread_mutex_lock(&q->mu);
  q->closing = 1;
  /* Nothing queued will run: fail it now (it never touches its communicator,
   * which may be finalised already: finalizers run in any order). */
  fail_queued(q, "the queue was destroyed before it ran");
  pthread_cond_broadcast(&q->cv);
  int join = q->started && !q->joined;
  q->joined = 1;
  int abandoned = q->abandoned;
  pthread_mutex_unlock(&q->mu);
  if (join) pthread_join(q->th, NULL);  /* after the running op, bounded by its timeout */
  if (abandoned) return 0;              /* its worker may still use it */
  pthread_cond_destroy(&q->idle);
  pthread_cond_destroy(&q->cv);
  pthread_mutex_destroy(&q->mu);
  free(q);
  wf_clear_error();
  return 0;
}

int weft_async_queue_stats(weft_async_queue *q, weft_async_stats *out) {
  WF_CHECK_ARG(q && out, "async queue stats: NULL argument");
  pthread_mutex_lock(&q->mu);
  out->submitted = q->submitted;
  out->completed = q->completed;
  out->failed = q->failed;
  out->pending = (int)(q->submitted - q->completed);
  out->started = q->started;
  pthread_mutex_unlock(&q->mu);
  return 0;
}

int weft_async_submit(weft_async_queue *q, const weft_async_desc *d, weft_async **out) {
  WF_CHECK_ARG(out, "async submit: out must not be NULL");
  *out = NULL;
  WF_CHECK_ARG(q && d, "async submit: NULL queue or descriptor");
  const char *kn = kind_name(d->kind);
  WF_CHECK_ARG(kn, "async submit on queue '%s': unknown operation kind %d", q->name, d->kind);
  WF_CHECK_ARG(d->kind <= WEFT_ASYNC_SLEEP || d->comm,
               "async %s on queue '%s': NULL communicator", kn, q->name);
  WF_CHECK_ARG(d->kind != WEFT_ASYNC_STORE_GET || d->key,
               "async store get on queue '%s': NULL key", q->name);
  if (q->started && q->pid != getpid())
    return wf_error(WEFT_ESTATE, "async %s on queue '%s': the queue was made by process %d "
                    "before fork(); this process (%d) has no worker: create the group (and "
                    "its queue) after the fork", kn, q->name, (int)q->pid, (int)getpid());
  weft_async *h = calloc(1, sizeof *h);
  if (!h) return wf_error(WEFT_ENOMEM, "async %s on queue '%s': out of memory", kn, q->name);
  h->d = *d;
  if (d->kind == WEFT_ASYNC_STORE_GET) {
    h->key = strdup(d->key);
    if (!h->key) { free(h); return wf_error(WEFT_ENOMEM, "async store get: out of memory"); }
    h->d.key = h->key;
  }
  snprintf(h->qname, sizeof h->qname, "%s", q->name);
  pthread_mutex_init(&h->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&h->cv, &ca);
  pthread_condattr_destroy(&ca);
  atomic_init(&h->state, WF_ASYNC_QUEUED);
  atomic_init(&h->refs, 2);
  h->t_submit_ns = wf_now_ns();

  pthread_mutex_lock(&q->mu);
  if (q->closing) {
    pthread_mutex_unlock(&q->mu);
    atomic_store(&h->refs, 1);
    handle_unref(h);
    return wf_error(WEFT_ESTATE, "async %s: queue '%s' is being destroyed", kn, q->name);
  }
  if (!q->started) {
    int rc = start_worker(q);
    if (rc) {
      pthread_mutex_unlock(&q->mu);
      atomic_store(&h->refs, 1);
      handle_unref(h);
      return rc;
    }
  }
  if (q->tail) q->tail->next = h; else q->head = h;
  q->tail = h;
  q->submitted++;
  pthread_cond_signal(&q->cv);
  pthread_mutex_unlock(&q->mu);
  *out = h;
  return 0;
}

/* ---------------------------------------------------------------- waiting */

static int finished(weft_async *h) {
  if (h->rc == 0) return 0;
  /* Re-raise on the caller's thread: weft_last_error() is thread-local. */
  return wf_error(h->rc, "%s", h->msg);
}

int weft_async_test(weft_async *h) {
  WF_CHECK_ARG(h, "async test: NULL handle");
  if (atomic_load_explicit(&h->state, memory_order_acquire) != WF_ASYNC_DONE) return WEFT_EAGAIN;
  return finished(h);
}

int weft_async_wait(weft_async *h, int timeout_ms) {
  WF_CHECK_ARG(h, "async wait: NULL handle");
  if (atomic_load_explicit(&h->state, memory_order_acquire) == WF_ASYNC_DONE) return finished(h);
  struct timespec dl;
  clock_gettime(CLOCK_MONOTONIC, &dl);
  if (timeout_ms >= 0) {
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
  }
  int timed_out = 0;
  pthread_mutex_lock(&h->mu);
  while (atomic_load_explicit(&h->state, memory_order_acquire) != WF_ASYNC_DONE) {
    int e = timeout_ms >= 0 ? pthread_cond_timedwait(&h->cv, &h->mu, &dl)
                            : pthread_cond_wait(&h->cv, &h->mu);
    if (e == ETIMEDOUT) { timed_out = 1; break; }
  }
  pthread_mutex_unlock(&h->mu);
  if (timed_out && atomic_load_explicit(&h->state, memory_order_acquire) != WF_ASYNC_DONE) {
    int st = atomic_load(&h->state);
    return wf_error(WEFT_ETIMEOUT, "async %s on queue '%s': not done after %d ms (%s; it stays "
                    "bounded by its communicator's timeout: wait again or test later)",
                    kind_name(h->d.kind), h->qname, timeout_ms,
                    st == WF_ASYNC_RUNNING ? "running" : "still queued behind earlier operations");
  }
  return finished(h);
}

int weft_async_result(weft_async *h, const void **data, size_t *len, const size_t **lens,
                      int *nlens) {
  WF_CHECK_ARG(h, "async result: NULL handle");
  if (atomic_load_explicit(&h->state, memory_order_acquire) != WF_ASYNC_DONE)
    return wf_error(WEFT_ESTATE, "async %s on queue '%s': result asked before the operation "
                    "is done", kind_name(h->d.kind), h->qname);
  if (h->rc) return finished(h);
  if (data) *data = h->res;
  if (len) *len = h->res_len;
  if (lens) *lens = h->lens;
  if (nlens) *nlens = h->nlens;
  return 0;
}

int weft_async_times(weft_async *h, int64_t *submit_ns, int64_t *start_ns, int64_t *end_ns) {
  WF_CHECK_ARG(h, "async times: NULL handle");
  int st = atomic_load_explicit(&h->state, memory_order_acquire);
  if (submit_ns) *submit_ns = h->t_submit_ns;
  if (start_ns) *start_ns = st >= WF_ASYNC_RUNNING ? h->t_start_ns : 0;
  if (end_ns) *end_ns = st == WF_ASYNC_DONE ? h->t_end_ns : 0;
  return 0;
}

int weft_async_release(weft_async *h) {
  if (h) handle_unref(h);
  return 0;
}
