/* host_arena_test.c — the shared host arena (src/host/host_arena.c) behind
 * weft_host_alloc / weft_host_free / weft_host_is_shared (src/host/hostops.c),
 * with real threads and processes, no GPU needed:
 *   1. small allocations stay on the heap, large ones are arena memory;
 *      all are 64-byte aligned and zeroed;
 *   2. a freed block reads as zeros when handed out again (first fit: same
 *      address), and its pages go back to the system;
 *   3. mixed sizes freed in random order coalesce; alloc/free cycles do not
 *      grow the arena;
 *   4. 4 threads allocate, write, check and free concurrently;
 *   5. fork(): the child sees the parent's data, ignores frees of inherited
 *      blocks and allocates from an arena of its own, also when other
 *      threads were allocating at the fork;
 *   6. a peer process maps the arena through /proc/<pid>/fd (read-only,
 *      live), and map_peer refuses a wrong size or a non-arena descriptor;
 *   7. WEFT_HOST_ARENA=0: heap only; WEFT_HOST_ARENA_GB=1: a full arena
 *      falls back to the heap.
 * Prints "FAIL what" per failed check and closes with
 * "host_arena: N passed, M failed"; exit status 0 only if nothing failed.
 * Child processes count into a shared page and also report through their
 * exit status. */
#include "core/internal.h"
#include "host/host_arena.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* pass/fail counters on a MAP_SHARED page: children and threads add to them */
static struct counters { int pass, fail; } *cnt;

#define CHECK(cond, ...)                                                                   \
  do {                                                                                     \
    if (cond) {                                                                            \
      __atomic_add_fetch(&cnt->pass, 1, __ATOMIC_SEQ_CST);                                 \
    } else {                                                                               \
      __atomic_add_fetch(&cnt->fail, 1, __ATOMIC_SEQ_CST);                                 \
      char m_[512];                                                                        \
      snprintf(m_, sizeof m_, __VA_ARGS__);                                                \
      printf("FAIL [pid %d] %s (%s:%d)\n", (int)getpid(), m_, __FILE__, __LINE__);         \
      fflush(stdout);                                                                      \
    }                                                                                      \
  } while (0)

static int fails_now(void) { return __atomic_load_n(&cnt->fail, __ATOMIC_SEQ_CST); }

/* ---- helpers ---- */

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
  uint64_t x = *s;
  x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1DULL;
}

static void fill(void *p, size_t bytes, uint64_t seed) {
  uint64_t *w = p;
  for (size_t i = 0; i < bytes / 8; i++) w[i] = seed ^ (i * 0x9E3779B97F4A7C15ULL);
}

/* index of the first word that differs from the pattern, or -1 */
static long check_fill(const void *p, size_t bytes, uint64_t seed) {
  const uint64_t *w = p;
  for (size_t i = 0; i < bytes / 8; i++)
    if (w[i] != (seed ^ (i * 0x9E3779B97F4A7C15ULL))) return (long)i;
  return -1;
}

static int all_zero(const void *p, size_t bytes) {
  const uint64_t *w = p;
  for (size_t i = 0; i < bytes / 8; i++) if (w[i]) return 0;
  const uint8_t *b = p;
  for (size_t i = bytes / 8 * 8; i < bytes; i++) if (b[i]) return 0;
  return 1;
}

static int aligned64(const void *p) { return ((uintptr_t)p & 63u) == 0; }

/* this process's arena: base address and reserved size (lookup of a live
 * arena block gives its offset) */
static const uint8_t *arena_base(const void *block) {
  uint64_t off;
  if (!wf_arena_lookup(block, 1, &off)) return NULL;
  return (const uint8_t *)block - off;
}

/* committed bytes of this process's arena (its memfd's allocated blocks) */
static long long arena_committed(void) {
  int32_t fd; uint64_t size; struct stat st;
  if (wf_arena_export(&fd, &size) != 0 || fstat(fd, &st) != 0) return -1;
  return (long long)st.st_blocks * 512;
}

/* Shared-memory transparent huge pages (shmem_enabled always, within_size or
 * force) may keep a partly punched huge page: the arena still reads zeros,
 * but "nothing committed after freeing all" is then not exact. */
static int g_shmem_thp = -1;

static int shmem_thp(void) {
  if (g_shmem_thp >= 0) return g_shmem_thp;
  char buf[256] = "";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
  if (f) { if (!fgets(buf, sizeof buf, f)) buf[0] = '\0'; fclose(f); }
  g_shmem_thp = strstr(buf, "[always]") || strstr(buf, "[within_size]") || strstr(buf, "[force]");
  return g_shmem_thp;
}

