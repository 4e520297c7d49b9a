/* ar_layout.cuh — where a weft_ar workspace keeps its epochs and flags
 * (src/coll/ar_internal.h's offsets), for the kernels that use one: the
 * all-reduce (allreduce_kernels.cuh) and the quick all-reduce
 * (quick_allreduce_kernels.cuh). A: their kernel arguments, each with the
 * peers' workspaces ws[] and this rank. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common.cuh"

extern "C" {
#include "coll/ar_internal.h"
}

namespace wf {

/* Index of src's slot in dst's workspace (dst has no slot for itself). */
__device__ __forceinline__ int pslot(int src, int dst) { return src < dst ? src : src - 1; }

template <typename A> __device__ __forceinline__ uint32_t *epochs_of(const A &a) {
  return reinterpret_cast<uint32_t *>(a.ws[a.rank] + WF_AR_OFF_EPOCHS);
}
/* Flag written by `sender` into `owner`'s workspace. */
template <typename A>
__device__ __forceinline__ uint64_t *flag_ptr(const A &a, int owner, uint32_t par, int phase, int block,
                                              int sender) {
  return reinterpret_cast<uint64_t *>(a.ws[owner] + WF_AR_OFF_FLAGS) + WF_FLAG_INDEX(par, phase, block, sender);
}

/* The byte counts of the three Lamport buffers' last use. */
template <typename A> __device__ __forceinline__ uint64_t *lbytes_of(const A &a) {
  return reinterpret_cast<uint64_t *>(a.ws[a.rank] + WF_AR_OFF_LBYTES);
}

/* Every kernel on the workspace keeps the Lamport buffers clean: it clears
 * the buffer call E-1 used (its size is in lbytes) and records what this
 * call uses (used_bytes; 0 for the kernels that use none).  See common.cuh
 * for why this is race-free. L: the buffers' layout (off_lamport and
 * lamport_slot members: the kernel's arguments themselves, or their own). */
template <int W, typename A, typename L>
__device__ __forceinline__ void lamport_maintain(const A &a, const L &lay, uint32_t E, uint64_t used_bytes) {
  uint64_t *lb = lbytes_of(a);
  const uint32_t prev = (E + 2) % 3;
  /* all three loaded at once: no load that waits for E's */
  const uint64_t l0 = lb[0], l1 = lb[1], l2 = lb[2];
  const uint64_t pv = (prev == 0 ? l0 : prev == 1 ? l1 : l2) / 16;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t nthr = (uint64_t)gridDim.x * blockDim.x;
  if (pv) {
    const uint4 empty = lamport_empty_vec();
    char *base = a.ws[a.rank] + lay.off_lamport + (uint64_t)prev * (W - 1) * lay.lamport_slot;
#pragma unroll
    for (int k = 0; k < W - 1; k++)
      for (uint64_t v = tid; v < pv; v += nthr) st_vec(base + k * lay.lamport_slot + v * 16, empty);
  }
  if (tid == 0) lb[E % 3] = used_bytes;
}

/* The two-shot's schedule, the same for every wire (the exact kernel's
 * vectors, the quick kernel's codec): a three-stage software pipeline over
 * this block's rounds of chunks (chunk c = block + r x grid), one flag per
 * (phase, block, sender) and round number in the flag's step:
 *   A  push(c): part q of chunk c to rank q; then flag phase 0 to each peer
 *   B  once every peer's phase-0 flag of chunk c-1 is here: reduce(c-1),
 *      my part in rank order, pushed to every peer; then flag phase 1
 *   C  once every peer's phase-1 flag of chunk c-2 is here: pull(c-2), the
 *      owners' results out
 * A chunk's flags are cleared by its last wait (the next call's epoch would
 * not pass them anyway).  A failed wait (bounded_spin: a peer late past the
 * timeout, gone, or making another call; reported) ends the rounds of the
 * whole block; the kernel then only verifies and advances its epoch. */
template <int W, typename A, typename Push, typename Reduce, typename Pull>
__device__ __forceinline__ void twoshot_rounds(const A &a, uint32_t E, uint64_t R, uint32_t site_rs,
                                               uint32_t site_ag, Push push, Reduce reduce, Pull pull) {
  const uint32_t par = E & 1;
  const int me = a.rank, t = threadIdx.x, b = blockIdx.x, G = gridDim.x;
  bool ok = true;
  for (uint64_t r = 0; r <= R + 1; r++) {
    if (r < R) { /* A */
      push(b + r * G);
      __syncthreads();
      if (t < W && t != me) st_release_sys(flag_ptr(a, t, par, 0, b, me), flag_value(E, r + 1));
    }
    if (r >= 1 && r <= R) { /* B */
      const uint64_t rr = r - 1;
      if (t < W && t != me) {
        uint64_t *f = flag_ptr(a, me, par, 0, b, t);
        ok = wait_flag_geq(f, flag_value(E, rr + 1), a.env, t, site_rs, E) == SPIN_OK;
        if (rr + 1 == R) st_relaxed_sys(f, 0ull);
      }
      if (!__syncthreads_and(ok)) break;
      reduce(b + rr * G);
      __syncthreads();
      if (t < W && t != me) st_release_sys(flag_ptr(a, t, par, 1, b, me), flag_value(E, rr + 1));
    }
    if (r >= 2) { /* C */
      const uint64_t rr = r - 2;
      if (t < W && t != me) {
        uint64_t *f = flag_ptr(a, me, par, 1, b, t);
        ok = wait_flag_geq(f, flag_value(E, rr + 1), a.env, t, site_ag, E) == SPIN_OK;
        if (rr + 1 == R) st_relaxed_sys(f, 0ull);
      }
      if (!__syncthreads_and(ok)) break;
      pull(b + rr * G);
    }
  }
}

}  // namespace wf
