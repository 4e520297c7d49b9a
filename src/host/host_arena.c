/* host_arena.c — the shared host arena (see host_arena.h).
 *
 * One memfd per process, sized once to a large sparse reserve (default
 * 256 GiB of address space, WEFT_HOST_ARENA_GB; nothing is committed until
 * touched) and mapped MAP_SHARED | MAP_NORESERVE. Blocks are multiples of
 * WF_ARENA_GRAIN, first fit over an offset-ordered free list, else bumped
 * from the top. Freed blocks stay resident up to WEFT_HOST_ARENA_KEEP_MB
 * (default 64 MiB: a loop that frees and allocates a tensor does not fault
 * its pages in again every time; such a block is zeroed when handed out
 * again); beyond that every freed page is punched out (fallocate) and goes
 * back to the system. Every block handed out reads as zeros.
 *
 * Peers map the arena through /proc/<pid>/fd/<fd> (same user; the link must
 * name our memfd and its size must match), read-only: a peer can read this
 * process's large tensors, never write them. The memfd has no name in any
 * file system, so nothing outlives the processes.
 *
 * fork(): a child shares (does not copy) the blocks it inherited. It never
 * allocates from, frees into or exports the parent's arena (that would
 * corrupt the parent's bookkeeping or zero its data); it makes its own on
 * first use, and frees of inherited blocks are ignored. Unlike heap memory,
 * the inherited blocks are shared with the parent, not copied on write. */
#include "host_arena.h"
#include "core/internal.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define ARENA_NAME "weft-host-arena"

typedef struct {
  uint64_t off, len;
  uint32_t dirty; /* free list: written since its pages were last punched */
} extent;

typedef struct {
  extent *v;
  size_t n, cap;
} extents;

static struct {
  pthread_mutex_t mu;
  int state;    /* 0: not tried, 1: ready, -1: off or failed (heap only) */
  int fd;
  uint8_t *base;
  uint64_t size, top;
  uint64_t clean_from; /* nothing at or above was written since the last release */
  uint64_t kept, keep_max; /* freed bytes still resident (an estimate), and the cap */
  extents free_, live; /* both ordered by offset */
  /* arenas inherited through fork() (every generation's): frees of their
   * blocks are ignored */
  extents old;
} A = {PTHREAD_MUTEX_INITIALIZER, 0, -1, NULL, 0, 0, 0, 0, 0, {NULL, 0, 0}, {NULL, 0, 0}, {NULL, 0, 0}};

static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static void before_fork(void) { pthread_mutex_lock(&A.mu); }
static void after_fork_parent(void) { pthread_mutex_unlock(&A.mu); }
static int insert_at(extents *e, size_t i, extent x);

static void after_fork_child(void) {
  if (A.state == 1) {
    /* remembered for as many generations as there are (malloc works in the
     * child of fork); if even that fails, this child keeps using the
     * parent's bookkeeping rather than risk free() on arena memory */
    if (insert_at(&A.old, A.old.n, (extent){(uint64_t)(uintptr_t)A.base, A.size, 0}) != 0) {
      pthread_mutex_unlock(&A.mu);
      return;
    }
    close(A.fd);
    free(A.free_.v);
    free(A.live.v);
    memset(&A.free_, 0, sizeof A.free_);
    memset(&A.live, 0, sizeof A.live);
    A.fd = -1;
    A.base = NULL;
    A.size = A.top = A.clean_from = A.kept = 0;
    A.state = 0;
  }
  pthread_mutex_unlock(&A.mu);
}
static void register_atfork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

/* ---- offset-ordered extent lists ---- */

