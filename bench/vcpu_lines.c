/* vcpu_lines.c — the cost of a cache line between CPUs 0 and 1 on 24 lines
 * (each on a page of its own), twice over, in one launch: whether the
 * machine's cache-line cost depends on the line (its physical address) or on
 * the moment (bench/results/host-busy-trace-vm-2cpu-2026-12-07.md).
 *   cc -O2 -pthread -o /tmp/vcpu_lines bench/vcpu_lines.c && /tmp/vcpu_lines
 * Prints "first/second" ns per round trip for each line. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
enum { N = 20000, L = 24 };
static _Atomic unsigned *flag;
static _Atomic int go = -1;
static void pin(int cpu) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s); }
static double now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static char *base;
static void *peer(void *a) {
  (void)a; pin(1);
  for (int round = 0; round < 2 * L; round++) {
    while (atomic_load(&go) != round) {}
    _Atomic unsigned *f = (_Atomic unsigned *)(base + (size_t)(round % L) * 4096 * 3);
    for (unsigned i = 0; i < N; i++) { while (atomic_load(f) != 2 * i + 1) {} atomic_store(f, 2 * i + 2); }
  }
  return NULL;
}
int main(void) {
  base = mmap(NULL, (size_t)L * 4096 * 3, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  for (int i = 0; i < L; i++) base[(size_t)i * 4096 * 3] = 0;
  pthread_t t; pin(0); pthread_create(&t, NULL, peer, NULL);
  double r[2 * L];
  for (int round = 0; round < 2 * L; round++) {
    _Atomic unsigned *f = (_Atomic unsigned *)(base + (size_t)(round % L) * 4096 * 3);
    atomic_store(f, 0);
    atomic_store(&go, round);
    double t0 = now_ns();
    for (unsigned i = 0; i < N; i++) { atomic_store(f, 2 * i + 1); while (atomic_load(f) != 2 * i + 2) {} }
    r[round] = (now_ns() - t0) / N;
  }
  pthread_join(t, NULL);
  for (int i = 0; i < L; i++) printf("%4.0f/%-4.0f ", r[i], r[i + L]);
  printf("\n");
}