/* nothing of the arena is committed (or shmem THP may hold some back) */
static int none_committed(void) {
  long long c = arena_committed();
  return c == 0 || (c > 0 && shmem_thp());
}

/* fork a child that runs fn and _exits with 1 when it failed a check */
static pid_t spawn(void (*fn)(void *), void *arg) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    int before = fails_now();
    fn(arg);
    fflush(stdout);
    _exit(fails_now() != before ? 1 : 0);
  }
  return pid;
}

/* wait at most timeout_ms for pid (killed when late); its exit status or -1 */
static int wait_child(pid_t pid, int timeout_ms) {
  if (pid < 0) return -1;
  const int64_t end = wf_now_ms() + timeout_ms;
  int st = 0, us = 0;
  for (;;) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) break;
    if (r < 0) return -1;
    if (wf_now_ms() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      printf("FAIL child %d timed out after %d ms\n", (int)pid, timeout_ms);
      return -1;
    }
    wf_backoff(&us, 2000);
  }
  if (WIFSIGNALED(st)) printf("FAIL child %d killed by signal %d\n", (int)pid, WTERMSIG(st));
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void run_child(const char *what, void (*fn)(void *), void *arg) {
  int rc = wait_child(spawn(fn, arg), 10000);
  CHECK(rc == 0, "%s: child exit status %d", what, rc);
}

/* ---- 7a (first, before this process touches the arena): WEFT_HOST_ARENA=0 ---- */

static void child_arena_off(void *arg) {
  (void)arg;
  setenv("WEFT_HOST_ARENA", "0", 1);
  const size_t sizes[] = {100, 64 * KiB, 1 * MiB + 3, 8 * MiB};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    uint8_t *p = weft_host_alloc(sizes[i]);
    CHECK(p != NULL, "arena off: alloc %zu: %s", sizes[i], weft_last_error());
    if (!p) continue;
    CHECK(!weft_host_is_shared(p, sizes[i]), "arena off: %zu bytes are shared", sizes[i]);
    CHECK(aligned64(p), "arena off: %p not 64-byte aligned", (void *)p);
    CHECK(all_zero(p, sizes[i]), "arena off: %zu bytes not zeroed", sizes[i]);
    fill(p, sizes[i] & ~(size_t)7, 77 + i);
    CHECK(check_fill(p, sizes[i] & ~(size_t)7, 77 + i) < 0, "arena off: pattern of %zu", sizes[i]);
    weft_host_free(p);
  }
  int32_t fd = 0; uint64_t size = 1;
  int rc = wf_arena_export(&fd, &size);
  CHECK(rc == WEFT_ESTATE && fd == -1 && size == 0, "arena off: export gave rc %d fd %d size %llu",
        rc, (int)fd, (unsigned long long)size);
  CHECK(strstr(weft_last_error(), "not available") != NULL, "arena off: export error '%s'",
        weft_last_error());
}

/* ---- 1. small / large ---- */

static void test_sizes(void) {
  struct { size_t bytes; int shared; } cases[] = {
    {0, 0}, {1, 0}, {63, 0}, {4096, 0}, {60 * KiB, 0}, {64 * KiB - 64, 0},
    {64 * KiB, 1}, {64 * KiB + 1, 1}, {100000, 1}, {1 * MiB, 1}, {3 * MiB + 5, 1}, {32 * MiB, 1},
  };
  const size_t n = sizeof cases / sizeof *cases;
  uint8_t *p[sizeof cases / sizeof *cases];
  for (size_t i = 0; i < n; i++) {
    const size_t b = cases[i].bytes;
    p[i] = weft_host_alloc(b);
    CHECK(p[i] != NULL, "alloc %zu: %s", b, weft_last_error());
    if (!p[i]) continue;
    CHECK(aligned64(p[i]), "alloc %zu: %p not 64-byte aligned", b, (void *)p[i]);
    CHECK(weft_host_is_shared(p[i], b ? b : 1) == cases[i].shared, "alloc %zu: is_shared %d, want %d",
          b, weft_host_is_shared(p[i], b ? b : 1), cases[i].shared);
    CHECK(all_zero(p[i], b), "alloc %zu: not zeroed", b);
    if (cases[i].shared) {
      /* arena blocks are whole grains: the rounded-up tail is ours too */
      const size_t whole = (b + WF_ARENA_GRAIN - 1) / WF_ARENA_GRAIN * WF_ARENA_GRAIN;
      CHECK(weft_host_is_shared(p[i], whole), "alloc %zu: the %zu-byte grain is not shared", b, whole);
    }
    memset(p[i], 0xA5, b); /* writable, and dirty for the reuse checks */
  }
  /* disjoint (no two live blocks overlap) */
  int overlap = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++)
      if (p[i] && p[j] && p[i] < p[j] + (cases[j].bytes ? cases[j].bytes : 1) &&
          p[j] < p[i] + (cases[i].bytes ? cases[i].bytes : 1))
        overlap++;
  CHECK(overlap == 0, "%d pairs of live blocks overlap", overlap);
  /* is_shared: a range running past the arena's used part, NULL, the stack */
  int stack_var = 0;
  CHECK(!weft_host_is_shared(NULL, 16), "NULL is shared");
  CHECK(!weft_host_is_shared(&stack_var, sizeof stack_var), "a stack address is shared");
  CHECK(!weft_host_is_shared(p[n - 1], ((size_t)1 << 40)), "a 1 TiB range is shared");
  for (size_t i = 0; i < n; i++) weft_host_free(p[i]);
  weft_host_free(NULL); /* a no-op */
  CHECK(1, "free(NULL)");
}

