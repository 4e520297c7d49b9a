/* shm_sync.c — barriers of the shm communicator: generation-counted
 * arrivals, a short bounded spin, then a shared (not private) futex sleep with
 * a timeout; the call descriptor check; abort, departure and liveness.
 *
 * Arriving at generation g, a rank stores g in its own word (who is missing,
 * for messages, and the publication of its call descriptor) and adds 1 to
 * the segment's arrival counter; g is complete when the counter reaches
 * g * world. Everybody waits on that one word, so a barrier costs each
 * sleeper one wake-up (8 ranks on 2 cores: 8 context switches, not 56). A
 * sleeper announces itself in `sleepers` before re-checking the counter, and
 * the last arrival wakes only when that count is non-zero (both sides
 * seq_cst, so one always sees the other: no lost wake-up, and no syscall when
 * nobody sleeps). How long to spin, whether to yield first (ranks
 * outnumber CPUs) is the adaptive wait's decision (core/wait.h). Sleeps last
 * at most SLICE_MS, to notice an abort, a rank that destroyed its handle or
 * a process that died. */
#include "shm.h"
#include "cpugroup.h"
#include "core/futex.h"
#include "core/shape_word.h"
#include "core/wait.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SLICE_MS 100 /* sleeps wake up this often to check abort, departure, death */

const char *wf_shm_rank_name(weft_shm *c, int i, char *buf, size_t n) {
  snprintf(buf, n, "rank %d (global %d)", i, c->ranks[i]);
  return buf;
}

/* A peer whose process is gone (or a zombie) will never arrive. Only asked
 * when both share a pid namespace, where the pid means the same process. */
static int peer_dead(weft_shm *c, int i) {
  wf_shm_rank *r = &c->rk[i];
  uint64_t ns = c->rk[c->me].pidns;
  int32_t pid = atomic_load(&r->pid);
  if (!ns || r->pidns != ns || pid <= 0) return 0;
  return wf_pid_dead(pid);
}

/* Record why this rank stops, raise the abort word (first one wins) and wake
 * every sleeper so the others fail now instead of at their own deadline. */
static void give_up(weft_shm *c, const char *why) {
  wf_shm_rank *me = &c->rk[c->me];
  snprintf(me->why, sizeof me->why, "%.*s", (int)sizeof me->why - 1, why); /* kept short: a peer reads it */
  uint32_t zero = 0;
  atomic_compare_exchange_strong(&c->hdr->abort, &zero, (uint32_t)c->me + 1);
  wf_futex_wake_all(&c->hdr->arrivals);
}

int weft_shm_abort(weft_shm *c, const char *why) {
  WF_CHECK_ARG(c, "weft_shm_abort: NULL communicator");
  give_up(c, why && *why ? why : "aborted by its caller");
  return 0;
}

int weft_shm_set_timeout(weft_shm *c, int timeout_ms) {
  WF_CHECK_ARG(c && timeout_ms > 0, "weft_shm_set_timeout: NULL communicator or timeout %d <= 0",
               timeout_ms);
  c->timeout_ms = timeout_ms;
  return 0;
}

static int aborted_error(weft_shm *c, uint32_t ab, const char *op) {
  char rn[64];
  int who = (int)ab - 1;
  char why[sizeof c->rk[0].why];
  memcpy(why, c->rk[who].why, sizeof why);
  why[sizeof why - 1] = '\0';
  return wf_error(WEFT_EABORT, "%s: group '%s': communicator aborted by %s: %s (it cannot be "
                  "used any more: weft.recover() on every rank rebuilds the groups, "
                  "docs/faults.md)", op, c->group, wf_shm_rank_name(c, who, rn, sizeof rn), why);
}

int wf_shm_enter(weft_shm *c, const char *op) {
  if (!c) return wf_error(WEFT_EINVAL, "%s: NULL communicator", op);
  uint32_t ab = atomic_load(&c->hdr->abort);
  if (ab) return aborted_error(c, ab, op);
  int zero = 0;
  if (!atomic_compare_exchange_strong(&c->busy, &zero, 1))
    return wf_error(WEFT_ESTATE, "%s: group '%s': another operation is in flight on this "
                    "communicator (one at a time)", op, c->group);
  return 0;
}

void wf_shm_mark_left(weft_shm *c) {
  atomic_store(&c->rk[c->me].left, 1);
  wf_futex_wake_all(&c->hdr->arrivals);
}

