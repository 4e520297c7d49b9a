/* mq.c — message-queue broadcaster: a shared-memory ring from one writer to
 * the other ranks of a node (SGLang's MessageQueue / mq_broadcaster), layout
 * in mq.h. Creation goes through the cpu group like the shm communicator
 * (random name, 0600, unlinked once everyone attached).
 *
 * Waits spin (how long: the adaptive wait of core/wait.h; not at all when
 * ranks outnumber their CPUs), then sleep on a shared futex in slices of SLICE_MS,
 * checking the abort word, the peer's departure and (same pid namespace) its
 * liveness at every slice, within a bound: the group's timeout. A sleeper
 * announces itself in the line's `waiters` before re-checking the word and a
 * publisher wakes only when that count is non-zero (both seq_cst), so no
 * wake-up is lost and nobody pays a syscall when nobody sleeps.
 *
 * Failures that leave the ring inconsistent or the group broken (a peer that
 * died or left, a half-written message) raise the abort word with a reason,
 * so every rank fails at once with the same cause; a reader's timeout and a
 * writer's timeout before a message's first fragment leave it usable. */
#include "mq.h"
#include "cpugroup.h"
#include "core/futex.h"
#include "core/wait.h"
#include "shm.h" /* wf_shm_random_name, wf_shm_unlink */

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SLICE_MS 100

/* ---------------------------------------------------------------- helpers */

static inline wf_mq_wline *wline(weft_mq *q, uint64_t slot) {
  return (wf_mq_wline *)(q->ctl + (size_t)slot * (size_t)(1 + q->world) * WF_MQ_LINE);
}
static inline wf_mq_rline *rline(weft_mq *q, uint64_t slot, int r) {
  return (wf_mq_rline *)((uint8_t *)wline(q, slot) + (size_t)(1 + r) * WF_MQ_LINE);
}
static inline uint8_t *slot_data(weft_mq *q, uint64_t slot) {
  return q->data + (size_t)slot * q->stride;
}

static const char *rank_name(weft_mq *q, int i, char *buf, size_t n) {
  snprintf(buf, n, "rank %d (global %d)", i, q->ranks[i]);
  return buf;
}

/* A peer whose process is gone (or a zombie) will never make progress. */
static int peer_dead(weft_mq *q, int i) {
  wf_mq_rank *r = &q->rk[i];
  int32_t pid = atomic_load(&r->pid);
  if (!q->check_pids || r->pidns != q->rk[q->me].pidns || pid <= 0) return 0;
  return wf_pid_dead(pid);
}

/* Wake everyone who may sleep on a word this rank publishes or waits on. */
static void wake_all_words(weft_mq *q) {
  for (uint32_t s = 0; s < q->chunks; s++) {
    wf_mq_wline *w = wline(q, s);
    if (atomic_load(&w->waiters)) wf_futex_wake_all(&w->seq);
    for (int r = 0; r < q->world; r++) {
      wf_mq_rline *l = rline(q, s, r);
      if (atomic_load(&l->waiters)) wf_futex_wake_all(&l->seq);
    }
  }
}

/* Record why this rank stops, raise the abort word (first one wins) and wake
 * every sleeper so the others fail now instead of at their own deadline. */
