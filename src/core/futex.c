/* futex.c — shared futex wait/wake and pid liveness (futex.h). */
#include "futex.h"
#include "internal.h"

#include <limits.h>
#include <pthread.h>
#include <linux/futex.h>
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