/* index of the first extent with off >= key */
static size_t lower_bound(const extents *e, uint64_t key) {
  size_t lo = 0, hi = e->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (e->v[mid].off < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

static int insert_at(extents *e, size_t i, extent x) {
  if (e->n == e->cap) {
    size_t cap = e->cap ? 2 * e->cap : 64;
    extent *v = realloc(e->v, cap * sizeof *v);
    if (!v) return -1;
    e->v = v;
    e->cap = cap;
  }
  memmove(&e->v[i + 1], &e->v[i], (e->n - i) * sizeof *e->v);
  e->v[i] = x;
  e->n++;
  return 0;
}

static void remove_at(extents *e, size_t i) {
  memmove(&e->v[i], &e->v[i + 1], (e->n - i - 1) * sizeof *e->v);
  e->n--;
}

/* ---- creation ---- */

static int create_locked(void) {
  pthread_once(&g_atfork_once, register_atfork);
  long gb = wf_env_long("WEFT_HOST_ARENA_GB", 256);
  if (wf_env_long("WEFT_HOST_ARENA", 1) == 0 || gb <= 0) { A.state = -1; return -1; }
  /* a name of its own: a peer's mapping cache tells this arena from one of
   * a later process that got the same pid and descriptor number */
  char name[64];
  uint64_t id = 0;
  if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
    id = (uint64_t)wf_now_ns() ^ ((uint64_t)getpid() << 32);
  snprintf(name, sizeof name, ARENA_NAME "-%016llx", (unsigned long long)id);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) {
    wf_log(1, "host arena: memfd_create: %s (large tensors stay on the heap)", strerror(errno));
    A.state = -1;
    return -1;
  }
  /* the largest reserve the system lets us map, down to 1 GiB */
  for (uint64_t size = (uint64_t)gb << 30; size >= (1ull << 30); size /= 2) {
    if (ftruncate(fd, (off_t)size) != 0) continue;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) continue;
    A.fd = fd;
    A.base = p;
    A.size = size;
    A.top = A.clean_from = A.kept = 0;
    const long keep = wf_env_long("WEFT_HOST_ARENA_KEEP_MB", 64);
    A.keep_max = keep > 0 ? (uint64_t)keep << 20 : 0;
    A.state = 1;
    wf_log(1, "host arena: %llu GiB reserved (memfd %d)", (unsigned long long)(size >> 30), fd);
    return 0;
  }
  wf_log(1, "host arena: cannot map a reserve (large tensors stay on the heap)");
  close(fd);
  A.state = -1;
  return -1;
}

static int ready_locked(void) {
  if (A.state == 0) create_locked();
  return A.state == 1;
}

/* ---- allocation ---- */

void *wf_arena_alloc(size_t bytes) {
  if (bytes < WF_ARENA_MIN || bytes > UINT64_MAX - WF_ARENA_GRAIN) return NULL;
  const uint64_t n = ((uint64_t)bytes + WF_ARENA_GRAIN - 1) / WF_ARENA_GRAIN * WF_ARENA_GRAIN;
  void *p = NULL;
  uint64_t zero_off = 0, zero_len = 0; /* written before: zeroed once we hold it */
  pthread_mutex_lock(&A.mu);
  if (!ready_locked()) goto out;
  uint64_t off = UINT64_MAX;
  extent taken = {0, 0, 0};
  for (size_t i = 0; i < A.free_.n; i++) { /* first fit */
    extent *f = &A.free_.v[i];
    if (f->len < n) continue;
    off = f->off;
    taken = (extent){f->off, n, f->dirty};
    if (f->dirty) { zero_off = off; zero_len = n; }
    f->off += n;
    f->len -= n;
    if (f->len == 0) remove_at(&A.free_, i);
    break;
  }
  int bumped = 0;
  if (off == UINT64_MAX) {
    if (n > A.size - A.top) goto out;
    off = A.top;
    A.top += n;
    if (off < A.clean_from) { /* below the high-water mark: written before */
      zero_off = off;
      zero_len = (A.top < A.clean_from ? A.top : A.clean_from) - off;
    }
    bumped = 1;
  }
  if (insert_at(&A.live, lower_bound(&A.live, off), (extent){off, n, 0}) != 0) {
    /* no room to remember it: give the block back */
    if (bumped) A.top -= n;
    else insert_at(&A.free_, lower_bound(&A.free_, off), taken);
    zero_len = 0;
    goto out;
  }
  if (A.top > A.clean_from) A.clean_from = A.top;
  A.kept = A.kept > zero_len ? A.kept - zero_len : 0;
  p = A.base + off;
out:
  pthread_mutex_unlock(&A.mu);
  if (zero_len) memset(A.base + zero_off, 0, zero_len); /* the block is ours alone now */
  return p;
}