static void give_up(weft_mq *q, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void give_up(weft_mq *q, const char *fmt, ...) {
  wf_mq_rank *me = &q->rk[q->me];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(me->why, sizeof me->why, fmt, ap);
  va_end(ap);
  uint32_t zero = 0;
  atomic_compare_exchange_strong(&q->hdr->abort, &zero, (uint32_t)q->me + 1);
  wake_all_words(q);
}

static int aborted_error(weft_mq *q, uint32_t ab, const char *op) {
  char rn[64], why[sizeof q->rk[0].why];
  int who = (int)ab - 1;
  if (who < 0 || who >= q->world) who = 0;
  memcpy(why, q->rk[who].why, sizeof why);
  why[sizeof why - 1] = '\0';
  return wf_error(WEFT_EABORT, "%s: group '%s': message queue aborted by %s: %s", op, q->group,
                  rank_name(q, who, rn, sizeof rn), why);
}

/* Readers pass check_abort 0: what is already in the ring stays readable;
 * the abort is reported when they would have to wait for more. */
static int enter(weft_mq *q, const char *op, int check_abort) {
  if (!q) return wf_error(WEFT_EINVAL, "%s: NULL message queue", op);
  uint32_t ab = check_abort ? atomic_load(&q->hdr->abort) : 0;
  if (ab) return aborted_error(q, ab, op);
  int zero = 0;
  if (!atomic_compare_exchange_strong(&q->busy, &zero, 1))
    return wf_error(WEFT_ESTATE, "%s: group '%s': another call is in flight on this message "
                    "queue (one at a time)", op, q->group);
  return 0;
}

static inline int leave(weft_mq *q, int rc) {
  atomic_store_explicit(&q->busy, 0, memory_order_release);
  return rc;
}

enum { WT_OK = 0, WT_TIMEOUT, WT_LEFT, WT_DEAD, WT_ABORT, WT_INTR };

/* An interrupt (weft_interrupt_arm) aborts the queue for every member. */
static int interrupted_error(weft_mq *q, const char *op) {
  char why[160], rn[64];
  wf_interrupted(why, sizeof why);
  give_up(q, "%s was %.100s", rank_name(q, q->me, rn, sizeof rn), why);
  return wf_error(WEFT_EABORT, "%s: group '%s': %s (message %llu); the queue is aborted on every "
                  "rank: weft.recover() on every rank rebuilds the groups (docs/faults.md)", op,
                  q->group, why, (unsigned long long)q->msgs);
}

/* Sleep until *w reaches target, peer (whose progress that is) leaves or
 * dies, the queue is aborted, or deadline_ms passes. */
static int sleep_until(weft_mq *q, _Atomic uint32_t *w, _Atomic uint32_t *waiters,
                       uint32_t target, int peer, int64_t deadline_ms) {
  for (;;) {
    if (wf_reached(atomic_load_explicit(w, memory_order_acquire), target)) return WT_OK;
    if (atomic_load(&q->hdr->abort)) return WT_ABORT;
    /* departure is published after the peer's last store: re-check the word */
    if (atomic_load(&q->rk[peer].left))
      return wf_reached(atomic_load_explicit(w, memory_order_acquire), target) ? WT_OK : WT_LEFT;
    int64_t now = wf_now_ms();
    if (now >= deadline_ms) return WT_TIMEOUT;
    if (wf_interrupted(NULL, 0)) return WT_INTR;
    int64_t slice = deadline_ms - now < SLICE_MS ? deadline_ms - now : SLICE_MS;
    atomic_fetch_add(waiters, 1);
    uint32_t v = atomic_load(w);
    int e = wf_reached(v, target) ? 0 : wf_futex_wait(w, v, slice);
    atomic_fetch_sub(waiters, 1);
    if (e == ETIMEDOUT && peer_dead(q, peer))
      return wf_reached(atomic_load_explicit(w, memory_order_acquire), target) ? WT_OK : WT_DEAD;
  }
}

/* ---------------------------------------------------------------- segment */

static size_t seg_ctl_off(int world) {
  size_t off = WF_MQ_HDR + (size_t)world * WF_MQ_RANK;
  return (off + WF_MQ_LINE - 1) & ~(size_t)(WF_MQ_LINE - 1);
}

static size_t seg_data_off(int world, uint32_t chunks) {
  size_t end = seg_ctl_off(world) + (size_t)chunks * (size_t)(1 + world) * WF_MQ_LINE;
  return (end + 4095) & ~(size_t)4095;
}

static size_t seg_stride(size_t chunk) { return (chunk + 63) & ~(size_t)63; }

static void mq_close(weft_mq *q) {
  if (!q) return;
  if (q->base) munmap(q->base, q->map_len);
  free(q->ranks);
  free(q->buf);
  free(q);
}

/* Create (index 0) or attach to the segment `name` and fill *out. */
static int mq_attach(const char *name, int create, int index, int world, int writer,
                     size_t chunk, uint32_t chunks, int timeout_ms, const char *group,
                     const int *ranks, weft_mq **out) {
  *out = NULL;
  size_t stride = seg_stride(chunk);
  size_t ctl_off = seg_ctl_off(world), data_off = seg_data_off(world, chunks);
  size_t total = data_off + stride * chunks;
  weft_mq *q = calloc(1, sizeof *q);
  if (!q || !(q->ranks = malloc(sizeof(int) * (size_t)world))) {
    mq_close(q);
    return wf_error(WEFT_ENOMEM, "weft_mq_create: group '%s': out of memory", group);
  }
  for (int i = 0; i < world; i++) q->ranks[i] = ranks ? ranks[i] : i;
  snprintf(q->group, sizeof q->group, "%s", group);
  q->world = world;
  q->me = index;
  q->writer = writer;
  q->chunk = chunk;
  q->chunks = chunks;
  q->stride = stride;
  q->timeout_ms = timeout_ms > 0 ? timeout_ms : 1;
  /* crowded until every rank's CPU note is known (weft_mq_create) */
  wf_wait_init(&q->wait, "WEFT_MQ_SPIN_US", NULL, sysconf(_SC_NPROCESSORS_ONLN) < world);

  int rc = wf_shm_map(name, create, 0, total, "weft_mq_create", group,
                      " (is this rank on the writer's node?)", "", &q->base);
  if (rc) {
    mq_close(q);
    return rc;
  }
  q->map_len = total;
  q->hdr = (wf_mq_hdr *)q->base;
  q->rk = (wf_mq_rank *)(q->base + WF_MQ_HDR);
  q->ctl = q->base + ctl_off;
  q->data = q->base + data_off;
  wf_mq_hdr *h = q->hdr;
  if (create) {
    h->version = WF_MQ_VERSION;
    h->world = (uint32_t)world;
    h->writer = (uint32_t)writer;
    h->chunks = chunks;
    h->chunk = chunk;
    h->stride = stride;
    h->ctl_off = ctl_off;
    h->data_off = data_off;
    h->total = total;
    __atomic_store_n(&h->magic, WF_MQ_MAGIC, __ATOMIC_RELEASE);
  } else if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != WF_MQ_MAGIC ||
             h->version != WF_MQ_VERSION || h->world != (uint32_t)world ||
             h->writer != (uint32_t)writer || h->chunks != chunks || h->chunk != chunk) {
    mq_close(q);
    return wf_error(WEFT_EPROTO, "weft_mq_create: group '%s': segment %s is not a weft message "
                    "queue of this geometry", group, name);
  }
  wf_mq_rank *r = &q->rk[index];
  r->pidns = wf_pidns();
  r->cpus = wf_cpu_note_self();
  atomic_store(&r->pid, (int32_t)getpid());
  atomic_fetch_add(&h->attached, 1);
  *out = q;
  return 0;
}

