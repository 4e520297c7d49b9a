/* internal.h — helpers shared by the C core; nothing here is exported.
 * Internal symbols use the wf_ prefix; only weft_* from weft.h leave the .so. */
#ifndef WEFT_INTERNAL_H
#define WEFT_INTERNAL_H

#include "weft.h"
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>

/* Record a thread-local error message and return code (code < 0). */
int wf_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Same, appending ": strerror(errno)". */
int wf_error_errno(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefix the current message with "op: " context (keeps the code). */
int wf_error_context(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void wf_clear_error(void);

/* Logging to stderr, only when WEFT_LOG is set (level 1 = info, 2 = debug). */
int wf_log_level(void);
void wf_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Environment, read in one place (src/core/env.c). */
const char *wf_env_str(const char *name);               /* NULL when unset/empty */
long wf_env_long(const char *name, long dflt);
/* The rank this process says it is (torchrun's RANK, WORLD_SIZE); -1 when
 * unset. Only informs the store's messages, never decides anything alone. */
void wf_env_rank(int *rank, int *world);
/* The store server's connection limits (docs/store.md). 0 where noted means
 * "derive" (max_conns: from the fd limit) or "off" (idle_ms). */
typedef struct wf_store_limits {
  long max_conns;    /* WEFT_STORE_MAX_CONNS: open connections, all kinds */
  long max_preauth;  /* WEFT_STORE_MAX_PREAUTH: connections still in the handshake */
  long read_ms;      /* WEFT_STORE_READ_TIMEOUT_MS: handshake, and a frame's base deadline */
  long idle_ms;      /* WEFT_STORE_IDLE_MS: close idle authenticated connections (0: never) */
  long long max_total; /* WEFT_STORE_MAX_TOTAL: bytes of keys and values held, and frames being
                        * read, at once (0: derive, a quarter of the RAM, at least 1 GiB) */
} wf_store_limits;
void wf_env_store_limits(wf_store_limits *l);

/* Monotonic clock in milliseconds / nanoseconds. */
int64_t wf_now_ms(void);
int64_t wf_now_ns(void);
/* Sleep with exponential backoff: call with *us starting at 0. Never spins. */
void wf_backoff(int *us, int max_us);

/* The process-wide interrupt (src/core/interrupt.c, weft_interrupt_arm): 1 when
 * a blocking wait should give up now, with the reason in why. */
int wf_interrupted(char *why, size_t n);
int wf_interrupt_armed(void);
/* pthread_create with every signal blocked while the thread is made, so it
 * inherits an all-blocked mask and signals stay with the application's
 * threads (src/core/interrupt.c; the store server, the async workers).
 * pthread_create's result: 0 or an errno value. */
int wf_thread_start(pthread_t *th, void *(*fn)(void *), void *arg);

/* Graph-capture nesting depth of the calling thread (src/core/capture.c;
 * src/cuda/graph.c counts it): wf_capture_active() is 1 while the thread
 * captures a CUDA graph through weft. */
extern __thread int wf_tl_capture_depth;
int wf_capture_active(void);

#define WF_CHECK_ARG(cond, ...) \
  do { if (!(cond)) return wf_error(WEFT_EINVAL, __VA_ARGS__); } while (0)

/* Before memory or a handle is freed (in_use.c): a worker thread's running
 * operation that uses [lo, lo + len) or handle is waited for, bounded; -1
 * when it still runs after the bound (the caller leaks rather than frees).
 * The async workers register the answer (src/async.c). */
typedef int (*wf_in_use_fn)(const void *lo, size_t len, const void *handle);
void wf_in_use_register(wf_in_use_fn fn);
int wf_wait_unused(const void *lo, size_t len, const void *handle);
/* operations running on workers now: frees look further only when > 0 */
extern int wf_in_use_running;   /* __atomic builtins only (C and C++ include this) */
static inline int wf_in_use_any(void) { return __atomic_load_n(&wf_in_use_running, __ATOMIC_ACQUIRE) != 0; }

#endif