static void punch(uint64_t off, uint64_t len) {
  if (len && fallocate(A.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len) != 0)
    memset(A.base + off, 0, len); /* cannot punch: zero, so it reads as holes do */
}

/* Everything freed goes back to the system: the free blocks and what lies
 * between the top and the high-water mark. */
static void release_locked(void) {
  for (size_t i = 0; i < A.free_.n; i++)
    if (A.free_.v[i].dirty) {
      punch(A.free_.v[i].off, A.free_.v[i].len);
      A.free_.v[i].dirty = 0;
    }
  punch(A.top, A.clean_from - A.top);
  A.clean_from = A.top;
  A.kept = 0;
}

static int inherited(const uint8_t *p) {
  for (size_t i = 0; i < A.old.n; i++) {
    const uint8_t *b = (const uint8_t *)(uintptr_t)A.old.v[i].off;
    if (p >= b && p < b + A.old.v[i].len) return 1;
  }
  return 0;
}

size_t wf_arena_len(const void *ptr) {
  const uint8_t *p = ptr;
  size_t len = 0;
  pthread_mutex_lock(&A.mu);
  if (A.state == 1 && p >= A.base && p < A.base + A.size) {
    const uint64_t off = (uint64_t)(p - A.base);
    size_t i = lower_bound(&A.live, off);
    if (i < A.live.n && A.live.v[i].off == off) len = A.live.v[i].len;
  }
  pthread_mutex_unlock(&A.mu);
  return len;
}

int wf_arena_free(void *ptr) {
  const uint8_t *p = ptr;
  int mine = 0;
  pthread_mutex_lock(&A.mu);
  if (A.state == 1 && p >= A.base && p < A.base + A.size) {
    mine = 1;
    const uint64_t off = (uint64_t)(p - A.base);
    size_t i = lower_bound(&A.live, off);
    if (i < A.live.n && A.live.v[i].off == off) {
      extent x = A.live.v[i];
      remove_at(&A.live, i);
      x.dirty = 1; /* resident until released; zeroed when handed out again */
      A.kept += x.len;
      size_t j = lower_bound(&A.free_, x.off);
      if (j > 0 && A.free_.v[j - 1].off + A.free_.v[j - 1].len == x.off) { /* merge left */
        x.off = A.free_.v[j - 1].off;
        x.len += A.free_.v[j - 1].len;
        remove_at(&A.free_, --j);
      }
      if (j < A.free_.n && x.off + x.len == A.free_.v[j].off) { /* merge right */
        x.len += A.free_.v[j].len;
        remove_at(&A.free_, j);
      }
      /* the top block: shrink (its pages stay below the high-water mark) */
      if (x.off + x.len == A.top) A.top = x.off;
      else if (insert_at(&A.free_, j, x) != 0) { /* lost track of it: leak, safely */ }
      if (A.kept > A.keep_max) release_locked();
    }
  } else if (inherited(p)) {
    mine = 1; /* the parent's block (fork): not ours to free */
  }
  pthread_mutex_unlock(&A.mu);
  return mine;
}

/* inside one live block (a freed one is not shared memory any more) */
int wf_arena_lookup(const void *ptr, size_t len, uint64_t *off) {
  const uint8_t *p = ptr;
  int in = 0;
  pthread_mutex_lock(&A.mu);
  if (A.state == 1 && p >= A.base && p < A.base + A.top) {
    const uint64_t o = (uint64_t)(p - A.base);
    const size_t i = lower_bound(&A.live, o + 1); /* the block starting at or before o */
    if (i > 0) {
      const extent *b = &A.live.v[i - 1];
      if (o < b->off + b->len && len <= b->off + b->len - o) {
        *off = o;
        in = 1;
      }
    }
  }
  pthread_mutex_unlock(&A.mu);
  return in;
}