/* List the ranks that have not reached generation g into buf. */
static void missing_list(weft_shm *c, uint32_t g, char *buf, size_t n, int only_dead) {
  size_t k = 0;
  buf[0] = '\0';
  for (int i = 0; i < c->world && k + 1 < n; i++) {
    if (i == c->me || wf_reached(atomic_load(&c->rk[i].seq), g)) continue;
    if (only_dead && !peer_dead(c, i)) continue;
    /* a rank that is late is named with its process, and as stopped when it
     * is (SIGSTOP, a debugger: alive, yet it will not arrive) */
    const int32_t pid = atomic_load(&c->rk[i].pid);
    const int known = pid > 0 && c->rk[i].pidns && c->rk[i].pidns == c->rk[c->me].pidns;
    const char *mark = only_dead ? (c->store_rank0 && c->ranks[i] == 0 ? ", which hosts the store" : "")
                       : known && wf_pid_stopped(pid) ? ", stopped" : "";
    int w = known || only_dead ? snprintf(buf + k, n - k, "%srank %d (global %d, pid %d, host %s%s)",
                                          k ? ", " : "", i, c->ranks[i], (int)pid, wf_hostname(), mark)
                               : snprintf(buf + k, n - k, "%srank %d (global %d)", k ? ", " : "", i,
                                          c->ranks[i]);
    if (w < 0) break;
    k += (size_t)w;
  }
  if (k >= n) buf[n - 1] = '\0';
}

/* The first rank that has not reached g and has destroyed its handle, or -1. */
static int departed(weft_shm *c, uint32_t g) {
  for (int i = 0; i < c->world; i++)
    if (i != c->me && !wf_reached(atomic_load(&c->rk[i].seq), g) && atomic_load(&c->rk[i].left))
      return i;
  return -1;
}

void wf_shm_note_recv(weft_shm *c, int src, uint64_t seq) {
  /* the source in 8 bits: from index 255 on (worlds up to WF_SHM_MAX_WORLD)
   * no note, so no check, rather than another rank's index */
  const uint32_t v = src < 0 || src >= 255 ? 0 : (uint32_t)(src + 1) << 24 | (uint32_t)(seq & 0xffffff);
  atomic_store(&c->rk[c->me].p2p_wait, v);
}

void wf_shm_forget_cpugroup(weft_shm *c, weft_cpugroup *g) {
  if (c->cg == g) c->cg = NULL;
}

/* A peer that has not reached generation g and waits in a recv from this
 * rank for a message this rank has not sent: it will never come (this rank
 * is at a barrier), so the two made different calls. The peer's index, and
 * the message's number in *msg; -1 if none. A message this rank sent before
 * the barrier is in the store: the peer's recv returns with it, and the
 * count says so (a peer waits for message k only after 0..k-1). */
static int recv_against_barrier(weft_shm *c, uint32_t g, uint32_t *msg) {
  if (!c->cg) return -1;
  for (int i = 0; i < c->world; i++) {
    if (i == c->me || wf_reached(atomic_load(&c->rk[i].seq), g)) continue;
    const uint32_t w = atomic_load(&c->rk[i].p2p_wait);
    if (!w || (int)(w >> 24) - 1 != c->me) continue;
    const uint32_t k = w & 0xffffff;
    if (k == (uint32_t)(wf_cpugroup_sent(c->cg, i) & 0xffffff)) {
      *msg = k;
      return i;
    }
  }
  return -1;
}

