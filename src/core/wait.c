/* wait.c — the adaptive wait (wait.h): spin budget, yield phase, CPU notes. */
#include "wait.h"
#include "futex.h"
#include "internal.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* CPUs' worth of time a cgroup v2 quota allows ("max" or absent: no limit,
 * 0), rounded up: a container given 2 CPUs of a 64-CPU host crowds at 3 ranks. */
static int quota_cpus(void) {
  FILE *f = fopen("/sys/fs/cgroup/cpu.max", "r");
  if (!f) return 0;
  char q[32] = "";
  long long period = 0;
  int got = fscanf(f, "%31s %lld", q, &period);
  fclose(f);
  if (got != 2 || period <= 0 || q[0] < '0' || q[0] > '9') return 0;
  long long quota = atoll(q);
  return quota > 0 ? (int)((quota + period - 1) / period) : 0;
}

wf_cpu_note wf_cpu_note_self(void) {
  wf_cpu_note n = {0, -1};
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return n;
  int k = CPU_COUNT(&set);
  int quota = quota_cpus();
  if (quota > 0 && quota < k) k = quota; /* no single CPU to name then: count only */
  n.count = (uint16_t)(k > 65535 ? 65535 : k);
  if (k == 1 && CPU_COUNT(&set) == 1)
    for (int i = 0; i < CPU_SETSIZE; i++)
      if (CPU_ISSET(i, &set)) { n.cpu = (int16_t)i; break; }
  return n;
}

int wf_cpu_notes_cover(const wf_cpu_note *notes, int n, int stride_bytes) {
  uint64_t pinned[CPU_SETSIZE / 64];
  memset(pinned, 0, sizeof pinned);
  int distinct = 0, widest = 0;
  for (int i = 0; i < n; i++) {
    const wf_cpu_note *p = (const wf_cpu_note *)((const char *)notes + (size_t)i * (size_t)stride_bytes);
    if (p->count == 0) { /* unknown: assume the machine */
      long on = sysconf(_SC_NPROCESSORS_ONLN);
      if (on > widest) widest = (int)on;
    } else if (p->count == 1 && p->cpu >= 0 && p->cpu < CPU_SETSIZE) {
      uint64_t bit = 1ull << (p->cpu % 64);
      if (!(pinned[p->cpu / 64] & bit)) { pinned[p->cpu / 64] |= bit; distinct++; }
    } else if (p->count > widest) {
      widest = p->count;
    }
  }
  return distinct > widest ? distinct : widest;
}

int wf_cpu_crowded(const wf_cpu_note *notes, int n, int stride_bytes) {
  int cover = wf_cpu_notes_cover(notes, n, stride_bytes);
  int pinned = 1;
  for (int i = 0; i < n && pinned; i++) {
    const wf_cpu_note *p = (const wf_cpu_note *)((const char *)notes + (size_t)i * (size_t)stride_bytes);
    pinned = p->count == 1 && p->cpu >= 0;
  }
  if (pinned && cover == n) return 0;  /* a CPU of its own each */
  /* unpinned: the job's other ranks on this machine (other groups: the TP
   * groups of a PP job wait at the same time) want the same CPUs. Read
   * once: the launcher's LOCAL_WORLD_SIZE does not change in a process. */
  static int node_ranks = -1;
  if (node_ranks < 0) {
    long l = wf_env_long("LOCAL_WORLD_SIZE", 0);
    node_ranks = l > 0 && l < 1 << 20 ? (int)l : 0;
  }
  int ranks = node_ranks > n ? node_ranks : n;
  return cover < ranks;
}

void wf_wait_init(wf_wait *w, const char *spin_env, const char *yield_env, int crowded) {
  memset(w, 0, sizeof *w);
  w->crowded = crowded;
  /* a fixed phase is at most WF_FIXED_PHASE_MAX_US: the waits look at the
   * deadline, a dead peer and an interrupt between phases, so a longer one
   * would outlast the timeout (weft.init refuses more; a C caller is held
   * to it here) */
  long us = spin_env ? wf_env_long(spin_env, -1) : -1;
  if (us > WF_FIXED_PHASE_MAX_US) us = WF_FIXED_PHASE_MAX_US;
  w->fixed_spin = us >= 0;
  w->spin_ns = us >= 0 ? (int64_t)us * 1000 : WF_SPIN_START_NS;
  us = yield_env ? wf_env_long(yield_env, -1) : -1;
  if (us > WF_FIXED_PHASE_MAX_US) us = WF_FIXED_PHASE_MAX_US;
  w->fixed_yield = us >= 0;
  w->yield_ns = us >= 0 ? (int64_t)us * 1000 : yield_env ? WF_YIELD_NS : 0;
}

/* Spin on word until target or w->end; a clock jump between two looks ends
 * the spin (w->preempted). */
static int spin_to(wf_wait *w, _Atomic uint32_t *word, uint32_t target) {
  int64_t last = wf_now_ns();
  for (uint32_t it = 1;; it++) {
    if (wf_wait_reached(word, target)) return 1;
    if ((it & 15) == 0) {
      int64_t now = wf_now_ns();
      if (now - last > WF_PREEMPT_NS && !w->fixed_spin) {
        w->preempted = 1; /* the core is wanted elsewhere: stop taking it */
        w->end = 0;
        return wf_wait_reached(word, target);
      }
      if (now >= w->end) return 0;
      last = now;
    }
    wf_cpu_relax();
  }
}