/* ---------------------------------------------------------------- create */

typedef struct {
  int32_t ok, writer;
  uint32_t chunks, pad;
  uint64_t chunk;
  char name[64];
} create_msg;


int weft_mq_create(weft_cpugroup *g, int writer, size_t chunk_bytes, int chunks, weft_mq **out) {
  static const char op[] = "weft_mq_create";
  WF_CHECK_ARG(g && out, "%s: NULL group or out pointer", op);
  *out = NULL;
  const char *gname = NULL;
  const int *granks = NULL;
  int size = 0, index = 0, tmo = 0;
  int rc = wf_cpugroup_info(g, &gname, &size, &index, &granks, &tmo);
  if (rc) return wf_error_context(rc, "%s", op);
  if (!gname) gname = "?";
  if (!chunk_bytes) chunk_bytes = (size_t)wf_env_long("WEFT_MQ_CHUNK_BYTES", 1 << 20);
  if (!chunks) chunks = (int)wf_env_long("WEFT_MQ_CHUNKS", 8);
  WF_CHECK_ARG(size >= 1 && size <= WF_MQ_MAX_WORLD, "%s: group '%s': %d ranks (1..%d supported)",
               op, gname, size, WF_MQ_MAX_WORLD);
  WF_CHECK_ARG(writer >= 0 && writer < size, "%s: group '%s': writer index %d outside 0..%d", op,
               gname, writer, size - 1);
  WF_CHECK_ARG(chunk_bytes >= 1 && chunk_bytes <= WF_MQ_MAX_CHUNK,
               "%s: group '%s': chunk_bytes %zu outside 1..%zu", op, gname, chunk_bytes,
               WF_MQ_MAX_CHUNK);
  WF_CHECK_ARG(chunks >= 1 && chunks <= WF_MQ_MAX_CHUNKS, "%s: group '%s': chunks %d outside 1..%d",
               op, gname, chunks, WF_MQ_MAX_CHUNKS);
  WF_CHECK_ARG(seg_stride(chunk_bytes) * (size_t)chunks <= WF_MQ_MAX_DATA,
               "%s: group '%s': %d chunks of %zu bytes exceed %zu bytes", op, gname, chunks,
               chunk_bytes, WF_MQ_MAX_DATA);

  /* 1. index 0 creates and announces the name and geometry (or its failure). */
  weft_mq *q = NULL;
  create_msg m;
  memset(&m, 0, sizeof m);
  int my_rc = 0;
  char my_err[200] = "";
  if (index == 0) {
    my_rc = wf_shm_random_name("mq", m.name, sizeof m.name);
    if (!my_rc)
      my_rc = mq_attach(m.name, 1, 0, size, writer, chunk_bytes, (uint32_t)chunks, tmo, gname,
                        granks, &q);
    m.ok = my_rc == 0;
    m.writer = writer;
    m.chunks = (uint32_t)chunks;
    m.chunk = chunk_bytes;
    if (my_rc) snprintf(my_err, sizeof my_err, "%s", weft_last_error());
  }
  rc = wf_shm_announce(g, index, &m, sizeof m, m.name, sizeof m.name, &m.ok, &my_rc, op, gname);
  if (rc) {
    if (q) { wf_shm_unlink(m.name); mq_close(q); }
    return rc;
  }
  if (index != 0) {
    if (my_rc == 0 && (m.writer != writer || m.chunks != (uint32_t)chunks || m.chunk != chunk_bytes))
      my_rc = wf_error(WEFT_EINVAL, "%s: group '%s': ranks disagree on the queue (index 0: "
                       "writer %d, %u chunks of %llu bytes; this rank: writer %d, %d chunks "
                       "of %zu bytes)", op, gname, m.writer, m.chunks,
                       (unsigned long long)m.chunk, writer, chunks, chunk_bytes);
    else if (my_rc == 0)
      my_rc = mq_attach(m.name, 0, index, size, writer, chunk_bytes, (uint32_t)chunks, tmo,
                        gname, granks, &q);
    if (my_rc) snprintf(my_err, sizeof my_err, "%s", weft_last_error());
  }

  /* 2. everyone reports; index 0 removes the name whatever happened */
  rc = wf_shm_confirm_attach(g, index, size, granks, my_rc, my_err, m.ok ? m.name : NULL, op,
                             gname);
  if (rc) {
    mq_close(q);
    return rc;
  }
  /* Same pid namespace everywhere: liveness checks are meaningful. */
  q->check_pids = 1;
  /* every rank attached (and published its CPU note) before confirming */
  q->wait.crowded = wf_cpu_crowded(&q->rk[0].cpus, size, (int)sizeof q->rk[0]);
  *out = q;
  wf_log(1, "mq: group '%s': writer %d, %d ranks, %u chunks of %zu bytes, segment %zu bytes",
         gname, writer, size, q->chunks, q->chunk, q->map_len);
  return 0;
}

