/* vcpu_pingpong.c — how long one cache line takes to go between CPU 0 and
 * CPU 1 and back (two pinned threads, 200000 round trips): a probe of the
 * machine under weft's host plane, not of weft. On a VM the figure moves
 * from launch to launch with where the hypervisor runs the vCPUs
 * (bench/results/host-busy-pairs-vm-2cpu-2026-12-06.md); scripts/bench-host.lua
 * takes it before each run (--line-probe, which make bench-host passes).
 *   cc -O2 -pthread -o /tmp/vcpu_pingpong bench/vcpu_pingpong.c
 *   for i in $(seq 30); do /tmp/vcpu_pingpong; sleep 0.2; done   # ns per round trip
 * An argument: the number of round trips (default 200000). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static unsigned N = 200000;
static _Atomic unsigned flag __attribute__((aligned(64)));

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *peer(void *arg) {
  (void)arg;
  pin(1);
  for (unsigned i = 0; i < N; i++) {
    while (atomic_load(&flag) != 2 * i + 1) {}
    atomic_store(&flag, 2 * i + 2);
  }
  return NULL;
}

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
  if (argc > 1 && atol(argv[1]) > 0) N = (unsigned)atol(argv[1]);
  pthread_t t;
  pin(0);
  pthread_create(&t, NULL, peer, NULL);
  double t0 = now_ns();
  for (unsigned i = 0; i < N; i++) {
    atomic_store(&flag, 2 * i + 1);
    while (atomic_load(&flag) != 2 * i + 2) {}
  }
  double t1 = now_ns();
  pthread_join(t, NULL);
  printf("%.1f\n", (t1 - t0) / N);
  return 0;
}
