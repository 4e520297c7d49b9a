/* shm.h — internals of the shared-memory host data plane (src/shm*.c).
 *
 * Segment layout (one POSIX shm object per communicator, unlinked as soon as
 * every rank mapped it):
 *   [0, 256)                      header: magic, geometry, abort word; the
 *                                 arrival counter on its own line
 *   [256 + 256*i, +256)           rank i control block: its generation word on
 *                                 its own 128-byte line, call descriptors on the next
 *   [data_off, data_off + 2*N*S)  data: two halves ("double buffer"), each with
 *                                 one slot of S bytes per rank
 * Chunk k of any collective uses half k%2, so a rank may fill the next chunk
 * while slow peers still read the previous one; every chunk ends with at least
 * one all-rank barrier, which is what makes reuse of half k%2 at chunk k+2 safe.
 */
#ifndef WF_SHM_H
#define WF_SHM_H

#include "core/internal.h"
#include "shm_zc.h"
#include "core/wait.h"

#include <stdatomic.h>

#define WF_SHM_MAGIC 0x326d68732d746677ULL /* "wft-shm2" (2: the shape and args words in descriptors) */
#define WF_SHM_VERSION 1u
#define WF_SHM_HDR 256u
#define WF_SHM_RANK 256u
#define WF_SHM_MAX_WORLD 4096
#define WF_SHM_MIN_SLOT 4096u
#define WF_SHM_BLOCK 8192u /* all_reduce publishes its share in blocks of this many bytes */

enum { WF_OP_ALL_REDUCE = 1, WF_OP_ALL_GATHER, WF_OP_REDUCE_SCATTER, WF_OP_BROADCAST,
       WF_OP_BARRIER };

/* What a rank is about to do; compared across ranks at the first barrier of
 * every call so mismatched calls fail cleanly on every rank. */
typedef struct {
  uint32_t kind;
  int32_t dtype, redop, root;
  uint64_t count; /* elements (reduce ops) or bytes (gather/broadcast) */
  uint64_t call;  /* call number on this communicator */
  uint64_t shape; /* the caller's shape word (core/shape_word.h; 0: none) */
  uint64_t args;  /* the caller's args word (core/shape_word.h; 0: none) */
} wf_shm_desc;

typedef struct {
  _Atomic uint32_t seq;     /* last barrier generation this rank arrived at */
  _Atomic uint32_t left;    /* set by destroy: waiting on this rank is futile */
  _Atomic int32_t pid;
  wf_cpu_note cpus;         /* where this rank may run (core/wait.h): who may spin */
  uint64_t pidns;           /* pid namespace inode: liveness checks only if equal */
  char why[88];             /* reason, written before this rank sets the abort word */
  wf_shm_desc desc[2];      /* by call parity (a peer is at most one call ahead) */
  int32_t arena_fd;         /* this rank's host arena (memfd; host_arena.c), -1: none */
  _Atomic uint32_t p2p_wait; /* 0, or the recv this rank waits in: (src + 1) << 24 | message # mod 2^24 */
  uint64_t arena_bytes;
  /* by call parity: the arena offsets of this call's input and output, or
   * WF_ZC_NONE (zero-copy all_reduce, shm_zc.c) */
  uint64_t zc_in[2], zc_out[2];
} wf_shm_rank;
_Static_assert(sizeof(wf_shm_rank) == WF_SHM_RANK, "rank block is 256 bytes");

typedef struct {
  uint64_t magic;
  uint32_t version, world;
  uint64_t slot, data_off, total;
  _Atomic uint32_t attached; /* ranks that mapped the segment */
  _Atomic uint32_t abort;    /* 0, or 1 + index of the first rank that gave up */
  uint8_t pad[128 - 40];
  /* on their own line: every arrival adds 1, so generation g is complete when
   * arrivals reaches g * world (mod 2^32); sleepers wait on this one word */
  _Atomic uint32_t arrivals;
  _Atomic uint32_t sleepers; /* ranks in FUTEX_WAIT: the last arrival wakes only if > 0 */
} wf_shm_hdr;
_Static_assert(sizeof(wf_shm_hdr) <= WF_SHM_HDR, "header fits");

struct weft_shm {
  uint8_t *base;
  size_t map_len;
  wf_shm_hdr *hdr;
  wf_shm_rank *rk;
  uint8_t *data;
  size_t slot;          /* bytes per rank per half */
  size_t oneshot_max;   /* all_reduce up to this many bytes: one barrier, N reads */
  int world, me, timeout_ms, check_pids;
  wf_wait wait;         /* the adaptive wait of this rank's barriers (core/wait.h) */
  int cpus_known;       /* wait.crowded was decided from every rank's CPU note */
  uint32_t gen;         /* barriers passed */
  uint64_t call, chunk; /* calls made, chunks moved (chunk parity picks the half) */
  uint64_t next_shape, next_args; /* weft_shm_set_call: the next call's words */
  _Atomic int busy;     /* one operation in flight per communicator */
  wf_shm_zc zc;            /* the zero-copy strategy's own state (shm_zc.c) */
  uint64_t zc_calls, seg_calls; /* calls served by each path (the engine counts) */
  int *ranks;           /* global ranks, for messages */
  int store_rank0;      /* global rank 0 hosts the group's store (weft.init's): its death is said so */
  const void **srcs;    /* scratch: one source pointer per rank */
  char group[64];
  char name[64];        /* segment name (already unlinked after create) */
  weft_cpugroup *cg;    /* the group it was made on (a recv against a barrier, cpugroup.h), or NULL */
};

