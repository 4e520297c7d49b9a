/* wait_spin_test.c — wf_wait_spin_on (src/core/wait.c), the adaptive spin
 * on a readiness test that the Gloo shim's small path runs on its partner's
 * socket before blocking in the read:
 *   1. ready at the first look, or after a few: 1, the wait did not sleep;
 *   2. never ready: 0 once the budget is spent (the caller blocks), having
 *      looked many times and never called sched_yield (this file defines
 *      sched_yield, so a yield in the loop is counted);
 *   3. a look that lost the CPU (a 30 ms gap, as when a busy process took
 *      the core) ends the spin at once and wf_wait_end halves the budget;
 *   4. the budget adapts: a wait that blocked but whose peer came within
 *      200 µs raises it to 1.25 times that wait, one far later lowers it by
 *      1/8, always within [WF_SPIN_MIN_NS, WF_SPIN_MAX_NS];
 *   5. crowded: one look, no spin;
 *   6. WEFT_GLOO_SPIN_US=0: one look (blocks at once); a fixed budget keeps
 *      spinning through a lost CPU and never adapts;
 *   7. wf_wait_yield_on: only when crowded, looks before every yield, ends
 *      when ready or after its 100 µs; a yield that kept the core 2 ms with
 *      nothing ready holds yields off (the next crowded wait blocks at once);
 *      WEFT_GLOO_YIELD_US=0: no yields even when crowded.
 * Prints "FAIL what" per failed check and closes with
 * "wait_spin: N passed, M failed"; exit status 0 only if nothing failed. */
#include "core/internal.h"
#include "core/wait.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int passed, failed;
#define CHECK(c, ...)                                                      \
  do {                                                                     \
    if (c) passed++;                                                       \
    else { failed++; printf("FAIL line %d: ", __LINE__); printf(__VA_ARGS__); printf("\n"); } \
  } while (0)

static int yields;
static int yield_sleep_us;   /* a yield that gives the core away this long (a stranger's slice) */
int sched_yield(void) {
  yields++;
  if (yield_sleep_us) {
    struct timespec ts = {0, yield_sleep_us * 1000L};
    nanosleep(&ts, NULL);
  }
  return 0;
}

typedef struct {
  int looks;      /* looks so far */
  int ready_at;   /* ready from this look on (0: never) */
  int stall_at;   /* this look sleeps 30 ms first (0: none) */
  int64_t stall_ns; /* how long that sleep really took (a loaded machine oversleeps) */
} probe;

static int ready(void *arg) {
  probe *p = arg;
  p->looks++;
  if (p->stall_at && p->looks == p->stall_at) {
    struct timespec ts = {0, 30 * 1000 * 1000};
    int64_t s0 = wf_now_ns();
    nanosleep(&ts, NULL);
    p->stall_ns = wf_now_ns() - s0;
  }
  return p->ready_at && p->looks >= p->ready_at;
}

static void wait_until(int64_t t) { while (wf_now_ns() < t) {} }

