/* fused_twoshot.cuh — the schedule of the fused all-reduce + norm two-shots,
 * written once: the exact kernel (fused_norm_kernels.cuh twoshot_kernel) and
 * the quick one (quick_fused.cu qr_fused_twoshot) differ only in what crosses
 * the wire (the dtype's vectors, or codes and scales) and how a row is
 * finished; the ranges, the flags, the waits and the epoch are these.
 *
 * Rank p owns rows [range_start(p), range_start(p + 1)) of the call's tokens
 * (common.cuh); a block takes rows r = blockIdx.x, + gridDim.x, ... of a range.
 *  1. push(dst, ps + r, r): this rank's part of row ps + r of peer p's range,
 *     to dst = p's RS inbox slot [rank] (rows of `slot` bytes each); then the
 *     RS flags: phase 0, flag_value(E, 1), one per (block, sender);
 *  2. own(ms + r, r, parity): this rank's rows, reduced and pushed to every
 *     peer's AG inbox; then the AG flags: phase 1, flag_value(E, 2);
 *  3. pull(p, ps + r, r, parity): the peers' rows, from this rank's AG inbox,
 *     each peer's once its AG flag is up (the last-owned peer first).
 * parity alternates row by row over 2 and 3 (the norm's double-buffered
 * partials). wait(flag, target, peer, site) is the kernel's bounded wait
 * (SPIN_OK or a failure already recorded); a failed wait returns false,
 * uniformly over the block, and the kernel leaves. The last step verifies
 * the call's agreement words and advances the epoch. */
#ifndef WEFT_FUSED_TWOSHOT_CUH
#define WEFT_FUSED_TWOSHOT_CUH

#include "common.cuh"

extern "C" {
#include "coll/fusion_internal.h"
}

namespace wf {

template <int W, typename Wait, typename Push, typename Own, typename Pull>
__device__ __forceinline__ bool fused_twoshot_ranges(const wf_fused_args &a, const SpinEnv &env,
                                                     wf_fused_state *st, uint32_t E, size_t slot,
                                                     Wait wait, Push push, Own own, Pull pull) {
  char *const local = (char *)a.peer[a.rank];
  const uint32_t par = E & 1u;
  const int rank = a.rank, tid = threadIdx.x;
  /* flags[par][phase][block][sender] in the receiver's workspace */
  auto flag = [&](const void *base, int phase, int sender) {
    return flag_in((char *)base + a.off_flags, par, phase, blockIdx.x, sender);
  };

  /* 1. reduce-scatter push: my rows of range p into p's RS inbox slot [rank] */
#pragma unroll 1
  for (int i = 1; i < W; i++) {
    const int p = (rank + i) % W;
    const int ps = range_start(p, a.tokens, W), pn = range_start(p + 1, a.tokens, W) - ps;
    char *const dst = (char *)a.peer[p] + a.off_rs + (size_t)rank * slot;
    for (int r = blockIdx.x; r < pn; r += gridDim.x) push(dst, ps + r, r);
  }
  if (!(a.flags & WF_FUSED_TRIGGER_AT_END)) pdl_launch_dependents();
  __syncthreads(); /* every push of the block precedes the release below */
  if (tid < W && tid != rank) st_release_sys(flag(a.peer[tid], 0, rank), flag_value(E, 1));
  bool fail = tid < W && tid != rank &&
              wait(flag(local, 0, tid), flag_value(E, 1), (uint32_t)tid, WF_FUSED_SITE_RS) != SPIN_OK;
  if (__syncthreads_or(fail)) return false;

  /* 2. own rows */
  const int ms = range_start(rank, a.tokens, W), mn = range_start(rank + 1, a.tokens, W) - ms;
  int parity = 0;
  for (int r = blockIdx.x; r < mn; r += gridDim.x, parity ^= 1) own(ms + r, r, parity);
  __syncthreads();
  if (tid < W && tid != rank) st_release_sys(flag(a.peer[tid], 1, rank), flag_value(E, 2));

  /* 3. the peers' rows */
#pragma unroll 1
  for (int i = 1; i < W; i++) {
    const int p = (rank + W - i) % W;
    fail = tid == 0 && wait(flag(local, 1, p), flag_value(E, 2), (uint32_t)p, WF_FUSED_SITE_AG) != SPIN_OK;
    if (__syncthreads_or(fail)) return false;
    const int ps = range_start(p, a.tokens, W), pn = range_start(p + 1, a.tokens, W) - ps;
    for (int r = blockIdx.x; r < pn; r += gridDim.x, parity ^= 1) pull(p, ps + r, r, parity);
  }
  __syncthreads();
  agree_verify(env, WF_FUSED_SITE_AGREE);
  epoch_advance(st->flag_epoch, E);
  if (a.flags & WF_FUSED_TRIGGER_AT_END) pdl_launch_dependents();
  return true;
}

}  // namespace wf

#endif
