/* ar_layout.cuh — where a weft_ar workspace keeps its epochs and flags
 * (src/coll/ar_internal.h's offsets), for the kernels that use one: the
 * all-reduce (allreduce_kernels.cuh) and the quick all-reduce
 * (quick_allreduce_kernels.cuh). A: their kernel arguments, each with the
 * peers' workspaces ws[] and this rank. */
#pragma once
#include <stddef.h>
#include <stdint.h>

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
         (((size_t)(par * 2 + phase) * WF_AR_MAX_BLOCKS + block) * WF_AR_MAX_WORLD + sender);
}

}  // namespace wf
