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
  return reinterpret_cast<uint64_t *>(a.ws[owner] + WF_AR_OFF_FLAGS) +
         (((size_t)(par * 2 + phase) * WF_MAX_GRID + block) * WF_MAX_WORLD + sender);
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

}  // namespace wf