/* ---- 2. reuse reads zeros; pages go back ---- */

static void test_reuse_zero(void) {
  const size_t sizes[] = {64 * KiB, 200 * KiB + 8, 4 * MiB};
  for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
    const size_t b = sizes[k];
    uint8_t *a = weft_host_alloc(b);
    CHECK(a && weft_host_is_shared(a, b), "reuse %zu: first block not shared", b);
    if (!a) continue;
    fill(a, b & ~(size_t)7, 1234 + k);
    weft_host_free(a);
    uint8_t *c = weft_host_alloc(b);
    CHECK(c != NULL, "reuse %zu: second alloc failed", b);
    if (!c) continue;
    CHECK(c == a, "reuse %zu: second block at %p, first at %p (first fit)", b, (void *)c, (void *)a);
    CHECK(all_zero(c, b), "reuse %zu: the reused block is not zeroed", b);
    weft_host_free(c);
  }
  /* a block in the middle (neighbours live on both sides) */
  uint8_t *l = weft_host_alloc(128 * KiB), *m = weft_host_alloc(256 * KiB), *r = weft_host_alloc(128 * KiB);
  CHECK(l && m && r, "middle: allocs failed");
  if (l && m && r) {
    memset(l, 0x11, 128 * KiB); memset(m, 0x22, 256 * KiB); memset(r, 0x33, 128 * KiB);
    weft_host_free(m);
    uint8_t *m2 = weft_host_alloc(256 * KiB);
    CHECK(m2 == m, "middle: reused at %p, want %p", (void *)m2, (void *)m);
    CHECK(m2 && all_zero(m2, 256 * KiB), "middle: reused block not zeroed");
    int ok = 1;
    for (size_t i = 0; i < 128 * KiB; i++) ok &= l[i] == 0x11 && r[i] == 0x33;
    CHECK(ok, "middle: freeing a block touched its neighbours");
    weft_host_free(m2);
  }
  weft_host_free(l); weft_host_free(r);
  /* written pages are returned on free (the memfd holds nothing afterwards) */
  long long c0 = arena_committed();
  uint8_t *big = weft_host_alloc(16 * MiB);
  if (big) memset(big, 1, 16 * MiB);
  long long c1 = arena_committed();
  weft_host_free(big);
  long long c2 = arena_committed();
  CHECK(c1 >= (long long)(16 * MiB) && ((c0 == 0 && c2 == 0) || shmem_thp()),
        "committed arena bytes: %lld before, %lld written, %lld after free (want 0, >=16 MiB, 0)",
        c0, c1, c2);
}

/* ---- 3. coalescing, no growth ---- */

static void shuffle(void **v, size_t n, uint64_t *s) {
  for (size_t i = n; i > 1; i--) {
    size_t j = rng_next(s) % i;
    void *t = v[i - 1]; v[i - 1] = v[j]; v[j] = t;
  }
}

#define NMIX 48