int main(void) {
  unsetenv("WEFT_GLOO_SPIN_US");
  wf_wait w;

  /* 1. ready at once / after a few looks */
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", NULL, 0);
  CHECK(w.spin_ns == WF_SPIN_START_NS && !w.fixed_spin, "default budget %lld", (long long)w.spin_ns);
  probe p = {0, 1, 0, 0};
  CHECK(wf_wait_spin_on(&w, ready, &p) == 1 && p.looks == 1 && !w.slept, "ready at once: looks %d", p.looks);
  wf_wait_end(&w);
  CHECK(w.spin_ns == WF_SPIN_START_NS, "a wait that never slept keeps the budget: %lld", (long long)w.spin_ns);
  p = (probe){0, 5, 0, 0};
  CHECK(wf_wait_spin_on(&w, ready, &p) == 1 && p.looks == 5 && !w.slept, "ready at look 5: looks %d", p.looks);
  wf_wait_end(&w);

  /* 2. never ready: spins the budget, never yields. A machine shared with
   * other work may take this CPU meanwhile (that is case 3): retried. */
  yields = 0;
  int64_t t0, took = 0;
  int r = -1;
  for (int tries = 0; tries < 20; tries++) {
    wf_wait_init(&w, "WEFT_GLOO_SPIN_US", NULL, 0);
    p = (probe){0, 0, 0, 0};
    t0 = wf_now_ns();
    r = wf_wait_spin_on(&w, ready, &p);
    took = wf_now_ns() - t0;
    if (!w.preempted) break;
  }
  CHECK(r == 0 && w.slept && !w.preempted, "never ready: r %d slept %d preempted %d", r, w.slept, w.preempted);
  CHECK(took >= WF_SPIN_START_NS, "spun the whole budget: %lld ns", (long long)took);
  CHECK(p.looks > 10, "looked many times while spinning: %d", p.looks);
  CHECK(yields == 0, "never yields while spinning: %d yields", yields);
  /* the peer came 100 µs after the wait began (the caller blocked meanwhile) */
  wait_until(w.t0 + 100000);
  wf_wait_end(&w);
  CHECK(w.spin_ns >= 125000 && w.spin_ns <= WF_SPIN_MAX_NS, "raised to 1.25x the wait: %lld", (long long)w.spin_ns);

  /* 3. a lost CPU ends the spin at once and halves the budget */
  int64_t before = w.spin_ns;
  p = (probe){0, 0, 3, 0};
  t0 = wf_now_ns();
  r = wf_wait_spin_on(&w, ready, &p);
  took = wf_now_ns() - t0;
  CHECK(r == 0 && w.preempted && w.slept, "preempted: r %d preempted %d slept %d", r, w.preempted, w.slept);
  CHECK(p.looks == 3, "stopped at the look that lost the CPU: looks %d", p.looks);
  CHECK(took < p.stall_ns + before, "no spin after the gap: %lld ns (the gap %lld)", (long long)took,
        (long long)p.stall_ns);
  wf_wait_end(&w);
  CHECK(w.spin_ns == before / 2, "halved: %lld -> %lld", (long long)before, (long long)w.spin_ns);

  /* 4. bounds of the adaptation */
  for (int i = 0; i < 20; i++) {   /* peers far behind: 1/8 off each time, down to the floor */
    p = (probe){0, 0, 0, 0};
    wf_wait_spin_on(&w, ready, &p);
    wait_until(w.t0 + WF_SPIN_MAX_NS + 50000);
    wf_wait_end(&w);
  }
  CHECK(w.spin_ns == WF_SPIN_MIN_NS, "floor: %lld", (long long)w.spin_ns);
  for (int i = 0; i < 40 && w.spin_ns < WF_SPIN_MAX_NS; i++) {   /* peers just inside 200 µs: up to the ceiling */
    p = (probe){0, 0, 0, 0};
    wf_wait_spin_on(&w, ready, &p);
    wait_until(w.t0 + WF_SPIN_MAX_NS - 1000);
    wf_wait_end(&w);
  }
  CHECK(w.spin_ns == WF_SPIN_MAX_NS, "ceiling: %lld", (long long)w.spin_ns);

  /* 5. crowded: one look */
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", NULL, 1);
  p = (probe){0, 0, 0, 0};
  CHECK(wf_wait_spin_on(&w, ready, &p) == 0 && p.looks == 1 && w.slept, "crowded: looks %d", p.looks);

  /* 6. fixed budgets */
  setenv("WEFT_GLOO_SPIN_US", "0", 1);
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", NULL, 0);
  p = (probe){0, 0, 0, 0};
  CHECK(wf_wait_spin_on(&w, ready, &p) == 0 && p.looks == 1, "WEFT_GLOO_SPIN_US=0: looks %d", p.looks);
  wf_wait_end(&w);
  CHECK(w.spin_ns == 0, "a fixed 0 stays 0: %lld", (long long)w.spin_ns);
  setenv("WEFT_GLOO_SPIN_US", "40000", 1);   /* 40 ms: outlasts the 30 ms stall */
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", NULL, 0);
  p = (probe){0, 0, 3, 0};
  t0 = wf_now_ns();
  r = wf_wait_spin_on(&w, ready, &p);
  took = wf_now_ns() - t0;
  CHECK(r == 0 && !w.preempted && took >= 40000000LL && p.looks > 3,
        "a fixed spin goes on through a lost CPU: preempted %d took %lld looks %d", w.preempted, (long long)took, p.looks);
  wf_wait_end(&w);
  CHECK(w.spin_ns == 40000000LL, "a fixed budget never adapts: %lld", (long long)w.spin_ns);
  CHECK(yields == 0, "no yields at all: %d", yields);

  /* 7. the yield phase */
  unsetenv("WEFT_GLOO_SPIN_US");
  unsetenv("WEFT_GLOO_YIELD_US");
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", "WEFT_GLOO_YIELD_US", 0);
  p = (probe){0, 0, 0, 0};
  yields = 0;
  for (int tries = 0; tries < 20; tries++) {   /* uncrowded: spin, then no yields */
    w.spin_ns = WF_SPIN_MIN_NS;
    if (!wf_wait_spin_on(&w, ready, &p) && !w.preempted) break;
  }
  CHECK(wf_wait_yield_on(&w, ready, &p) == 0 && yields == 0, "uncrowded: no yields (%d)", yields);
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", "WEFT_GLOO_YIELD_US", 1);
  p = (probe){0, 4, 0, 0};
  CHECK(wf_wait_spin_on(&w, ready, &p) == 0 && p.looks == 1, "crowded: no spin, looks %d", p.looks);
  CHECK(wf_wait_yield_on(&w, ready, &p) == 1 && yields == 2 && p.looks == 4,
        "crowded: a look before each yield, ready at look 4: yields %d looks %d", yields, p.looks);
  yields = 0;
  p = (probe){0, 0, 0, 0};
  t0 = wf_now_ns();
  wf_wait_spin_on(&w, ready, &p);
  r = wf_wait_yield_on(&w, ready, &p);
  took = wf_now_ns() - t0;
  CHECK(r == 0 && yields > 1 && took >= WF_YIELD_NS, "crowded, never ready: yields %d for %lld ns", yields,
        (long long)took);
  yield_sleep_us = 2000;
  yields = 0;
  p = (probe){0, 0, 0, 0};
  wf_wait_spin_on(&w, ready, &p);
  CHECK(wf_wait_yield_on(&w, ready, &p) == 0 && yields == 1, "a 2 ms yield with nothing ready ends the phase: %d",
        yields);
  yield_sleep_us = 0;
  yields = 0;
  p = (probe){0, 0, 0, 0};
  wf_wait_spin_on(&w, ready, &p);
  CHECK(wf_wait_yield_on(&w, ready, &p) == 0 && yields == 0 && p.looks == 1, "then yields are held off: %d", yields);
  setenv("WEFT_GLOO_YIELD_US", "0", 1);
  wf_wait_init(&w, "WEFT_GLOO_SPIN_US", "WEFT_GLOO_YIELD_US", 1);
  p = (probe){0, 0, 0, 0};
  wf_wait_spin_on(&w, ready, &p);
  CHECK(wf_wait_yield_on(&w, ready, &p) == 0 && yields == 0, "WEFT_GLOO_YIELD_US=0: no yields (%d)", yields);

  /* Crowding: 2 ranks pinned to CPUs 0 and 1 have a CPU each whatever else
   * runs; 2 unpinned ranks on 2 CPUs are crowded once the job has 4 ranks on
   * this machine (a PP job's two TP groups wait at the same time). */
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  wf_cpu_note pinned2[2] = {{1, 0}, {1, 1}}, same[2] = {{1, 0}, {1, 0}}, free2[2] = {{2, -1}, {2, -1}};
  CHECK(!wf_cpu_crowded(pinned2, 2, sizeof pinned2[0]), "pinned to distinct CPUs: not crowded");
  CHECK(wf_cpu_crowded(same, 2, sizeof same[0]), "two ranks pinned to one CPU: crowded");
  CHECK(wf_cpu_crowded(free2, 2, sizeof free2[0]), "2 of 4 local ranks on 2 CPUs: crowded");
  wf_cpu_note free8[2] = {{8, -1}, {8, -1}};
  CHECK(!wf_cpu_crowded(free8, 2, sizeof free8[0]), "4 local ranks on 8 CPUs: not crowded");

  printf("wait_spin: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
