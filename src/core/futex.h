/* futex.h — wait/wake and liveness primitives shared by the shm communicator
 * (shm_sync.c, shm_seg.c) and the message queue (mq.c): shared (not private)
 * futexes on words in a segment, and "is that peer process gone" checks. */
#ifndef WEFT_FUTEX_H
#define WEFT_FUTEX_H

#include <stdint.h>

/* Spin-loop hint: lets the sibling hyperthread (or the peer) run. */
static inline void wf_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Wrap-safe "counter v has reached target". */
static inline int wf_reached(uint32_t v, uint32_t target) { return (int32_t)(v - target) >= 0; }

/* Wake every sleeper on *w (shared futex: other processes map the word). */
void wf_futex_wake_all(_Atomic uint32_t *w);
/* Sleep while *w == v, at most ms: 0 when woken, else the errno (EAGAIN:
 * value changed, ETIMEDOUT, EINTR). */
int wf_futex_wait(_Atomic uint32_t *w, uint32_t v, int64_t ms);

/* Inode of this process's pid namespace (0 if unknown): pids are only
 * comparable between processes whose values are equal. */
uint64_t wf_pidns(void);
/* 1 if process pid is gone or a zombie (it will never make progress). Only
 * meaningful in the caller's pid namespace. */
int wf_pid_dead(int32_t pid);
/* 1 if process pid is stopped (SIGSTOP, a debugger): alive but not running. */
int wf_pid_stopped(int32_t pid);
/* This machine's host name (cached; "?" when unknown), for messages. */
const char *wf_hostname(void);

#endif
