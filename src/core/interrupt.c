/* interrupt.c — a process-wide interrupt for weft's blocking host waits
 * (cpu group and store waits, shm barriers, the mq broadcaster). An
 * application that handles Ctrl-C itself (the REPL: a signalfd) arms it with
 * that fd and/or a deadline; every bounded wait already wakes up every
 * 100-200 ms and then asks wf_interrupted(). weft only polls the fd, never
 * reads it: the application drains it. No thread, no signal handler. */
#include "internal.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>

static int armed_fd = -1;          /* atomic */
static int64_t armed_deadline = 0; /* atomic; wf_now_ms() clock, 0: none */
static int armed_timeout = 0;      /* atomic; for the message */

int weft_interrupt_arm(int fd, int timeout_ms) {
  __atomic_store_n(&armed_fd, fd >= 0 ? fd : -1, __ATOMIC_RELEASE);
  __atomic_store_n(&armed_timeout, timeout_ms > 0 ? timeout_ms : 0, __ATOMIC_RELEASE);
  __atomic_store_n(&armed_deadline, timeout_ms > 0 ? wf_now_ms() + timeout_ms : 0, __ATOMIC_RELEASE);
  return 0;
}

int wf_interrupt_armed(void) {
  return __atomic_load_n(&armed_fd, __ATOMIC_ACQUIRE) >= 0 ||
         __atomic_load_n(&armed_deadline, __ATOMIC_ACQUIRE) != 0;
}

int wf_interrupted(char *why, size_t n) {
  int fd = __atomic_load_n(&armed_fd, __ATOMIC_ACQUIRE);
  int64_t dl = __atomic_load_n(&armed_deadline, __ATOMIC_ACQUIRE);
  if (fd >= 0) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) {
      if (why) snprintf(why, n, "interrupted (Ctrl-C)");
      return 1;
    }
  }
  if (dl && wf_now_ms() >= dl) {
    if (why) snprintf(why, n, "interrupted: still running after %d ms (the interrupt deadline; "
                      "in the REPL, :timeout MS sets it)",
                      __atomic_load_n(&armed_timeout, __ATOMIC_ACQUIRE));
    return 1;
  }
  return 0;
}

int wf_thread_start(pthread_t *th, void *(*fn)(void *), void *arg) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int e = pthread_create(th, NULL, fn, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return e;
}
