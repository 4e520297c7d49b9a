/* shm.c — host data plane: shared-memory collectives among the ranks of one
 * node (weft_shm_*). Creation goes through the cpu group; the data moves
 * through the segment of shm_seg.c, chunked by the slot size (any message
 * size works), with the barriers of shm_sync.c.
 *
 * all_reduce: up to oneshot_max bytes (WEFT_SHM_ONESHOT_MAX, default 32 KiB)
 * every rank copies its input into its slot, one barrier, every rank reduces
 * all slots into its output (latency: one barrier per chunk); with 2 ranks
 * at any size (each rank reads its own part from its input, the other from
 * the slot: one copy in, one barrier, no copy out). Above, with 3+ ranks, per
 * chunk: copy in all but its own share, barrier, rank r reduces the r-th 1/N
 * of the chunk (its own part from its input, the others from their slots)
 * straight into its output and publishes it in its slot, barrier, every rank
 * copies the other N-1 reduced pieces out (reduce-scatter + all-gather: each
 * element is reduced once, by one rank: bandwidth); the second barrier of a
 * chunk is the first of the next, so C chunks take C + 1 barriers.
 * Summation order is rank 0..N-1 everywhere, so all ranks get bit-identical
 * results. all_gather, reduce_scatter and broadcast take one barrier per
 * chunk; broadcast uses every slot of a half (N * slot bytes per chunk).
 *
 * Zero-copy (shm_zc.c): when the buffers peers read are arena memory on
 * every rank (weft host tensors of 64 KiB and more) and the call moves at
 * least zc_min bytes, ranks read each other's buffers in place instead.
 *
 * Every call starts by publishing a descriptor (kind, dtype, op, count,
 * root, call number) at its first barrier; ranks that disagree all fail with
 * the list of what each rank called, and the communicator stays usable. A
 * rank with bad arguments takes part in that first barrier too, so nobody
 * waits for it. */
#include "shm.h"
#include "cpugroup.h"
#include "store/store_share.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* local teardown: the strategy's state, then the segment */
static void close_comm(weft_shm *c) {
  if (c) wf_shm_zc_close(&c->zc);
  wf_shm_close(c);
}

typedef struct {
  int32_t ok;
  uint32_t pad;
  uint64_t slot;
  char name[64];
} create_msg;

int weft_shm_create(weft_cpugroup *g, size_t bytes_per_rank, weft_shm **out) {
  static const char op[] = "weft_shm_create";
  WF_CHECK_ARG(g && out, "%s: NULL group or out pointer", op);
  *out = NULL;
  wf_group_info gi;
  int rc = wf_shm_group_info(g, &gi, op);
  if (rc) return rc;
  const char *gname = gi.name ? gi.name : "?";
  size_t slot = wf_shm_round_slot(bytes_per_rank, gi.size);

  /* 1. index 0 creates and announces the name (or its failure). */
  weft_shm *c = NULL;
  create_msg m;
  memset(&m, 0, sizeof m);
  int my_rc = 0;
  char my_err[200] = "";
  if (gi.index == 0) {
    wf_shm_sweep(2 * (gi.timeout_ms / 1000) + 60);
    my_rc = wf_shm_random_name("shm", m.name, sizeof m.name);
    if (!my_rc)
      my_rc = wf_shm_attach(m.name, 1, 0, gi.size, slot, gi.timeout_ms, gname, gi.ranks, &c);
    m.ok = my_rc == 0;
    m.slot = slot;
    if (my_rc) snprintf(my_err, sizeof my_err, "%s", weft_last_error());
  }
  rc = wf_shm_announce(g, gi.index, &m, sizeof m, m.name, sizeof m.name, &m.ok, &my_rc, op, gname);
  if (rc) {
    if (c) { wf_shm_unlink(m.name); wf_shm_close(c); }
    return rc;
  }
  if (gi.index != 0) {
    if (my_rc == 0 && m.slot != slot)
      my_rc = wf_error(WEFT_EINVAL, "%s: group '%s': ranks disagree on bytes_per_rank "
                       "(index 0: %llu after rounding, this rank: %zu)", op, gname,
                       (unsigned long long)m.slot, slot);
    else if (my_rc == 0)
      my_rc = wf_shm_attach(m.name, 0, gi.index, gi.size, slot, gi.timeout_ms, gname,
                            gi.ranks, &c);
    if (my_rc) snprintf(my_err, sizeof my_err, "%s", weft_last_error());
  }

  /* 2. everyone reports; index 0 removes the name whatever happened */
  rc = wf_shm_confirm_attach(g, gi.index, gi.size, gi.ranks, my_rc, my_err, m.ok ? m.name : NULL,
                             op, gname);
  if (rc) {
    wf_shm_close(c);
    return rc;
  }
  c->name[0] = '\0'; /* unlinked */
  c->store_rank0 = wf_store_live_registered(wf_cpugroup_store(g));
  if ((rc = wf_shm_zc_setup(c, g))) {
    close_comm(c);
    return rc;
  }
  c->cg = g;
  wf_cpugroup_link_shm(g, c);
  *out = c;
  wf_log(1, "shm: group '%s': %d ranks, %zu bytes per slot, segment %zu bytes, zero-copy %s",
         gname, gi.size, slot, c->map_len, c->zc.on ? "on" : "off");
  return 0;
}