int weft_mq_destroy(weft_mq *q) {
  if (!q) return 0;
  if (q->hdr) {
    atomic_store(&q->rk[q->me].left, 1);
    wake_all_words(q);
  }
  mq_close(q);
  return 0;
}

int weft_mq_set_timeout(weft_mq *q, int timeout_ms) {
  WF_CHECK_ARG(q, "weft_mq_set_timeout: NULL message queue");
  WF_CHECK_ARG(timeout_ms > 0, "weft_mq_set_timeout: group '%s': timeout %d ms must be > 0",
               q->group, timeout_ms);
  q->timeout_ms = timeout_ms;
  return 0;
}

int weft_mq_info(weft_mq *q, int *writer, int *index, int *world, size_t *chunk_bytes,
                 int *chunks) {
  WF_CHECK_ARG(q, "weft_mq_info: NULL message queue");
  if (writer) *writer = q->writer;
  if (index) *index = q->me;
  if (world) *world = q->world;
  if (chunk_bytes) *chunk_bytes = q->chunk;
  if (chunks) *chunks = (int)q->chunks;
  return 0;
}

/* ---------------------------------------------------------------- writer */

/* List readers that have not released position `need` of slot s. */
static void unread_list(weft_mq *q, uint64_t s, uint32_t need, char *buf, size_t n, int dead) {
  size_t k = 0;
  buf[0] = '\0';
  for (int r = 0; r < q->world && k + 1 < n; r++) {
    if (r == q->writer || wf_reached(atomic_load(&rline(q, s, r)->seq), need)) continue;
    if (dead && !peer_dead(q, r)) continue;
    int w = dead ? snprintf(buf + k, n - k, "%srank %d (global %d, pid %d, host %s)", k ? ", " : "",
                            r, q->ranks[r], (int)atomic_load(&q->rk[r].pid), wf_hostname())
                 : snprintf(buf + k, n - k, "%srank %d (global %d)", k ? ", " : "", r, q->ranks[r]);
    if (w < 0) break;
    k += (size_t)w;
  }
  if (k >= n) buf[n - 1] = '\0';
}