static void test_coalesce(void) {
  uint64_t s = 0x1234567;
  void *v[NMIX];
  size_t total = 0;
  uint8_t *lo = NULL;
  for (int i = 0; i < NMIX; i++) {
    /* mixed: exact grains, odd sizes, a few MiB-sized ones */
    size_t b = (i % 7 == 0) ? (1 + rng_next(&s) % 4) * MiB : 64 * KiB + rng_next(&s) % (512 * KiB);
    v[i] = weft_host_alloc(b);
    CHECK(v[i] && weft_host_is_shared(v[i], b), "coalesce: block %d (%zu bytes) not shared", i, b);
    total += (b + WF_ARENA_GRAIN - 1) / WF_ARENA_GRAIN * WF_ARENA_GRAIN; /* whole grains */
    if (v[i] && (!lo || (uint8_t *)v[i] < lo)) lo = v[i];
    if (v[i]) memset(v[i], i + 1, 4096);
  }
  /* a guard above them all: the freed space cannot just shrink the top */
  uint8_t *guard = weft_host_alloc(64 * KiB);
  CHECK(guard && weft_host_is_shared(guard, 64 * KiB), "coalesce: guard not shared");
  shuffle(v, NMIX, &s);
  for (int i = 0; i < NMIX; i++) weft_host_free(v[i]);
  uint8_t *all = weft_host_alloc(total);
  CHECK(all != NULL && weft_host_is_shared(all, total), "coalesce: one block of %zu bytes not shared", total);
  CHECK(all == lo, "coalesce: the %zu-byte block is at %p, want %p (the freed run below the guard)",
        total, (void *)all, (void *)lo);
  CHECK(all && all_zero(all, total), "coalesce: the merged block is not zeroed");
  weft_host_free(all);
  weft_host_free(guard);

  /* cycles of alloc-all / free-all: addresses stay in the first cycle's range */
  const uint8_t *rlo = NULL, *rhi = NULL;
  int out = 0, unshared = 0;
  for (int round = 0; round < 200; round++) {
    for (int i = 0; i < NMIX; i++) {
      size_t b = (i % 5 == 0) ? 2 * MiB : 64 * KiB + (size_t)(i * 7919) % (256 * KiB);
      v[i] = weft_host_alloc(b);
      if (!v[i] || !weft_host_is_shared(v[i], b)) { unshared++; continue; }
      ((uint8_t *)v[i])[b - 1] = 1;
      const uint8_t *p = v[i];
      if (round == 0) {
        if (!rlo || p < rlo) rlo = p;
        if (!rhi || p + b > rhi) rhi = p + b;
      } else if (p < rlo || p + b > rhi) {
        out++;
      }
    }
    shuffle(v, NMIX, &s);
    for (int i = 0; i < NMIX; i++) weft_host_free(v[i]);
  }
  CHECK(unshared == 0, "cycles: %d allocations not shared", unshared);
  CHECK(out == 0, "cycles: %d allocations outside the first round's range (growth)", out);
  CHECK(none_committed(), "cycles: %lld bytes still committed after freeing all",
        arena_committed());
}

/* ---- 4. threads ---- */

#define NTHREADS 4
#define NSLOTS 16

static void *thread_main(void *arg) {
  const uint64_t tid = (uint64_t)(uintptr_t)arg;
  uint64_t s = 0xC0FFEE + tid * 7777;
  struct { uint8_t *p; size_t b; uint64_t seed; } slot[NSLOTS] = {{0}};
  int bad_zero = 0, bad_pat = 0, bad_share = 0, nulls = 0;
  for (int it = 0; it < 3000; it++) {
    int k = (int)(rng_next(&s) % NSLOTS);
    if (slot[k].p) {
      if (check_fill(slot[k].p, slot[k].b, slot[k].seed) >= 0) bad_pat++;
      weft_host_free(slot[k].p);
      slot[k].p = NULL;
      continue;
    }
    size_t b = (rng_next(&s) % 4 == 0) ? 8 + rng_next(&s) % (16 * KiB)
                                       : 64 * KiB + rng_next(&s) % (384 * KiB);
    b &= ~(size_t)7;
    uint8_t *p = weft_host_alloc(b);
    if (!p) { nulls++; continue; }
    if (!all_zero(p, b)) bad_zero++;
    if (weft_host_is_shared(p, b) != (b >= WF_ARENA_MIN)) bad_share++;
    slot[k].p = p;
    slot[k].b = b;
    slot[k].seed = (tid << 56) ^ ((uint64_t)it << 20) ^ b;
    fill(p, b, slot[k].seed);
  }
  for (int k = 0; k < NSLOTS; k++)
    if (slot[k].p) {
      if (check_fill(slot[k].p, slot[k].b, slot[k].seed) >= 0) bad_pat++;
      weft_host_free(slot[k].p);
    }
  CHECK(nulls == 0, "thread %d: %d allocations failed", (int)tid, nulls);
  CHECK(bad_zero == 0, "thread %d: %d blocks not zeroed when handed out", (int)tid, bad_zero);
  CHECK(bad_pat == 0, "thread %d: %d blocks changed under us (corruption)", (int)tid, bad_pat);
  CHECK(bad_share == 0, "thread %d: %d blocks shared/heap the wrong way", (int)tid, bad_share);
  return NULL;
}