int weft_shm_get_info(weft_shm *c, weft_shm_info *out) {
  WF_CHECK_ARG(c && out, "weft_shm_get_info: NULL communicator or out pointer");
  memset(out, 0, sizeof *out);
  out->world = c->world;
  out->zero_copy = c->zc.on;
  out->zero_copy_min = c->zc.min;
  out->zero_copy_calls = c->zc_calls;
  out->segment_calls = c->seg_calls;
  return 0;
}

int weft_shm_destroy(weft_shm *c) {
  if (!c) return 0;
  if (c->hdr) wf_shm_mark_left(c);   /* first: the peers' waits on this rank end */
  if (c->cg) wf_cpugroup_unlink_shm(c->cg, c);
  c->cg = NULL;
  /* a worker's operation still inside c (a closing Lua state's finalizers run
   * in any order): wait for it, or leak c rather than unmap it under it */
  if (wf_wait_unused(NULL, 0, c)) return 0;
  close_comm(c);
  return 0;
}

static int done(weft_shm *c, int rc) {
  wf_shm_leave(c);
  return rc;
}

/* a call the zero-copy strategy served: counted here, by the engine */
static int zc_done(weft_shm *c, int rc) {
  if (rc == 0) c->zc_calls++;
  return done(c, rc);
}

static inline size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

int weft_shm_set_call(weft_shm *c, uint64_t shape_word, uint64_t args_word) {
  WF_CHECK_ARG(c, "weft_shm_set_call: NULL communicator");
  c->next_shape = shape_word;
  c->next_args = args_word;
  return 0;
}

/* This call's descriptor: what the caller asked for, numbered, with the
 * words weft_shm_set_call gave it (taken: the next call starts without). */
static wf_shm_desc call_desc(weft_shm *c, uint32_t kind, int dtype, int op, int root, uint64_t count) {
  wf_shm_desc d = {kind, dtype, op, root, count, c->call++, c->next_shape, c->next_args};
  c->next_shape = c->next_args = 0;
  return d;
}

/* What the engine serves (weft.policy's shm_reduce table says the same);
 * the kernels also do u8 and prod, which the group layer sends through
 * all-gather + weft_host_reduce. */
static int engine_reduces(int dtype, int op) {
  return wf_reduce_supported(dtype, op) && dtype != WEFT_U8 && op != WEFT_PROD;
}

/* A rank with bad arguments still takes part in the first barrier with a
 * descriptor nobody else has, so every rank fails now instead of timing out. */
static int refuse(weft_shm *c, wf_shm_desc *d, const char *op, int code, const char *why) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", why);
  d->kind |= 0x100; /* matches no valid call */
  c->chunk++;
  wf_shm_sync(c, d, op);
  return done(c, wf_error(code, "%s: group '%s': %s", op, c->group, msg));
}

/* The checks a reducing collective (all_reduce, reduce_scatter) starts
 * with: a dtype and op the engine reduces, buffers for a call that moves
 * something, and count * parts elements (parts: the input's pieces per
 * count) that fit in a size_t. 0, or the refusal's status. */