/* Bounds of rank j's share of an n-element chunk split like a geo-element
 * one (geo >= n): cache-line-aligned pieces. */
static inline void wf_shm_share(size_t geo, size_t n, int world, int j, size_t align,
                                size_t *lo, size_t *hi) {
  size_t seg = (geo + (size_t)world - 1) / (size_t)world;
  seg = (seg + align - 1) / align * align;
  *lo = (size_t)j * seg < n ? (size_t)j * seg : n;
  *hi = *lo + seg < n ? *lo + seg : n;
}

static inline uint8_t *wf_shm_slot(weft_shm *c, uint64_t half, int rank) {
  return c->data + ((size_t)(half & 1) * (size_t)c->world + (size_t)rank) * c->slot;
}

/* Segment (shm_seg.c). create: make the object (O_EXCL, 0600) and the header.
 * ranks may be NULL (group indices are then used in messages). */
int wf_shm_attach(const char *name, int create, int index, int world, size_t slot,
                  int timeout_ms, const char *group, const int *ranks, weft_shm **out);
/* Creator side without a cpu group: wait until every rank attached. */
int wf_shm_wait_attached(weft_shm *c);
int wf_shm_unlink(const char *name);
/* Opens the POSIX shared-memory object `name` (create: makes it, O_EXCL,
 * 0600, and sizes it to `total` bytes, reserving the pages when `reserve`;
 * else it must have `total` bytes already) and maps it whole, pages faulted
 * in now, at *base. Errors read "<who>: group '<gname>': ...", attach_hint
 * after a failed attach's shm_open and size_hint after a size that differs.
 * On failure an object it created is unlinked. shm_seg.c and mq.c. */
int wf_shm_map(const char *name, int create, int reserve, size_t total, const char *who,
               const char *gname, const char *attach_hint, const char *size_hint, uint8_t **base);
/* Step 1 of creating a segment shared by a group: group index 0's
 * announcement m (len bytes: whether it created the segment, *ok, its name,
 * name_cap bytes at `name`, and the geometry the caller checks) goes to every
 * rank. On the others m becomes index 0's and a bad announcement or index 0's
 * failure is set in *my_rc. The broadcast's failure is returned (the caller
 * cleans up). shm.c and mq.c. */
int wf_shm_announce(weft_cpugroup *g, int index, void *m, size_t len, char *name, size_t name_cap,
                    const int32_t *ok, int *my_rc, const char *op, const char *gname);
/* Step 2 of creating a segment shared by a group: every rank reports how its
 * attach went (my_rc, and my_err when it failed); group index 0 then unlinks
 * name (NULL: nothing was created) whatever happened, so nothing is left in
 * /dev/shm even if a rank dies later. 0 when every rank attached, else the
 * error naming each rank that did not (its code: mine, or the first one's).
 * shm.c and mq.c. */
int wf_shm_confirm_attach(weft_cpugroup *g, int index, int size, const int *granks, int my_rc,
                          const char *my_err, const char *name, const char *op,
                          const char *gname);
/* "/weft-<prefix>-<pid>-<32 hex from getrandom>" (needs 64 bytes at most for
 * a short prefix) */
int wf_shm_random_name(const char *prefix, char *buf, size_t n);
/* Remove names left by creators that died mid-creation (see shm_seg.c). */
void wf_shm_sweep(int min_age_s);
size_t wf_shm_segment_bytes(int world, size_t slot);
size_t wf_shm_round_slot(size_t bytes_per_rank, int world);
void wf_shm_close(weft_shm *c); /* unmap and free, no collective */

/* Synchronisation (shm_sync.c). Arrive at the next generation (publishing d
 * first when given), wait for every rank; with d, compare the descriptors. */
int wf_shm_sync(weft_shm *c, const wf_shm_desc *d, const char *op);
/* Entry check: aborted or busy communicators refuse work. */
int wf_shm_enter(weft_shm *c, const char *op);
static inline void wf_shm_leave(weft_shm *c) {
  atomic_store_explicit(&c->busy, 0, memory_order_release);
}
void wf_shm_mark_left(weft_shm *c);
/* This rank waits in a recv from index src for message number seq (src -1:
 * no longer); published for the peers' barrier waits (shm_sync.c). */
void wf_shm_note_recv(weft_shm *c, int src, uint64_t seq);
/* the cpu group c was made on is being destroyed */
void wf_shm_forget_cpugroup(weft_shm *c, weft_cpugroup *g);
const char *wf_shm_rank_name(weft_shm *c, int i, char *buf, size_t n);

/* The cpu group's name, size, this rank's index, global ranks (NULL when
 * unknown) and timeout (shm_seg.c; shm.c, shm_node.c). */
typedef struct {
  const char *name;
  int size, index, timeout_ms;
  const int *ranks;
} wf_group_info;
int wf_shm_group_info(weft_cpugroup *g, wf_group_info *gi, const char *op);

/* Reductions (shm_reduce.c): dst[i] = src[0][i] op src[1][i] op ... in that
 * order (identical results on every rank); dst may alias a source.
 * f16/bf16 accumulate in f32 and round once; integers wrap; float max/min
 * propagate NaN. supported: f32, f16, bf16, f64, i32, i64, u8 with sum,
 * max, min, prod (weft_host_reduce exports the same kernels). */
int wf_reduce_supported(int dtype, int op);
void wf_reduce(void *dst, const void *const *src, int n, size_t count, int dtype, int op);

#endif