static void test_threads(void) {
  pthread_t th[NTHREADS];
  int started = 0;
  for (int i = 0; i < NTHREADS; i++)
    if (pthread_create(&th[i], NULL, thread_main, (void *)(uintptr_t)i) == 0) started++;
  CHECK(started == NTHREADS, "threads: %d of %d started", started, NTHREADS);
  for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
  CHECK(none_committed(), "threads: %lld bytes still committed after all frees",
        arena_committed());
}

/* fork() while other threads allocate: the child must not inherit a held
 * lock or half-updated lists (it allocates from an arena of its own) */
static volatile int g_stop;

static void *churn_main(void *arg) {
  uint64_t s = 0xBEEF + (uintptr_t)arg;
  while (!__atomic_load_n(&g_stop, __ATOMIC_SEQ_CST)) {
    size_t b = 64 * KiB + rng_next(&s) % (256 * KiB);
    uint8_t *p = weft_host_alloc(b);
    if (p) { p[0] = 1; p[b - 1] = 2; }
    weft_host_free(p);
  }
  return NULL;
}

static void child_during_churn(void *arg) {
  (void)arg;
  for (int i = 0; i < 4; i++) {
    uint8_t *p = weft_host_alloc(256 * KiB);
    CHECK(p && weft_host_is_shared(p, 256 * KiB) && all_zero(p, 256 * KiB),
          "fork during threads: child alloc %d", i);
    if (p) memset(p, 7, 256 * KiB);
    weft_host_free(p);
  }
}

static void test_fork_during_threads(void) {
  pthread_t th[2];
  int started = 0;
  g_stop = 0;
  for (int i = 0; i < 2; i++)
    if (pthread_create(&th[i], NULL, churn_main, (void *)(uintptr_t)i) == 0) started++;
  int bad = 0;
  for (int k = 0; k < 20; k++) {
    int rc = wait_child(spawn(child_during_churn, NULL), 5000);
    if (rc != 0) bad++;
  }
  __atomic_store_n(&g_stop, 1, __ATOMIC_SEQ_CST);
  for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
  CHECK(started == 2, "fork during threads: %d of 2 threads started", started);
  CHECK(bad == 0, "fork during threads: %d of 20 children failed or hung", bad);
  CHECK(none_committed(), "fork during threads: %lld bytes committed afterwards",
        arena_committed());
}

/* ---- 5. fork ---- */

#define NPARENT 3

typedef struct {
  uint8_t *blk[NPARENT];
  size_t bytes[NPARENT];
  const uint8_t *pbase;
  uint64_t psize;
} fork_arg;

static void child_fork(void *arg) {
  fork_arg *f = arg;
  /* (a) the parent's data is visible */
  for (int i = 0; i < NPARENT; i++)
    CHECK(check_fill(f->blk[i], f->bytes[i], 500 + i) < 0, "fork child: parent block %d pattern", i);
  /* (b) freeing an inherited block is ignored (it would zero the parent's
   * pages and corrupt its free list) */
  weft_host_free(f->blk[0]);
  CHECK(check_fill(f->blk[0], f->bytes[0], 500) < 0,
        "fork child: freeing an inherited block changed it (pages punched?)");
  /* (c) a new block comes from the child's own arena */
  const size_t b = 1 * MiB;
  uint8_t *q = weft_host_alloc(b);
  CHECK(q != NULL, "fork child: alloc: %s", weft_last_error());
  if (!q) return;
  CHECK(weft_host_is_shared(q, b), "fork child: new large block not shared");
  CHECK(all_zero(q, b), "fork child: new block not zeroed");
  for (int i = 0; i < NPARENT; i++)
    CHECK(q + b <= f->blk[i] || q >= f->blk[i] + f->bytes[i],
          "fork child: new block %p overlaps live parent block %d at %p", (void *)q, i,
          (void *)f->blk[i]);
  CHECK(q + b <= f->pbase || q >= f->pbase + f->psize,
        "fork child: new block %p inside the parent's arena [%p, +%llu)", (void *)q,
        (const void *)f->pbase, (unsigned long long)f->psize);
  int32_t fd; uint64_t size;
  CHECK(wf_arena_export(&fd, &size) == 0, "fork child: export: %s", weft_last_error());
  fill(q, b, 999);
  weft_host_free(q);
  /* an inherited block freed in the child is not the child's either */
  uint8_t *q2 = weft_host_alloc(b);
  CHECK(q2 == q, "fork child: realloc at %p, want %p", (void *)q2, (void *)q);
  CHECK(q2 && all_zero(q2, b), "fork child: reused block not zeroed");
  weft_host_free(q2);
  /* a grandchild: inherits both arenas, frees of either are ignored */
  pid_t g = fork();
  if (g == 0) {
    uint8_t *q3 = weft_host_alloc(b); /* from the grandchild's own arena */
    weft_host_free(f->blk[1]);        /* the grandparent's: ignored */
    int ok = q3 && check_fill(f->blk[1], f->bytes[1], 501) < 0;
    weft_host_free(q3);
    _exit(ok ? 0 : 1);
  }
  CHECK(wait_child(g, 10000) == 0, "fork grandchild: freeing a grandparent block changed it");
  /* the parent's blocks, once more */
  for (int i = 0; i < NPARENT; i++)
    CHECK(check_fill(f->blk[i], f->bytes[i], 500 + i) < 0, "fork child: parent block %d at exit", i);
}

