/* agree.h — the agreement of device calls: what every kernel on a device
 * collective's workspace (the all-reduce and the quick all-reduce, the fused
 * all-reduce + norm, the MoE / pre-post fusions) tells its peers about its
 * call, so that two ranks making different calls fail at once, naming both
 * calls, instead of waiting for flags that never come. Plain C: gcc and
 * nvcc read it (kernels/common.cuh has the device side).
 *
 * Each workspace holds one wf_agree_area (same offset on every rank). At the
 * start of every call, one thread of block 0 counts the call (calls) and
 * writes its announcement into slot[me] of every rank's area (its own too):
 * word = (call number << 32) | hash of the descriptor (d0, d1), beside the
 * descriptor itself. No wait depends on it: it costs W stores of 32 bytes per
 * call. A wait that lasts longer than WF_AGREE_AFTER_NS compares the slots
 * in its own area: a peer that announced the same call number with another
 * hash made a different call (WF_SPIN_MISMATCH, both descriptors mirrored to
 * the host); a peer whose slot holds the failure mark gave up
 * (WF_SPIN_PEER_FAILED). A kernel that fails writes the failure mark into
 * every peer's slot for it, so no peer waits for the timeout behind it. */
#ifndef WEFT_AGREE_H
#define WEFT_AGREE_H

#include "coll/limits.h"
#include <stdint.h>

#define WF_AGREE_AFTER_NS 20000u /* a wait older than this compares the slots */
#define WF_AGREE_FAILED 0xffffffffu /* a slot word's call number that marks a failure */

typedef struct wf_agree_area {
  uint64_t slot[WF_MAX_WORLD][4];  /* written by rank r: {word, d0, d1, 0} */
  uint64_t peer_row[WF_MAX_WORLD]; /* every rank's area, as this process maps it */
  uint32_t calls;                        /* this rank's announced calls */
  uint32_t pad[47];
} wf_agree_area;                         /* 512 bytes */

/* What a kernel gets (by value, in its arguments): area NULL = no agreement. */
typedef struct wf_agree {
  wf_agree_area *area; /* device address of this rank's area */
  uint64_t d0, d1;     /* this call's descriptor (wf_agree_desc) */
  int32_t me, world;
} wf_agree;

/* Packed error word statuses beyond kernels/common.cuh's SPIN_* (1 abort,
 * 2 timeout): the peer named made a different call / gave up. For
 * PEER_FAILED the site byte holds the peer's own status and the epoch the
 * rank its failure named. */
enum { WF_SPIN_MISMATCH = 4, WF_SPIN_PEER_FAILED = 5 };

/* Families (the top byte of d0): whose descriptor it is. */
enum { WF_AGREE_AR = 1, WF_AGREE_QUICK = 2, WF_AGREE_FUSED = 3, WF_AGREE_QFUSED = 4, WF_AGREE_EXT = 5 };

/* d0: family | algorithm | dtype | pattern/op | grid | threads | bits, d1: the
 * element count (or tokens x hidden) and whatever else must agree. Only what
 * every rank must have the same: no pointers, nothing rank-local. */
static inline uint64_t wf_agree_d0(unsigned family, unsigned algo, unsigned dtype, unsigned pattern,
                                   unsigned grid, unsigned threads, unsigned bits) {
  return ((uint64_t)(family & 0xff) << 56) | ((uint64_t)(algo & 0xff) << 48) |
         ((uint64_t)(dtype & 0xff) << 40) | ((uint64_t)(pattern & 0xff) << 32) |
         ((uint64_t)(grid & 0xffff) << 16) | ((uint64_t)(threads & 0x3ff) << 6) | (bits & 0x3f);
}

#endif