static int check_reduce(weft_shm *c, wf_shm_desc *d, const char *OP, int dtype, int op,
                        size_t count, size_t parts, const void *in, const void *out) {
  if (!engine_reduces(dtype, op))
    return refuse(c, d, OP, WEFT_EINVAL, "unsupported dtype/op (f32, f16, bf16, f64, i32, "
                  "i64 with sum, max, min)");
  if (count && (!in || !out)) return refuse(c, d, OP, WEFT_EINVAL, "NULL buffer");
  if (count > SIZE_MAX / weft_dtype_size(dtype) / parts)
    return refuse(c, d, OP, WEFT_EINVAL, "count too large");
  return 0;
}

/* The zero-copy decision (shm_zc.c), taken at the call's first barrier:
 * with eligible (same on every rank: the communicator can and the call is
 * large enough), every rank offers its buffers (in/out, NULL: not arena
 * memory or not needed) and syncs with the call's descriptor; 1 when every
 * rank (only >= 0: that rank) offered, so the caller runs the zero-copy
 * collective. 0: the segment path, and *checked says whether the
 * descriptors were already compared. < 0: the barrier failed. */
static int zc_decide(weft_shm *c, const wf_shm_desc *d, const char *op, int eligible, int only,
                     const void *in, size_t in_bytes, const void *out, size_t out_bytes,
                     int *checked) {
  *checked = 0;
  if (eligible) {
    wf_shm_zc_offer(c, d->call, in, in_bytes, out, out_bytes);
    int rc = wf_shm_sync(c, d, op);
    if (rc) return rc;
    if (wf_shm_zc_agreed(c, d->call, only, in_bytes, out ? out_bytes : 0)) return 1;
    *checked = 1;
  }
  c->seg_calls++;
  return 0;
}

int weft_shm_all_reduce(weft_shm *c, const void *in, void *out, size_t count, int dtype,
                        int op) {
  static const char OP[] = "weft_shm_all_reduce";
  int rc = wf_shm_enter(c, OP);
  if (rc) return rc;
  wf_shm_desc d = call_desc(c, WF_OP_ALL_REDUCE, dtype, op, 0, count);
  if ((rc = check_reduce(c, &d, OP, dtype, op, count, 1, in, out))) return rc;
  const size_t es = weft_dtype_size(dtype), world = (size_t)c->world;
  const uint8_t *src = in;
  uint8_t *dst = out;
  const size_t per = c->slot / es, align = 64 / es;
  /* Zero-copy when every rank's buffers are arena memory (shm_zc.c). The
   * offers go with the call's first barrier, so the decision is the same
   * everywhere; when it is no, that barrier was the segment path's
   * descriptor check and its own first barrier carries none. */
  const size_t b = count * es;
  const int apart = src == dst || src + b <= dst || dst + b <= src; /* not partly overlapping */
  int checked;
  rc = zc_decide(c, &d, OP, wf_shm_zc_eligible(&c->zc, b), -1, apart ? in : NULL, b,
                 apart ? out : NULL, b, &checked);
  if (rc < 0) return done(c, rc);
  if (rc == 1) return zc_done(c, wf_shm_zc_all_reduce(c, d.call, in, out, count, dtype, op, OP));
  /* Two ranks: every rank reducing the whole chunk is as much traffic as the
   * split (each rank still writes N bytes and reads N written by the other
   * core; measured: no faster) and saves a barrier and the copy out, so they
   * take this path at any size. */
  if (count * es <= c->oneshot_max || c->world == 2) {
    /* one barrier per chunk, every rank reduces it all (its own part from its
     * input, which is in cache, the others' from their slots) */
    size_t off = 0;
    do {
      size_t n = min_sz(per, count - off);
      uint64_t half = c->chunk++;
      memcpy(wf_shm_slot(c, half, c->me), src + off * es, n * es);
      if ((rc = wf_shm_sync(c, off == 0 && !checked ? &d : NULL, OP))) return done(c, rc);
      for (size_t j = 0; j < world; j++) c->srcs[j] = wf_shm_slot(c, half, (int)j);
      c->srcs[c->me] = src + off * es;
      wf_reduce(dst + off * es, c->srcs, c->world, n, dtype, op);
      off += n;
    } while (off < count);
    return done(c, 0);
  }
  /* Reduce-scatter + all-gather, one barrier per chunk plus one: chunk k is
   * copied in, barrier k, then chunk k-1's reduced shares are copied out
   * (published before everyone arrived at barrier k) and chunk k is reduced
   * and published; a last barrier, then the last chunk is copied out.
   * Nobody reads rank r's share from r's slot before r published its result
   * there, so r copies in only the other shares and reduces its own straight
   * from its input. Chunk k's copy-in (other shares of half k%2) can overlap
   * a peer's copy-out of chunk k-2 (my share of the same half): disjoint as
   * long as both chunks split alike, so a message of several chunks splits
   * each like a full one. */
  const size_t blk = WF_SHM_BLOCK / es; /* publish from L1: reduce a block, copy it */
  const size_t geo = count > per ? per : count;
  size_t off = 0, prev_off = 0, prev_n = 0;
  uint64_t prev_half = 0;
  for (;;) {
    size_t n = min_sz(per, count - off), lo = 0, hi = 0;
    uint64_t half = c->chunk;
    if (n) {
      c->chunk++;
      uint8_t *mine = wf_shm_slot(c, half, c->me);
      wf_shm_share(geo, n, c->world, c->me, align, &lo, &hi);
      memcpy(mine, src + off * es, lo * es);
      memcpy(mine + hi * es, src + (off + hi) * es, (n - hi) * es);
    }
    if ((rc = wf_shm_sync(c, off == 0 && !checked ? &d : NULL, OP))) return done(c, rc);
    for (int j = 0; j < c->world && prev_n; j++) {
      size_t plo, phi;
      wf_shm_share(geo, prev_n, c->world, j, align, &plo, &phi);
      if (j != c->me && phi > plo)
        memcpy(dst + (prev_off + plo) * es, wf_shm_slot(c, prev_half, j) + plo * es,
               (phi - plo) * es);
    }
    if (!n) break;
    /* In place is fine: my share of the input is read only here, each block
     * before it is overwritten. */
    uint8_t *mine = wf_shm_slot(c, half, c->me);
    for (size_t b = lo; b < hi; b += blk) {
      size_t m = min_sz(blk, hi - b);
      for (size_t j = 0; j < world; j++) c->srcs[j] = wf_shm_slot(c, half, (int)j) + b * es;
      c->srcs[c->me] = src + (off + b) * es;
      wf_reduce(dst + (off + b) * es, c->srcs, c->world, m, dtype, op);
      memcpy(mine + b * es, dst + (off + b) * es, m * es);
    }
    prev_off = off;
    prev_n = n;
    prev_half = half;
    off += n;
  }
  return done(c, 0);
}