/* Wait until every reader released the previous use of slot s. frag: which
 * fragment of the message is about to go there (a failure after the first
 * one leaves a half-written message, so it aborts the queue). */
static int wait_readers(weft_mq *q, uint64_t s, uint32_t need, uint32_t frag, const char *op) {
  int r = 0;
  /* one spin window for all readers */
  int spun = 0;
  for (; r < q->world; r++) {
    if (r == q->writer) continue;
    _Atomic uint32_t *seq = &rline(q, s, r)->seq;
    if (wf_reached(atomic_load_explicit(seq, memory_order_acquire), need)) continue;
    int ok = spun ? wf_wait_spin_more(&q->wait, seq, need) : wf_wait_spin(&q->wait, seq, need);
    spun = 1;
    if (!ok) break;
  }
  if (r == q->world) {
    if (spun) wf_wait_end(&q->wait);
    return 0;
  }
  q->wait.slept = 1; /* spun (r < world implies it) and now sleeps */
  int64_t deadline = wf_now_ms() + q->timeout_ms;
  for (; r < q->world; r++) {
    if (r == q->writer) continue;
    wf_mq_rline *l = rline(q, s, r);
    int w = sleep_until(q, &l->seq, &l->waiters, need, r, deadline);
    if (w == WT_OK) continue;
    uint32_t ab = atomic_load(&q->hdr->abort);
    if (w == WT_ABORT || ab) return aborted_error(q, ab, op);
    if (w == WT_INTR) return interrupted_error(q, op);
    char who[512], rn[64];
    unsigned long long msg = (unsigned long long)q->msgs;
    if (w == WT_LEFT) {
      rank_name(q, r, rn, sizeof rn);
      give_up(q, "%s destroyed its message queue before reading message %llu", rn, msg);
      return wf_error(WEFT_ECLOSED, "%s: group '%s': %s destroyed its message queue while the "
                      "writer waited for it to read (message %llu)", op, q->group, rn, msg);
    }
    if (w == WT_DEAD) {
      unread_list(q, s, need, who, sizeof who, 1);
      if (!who[0])
        snprintf(who, sizeof who, "rank %d (global %d, pid %d, host %s)", r, q->ranks[r],
                 (int)atomic_load(&q->rk[r].pid), wf_hostname());
      give_up(q, "%.100s died before reading message %llu", who, msg);
      return wf_error(WEFT_ECLOSED, "%s: group '%s': reader %s died (process gone) while the "
                      "writer waited for it to read (message %llu)", op, q->group, who, msg);
    }
    unread_list(q, s, need, who, sizeof who, 0);
    if (frag > 0)
      give_up(q, "writer timed out in the middle of message %llu waiting for %.80s to read", msg,
              who);
    return wf_error(WEFT_ETIMEOUT, "%s: group '%s': timed out after %d ms (message %llu%s) "
                    "waiting for %s to read a slot (a full ring: %u slots of %zu bytes)", op,
                    q->group, q->timeout_ms, msg, frag > 0 ? ", queue aborted" : "", who,
                    q->chunks, q->chunk);
  }
  wf_wait_end(&q->wait);
  return 0;
}

