/* wait.h — the adaptive wait of the host data plane: how long a rank that
 * waits for its peers (the shm communicator's barrier, shm_sync.c; the
 * message queue, mq.c) spins, yields and sleeps, decided from what its own
 * recent waits observed rather than from its affinity mask.
 *
 *  - Spin only when the group's ranks have a CPU each: the number of
 *    distinct CPUs the ranks may run on (every rank publishes its affinity
 *    at attach) is at least the group size. Ranks pinned one per core spin;
 *    8 ranks on 2 cores never do (a spinner would burn the core a late rank
 *    needs).
 *  - The spin budget adapts: it grows toward what recent waits needed when
 *    the peer came soon after the sleep began (a sleep and a wake-up cost
 *    more than spinning that long), shrinks when peers came much later than
 *    any spin would cover, and halves when this thread lost its CPU while
 *    spinning (a clock jump between two looks: something else wants the
 *    core), between WF_SPIN_MIN_NS and WF_SPIN_MAX_NS (far below a
 *    scheduler slice).
 *  - When ranks outnumber CPUs, a bounded sched_yield() phase hands the
 *    core to a late rank before sleeping; a yield that gave the core away
 *    for more than WF_YIELD_LONG_NS while no peer made progress means a
 *    foreign busy thread took the slice, so yields stop for
 *    WF_YIELD_HOLD_NS and such waits sleep on the futex at once (a woken
 *    sleeper preempts a busy loop; a yielder waits for its slice to end:
 *    ~4 ms).
 *  - The Gloo shim's small path (gloo_shim.cc) spins and yields the same
 *    way on a readiness test (its partner's socket, polled without
 *    blocking), then blocks in the socket's read: wf_wait_spin_on,
 *    wf_wait_yield_on.
 * WEFT_SHM_SPIN_US / WEFT_MQ_SPIN_US / WEFT_GLOO_SPIN_US fix the spin
 * (microseconds, spinning even when crowded), WEFT_SHM_YIELD_US /
 * WEFT_GLOO_YIELD_US fix the yield phase (0: none). */
#ifndef WEFT_WAIT_H
#define WEFT_WAIT_H

#include <stdint.h>
#ifndef __cplusplus /* the Gloo shim (C++) uses only wf_wait and the readiness spin */
#include <stdatomic.h>
#endif

#define WF_FIXED_PHASE_MAX_US 100000L /* WEFT_*_SPIN_US / _YIELD_US at most (100 ms) */
#define WF_SPIN_MIN_NS 10000LL    /* a futex wake-up on a VM costs about this much */
#define WF_SPIN_MAX_NS 200000LL   /* well inside a scheduler slice (~3-4 ms) */
#define WF_SPIN_START_NS 50000LL
#define WF_PREEMPT_NS 50000LL     /* a gap this long between two looks: the CPU was taken */
#define WF_YIELD_NS 100000LL      /* default yield phase when ranks outnumber CPUs */
#define WF_YIELD_LONG_NS 500000LL /* a yield this long with no peer progress fed a stranger's slice */
#define WF_YIELD_HOLD_NS 500000000LL /* no yields this long after one fed a foreign thread */

/* Where a rank may run, published in the segment at attach: how many CPUs
 * its affinity mask holds (at most its cgroup's CPU quota) and, when its
 * mask holds exactly one, which. */
typedef struct {
  uint16_t count;
  int16_t cpu; /* -1 unless count == 1 */
} wf_cpu_note;

/* One waiter's state (one per communicator handle; not shared). */
typedef struct {
  int64_t spin_ns;       /* current spin budget */
  int64_t yield_ns;      /* yield phase when crowded (0: none) */
  int64_t no_yield_until;/* wf_now_ns() before which yields are off */
  int64_t t0;            /* start of the wait being timed, 0: none */
  int64_t end;           /* end of its spin, 0: no (more) spinning */
  int fixed_spin;        /* spin_ns came from the environment: no adapting, spin even crowded */
  int fixed_yield;       /* yield_ns came from the environment: yield even uncrowded, never held off */
  int crowded;           /* ranks outnumber their CPUs: no spin */
  int preempted;         /* the current wait lost its CPU while spinning */
  int slept;             /* the current wait reached the yield or sleep phase */
} wf_wait;

/* This thread's note (sched_getaffinity). */
wf_cpu_note wf_cpu_note_self(void);
/* Distinct CPUs n notes cover: exact when every rank is pinned to one CPU,
 * else at least the largest mask (masks of several CPUs are not published). */
int wf_cpu_notes_cover(const wf_cpu_note *notes, int n, int stride_bytes);

/* Whether n ranks (their notes) outnumber the CPUs they may run on: ranks
 * pinned to distinct CPUs never are; otherwise the CPUs they cover must
 * also hold the job's other ranks on this machine (LOCAL_WORLD_SIZE). */
int wf_cpu_crowded(const wf_cpu_note *notes, int n, int stride_bytes);

/* spin_env/yield_env: names of the overriding variables (yield_env NULL:
 * no yield phase by default). crowded: from wf_cpu_crowded. */
void wf_wait_init(wf_wait *w, const char *spin_env, const char *yield_env, int crowded);

/* Spin phase on a readiness test rather than a word: ready(arg) != 0 ends
 * it (the Gloo shim's socket poll: each look is a system call, so the clock
 * is read on every look, and there is no yield phase). Starts the wait's
 * clock; 0: the caller blocks next (the wait counts as one that slept, for
 * wf_wait_end). */
int wf_wait_spin_on(wf_wait *w, int (*ready)(void *), void *arg);
/* Its yield phase (crowded waits only, as wf_wait_yield): 1 when ready(arg)
 * said so; a long yield after which it still is not ready fed a stranger:
 * yields are held off. */
int wf_wait_yield_on(wf_wait *w, int (*ready)(void *), void *arg);

#ifndef __cplusplus
/* Spin phase: 1 when *word reached target. Starts the wait's clock. */
int wf_wait_spin(wf_wait *w, _Atomic uint32_t *word, uint32_t target);
/* The same wait's spin continued on another word (a writer waiting for
 * several readers): 1 when *word reached target before the spin's end. */
int wf_wait_spin_more(wf_wait *w, _Atomic uint32_t *word, uint32_t target);
/* Yield phase (crowded waits only, bounded by yield_ns, skipped while
 * yields are held off): 1 when *word reached target; 0 also when *stop
 * became non-zero (an abort: the caller reports it). A long yield after
 * which *word has not moved fed a stranger, not a peer: yields are held off
 * (shm's word counts every arrival, so any peer's progress moves it). */
int wf_wait_yield(wf_wait *w, _Atomic uint32_t *word, uint32_t target, _Atomic uint32_t *stop);
static inline int wf_wait_reached(_Atomic uint32_t *word, uint32_t target) {
  return (int32_t)(atomic_load_explicit(word, memory_order_acquire) - target) >= 0;
}
#endif

/* The wait ended (successfully): adapt the spin budget to what it saw. */
void wf_wait_end(wf_wait *w);

#endif
