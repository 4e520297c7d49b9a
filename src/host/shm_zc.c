/* shm_zc.c — zero-copy collectives of the shm communicator: when every rank's
 * buffers are weft host memory (the shared arena of src/host/host_arena.c), the
 * ranks read each other's buffers in place instead of copying through the
 * segment.
 *
 * Why: through the segment, every byte is written once more (into a slot
 * whose lines the peer read in the previous chunk, so the write must first
 * take them back from the peer's cache) and then read by the peer from
 * there. Reading the peer's buffer itself skips the copy and that transfer
 * of ownership. Measured with two pinned processes on the 2-vCPU CI VM, in
 * place, fresh data before every call (the shape of scripts/bench-host.lua):
 * 4 MiB 356 us against 698 through 1 MiB slots, 16 MiB 1460 against 2783.
 *
 * Set-up (at weft_shm_create): every rank publishes its arena's memfd number
 * and size in its control block; after a cpu-group barrier every rank maps
 * every peer's arena read-only through /proc/<pid>/fd/<fd>
 * (wf_arena_map_peer: same user, same pid namespace); the group agrees (MIN
 * over ranks) whether all mappings worked, and on the size threshold (MAX of
 * WEFT_SHM_ZEROCOPY_MIN). All or nothing: no call needs to know which peer
 * could map which.
 *
 * A call (moving at least zc_min bytes): before its first barrier, every
 * rank publishes the arena offsets of its buffers (or WF_ZC_NONE: heap
 * memory, a wrapped pointer); after it, every rank sees the same offers, so
 * either all take this path or all take the segment path. all_gather,
 * reduce_scatter and broadcast then read what they need straight from the
 * owners' inputs (broadcast: the root's only) and end with one barrier
 * (nobody returns while its input may still be read). all_reduce:
 *   1. rank r reduces share r of the message (a cache-line-aligned 1/W),
 *      every rank's part read from that rank's input, in rank order, into
 *      share r of its own output;
 *   2. barrier; rank r copies every other share j from rank j's output;
 *   3. barrier: no rank returns (letting its caller write the buffers) while
 *      a peer may still read them.
 * In place is safe: in step 1 a rank writes only its own share, which no peer
 * reads in step 1; in step 2 it writes the other shares of its buffer, which
 * peers read only in step 1. Each element is reduced once, by one rank, in
 * rank order with wf_reduce: the results are bit-identical on every rank and
 * to the segment path's.
 *
 * A strategy the engine (shm.c) calls, never the other way (shm_zc.h): the
 * engine takes the decision and counts the calls; this file keeps its own
 * state in c->zc and uses only the barrier, the kernels and the segment's
 * control blocks below the engine. */
#include "shm.h" /* the segment, its barrier (shm_sync.c), the kernels; never shm.c */
#include "cpugroup.h"
#include "host_arena.h"

#include <stdlib.h>
#include <string.h>

/* from the arena's smallest block on: at 64 KiB zero-copy already takes
 * 4.1-8.8 us against 7.0-14.7 through the segment (2 ranks, 2-vCPU VM,
 * interleaved runs) */
#define ZC_MIN_DEFAULT (64u << 10)
/* Round size when WEFT_SHM_ZEROCOPY_ROUND is unset: measured on the 2-vCPU
 * VM, 2 ranks in place (interleaved runs, us): 4 MiB one round 358-574,
 * 512 KiB rounds 418-594; 16 MiB 8 MiB rounds 1631-1642, one round
 * 1690-1972, 512 KiB rounds 2260-2539; 64 MiB 512 KiB rounds 10146-11462,
 * 8 MiB rounds 12000-12067, one round 12086-14440. Past the caches, short
 * rounds let step 2 read what a peer just wrote from its cache. */
#define ZC_ROUND_LARGE (8u << 20)
#define ZC_ROUND_HUGE (512u << 10)
#define ZC_HUGE_ABOVE (32u << 20)