int weft_mq_enqueue(weft_mq *q, const void *buf, size_t len) {
  static const char op[] = "weft_mq_enqueue";
  int rc = enter(q, op, 1);
  if (rc) return rc;
  if (q->me != q->writer)
    return leave(q, wf_error(WEFT_EINVAL, "%s: group '%s': rank %d (global %d) is a reader; only "
                             "the writer (index %d) enqueues", op, q->group, q->me,
                             q->ranks[q->me], q->writer));
  if (!buf && len)
    return leave(q, wf_error(WEFT_EINVAL, "%s: group '%s': NULL buffer with length %zu", op,
                             q->group, len));
  const uint8_t *src = buf;
  uint64_t nfrag = len ? (len + q->chunk - 1) / q->chunk : 1;
  if (nfrag > UINT32_MAX)
    return leave(q, wf_error(WEFT_EINVAL, "%s: group '%s': %zu bytes is too many fragments", op,
                             q->group, len));
  size_t off = 0;
  for (uint32_t f = 0; f < (uint32_t)nfrag; f++) {
    uint64_t s = q->pos % q->chunks;
    if ((rc = wait_readers(q, s, (uint32_t)(q->pos + 1 - q->chunks), f, op))) return leave(q, rc);
    size_t fl = len - off < q->chunk ? len - off : q->chunk;
    if (fl) memcpy(slot_data(q, s), src + off, fl);
    wf_mq_wline *w = wline(q, s);
    w->frag_len = (uint32_t)fl;
    w->frag_no = f;
    w->total = len;
    atomic_store_explicit(&w->seq, (uint32_t)(q->pos + 1), memory_order_seq_cst);
    if (atomic_load_explicit(&w->waiters, memory_order_seq_cst)) wf_futex_wake_all(&w->seq);
    q->pos++;
    off += fl;
  }
  q->msgs++;
  return leave(q, 0);
}

/* ---------------------------------------------------------------- readers */

static void release_pos(weft_mq *q, uint64_t pos) {
  wf_mq_rline *l = rline(q, pos % q->chunks, q->me);
  atomic_store_explicit(&l->seq, (uint32_t)(pos + 1), memory_order_seq_cst);
  if (atomic_load_explicit(&l->waiters, memory_order_seq_cst)) wf_futex_wake_all(&l->seq);
}

static void release_held(weft_mq *q) {
  if (q->held) {
    q->held = 0;
    release_pos(q, q->pos - 1);
  }
}

static int wait_writer(weft_mq *q, wf_mq_wline *w, uint32_t target, int nonblock,
                       int64_t deadline, int tmo, const char *op) {
  int res;
  if (nonblock) {
    res = WT_TIMEOUT;
    if (atomic_load(&q->hdr->abort)) res = WT_ABORT;
    else if (atomic_load(&q->rk[q->writer].left))
      res = wf_reached(atomic_load_explicit(&w->seq, memory_order_acquire), target) ? WT_OK : WT_LEFT;
  } else {
    if (wf_wait_spin(&q->wait, &w->seq, target)) {
      wf_wait_end(&q->wait);
      return 0;
    }
    q->wait.slept = 1;
    res = sleep_until(q, &w->seq, &w->waiters, target, q->writer, deadline);
    if (res == WT_OK) wf_wait_end(&q->wait);
  }
  if (res == WT_OK) return 0;
  uint32_t ab = atomic_load(&q->hdr->abort);
  if (res == WT_ABORT || ab) return aborted_error(q, ab, op);
  if (res == WT_INTR) return interrupted_error(q, op);
  char rn[64];
  unsigned long long msg = (unsigned long long)q->msgs;
  rank_name(q, q->writer, rn, sizeof rn);
  if (res == WT_LEFT) {
    give_up(q, "the writer %s destroyed its message queue before writing message %llu", rn, msg);
    return wf_error(WEFT_ECLOSED, "%s: group '%s': the writer %s destroyed its message queue "
                    "before writing message %llu", op, q->group, rn, msg);
  }
  if (res == WT_DEAD) {
    int pid = (int)atomic_load(&q->rk[q->writer].pid);
    char rn2[400];
    snprintf(rn2, sizeof rn2, "rank %d (global %d, pid %d, host %s)", q->writer,
             q->ranks[q->writer], pid, wf_hostname());
    give_up(q, "the writer %.100s died before writing message %llu", rn2, msg);
    return wf_error(WEFT_ECLOSED, "%s: group '%s': the writer %s died (process gone) before "
                    "writing message %llu", op, q->group, rn2, msg);
  }
  if (nonblock)
    return wf_error(WEFT_EAGAIN, "%s: group '%s': message %llu not %s yet", op, q->group, msg,
                    q->pending ? "complete" : "written");
  return wf_error(WEFT_ETIMEOUT, "%s: group '%s': timed out after %d ms waiting for the writer "
                  "%s to write message %llu", op, q->group, tmo, rn, msg);
}