static int wait_all(weft_shm *c, uint32_t g, const char *op) {
  _Atomic uint32_t *arr = &c->hdr->arrivals;
  const uint32_t target = g * (uint32_t)c->world;
  /* spin (ranks have a CPU each), else yield (crowded), then sleep:
   * core/wait.h decides from what recent waits saw */
  if (wf_wait_spin(&c->wait, arr, target) ||
      wf_wait_yield(&c->wait, arr, target, &c->hdr->abort)) {
    wf_wait_end(&c->wait);
    return 0;
  }
  const int64_t deadline = wf_now_ms() + c->timeout_ms;
  for (;;) {
    if (wf_reached(atomic_load_explicit(arr, memory_order_acquire), target)) {
      wf_wait_end(&c->wait);
      return 0;
    }
    uint32_t ab = atomic_load(&c->hdr->abort);
    if (ab) return aborted_error(c, ab, op);
    char rn[64], why[104];
    int gone = departed(c, g);
    if (gone >= 0) {
      wf_shm_rank_name(c, gone, rn, sizeof rn);
      snprintf(why, sizeof why, "%s destroyed its communicator during %s", rn, op);
      give_up(c, why);
      return wf_error(WEFT_ECLOSED, "%s: group '%s': %s destroyed its communicator while "
                      "the others waited (call %llu)", op, c->group, rn,
                      (unsigned long long)(c->call - 1));
    }
    char iw[160];
    if (wf_interrupted(iw, sizeof iw)) {
      wf_shm_rank_name(c, c->me, rn, sizeof rn);
      snprintf(why, sizeof why, "%.30s was %.60s", rn, iw);
      give_up(c, why);
      return wf_error(WEFT_EABORT, "%s: group '%s': %s (call %llu); the communicator is aborted "
                      "on every rank: weft.recover() on every rank rebuilds the groups "
                      "(docs/faults.md)", op, c->group, iw, (unsigned long long)(c->call - 1));
    }
    int64_t now = wf_now_ms();
    if (now >= deadline) {
      char list[512];
      missing_list(c, g, list, sizeof list, 0);
      snprintf(why, sizeof why, "timed out after %d ms waiting for %.60s", c->timeout_ms, list); /* a peer reads 87 */
      give_up(c, why);
      return wf_error(WEFT_ETIMEOUT, "%s: group '%s': timed out after %d ms (call %llu) "
                      "waiting for %s", op, c->group, c->timeout_ms,
                      (unsigned long long)(c->call - 1), list);
    }
    int64_t slice = deadline - now < SLICE_MS ? deadline - now : SLICE_MS;
    atomic_fetch_add(&c->hdr->sleepers, 1);
    uint32_t v = atomic_load(arr);
    int e = wf_reached(v, target) ? 0 : wf_futex_wait(arr, v, slice);
    atomic_fetch_sub(&c->hdr->sleepers, 1);
    if (e == ETIMEDOUT) {
      uint32_t msg;
      int p = recv_against_barrier(c, g, &msg);
      if (p >= 0) {
        /* both fail now: the barrier's peers through the abort word, the
         * receiver through the cpu group's abort (its recv waits on it) */
        const char *sop = strncmp(op, "weft_shm_", 9) ? op : op + 9;
        snprintf(why, sizeof why, "rank %d called %.20s; rank %d waits in recv (message #%u)", c->me, sop, p,
                 (unsigned)msg);
        give_up(c, why);
        char full[400];
        wf_shm_rank_name(c, p, rn, sizeof rn);
        snprintf(full, sizeof full, "the calls differ: %s waits in a recv from rank %d (message #%u) "
                 "that rank %d never sent: it called %s on group '%s' instead", rn, c->me, (unsigned)msg,
                 c->me, sop, c->group);
        weft_cpugroup_abort(c->cg, full);
        return wf_error(WEFT_EINVAL, "%s: group '%s': %s waits in a recv for message #%u from this rank, "
                        "which called %s instead (call %llu): the ranks' calls differ; the communicator "
                        "is aborted on every rank (weft.recover() rebuilds the groups, docs/faults.md)",
                        op, c->group, rn, (unsigned)msg, sop, (unsigned long long)(c->call - 1));
      }
      char list[512];
      missing_list(c, g, list, sizeof list, 1);
      if (list[0]) {
        /* the peers read this from the segment in a few dozen bytes: the
         * op without its "weft_shm_" prefix keeps it whole */
        const char *sop = strncmp(op, "weft_shm_", 9) ? op : op + 9;
        snprintf(why, sizeof why, "%.64s died during %.20s", list, sop);
        give_up(c, why);
        return wf_error(WEFT_ECLOSED, "%s: group '%s': %s died (process gone) while the "
                        "others waited (call %llu)", op, c->group, list,
                        (unsigned long long)(c->call - 1));
      }
    }
  }
}

static const char *kind_name(uint32_t k) {
  static const char *names[] = {"?", "all_reduce", "all_gather", "reduce_scatter",
                                "broadcast", "barrier"};
  return k < sizeof names / sizeof names[0] ? names[k] : "?";
}