int wf_shm_zc_setup(weft_shm *c, weft_cpugroup *g) {
  wf_shm_rank *me = &c->rk[c->me];
  me->arena_fd = -1;
  me->arena_bytes = 0;
  for (int p = 0; p < 2; p++) me->zc_in[p] = me->zc_out[p] = WF_ZC_NONE;
  c->zc.on = 0;
  c->zc.world = c->world;
  long mn = wf_env_long("WEFT_SHM_ZEROCOPY_MIN", ZC_MIN_DEFAULT);
  c->zc.min = (size_t)(mn > 0 ? mn : 1);
  if (c->world < 2) return 0;
  int32_t fd = -1;
  uint64_t bytes = 0;
  int ok = wf_env_long("WEFT_SHM_ZEROCOPY", 1) != 0;
  if (ok && wf_arena_export(&fd, &bytes) == 0) {
    me->arena_fd = fd;
    me->arena_bytes = bytes;
  } else {
    if (ok) wf_log(1, "shm: group '%s': zero-copy off: %s", c->group, weft_last_error());
    ok = 0;
    wf_clear_error();
  }
  int rc = weft_cpugroup_barrier(g); /* every rank's arena is announced */
  if (rc) return wf_error_context(rc, "weft_shm_create: group '%s': announcing host arenas", c->group);
  c->zc.arena = calloc((size_t)c->world, sizeof *c->zc.arena);
  c->zc.arena_bytes = calloc((size_t)c->world, sizeof *c->zc.arena_bytes);
  c->zc.srcs = calloc((size_t)c->world, sizeof *c->zc.srcs);
  if (!c->zc.arena || !c->zc.arena_bytes || !c->zc.srcs) ok = 0;
  for (int j = 0; j < c->world && ok; j++) {
    if (j == c->me) continue;
    const wf_shm_rank *r = &c->rk[j];
    if (r->arena_fd < 0 || !me->pidns || r->pidns != me->pidns) {
      wf_log(1, "shm: group '%s': zero-copy off: rank %d has no arena here", c->group, j);
      ok = 0;
      break;
    }
    c->zc.arena[j] = wf_arena_map_peer(atomic_load(&r->pid), r->arena_fd, r->arena_bytes);
    if (!c->zc.arena[j]) {
      wf_log(1, "shm: group '%s': zero-copy off: %s", c->group, weft_last_error());
      wf_clear_error();
      ok = 0;
      break;
    }
    c->zc.arena_bytes[j] = r->arena_bytes;
  }
  long rd = wf_env_long("WEFT_SHM_ZEROCOPY_ROUND", 0); /* 0: by size (above) */
  int64_t v[3] = {ok, -(int64_t)c->zc.min, -(int64_t)(rd > 0 ? rd : 0)};
  rc = weft_cpugroup_allreduce_i64(g, v, 3, WEFT_MIN);
  if (rc) return wf_error_context(rc, "weft_shm_create: group '%s': agreeing on zero-copy", c->group);
  c->zc.on = v[0] == 1;
  c->zc.min = (size_t)-v[1];
  c->zc.round = (size_t)-v[2];
  if (!c->zc.on && c->zc.arena && c->zc.arena_bytes) {
    for (int j = 0; j < c->world; j++) wf_arena_unmap_peer(c->zc.arena[j], c->zc.arena_bytes[j]);
    memset(c->zc.arena, 0, sizeof *c->zc.arena * (size_t)c->world);
  }
  return 0;
}

void wf_shm_zc_close(wf_shm_zc *z) {
  for (int j = 0; z->arena && z->arena_bytes && j < z->world; j++)
    wf_arena_unmap_peer(z->arena[j], z->arena_bytes[j]);
  free(z->arena);
  free(z->arena_bytes);
  free(z->srcs);
  memset(z, 0, sizeof *z);
}

/* The arena offset of [p, p + bytes), or WF_ZC_NONE. */
static uint64_t offset_of(const void *p, size_t bytes) {
  uint64_t off;
  return p && wf_arena_lookup(p, bytes, &off) ? off : WF_ZC_NONE;
}

int wf_shm_zc_offer(weft_shm *c, uint64_t call, const void *in, size_t in_bytes, const void *out,
                    size_t out_bytes) {
  const uint64_t io = offset_of(in, in_bytes), oo = out ? offset_of(out, out_bytes) : WF_ZC_NONE;
  wf_shm_rank *me = &c->rk[c->me];
  me->zc_in[call & 1] = io; /* published by the barrier */
  me->zc_out[call & 1] = oo;
  return io != WF_ZC_NONE && (!out || oo != WF_ZC_NONE);
}

/* a peer's offer must lie inside the part of its arena mapped here */
static int fits(const weft_shm *c, int j, uint64_t off, uint64_t bytes) {
  return off != WF_ZC_NONE && (j == c->me || (off <= c->zc.arena_bytes[j] && bytes <= c->zc.arena_bytes[j] - off));
}

