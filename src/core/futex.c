/* futex.c — shared futex wait/wake, pid liveness and spin defaults (futex.h). */
#include "futex.h"
#include "internal.h"

#include <limits.h>
#include <pthread.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

void wf_futex_wake_all(_Atomic uint32_t *w) {
  syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int wf_futex_wait(_Atomic uint32_t *w, uint32_t v, int64_t ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  if (syscall(SYS_futex, w, FUTEX_WAIT, v, &ts, NULL, 0) == 0) return 0;
  return errno; /* EAGAIN (value changed), ETIMEDOUT, EINTR */
}

uint64_t wf_pidns(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* The state letter of /proc/<pid>/stat, or 0. */
static char pid_state(int32_t pid) {
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[k] = '\0';
  const char *p = strrchr(buf, ')');
  return p && p[1] == ' ' ? p[2] : 0;
}

int wf_pid_dead(int32_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char st = pid_state(pid);
  return st == 'Z' || st == 'X';
}

int wf_pid_stopped(int32_t pid) {
  char st = pid_state(pid);
  return st == 'T' || st == 't';
}

static char host_name[256];
static pthread_once_t host_once = PTHREAD_ONCE_INIT;
static void host_init(void) {
  if (gethostname(host_name, sizeof host_name - 1) != 0 || !host_name[0])
    snprintf(host_name, sizeof host_name, "?");
}

const char *wf_hostname(void) {
  pthread_once(&host_once, host_init);
  return host_name;
}

static int cpus_usable(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

int64_t wf_yield_default_ns(const char *env, int world) {
  long us = wf_env_long(env, -1);
  if (us >= 0) return (int64_t)us * 1000;
  return cpus_usable() < world ? 100 * 1000 : 0;
}

int64_t wf_spin_default_ns(const char *env, int world) {
  long us = wf_env_long(env, -1);
  if (us >= 0) return (int64_t)us * 1000;
  int cpus = cpus_usable();
  /* With a core per rank a peer is usually microseconds away: spin a little.
   * Oversubscribed, spinning only steals the peer's core: sleep. */
  return cpus >= world ? 50 * 1000 : 2 * 1000;
}
