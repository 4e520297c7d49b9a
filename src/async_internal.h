/* async_internal.h — the queue and handle of src/async.c (not exported).
 *
 * One progress worker (a pthread) per queue, created on the first submit and
 * never at load time; it runs the queued operations in submission order by
 * calling the public weft_* functions, one at a time. A handle is shared by
 * the caller and the worker (reference count 2 while queued); its state is an
 * atomic the caller can read without a lock, and its mutex/condvar serve
 * weft_async_wait. */
#ifndef WF_ASYNC_INTERNAL_H
#define WF_ASYNC_INTERNAL_H

#include "core/internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

enum { WF_ASYNC_QUEUED = 0, WF_ASYNC_RUNNING = 1, WF_ASYNC_DONE = 2 };

#define WF_ASYNC_MSG 1024

struct weft_async {
  _Atomic int state;           /* WF_ASYNC_* */
  _Atomic int refs;            /* caller + worker */
  int rc;                      /* the operation's status, valid once DONE */
  weft_async_desc d;           /* copy of what was submitted */
  char *key;                   /* STORE_GET: owned copy of d.key */
  uint8_t *res;                /* result bytes (broadcast, allgather, recv, dequeue, get) */
  size_t res_len, res_cap;
  size_t *lens;                /* ALLGATHER: per-rank lengths */
  int nlens;
  int64_t t_submit_ns, t_start_ns, t_end_ns;
  pthread_mutex_t mu;
  pthread_cond_t cv;           /* signalled once, when state becomes DONE */
  struct weft_async *next;     /* queue linkage */
  char qname[64];              /* for messages */
  char msg[WF_ASYNC_MSG];      /* the worker thread's error message */
};

struct weft_async_queue {
  pthread_mutex_t mu;
  pthread_cond_t cv;           /* work arrived / closing */
  pthread_cond_t idle;         /* the running operation finished */
  weft_async *head, *tail;
  weft_async *running;
  pthread_t th;
  int started;                 /* worker created */
  int closing;
  pid_t pid;                   /* process that created the worker (fork check) */
  int64_t submitted, completed, failed;
  int joined;                  /* worker joined (by destroy or the exit handler) */
  int abandoned;               /* the exit handler gave up waiting: never free */
  struct weft_async_queue *reg_next;  /* the process-wide list of queues */
  char name[64];
};

#endif