int wf_shm_zc_agreed(weft_shm *c, uint64_t call, int only, size_t in_bytes, size_t out_bytes) {
  if (!c->zc.on) return 0;
  for (int j = 0; j < c->world; j++) {
    if (only >= 0 && j != only) continue;
    const wf_shm_rank *r = &c->rk[j];
    if (!fits(c, j, r->zc_in[call & 1], in_bytes)) return 0;
    if (out_bytes && !fits(c, j, r->zc_out[call & 1], out_bytes)) return 0;
  }
  return 1;
}

/* rank j's input (this rank's own: in) */
static const uint8_t *input_of(weft_shm *c, uint64_t call, int j, const void *in) {
  return j == c->me ? (const uint8_t *)in : c->zc.arena[j] + c->rk[j].zc_in[call & 1];
}

int wf_shm_zc_all_gather(weft_shm *c, uint64_t call, const void *in, void *out, size_t bytes,
                         const char *opname) {
  for (int k = 0; k < c->world; k++) { /* staggered, own piece first */
    const int j = (c->me + k) % c->world;
    uint8_t *to = (uint8_t *)out + (size_t)j * bytes;
    const uint8_t *from = input_of(c, call, j, in);
    if (to != from) memcpy(to, from, bytes);
  }
  int rc = wf_shm_sync(c, NULL, opname); /* nobody reads my input any more */
  return rc;
}

int wf_shm_zc_reduce_scatter(weft_shm *c, uint64_t call, const void *in, void *out,
                             size_t count_out, int dtype, int op, const char *opname) {
  const size_t piece = count_out * weft_dtype_size(dtype) * (size_t)c->me;
  for (int j = 0; j < c->world; j++) c->zc.srcs[j] = input_of(c, call, j, in) + piece;
  if (count_out) wf_reduce(out, c->zc.srcs, c->world, count_out, dtype, op);
  int rc = wf_shm_sync(c, NULL, opname);
  return rc;
}

int wf_shm_zc_broadcast(weft_shm *c, uint64_t call, void *buf, size_t bytes, int root,
                        const char *opname) {
  if (c->me != root) memcpy(buf, input_of(c, call, root, NULL), bytes);
  int rc = wf_shm_sync(c, NULL, opname);
  return rc;
}

/* Rounds: rank r's share of round k is reduced (step 1), then after the
 * barrier that ends round k the others' shares are copied out (step 2)
 * together with step 1 of round k + 1: R rounds take R + 1 barriers, and
 * step 2 reads shares a peer wrote just before the barrier, from its cache
 * rather than from memory. */
int wf_shm_zc_all_reduce(weft_shm *c, uint64_t call, const void *in, void *out, size_t count,
                         int dtype, int op, const char *opname) {
  const size_t es = weft_dtype_size(dtype), align = 64 / es;
  const int W = c->world, par = (int)(call & 1);
  const uint8_t *in8 = in;
  uint8_t *dst = out;
  const size_t round = c->zc.round ? c->zc.round
                       : count * es > ZC_HUGE_ABOVE ? ZC_ROUND_HUGE : ZC_ROUND_LARGE;
  size_t per = round / es;
  per = per < align * (size_t)W ? align * (size_t)W : per / align * align;
  size_t prev_off = 0, prev_n = 0;
  for (size_t off = 0;; off += per) {
    const size_t n = off < count ? (count - off < per ? count - off : per) : 0;
    /* 2. the previous round's other shares, from their owners' outputs
     * (staggered: not every rank reading rank 0 first) */
    for (int k = 1; k < W && prev_n; k++) {
      const int j = (c->me + k) % W;
      size_t lo, hi;
      wf_shm_share(prev_n, prev_n, W, j, align, &lo, &hi);
      const size_t b = (prev_off + lo) * es;
      if (hi > lo) memcpy(dst + b, c->zc.arena[j] + c->rk[j].zc_out[par] + b, (hi - lo) * es);
    }
    /* 1. my share of this round, from every rank's input, in rank order */
    if (n) {
      size_t lo, hi;
      wf_shm_share(n, n, W, c->me, align, &lo, &hi);
      const size_t b = (off + lo) * es;
      for (int j = 0; j < W; j++)
        c->zc.srcs[j] = (j == c->me ? in8 : c->zc.arena[j] + c->rk[j].zc_in[par]) + b;
      if (hi > lo) wf_reduce(dst + b, c->zc.srcs, W, hi - lo, dtype, op);
    }
    /* after the last round: nobody's buffers are read any more */
    int rc = wf_shm_sync(c, NULL, opname);
    if (rc) return rc;
    if (!n) break;
    prev_off = off;
    prev_n = n;
  }
  return 0;
}
