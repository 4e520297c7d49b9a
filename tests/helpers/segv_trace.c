/* LD_PRELOAD helper for GPU debugging: on SIGSEGV or SIGBUS print the
 * faulting thread's stack (symbols through dladdr) to stderr, then die of the
 * same signal (scripts/gpu-nccl-exit builds it: cc -shared -fPIC -O1 -g -o
 * segv_trace.so tests/helpers/segv_trace.c -ldl). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

static void on_fault(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  char line[512];
  int n = snprintf(line, sizeof line, "segv_trace: signal %d at %p in thread %ld\n", sig,
                   si->si_addr, (long)syscall(SYS_gettid));
  write(2, line, (size_t)n);
  /* the thread's name, and whether the faulting address is mapped at all
   * (code of a library unloaded under a thread that still runs is not) */
  char path[64], comm[64] = "?";
  snprintf(path, sizeof path, "/proc/self/task/%ld/comm", (long)syscall(SYS_gettid));
  FILE *f = fopen(path, "r");
  if (f) { if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = 0; fclose(f); }
  int mapped = 0;
  char where[300] = "";
  f = fopen("/proc/self/maps", "r");
  if (f) {
    char m[512];
    unsigned long lo, hi, a = (unsigned long)si->si_addr;
    while (fgets(m, sizeof m, f))
      if (sscanf(m, "%lx-%lx", &lo, &hi) == 2 && a >= lo && a < hi) { mapped = 1; snprintf(where, sizeof where, "%s", m); break; }
    fclose(f);
  }
  Dl_info d0;
  memset(&d0, 0, sizeof d0);
  dladdr(si->si_addr, &d0);
  n = snprintf(line, sizeof line, "segv_trace: thread '%s' (main: %s); address %s %s%s\n", comm,
               syscall(SYS_gettid) == getpid() ? "yes" : "no", mapped ? "mapped:" : "NOT MAPPED (unloaded code?)",
               where[0] ? where : "", d0.dli_fname ? d0.dli_fname : "");
  write(2, line, (size_t)n);
  void *pc[64];
  int depth = backtrace(pc, 64);
  for (int i = 0; i < depth; i++) {
    Dl_info di;
    memset(&di, 0, sizeof di);
    dladdr(pc[i], &di);
    n = snprintf(line, sizeof line, "  #%d %p %s+0x%lx (%s)\n", i, pc[i],
                 di.dli_sname ? di.dli_sname : "?",
                 (unsigned long)((char *)pc[i] - (char *)(di.dli_saddr ? di.dli_saddr : di.dli_fbase)),
                 di.dli_fname ? di.dli_fname : "?");
    write(2, line, (size_t)n);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
}
