/* cluster.cuh — distributed shared memory between the blocks of a cluster
 * (sm_90): the cluster barrier, remote shared-memory stores, and st.async
 * on transaction barriers; a block's own bulk-copy pipeline. Shared by the fused all-reduce + norm kernels
 * (kernels/fused_norm_kernels.cuh) and the local MoE reduction
 * (kernels/moe_reduce.cu), whose rows may be split over a cluster.
 * Below sm_90 every helper compiles to nothing (no cluster launches there). */
#pragma once

#include <stdint.h>

#include "common.cuh"

namespace wf {

__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
/* Store v at the same shared-memory offset as p in block `rank` of the cluster. */
__device__ __forceinline__ void st_shared_cluster(const void *p, uint32_t rank, uint2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t local = (uint32_t)__cvta_generic_to_shared(p);
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};" ::"r"(remote), "r"(v.x), "r"(v.y)
               : "memory");
#endif
}

/* Distributed shared memory with transaction barriers (sm_90): a block's
 * mbarrier completes its phase once its own thread 0 arrived (announcing
 * the bytes it expects) and that many bytes of st.async stores from the
 * cluster landed. Unlike barrier.cluster.arrive.release, nothing orders
 * this block's earlier global or NVLink stores: the exchange costs a
 * shared-memory round trip, not a flush. */
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t *m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(m)) : "memory");
#endif
}
/* makes the inits visible to the cluster before barrier.cluster.arrive.relaxed */
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_expect(uint64_t *m, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
               ::"r"(smem_addr(m)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ bool mbar_done(uint64_t *m, uint32_t parity) {
  uint32_t ok = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
               " selp.u32 %0, 1, 0, p; }"
               : "=r"(ok) : "r"(smem_addr(m)), "r"(parity) : "memory");
#endif
  return ok != 0;
}
/* v to the same offset as p in block `rank`, completing 8 bytes there on
 * the mbarrier at the same offset as m */
__device__ __forceinline__ void st_async_cluster(const void *p, const uint64_t *m, uint32_t rank, uint2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t rp, rm;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rp) : "r"(smem_addr(p)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rm) : "r"(smem_addr(m)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.u32 [%0], {%1, %2}, [%3];"
               ::"r"(rp), "r"(v.x), "r"(v.y), "r"(rm) : "memory");
#endif
}

/* A block's own pipeline (no cluster needed): mbarriers with several
 * arrivals, and bulk copies (the TMA unit) from global into this block's
 * shared memory completing their bytes on an mbarrier: many kilobytes in
 * flight for one instruction and no registers. */
__device__ __forceinline__ void mbar_init_n(uint64_t *m, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(m)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t *m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(smem_addr(m)) : "memory");
#endif
}
/* spins until the phase of parity `parity` of m completed (acquire, CTA scope) */
__device__ __forceinline__ void mbar_wait(uint64_t *m, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t ok = 0;
  while (!ok)
    asm volatile("{ .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(smem_addr(m)), "r"(parity) : "memory");
#endif
}
/* bytes (a multiple of 16; both addresses 16-byte aligned) from global src
 * to this block's shared dst, completing on m */
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, uint32_t bytes, uint64_t *m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(m)) : "memory");
#endif
}

}  // namespace wf