int wf_arena_export(int32_t *fd, uint64_t *bytes) {
  pthread_mutex_lock(&A.mu);
  const int ok = ready_locked();
  *fd = ok ? A.fd : -1;
  *bytes = ok ? A.size : 0;
  pthread_mutex_unlock(&A.mu);
  if (!ok) return wf_error(WEFT_ESTATE, "host arena: not available (WEFT_HOST_ARENA=0, or the "
                           "system refused a memfd mapping)");
  return 0;
}

/* ---- peers ----
 * A process maps each peer's arena once, whatever the number of
 * communicators it shares with that peer (every one would otherwise hold
 * its own mapping of the whole reserve): mappings are shared and counted,
 * keyed by the peer's pid and its arena's name (unique per arena). */

typedef struct {
  int32_t pid;
  char link[128];
  uint64_t bytes;
  const uint8_t *base;
  int refs;
} peer_map;

static struct {
  pthread_mutex_t mu;
  peer_map *v;
  size_t n, cap;
} P = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0};

static const uint8_t *map_new(int32_t pid, const char *path, uint64_t bytes) {
  int f = open(path, O_RDONLY | O_CLOEXEC);
  if (f < 0) {
    wf_error_errno(WEFT_ESYS, "host arena of process %d: open %s", (int)pid, path);
    return NULL;
  }
  struct stat st;
  void *p = MAP_FAILED;
  if (fstat(f, &st) != 0 || (uint64_t)st.st_size != bytes)
    wf_error(WEFT_EPROTO, "host arena of process %d: size %lld, announced %llu", (int)pid,
             (long long)st.st_size, (unsigned long long)bytes);
  else if ((p = mmap(NULL, bytes, PROT_READ, MAP_SHARED | MAP_NORESERVE, f, 0)) == MAP_FAILED)
    wf_error_errno(WEFT_ESYS, "host arena of process %d: mmap of %llu bytes", (int)pid,
                   (unsigned long long)bytes);
  close(f);
  return p == MAP_FAILED ? NULL : p;
}

const uint8_t *wf_arena_map_peer(int32_t pid, int32_t fd, uint64_t bytes) {
  char path[64], link[128];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, (int)fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0) {
    wf_error_errno(WEFT_ESYS, "host arena of process %d: readlink %s", (int)pid, path);
    return NULL;
  }
  link[n] = '\0';
  if (strncmp(link, "/memfd:" ARENA_NAME "-", strlen("/memfd:" ARENA_NAME "-")) != 0) {
    wf_error(WEFT_EPROTO, "host arena of process %d: %s is '%s', not a weft arena", (int)pid,
             path, link);
    return NULL;
  }
  const uint8_t *base = NULL;
  pthread_mutex_lock(&P.mu);
  for (size_t i = 0; i < P.n && !base; i++)
    if (P.v[i].pid == pid && P.v[i].bytes == bytes && !strcmp(P.v[i].link, link)) {
      P.v[i].refs++;
      base = P.v[i].base;
    }
  if (!base && (base = map_new(pid, path, bytes)) != NULL) {
    if (P.n == P.cap) {
      size_t cap = P.cap ? 2 * P.cap : 16;
      peer_map *v = realloc(P.v, cap * sizeof *v);
      if (v) { P.v = v; P.cap = cap; }
    }
    if (P.n < P.cap) { /* else: mapped, just not shared with later users */
      peer_map *m = &P.v[P.n++];
      m->pid = pid;
      snprintf(m->link, sizeof m->link, "%s", link);
      m->bytes = bytes;
      m->base = base;
      m->refs = 1;
    }
  }
  pthread_mutex_unlock(&P.mu);
  return base;
}

void wf_arena_unmap_peer(const uint8_t *base, uint64_t bytes) {
  if (!base) return;
  pthread_mutex_lock(&P.mu);
  for (size_t i = 0; i < P.n; i++)
    if (P.v[i].base == base) {
      if (--P.v[i].refs == 0) {
        munmap((void *)base, bytes);
        P.v[i] = P.v[--P.n];
      }
      pthread_mutex_unlock(&P.mu);
      return;
    }
  pthread_mutex_unlock(&P.mu);
  munmap((void *)base, bytes);
}