static const char *dtype_name(int d) {
  static const char *names[] = {"f32", "f16", "bf16", "i32", "i64", "u8", "f64", "f8e4m3"};
  return d >= 0 && d < 8 ? names[d] : "?";
}

static const char *op_name(int o) {
  static const char *names[] = {"sum", "max", "min", "and", "prod"};
  return o >= 0 && o < 5 ? names[o] : "?";
}

static int desc_text(const wf_shm_desc *d, char *buf, size_t n) {
  char sh[96]; /* " [2,4] ({2,3})": the shape word, then the args word */
  int k = wf_shape_word_text(d->shape, sh, sizeof sh);
  if (k < 0 || k >= (int)sizeof sh) k = 0;
  wf_args_word_text(d->args, sh + k, sizeof sh - k);
  switch (d->kind) {
  case WF_OP_ALL_REDUCE: case WF_OP_REDUCE_SCATTER:
    return snprintf(buf, n, "%s %s %s count=%llu%s", kind_name(d->kind), dtype_name(d->dtype),
                    op_name(d->redop), (unsigned long long)d->count, sh);
  case WF_OP_BROADCAST:
    return snprintf(buf, n, "broadcast bytes=%llu root=%d%s", (unsigned long long)d->count,
                    d->root, sh);
  case WF_OP_BARRIER: /* an object collective announces itself as a barrier marked "object" */
    return snprintf(buf, n, "%s", d->args == wf_args_word("object", 6) ? "an object collective (over the store)"
                                                                     : "barrier");
  default:
    return snprintf(buf, n, "%s bytes=%llu%s", kind_name(d->kind), (unsigned long long)d->count, sh);
  }
}

static int same_desc(const wf_shm_desc *a, const wf_shm_desc *b) {
  return a->kind == b->kind && a->dtype == b->dtype && a->redop == b->redop &&
         a->root == b->root && a->count == b->count && a->call == b->call && a->shape == b->shape &&
         a->args == b->args;
}

/* Every rank reads the same descriptors, so either all ranks pass or all
 * report the same mismatch; the communicator stays usable either way. */
static int check_desc(weft_shm *c, const wf_shm_desc *d, const char *op) {
  int bad = 0;
  for (int i = 0; i < c->world && !bad; i++)
    bad = !same_desc(&c->rk[i].desc[d->call & 1], d);
  if (!bad) return 0;
  char msg[900];
  size_t k = 0;
  for (int i = 0; i < c->world && k + 1 < sizeof msg; i++) {
    char rn[64], dt[200];
    const wf_shm_desc *o = &c->rk[i].desc[d->call & 1];
    desc_text(o, dt, sizeof dt);
    int w = snprintf(msg + k, sizeof msg - k, "%s%s: %s", i ? "; " : "",
                     wf_shm_rank_name(c, i, rn, sizeof rn), dt);
    if (w < 0) break;
    k += (size_t)w;
  }
  return wf_error(WEFT_EINVAL, "%s: group '%s': ranks called different collectives or sizes "
                  "(call %llu): %s", op, c->group, (unsigned long long)d->call, msg);
}

/* Whether this group's ranks outnumber the CPUs they may run on. */
static void crowding(weft_shm *c) {
  c->cpus_known = 1;
  c->wait.crowded = wf_cpu_crowded(&c->rk[0].cpus, c->world, (int)sizeof c->rk[0]);
}

int wf_shm_sync(weft_shm *c, const wf_shm_desc *d, const char *op) {
  uint32_t g = ++c->gen;
  wf_shm_rank *me = &c->rk[c->me];
  if (d) me->desc[d->call & 1] = *d;
  atomic_store_explicit(&me->seq, g, memory_order_release); /* publishes desc (and names who came) */
  /* The RMW publishes this rank's data: a waiter's acquire of the final count
   * synchronizes with every arrival before it (release sequence). */
  uint32_t before = atomic_fetch_add(&c->hdr->arrivals, 1);
  if (before + 1 == g * (uint32_t)c->world) {
    if (atomic_load(&c->hdr->sleepers)) wf_futex_wake_all(&c->hdr->arrivals);
  } else {
    int rc = wait_all(c, g, op);
    if (rc) return rc;
  }
  /* every rank published its CPU note before its first arrival */
  if (!c->cpus_known) crowding(c);
  return d ? check_desc(c, d, op) : 0;
}