int weft_shm_all_gather(weft_shm *c, const void *in, void *out, size_t bytes) {
  static const char OP[] = "weft_shm_all_gather";
  int rc = wf_shm_enter(c, OP);
  if (rc) return rc;
  wf_shm_desc d = call_desc(c, WF_OP_ALL_GATHER, -1, -1, 0, bytes);
  if (bytes && (!in || !out)) return refuse(c, &d, OP, WEFT_EINVAL, "NULL buffer");
  const uint8_t *src = in;
  uint8_t *dst = out;
  /* zero-copy: every rank's input is arena memory (shm_zc.c) */
  const int fits = bytes <= SIZE_MAX / (size_t)c->world;
  const size_t all = fits ? bytes * (size_t)c->world : SIZE_MAX;
  const int apart = src == dst + (size_t)c->me * bytes || src + bytes <= dst || dst + all <= src;
  int checked;
  rc = zc_decide(c, &d, OP, fits && wf_shm_zc_eligible(&c->zc, all), -1, apart ? in : NULL, bytes, NULL, 0,
                 &checked);
  if (rc < 0) return done(c, rc);
  if (rc == 1) return zc_done(c, wf_shm_zc_all_gather(c, d.call, in, out, bytes, OP));
  size_t off = 0;
  do {
    size_t n = min_sz(c->slot, bytes - off);
    uint64_t half = c->chunk++;
    memcpy(wf_shm_slot(c, half, c->me), src + off, n);
    if ((rc = wf_shm_sync(c, off == 0 && !checked ? &d : NULL, OP))) return done(c, rc);
    for (int j = 0; j < c->world; j++) {
      uint8_t *to = dst + (size_t)j * bytes + off;
      if (j == c->me && to == src + off) continue; /* in place */
      memcpy(to, wf_shm_slot(c, half, j), n);
    }
    off += n;
  } while (off < bytes);
  return done(c, 0);
}