int wf_wait_spin(wf_wait *w, _Atomic uint32_t *word, uint32_t target) {
  w->preempted = w->slept = 0;
  w->t0 = wf_now_ns();
  w->end = 0;
  /* crowded: not even the polls between clock reads (they burn the slice
   * the late rank needs); an explicit spin is the caller's choice */
  if ((w->crowded && !w->fixed_spin) || w->spin_ns <= 0) return 0;
  w->end = w->t0 + w->spin_ns;
  return spin_to(w, word, target);
}

int wf_wait_spin_on(wf_wait *w, int (*ready)(void *), void *arg) {
  w->preempted = w->slept = 0;
  w->t0 = wf_now_ns();
  w->end = 0;
  if (ready(arg)) return 1;
  if (!((w->crowded && !w->fixed_spin) || w->spin_ns <= 0)) {
    w->end = w->t0 + w->spin_ns;
    int64_t last = w->t0;
    for (;;) {
      if (ready(arg)) return 1;
      int64_t now = wf_now_ns();
      if (now - last > WF_PREEMPT_NS && !w->fixed_spin) {
        w->preempted = 1; /* the core is wanted elsewhere: block, a woken reader preempts */
        break;
      }
      if (now >= w->end) break;
      last = now;
      wf_cpu_relax(); /* never a yield: that hands a busy neighbour its whole slice */
    }
    w->end = 0;
  }
  w->slept = 1; /* the caller blocks next */
  return 0;
}

int wf_wait_spin_more(wf_wait *w, _Atomic uint32_t *word, uint32_t target) {
  if (wf_wait_reached(word, target)) return 1;
  return w->end && !w->slept ? spin_to(w, word, target) : 0;
}

/* The start of a yield phase (wf_wait_yield, wf_wait_yield_on): marks the
 * wait as one that blocks next, and says whether it yields at all now (a
 * phase configured, the CPUs crowded or the phase fixed, and no hold-off
 * after a slice fed to a stranger); if so *now is the time and *end the
 * phase's end. */
static inline int yield_begins(wf_wait *w, int64_t *now, int64_t *end) {
  w->slept = 1;
  if (w->yield_ns <= 0 || !(w->crowded || w->fixed_yield)) return 0;
  *now = wf_now_ns();
  if (*now < w->no_yield_until) return 0;
  *end = *now + w->yield_ns;
  return 1;
}

/* A yield from `before` to `after` long enough to have fed a thread that is
 * not a peer (unless the phase is fixed): when no peer moved meanwhile, the
 * caller holds yields off for WF_YIELD_HOLD_NS. */
static inline int yield_was_long(const wf_wait *w, int64_t before, int64_t after) {
  return after - before > WF_YIELD_LONG_NS && !w->fixed_yield;
}

int wf_wait_yield(wf_wait *w, _Atomic uint32_t *word, uint32_t target, _Atomic uint32_t *stop) {
  int64_t now, end;
  if (!yield_begins(w, &now, &end)) return 0;
  do {
    uint32_t v = atomic_load_explicit(word, memory_order_acquire);
    /* looked at before yielding: the last to arrive never yields */
    if ((int32_t)(v - target) >= 0) return 1;
    if (stop && atomic_load(stop)) return 0;
    sched_yield();
    int64_t t = wf_now_ns();
    if (yield_was_long(w, now, t) && atomic_load(word) == v) {
      /* the core went to a thread that is not a peer (or to a peer's long
       * work): sleeping costs less than waiting out its slices */
      w->no_yield_until = t + WF_YIELD_HOLD_NS;
      return wf_wait_reached(word, target);
    }
    now = t;
  } while (now < end);
  return wf_wait_reached(word, target);
}

int wf_wait_yield_on(wf_wait *w, int (*ready)(void *), void *arg) {
  int64_t now, end;
  if (!yield_begins(w, &now, &end)) return 0;
  do {
    if (ready(arg)) return 1; /* looked at before yielding */
    sched_yield();
    int64_t t = wf_now_ns();
    if (yield_was_long(w, now, t) && !ready(arg)) {
      w->no_yield_until = t + WF_YIELD_HOLD_NS; /* fed a stranger's slice, as in wf_wait_yield */
      return 0;
    }
    now = t;
  } while (now < end);
  return ready(arg);
}

void wf_wait_end(wf_wait *w) {
  if (!w->t0 || w->fixed_spin) return;
  int64_t took = wf_now_ns() - w->t0, s = w->spin_ns;
  w->t0 = 0;
  if (w->preempted) {
    s /= 2;
  } else if (w->slept && !w->crowded) {
    if (took <= WF_SPIN_MAX_NS) {
      /* the peer came soon after the sleep began: spinning that long would
       * have cost less than the sleep and the wake-up */
      int64_t want = took + took / 4;
      if (want > s) s = want;
    } else {
      s -= s / 8; /* peers come much later than any spin covers */
    }
  }
  if (s < WF_SPIN_MIN_NS) s = WF_SPIN_MIN_NS;
  if (s > WF_SPIN_MAX_NS) s = WF_SPIN_MAX_NS;
  w->spin_ns = s;
}