static void test_fork(void) {
  fork_arg f;
  for (int i = 0; i < NPARENT; i++) {
    f.bytes[i] = (size_t)(i + 1) * 384 * KiB;
    f.blk[i] = weft_host_alloc(f.bytes[i]);
    CHECK(f.blk[i] && weft_host_is_shared(f.blk[i], f.bytes[i]), "fork: parent block %d", i);
    if (!f.blk[i]) return;
    fill(f.blk[i], f.bytes[i], 500 + i);
  }
  int32_t fd;
  CHECK(wf_arena_export(&fd, &f.psize) == 0, "fork: export: %s", weft_last_error());
  f.pbase = arena_base(f.blk[0]);
  run_child("fork", child_fork, &f);
  for (int i = 0; i < NPARENT; i++)
    CHECK(check_fill(f.blk[i], f.bytes[i], 500 + i) < 0,
          "fork: parent block %d changed after the child freed/allocated", i);
  /* the parent's bookkeeping is intact: free, reuse at the same address */
  uint8_t *first = f.blk[0];
  weft_host_free(f.blk[0]);
  uint8_t *again = weft_host_alloc(f.bytes[0]);
  CHECK(again == first && all_zero(again, f.bytes[0]), "fork: parent reuse after the child");
  weft_host_free(again);
  for (int i = 1; i < NPARENT; i++) weft_host_free(f.blk[i]);
  CHECK(none_committed(), "fork: %lld bytes committed after freeing all", arena_committed());
}

/* ---- 6. a peer maps the arena ---- */

typedef struct {
  int32_t fd;
  uint64_t size, off;
  size_t bytes;
  int to_parent[2], to_child[2];
} peer_arg;

static int rd(int fd, int timeout_ms) { /* one byte, bounded; -1 on timeout/EOF */
  const int64_t end = wf_now_ms() + timeout_ms;
  int us = 0;
  for (;;) {
    char c;
    ssize_t n = read(fd, &c, 1);
    if (n == 1) return c;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return -1;
    if (wf_now_ms() > end) return -1;
    wf_backoff(&us, 2000);
  }
}

static void wr(int fd, char c) { ssize_t n = write(fd, &c, 1); (void)n; }