int weft_shm_reduce_scatter(weft_shm *c, const void *in, void *out, size_t count_out,
                            int dtype, int op) {
  static const char OP[] = "weft_shm_reduce_scatter";
  int rc = wf_shm_enter(c, OP);
  if (rc) return rc;
  wf_shm_desc d = call_desc(c, WF_OP_REDUCE_SCATTER, dtype, op, 0, count_out);
  if ((rc = check_reduce(c, &d, OP, dtype, op, count_out, (size_t)c->world, in, out))) return rc;
  const size_t es = weft_dtype_size(dtype), world = (size_t)c->world;
  const uint8_t *src = in;
  uint8_t *dst = out;
  /* zero-copy: every rank's input is arena memory (shm_zc.c) */
  const size_t all = count_out * world * es, piece = count_out * es;
  const int apart = dst == src + (size_t)c->me * piece || dst + piece <= src || src + all <= dst;
  int checked;
  rc = zc_decide(c, &d, OP, wf_shm_zc_eligible(&c->zc, all), -1, apart ? in : NULL, all, NULL, 0,
                 &checked);
  if (rc < 0) return done(c, rc);
  if (rc == 1) return zc_done(c, wf_shm_zc_reduce_scatter(c, d.call, in, out, count_out, dtype, op, OP));
  /* A slot holds one piece per destination rank; pieces start on cache lines. */
  size_t per = c->slot / (world * es);
  if (per >= 64 / es) per -= per % (64 / es);
  size_t off = 0;
  do {
    size_t n = min_sz(per, count_out - off);
    uint64_t half = c->chunk++;
    uint8_t *mine = wf_shm_slot(c, half, c->me);
    for (size_t j = 0; j < world; j++)
      memcpy(mine + j * per * es, src + (j * count_out + off) * es, n * es);
    if ((rc = wf_shm_sync(c, off == 0 && !checked ? &d : NULL, OP))) return done(c, rc);
    for (size_t j = 0; j < world; j++)
      c->srcs[j] = wf_shm_slot(c, half, (int)j) + (size_t)c->me * per * es;
    wf_reduce(dst + off * es, c->srcs, c->world, n, dtype, op);
    off += n;
  } while (off < count_out);
  return done(c, 0);
}

int weft_shm_barrier(weft_shm *c) {
  static const char OP[] = "weft_shm_barrier";
  int rc = wf_shm_enter(c, OP);
  if (rc) return rc;
  wf_shm_desc d = call_desc(c, WF_OP_BARRIER, -1, -1, -1, 0);
  c->chunk++;
  return done(c, wf_shm_sync(c, &d, OP));
}

int weft_shm_broadcast(weft_shm *c, void *buf, size_t bytes, int root) {
  static const char OP[] = "weft_shm_broadcast";
  int rc = wf_shm_enter(c, OP);
  if (rc) return rc;
  wf_shm_desc d = call_desc(c, WF_OP_BROADCAST, -1, -1, root, bytes);
  if (root < 0 || root >= c->world) return refuse(c, &d, OP, WEFT_EINVAL, "root out of range");
  if (bytes && !buf) return refuse(c, &d, OP, WEFT_EINVAL, "NULL buffer");
  uint8_t *p = buf;
  /* zero-copy: the root's buffer is arena memory (shm_zc.c) */
  int checked;
  rc = zc_decide(c, &d, OP, wf_shm_zc_eligible(&c->zc, bytes), root, c->me == root ? buf : NULL, bytes,
                 NULL, 0, &checked);
  if (rc < 0) return done(c, rc);
  if (rc == 1) return zc_done(c, wf_shm_zc_broadcast(c, d.call, buf, bytes, root, OP));
  const size_t region = c->slot * (size_t)c->world; /* the root fills a whole half */
  size_t off = 0;
  do {
    size_t n = min_sz(region, bytes - off);
    uint64_t half = c->chunk++;
    uint8_t *shared = wf_shm_slot(c, half, 0);
    if (c->me == root) memcpy(shared, p + off, n);
    if ((rc = wf_shm_sync(c, off == 0 && !checked ? &d : NULL, OP))) return done(c, rc);
    if (c->me != root) memcpy(p + off, shared, n);
    off += n;
  } while (off < bytes);
  return done(c, 0);
}
