/* shm_zc.h — the zero-copy strategy of the shm engine (shm_zc.c).
 *
 * Direction: the engine (shm.c) decides per call and calls this strategy;
 * the strategy calls only the units below the engine — the barrier
 * (shm_sync.c), the kernels (shm_reduce.c), the segment's control blocks
 * (shm.h) and the host arena — and never back into shm.c. Its state is its
 * own (wf_shm_zc, a member of the communicator that only shm_zc.c writes);
 * the engine reads it through wf_shm_zc_eligible and keeps its own counters.
 * Included by shm.h (the communicator embeds the state); needs nothing of it. */
#ifndef WF_SHM_ZC_H
#define WF_SHM_ZC_H

#include "core/internal.h"

#define WF_ZC_NONE UINT64_MAX

typedef struct {
  const uint8_t **arena;   /* [world]: the peers' host arenas, mapped read-only; NULL for this rank */
  uint64_t *arena_bytes;   /* [world] */
  const void **srcs;       /* scratch: one source pointer per rank */
  int world;
  int on;                  /* every rank mapped every peer's arena */
  size_t min;              /* collectives from this many bytes (agreed) */
  size_t round;            /* all_reduce bytes per round (agreed; 0: by size) */
} wf_shm_zc;

/* After the segment is confirmed: every rank publishes its arena and maps
 * the peers' (all or nothing, agreed through the cpu group: a peer that
 * cannot be mapped only means the segment path serves every call; an error
 * only when the cpu group itself fails). */
int wf_shm_zc_setup(weft_shm *c, weft_cpugroup *g);
/* Unmaps the peers' arenas and frees the state; idempotent, no collective. */
void wf_shm_zc_close(wf_shm_zc *z);

/* The communicator can read its peers in place and a call of `bytes` is
 * large enough (the same answer on every rank). */
static inline int wf_shm_zc_eligible(const wf_shm_zc *z, size_t bytes) {
  return z->on && bytes >= z->min;
}

/* Publishes this rank's arena offsets of in (in_bytes) and out (out_bytes;
 * out may be NULL: not needed) for the call, WF_ZC_NONE where a buffer is
 * not arena memory; before the call's first barrier. 1 when both are. */
int wf_shm_zc_offer(weft_shm *c, uint64_t call, const void *in, size_t in_bytes, const void *out,
                    size_t out_bytes);
/* After the first barrier: 1 when every rank (only >= 0: that rank alone)
 * offered its input (and its output, out_bytes > 0), inside its mapping. */
int wf_shm_zc_agreed(weft_shm *c, uint64_t call, int only, size_t in_bytes, size_t out_bytes);
/* The zero-copy collectives proper, after the first barrier. all_reduce:
 * reduce my share from every rank's input, barrier, copy the others'
 * shares from their outputs, barrier (in rounds: shm_zc.c). The others read
 * straight from the owners' inputs, then one barrier. */
int wf_shm_zc_all_reduce(weft_shm *c, uint64_t call, const void *in, void *out, size_t count,
                         int dtype, int op, const char *opname);
int wf_shm_zc_all_gather(weft_shm *c, uint64_t call, const void *in, void *out, size_t bytes,
                         const char *opname);
int wf_shm_zc_reduce_scatter(weft_shm *c, uint64_t call, const void *in, void *out,
                             size_t count_out, int dtype, int op, const char *opname);
int wf_shm_zc_broadcast(weft_shm *c, uint64_t call, void *buf, size_t bytes, int root,
                        const char *opname);

#endif