static void child_peer(void *arg) {
  peer_arg *a = arg;
  const pid_t pp = getppid();
  /* the child closed its copy of the parent's arena descriptor at fork */
  CHECK(fcntl(a->fd, F_GETFD) < 0 && errno == EBADF, "peer: the child still holds descriptor %d",
        (int)a->fd);
  const uint8_t *m = wf_arena_map_peer(pp, a->fd, a->size);
  CHECK(m != NULL, "peer: map_peer(%d, fd %d, %llu): %s", (int)pp, (int)a->fd,
        (unsigned long long)a->size, weft_last_error());
  if (!m) { wr(a->to_parent[1], 'x'); return; }
  CHECK(check_fill(m + a->off, a->bytes, 4242) < 0, "peer: the parent's pattern at offset %llu",
        (unsigned long long)a->off);
  /* read-only: the mapping cannot be made writable */
  CHECK(mprotect((void *)m, 4096, PROT_READ | PROT_WRITE) != 0, "peer: mapping could be made writable");
  /* live: the parent writes, the peer sees it; the parent frees, the peer sees zeros */
  wr(a->to_parent[1], 'm');
  CHECK(rd(a->to_child[0], 5000) == 'w', "peer: no 'written' from the parent");
  CHECK(check_fill(m + a->off, a->bytes, 4343) < 0, "peer: the parent's second pattern not visible");
  wr(a->to_parent[1], 'r');
  CHECK(rd(a->to_child[0], 5000) == 'f', "peer: no 'freed' from the parent");
  CHECK(all_zero(m + a->off, a->bytes), "peer: a freed block still shows data");
  /* a second user of the same arena shares the mapping; each unmaps once */
  const uint8_t *m2 = wf_arena_map_peer(pp, a->fd, a->size);
  CHECK(m2 == m, "peer: a second map of the same arena is %p, want the shared %p", (void *)m2,
        (void *)m);
  wf_arena_unmap_peer(m2, a->size);
  /* (reading it would fault if the second unmap had taken it away) */
  CHECK(all_zero(m + a->off, 4096), "peer: the first user's mapping changed after the second's unmap");
  wf_arena_unmap_peer(m, a->size);

  /* refusals */
  const uint8_t *w = wf_arena_map_peer(pp, a->fd, a->size + WF_ARENA_GRAIN);
  CHECK(w == NULL, "peer: map_peer accepted a wrong size");
  CHECK(strstr(weft_last_error(), "size") != NULL, "peer: wrong-size error '%s'", weft_last_error());
  if (w) wf_arena_unmap_peer(w, a->size + WF_ARENA_GRAIN);
  int dn = open("/dev/null", O_RDONLY);
  w = wf_arena_map_peer(getpid(), dn, a->size);
  CHECK(w == NULL, "peer: map_peer accepted /dev/null");
  CHECK(strstr(weft_last_error(), "not a weft arena") != NULL, "peer: /dev/null error '%s'",
        weft_last_error());
  close(dn);
  /* another memfd of the right size, but not an arena */
  int mf = memfd_create("not-an-arena", MFD_CLOEXEC);
  if (mf >= 0 && ftruncate(mf, (off_t)a->size) == 0) {
    w = wf_arena_map_peer(getpid(), mf, a->size);
    CHECK(w == NULL, "peer: map_peer accepted a memfd that is not an arena");
  }
  if (mf >= 0) close(mf);
  w = wf_arena_map_peer(pp, 1000000, a->size);
  CHECK(w == NULL && weft_last_error()[0], "peer: map_peer of a closed descriptor");
}

static void test_peer(void) {
  peer_arg a;
  CHECK(wf_arena_export(&a.fd, &a.size) == 0 && a.fd >= 0 && a.size >= (1ull << 30),
        "peer: export fd %d size %llu: %s", (int)a.fd, (unsigned long long)a.size, weft_last_error());
  uint8_t *spacer = weft_host_alloc(192 * KiB); /* so the block is not at offset 0 */
  a.bytes = 512 * KiB;
  uint8_t *blk = weft_host_alloc(a.bytes);
  CHECK(blk && weft_host_is_shared(blk, a.bytes), "peer: block not shared");
  if (!blk) return;
  CHECK(wf_arena_lookup(blk, a.bytes, &a.off) && a.off > 0, "peer: lookup");
  fill(blk, a.bytes, 4242);
  if (pipe(a.to_parent) || pipe(a.to_child)) { CHECK(0, "peer: pipe"); return; }
  fcntl(a.to_parent[0], F_SETFL, O_NONBLOCK);
  fcntl(a.to_child[0], F_SETFL, O_NONBLOCK);
  pid_t pid = spawn(child_peer, &a);
  int c = rd(a.to_parent[0], 5000);
  CHECK(c == 'm', "peer: child did not map (got %d)", c);
  if (c == 'm') {
    fill(blk, a.bytes, 4343);
    wr(a.to_child[1], 'w');
    c = rd(a.to_parent[0], 5000);
    CHECK(c == 'r', "peer: child did not read (got %d)", c);
    weft_host_free(blk);
    blk = NULL;
    wr(a.to_child[1], 'f');
  }
  int rc = wait_child(pid, 10000);
  CHECK(rc == 0, "peer: child exit status %d", rc);
  if (blk) weft_host_free(blk);
  weft_host_free(spacer);
  close(a.to_parent[0]); close(a.to_parent[1]); close(a.to_child[0]); close(a.to_child[1]);
}