/* timeout_ms < 0: the queue's timeout; 0: never wait (WEFT_EAGAIN). */
static int dequeue(weft_mq *q, int timeout_ms, const void **out, size_t *len, const char *op) {
  int rc = enter(q, op, 0);
  if (rc) return rc;
  if (!out || !len)
    return leave(q, wf_error(WEFT_EINVAL, "%s: group '%s': NULL out pointer", op, q->group));
  if (q->me == q->writer)
    return leave(q, wf_error(WEFT_EINVAL, "%s: group '%s': rank %d (global %d) is the writer; "
                             "only readers dequeue", op, q->group, q->me, q->ranks[q->me]));
  release_held(q);
  int nonblock = timeout_ms == 0;
  int tmo = timeout_ms < 0 ? q->timeout_ms : timeout_ms;
  int64_t deadline = wf_now_ms() + tmo;
  for (;;) {
    uint64_t s = q->pos % q->chunks;
    wf_mq_wline *w = wline(q, s);
    uint32_t target = (uint32_t)(q->pos + 1);
    if (!wf_reached(atomic_load_explicit(&w->seq, memory_order_acquire), target) &&
        (rc = wait_writer(q, w, target, nonblock, deadline, tmo, op)))
      return leave(q, rc);
    uint64_t total = w->total;
    uint32_t fl = w->frag_len, fn = w->frag_no;
    /* fragment f carries min(chunk, what is left) bytes: anything else is a
     * corrupted segment or a foreign writer */
    uint64_t off = q->pending ? q->pend_off : 0;
    uint64_t expect = total >= off ? (total - off < q->chunk ? total - off : q->chunk) : 0;
    int bad = total < off || fl != expect || fn != (q->pending ? q->pend_frag : 0) ||
              (q->pending && total != q->pend_total);
    if (bad) {
      give_up(q, "reader saw a malformed fragment at position %llu",
              (unsigned long long)q->pos);
      return leave(q, wf_error(WEFT_EPROTO, "%s: group '%s': malformed fragment at position "
                               "%llu (length %u of %llu, fragment %u; expected fragment %u)", op,
                               q->group, (unsigned long long)q->pos, fl,
                               (unsigned long long)total, fn, q->pending ? q->pend_frag : 0));
    }
    const uint8_t *src = slot_data(q, s);
    if (!q->pending && fl == total) { /* whole message in one slot: lend it */
      *out = src;
      *len = (size_t)total;
      q->held = 1;
      q->pos++;
      q->msgs++;
      return leave(q, 0);
    }
    if (!q->pending) {
      if (total > q->cap) {
        uint8_t *nb = malloc((size_t)total);
        if (!nb)
          return leave(q, wf_error(WEFT_ENOMEM, "%s: group '%s': out of memory for a message of "
                                   "%llu bytes", op, q->group, (unsigned long long)total));
        free(q->buf);
        q->buf = nb;
        q->cap = (size_t)total;
      }
      q->pending = 1;
      q->pend_total = total;
      q->pend_off = 0;
      q->pend_frag = 0;
    }
    memcpy(q->buf + q->pend_off, src, fl);
    release_pos(q, q->pos);
    q->pos++;
    q->pend_off += fl;
    q->pend_frag++;
    if (q->pend_off == q->pend_total) {
      q->pending = 0;
      *out = q->buf;
      *len = (size_t)q->pend_total;
      q->msgs++;
      return leave(q, 0);
    }
  }
}

int weft_mq_dequeue(weft_mq *q, int timeout_ms, const void **out, size_t *len) {
  return dequeue(q, timeout_ms, out, len, "weft_mq_dequeue");
}

int weft_mq_try_dequeue(weft_mq *q, const void **out, size_t *len) {
  return dequeue(q, 0, out, len, "weft_mq_try_dequeue");
}

int weft_mq_release(weft_mq *q) {
  static const char op[] = "weft_mq_release";
  if (!q) return wf_error(WEFT_EINVAL, "%s: NULL message queue", op);
  int zero = 0;
  if (!atomic_compare_exchange_strong(&q->busy, &zero, 1))
    return wf_error(WEFT_ESTATE, "%s: group '%s': another call is in flight on this message "
                    "queue (one at a time)", op, q->group);
  if (q->me != q->writer) release_held(q);
  return leave(q, 0);
}