/* ---- 7b. arena off in a child of an arena user; a small reserve fills up ---- */

static void child_small_reserve(void *arg) {
  (void)arg;
  setenv("WEFT_HOST_ARENA_GB", "1", 1); /* read when the child makes its own arena */
  int32_t fd; uint64_t size = 0;
  CHECK(wf_arena_export(&fd, &size) == 0 && size == (1ull << 30),
        "small reserve: size %llu, want 1 GiB", (unsigned long long)size);
  /* nearly the whole reserve (never touched, so it costs nothing) */
  const size_t most = (1ull << 30) - WF_ARENA_GRAIN;
  uint8_t *big = weft_host_alloc(most);
  CHECK(big && weft_host_is_shared(big, most), "small reserve: a %zu-byte block", most);
  uint8_t *a = weft_host_alloc(64 * KiB);
  CHECK(a && weft_host_is_shared(a, 64 * KiB), "small reserve: the last grain");
  uint8_t *b = weft_host_alloc(128 * KiB); /* does not fit: the heap */
  CHECK(b && !weft_host_is_shared(b, 128 * KiB) && all_zero(b, 128 * KiB) && aligned64(b),
        "small reserve: a full arena falls back to the heap");
  weft_host_free(b);
  weft_host_free(big);
  b = weft_host_alloc(128 * KiB);
  CHECK(b && weft_host_is_shared(b, 128 * KiB), "small reserve: freed room is used again");
  weft_host_free(b);
  weft_host_free(a);
}

/* Freed blocks kept resident (WEFT_HOST_ARENA_KEEP_MB, default 64): a block
 * freed and taken again is the same one, zeroed, and its pages stay
 * committed; past the cap everything freed is released. (A fresh arena: the
 * child of fork() makes its own.) */
static void child_keep(void *arg) {
  (void)arg;
  setenv("WEFT_HOST_ARENA_KEEP_MB", "8", 1);
  uint8_t *a = weft_host_alloc(1 * MiB);
  CHECK(a && weft_host_is_shared(a, 1 * MiB), "keep: first block not shared");
  if (!a) return;
  memset(a, 0x5a, 1 * MiB);
  long long c1 = arena_committed();
  weft_host_free(a);
  long long c2 = arena_committed();
  CHECK(c2 >= (long long)(1 * MiB) || shmem_thp(), "keep: freed 1 MiB not kept (%lld committed, %lld before)",
        c2, c1);
  uint8_t *b = weft_host_alloc(1 * MiB);
  CHECK(b == a, "keep: the kept block is not handed out again (%p, want %p)", (void *)b, (void *)a);
  CHECK(b && all_zero(b, 1 * MiB), "keep: the kept block is not zeroed");
  /* a block below a live one (free list, not the top) is zeroed too */
  uint8_t *c = weft_host_alloc(2 * MiB);
  if (b) memset(b, 0x6b, 1 * MiB);
  weft_host_free(b);
  uint8_t *d = weft_host_alloc(1 * MiB);
  CHECK(d == b && d && all_zero(d, 1 * MiB), "keep: a kept block below a live one comes back zeroed");
  weft_host_free(d);
  weft_host_free(c);
  /* past the cap: 16 MiB written and freed, everything goes back */
  uint8_t *big = weft_host_alloc(16 * MiB);
  if (big) memset(big, 1, 16 * MiB);
  weft_host_free(big);
  CHECK(none_committed(), "keep: %lld bytes committed after freeing past the cap", arena_committed());
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* the arena as it comes by default, whatever the caller's environment,
   * but freed pages released at once (the checks below count them) */
  unsetenv("WEFT_HOST_ARENA");
  unsetenv("WEFT_HOST_ARENA_GB");
  setenv("WEFT_HOST_ARENA_KEEP_MB", "0", 1);
  cnt = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (cnt == MAP_FAILED) { printf("FAIL mmap of the counters\nhost_arena: 0 passed, 1 failed\n"); return 1; }

  run_child("arena off (fresh process)", child_arena_off, NULL);
  test_sizes();
  test_reuse_zero();
  test_coalesce();
  test_threads();
  test_fork();
  test_fork_during_threads();
  test_peer();
  run_child("arena off (child of an arena user)", child_arena_off, NULL);
  run_child("small reserve", child_small_reserve, NULL);
  run_child("freed blocks kept resident", child_keep, NULL);

  printf("host_arena: %d passed, %d failed\n", cnt->pass, cnt->fail);
  return cnt->fail ? 1 : 0;
}
