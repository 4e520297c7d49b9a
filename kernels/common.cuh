/* common.cuh — device helpers shared by weft's kernels (allreduce.cu,
 * fused_norm.cu, ...): 16-byte vectors, packed bf16/f16 <-> f32 math,
 * system-scope flags, %globaltimer, and the bounded spin every cross-GPU wait
 * goes through.  Header-only; everything lives in namespace wf.
 *
 * ======================= the epoch / flag protocol =======================
 * Every rank owns one workspace (a VMM allocation mapped into every peer of
 * the group, src/cuda/vmm.c).  Peers PUSH into it (remote stores over NVLink) and
 * each rank POLLS only its own, local copy: a wait never crosses the link.
 *
 * Epoch.  A call's epoch E lives in device memory (never a host scalar baked
 * into a CUDA graph), one copy per block slot: epoch[0..WF_MAX_GRID).
 * Block b reads epoch[b] at entry; at exit (after a __syncthreads that
 * follows every read) block b writes E+1 into epoch[b], epoch[b+G],
 * epoch[b+2G], ... (G = gridDim.x).  Each slot has exactly one writer per
 * call, no slot is read after it is written within a call, and every slot
 * holds E+1 afterwards, so the grid may change from call to call and all
 * blocks still agree on E.  All ranks make the same sequence of calls with
 * the same grid (a deterministic function of count, dtype and algorithm), so
 * E is the same number on every rank without talking about it.
 *
 * E counts calls modulo kEpochWrap = 3 * 2^30 (a multiple of 2 and 3, so
 * E & 1 and E % 3 keep alternating across the wrap).
 *
 * Flags.  A flag is a 64-bit word in the receiver's workspace, indexed
 * [parity = E & 1][phase][block][sender].  The sender writes
 * ((E + 1) << 32 | step) with st.release.sys after a __syncthreads that
 * follows the block's data stores (bar.sync + release is cumulative, so the
 * other threads' stores are ordered before the flag); the receiver waits
 * with ld.acquire.sys until the flag's epoch word EQUALS E + 1 and its step
 * is at least the awaited one, then __syncthreads, then reads the data.
 * Equality (not "greater") because a slot may hold 0 (never written) or a
 * value from call E - 2: neither may pass, whatever E is.  Steps only grow
 * within a call, so "at least" tolerates a sender that is further along.
 * (allreduce.cu also resets each slot to 0 after its last wait of a call, so
 * a slot never holds anything older than the current call.)
 *
 * Alternation (why two flag/data sets are enough).  A sender writes set
 * s = E & 1 in call E.  It can next touch set s in call E + 2, which it can
 * only start after its call E + 1 finished, which needed every peer's
 * call-(E + 1) flags, which each peer sends only after its own call E ended
 * (stream order).  So a fast peer never overwrites a slow peer's pending flag
 * or data: at most one call of skew, and that call uses the other set.
 *
 * Lamport buffers (latency path).  Three buffers, index E % 3, filled with
 * the sentinel word 0x80008000 (below): a sender stores data directly, and
 * the receiver polls each 16-byte vector until no word is the sentinel (the
 * data is its own flag: no fence, one NVLink trip).  bf16/f16 inputs equal
 * to -0.0 are stored as +0.0 on every rank.  Call
 * E clears buffer (E - 1) % 3 (it consumed every element of it in call E - 1,
 * and no peer writes it again before call E + 2, which needs this rank's call
 * E + 1 data); the byte count each call used is recorded per buffer in device
 * memory so the next call knows how much to clear.
 *
 * Bounded waits.  Every spin goes through wf::bounded_spin: it polls the
 * predicate, and from time to time a %globaltimer deadline, a host-mapped
 * abort word and the device error word (so once one block failed, the rest
 * leave quickly).  A failed wait writes one packed 64-bit error (status,
 * late peer, site, epoch) into the device error word (first writer wins) and
 * mirrors it into a host-mapped word the host reads without synchronising;
 * the kernel then returns.  A dead or late peer becomes WEFT_ETIMEOUT /
 * WEFT_EABORT on the host, never a hang.  After an error the workspace state
 * is undefined: the owner must be destroyed and created again.
 * ========================================================================= */
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

extern "C" {
#include "coll/limits.h"
#include "coll/agree.h"
}


namespace wf {

/* ---------------------------------------------------------------- vectors */

/* Elements of T in one 16-byte vector. */
template <typename T> struct VecN { static constexpr int N = 16 / (int)sizeof(T); };

__device__ __forceinline__ uint4 ld_vec(const void *p) {   /* plain, may hit L1 */
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
/* L2 only: for data other GPUs wrote during this kernel (L1 is not coherent). */
__device__ __forceinline__ uint4 ld_vec_cg(const void *p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
/* Re-read every time (polling data that is its own flag). */
__device__ __forceinline__ uint4 ld_vec_volatile(const void *p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_vec(void *p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
/* Streaming store: data not re-read by this kernel (evict-first). */
__device__ __forceinline__ void st_vec_cs(void *p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_vec_volatile(void *p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

/* Tail vectors: only the first n (< N) elements exist in memory. Missing
 * lanes read as +0 (all-zero bits); stores write only the n present ones. */
template <typename T>
__device__ __forceinline__ uint4 ld_vec_partial(const T *p, int n) {
  union { uint4 u; T e[VecN<T>::N]; } r;
  r.u = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int i = 0; i < VecN<T>::N; i++)
    if (i < n) r.e[i] = p[i];
  return r.u;
}
template <typename T>
__device__ __forceinline__ void st_vec_partial(T *p, uint4 v, int n) {
  union { uint4 u; T e[VecN<T>::N]; } r;
  r.u = v;
#pragma unroll
  for (int i = 0; i < VecN<T>::N; i++)
    if (i < n) p[i] = r.e[i];
}

/* ------------------------------------------- packed math (f32 accumulation) */

template <typename T> struct Pack;

template <> struct Pack<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void to_f32(uint4 v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 from_f32(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]),
                      __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

template <> struct Pack<__nv_bfloat16> {
  static constexpr int N = 8;
  static __device__ __forceinline__ float2 w2f(uint32_t w) {
    /* bf16 -> f32 is a shift: exact, and cheaper than the intrinsic path */
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ uint32_t f2w(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b); /* round to nearest even */
    return *reinterpret_cast<uint32_t *>(&h);
  }
  static __device__ __forceinline__ void to_f32(uint4 v, float (&f)[8]) {
    float2 t;
    t = w2f(v.x); f[0] = t.x; f[1] = t.y;
    t = w2f(v.y); f[2] = t.x; f[3] = t.y;
    t = w2f(v.z); f[4] = t.x; f[5] = t.y;
    t = w2f(v.w); f[6] = t.x; f[7] = t.y;
  }
  static __device__ __forceinline__ uint4 from_f32(const float (&f)[8]) {
    return make_uint4(f2w(f[0], f[1]), f2w(f[2], f[3]), f2w(f[4], f[5]), f2w(f[6], f[7]));
  }
};

template <> struct Pack<__half> {
  static constexpr int N = 8;
  static __device__ __forceinline__ float2 w2f(uint32_t w) {
    __half2 h = *reinterpret_cast<__half2 *>(&w);
    return __half22float2(h);
  }
  static __device__ __forceinline__ uint32_t f2w(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
  }
  static __device__ __forceinline__ void to_f32(uint4 v, float (&f)[8]) {
    float2 t;
    t = w2f(v.x); f[0] = t.x; f[1] = t.y;
    t = w2f(v.y); f[2] = t.x; f[3] = t.y;
    t = w2f(v.z); f[4] = t.x; f[5] = t.y;
    t = w2f(v.w); f[6] = t.x; f[7] = t.y;
  }
  static __device__ __forceinline__ uint4 from_f32(const float (&f)[8]) {
    return make_uint4(f2w(f[0], f[1]), f2w(f[2], f[3]), f2w(f[4], f[5]), f2w(f[6], f[7]));
  }
};

/* acc[i] = v[i] (first term) / acc[i] += v[i]: f32 accumulation. */
template <typename T>
__device__ __forceinline__ void acc_set(float (&acc)[Pack<T>::N], uint4 v) { Pack<T>::to_f32(v, acc); }
template <typename T>
__device__ __forceinline__ void acc_add(float (&acc)[Pack<T>::N], uint4 v) {
  float f[Pack<T>::N];
  Pack<T>::to_f32(v, f);
#pragma unroll
  for (int i = 0; i < Pack<T>::N; i++) acc[i] += f[i];
}

/* ------------------------------------- RMSNorm's sum of squares, one order
 * The one tree over a row's hidden dimension that kernels/fused_norm.cu and
 * the deterministic kernel of kernels/norm.cu both follow, so their norms
 * agree bit for bit whatever their grids: (1) per 16-byte vector, elements
 * in order (vec_sumsq); (2) per chunk of 32 consecutive vectors, a warp's
 * xor butterfly with lane l holding vector 32 c + l (warp_xor_sum: the same
 * bits in every lane); (3) over the chunk partials, lane l adds chunks
 * l, l + 32, ... in order, then a butterfly.  A vector past the row's end
 * contributes +0 (exact).  Nothing here depends on tokens, blocks, clusters
 * or threads per row. */
template <typename T> __device__ __forceinline__ float vec_sumsq(uint4 yv) {
  float y[Pack<T>::N];
  Pack<T>::to_f32(yv, y);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < Pack<T>::N; e++) s += y[e] * y[e];
  return s;
}
__device__ __forceinline__ float warp_xor_sum(float s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

/* ------------------------------------------------- Lamport sentinel helpers
 * "Not yet written" is the 32-bit word 0x80008000 in every dtype (two -0.0
 * halves for bf16/f16, a negative f32 denormal), so one buffer serves calls
 * of any dtype and is cleared without knowing the next call's dtype.  A
 * 32-bit aligned word is single-copy atomic, so a word is either the
 * sentinel or the peer's data, never half of each.  Senders sanitise:
 * bf16/f16 lanes equal to -0.0 become +0.0 (DESIGN.md §5); the f32 denormal
 * 0x80008000 becomes -0.0 (f32 keeps the sign of zero).  Every rank uses the
 * sanitised value for its own term too, so results stay identical. */
constexpr uint32_t kLamportEmpty = 0x80008000u;

__device__ __forceinline__ uint4 lamport_empty_vec() {
  return make_uint4(kLamportEmpty, kLamportEmpty, kLamportEmpty, kLamportEmpty);
}
/* True while any word of v is still the sentinel. */
__device__ __forceinline__ bool lamport_pending(uint4 v) {
  return (v.x == kLamportEmpty) | (v.y == kLamportEmpty) | (v.z == kLamportEmpty) |
         (v.w == kLamportEmpty);
}
template <typename T> __device__ __forceinline__ uint32_t lamport_sanitize_word(uint32_t w) {
  if (sizeof(T) == 4) return w == kLamportEmpty ? 0x80000000u : w;
  uint32_t lo = w & 0xffffu, hi = w >> 16;
  lo = lo == 0x8000u ? 0u : lo;
  hi = hi == 0x8000u ? 0u : hi;
  return lo | (hi << 16);
}
template <typename T> __device__ __forceinline__ uint4 lamport_sanitize(uint4 v) {
  return make_uint4(lamport_sanitize_word<T>(v.x), lamport_sanitize_word<T>(v.y),
                    lamport_sanitize_word<T>(v.z), lamport_sanitize_word<T>(v.w));
}

/* ------------------------------------------- system-scope flags and fences */

__device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

/* Nanoseconds, shared by all SMs of the GPU (coarse ticks: ~1 us or finer). */
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* ------------------------------------------------------ errors and spinning */

enum : uint32_t {
  SPIN_OK = 0,
  SPIN_ABORT = 1,    /* the host set the abort word */
  SPIN_TIMEOUT = 2,  /* deadline passed: the awaited peer is dead or late */
  SPIN_FAILED = 3    /* another block already failed: leave quietly */
};

/* Packed error word: [63:56] status, [55:48] peer (0xff unknown),
 * [47:40] site (which wait), [39:32] reserved, [31:0] epoch.  Host side:
 * src/coll/allreduce.c decodes the same layout. */
__host__ __device__ __forceinline__ uint64_t err_pack(uint32_t status, uint32_t peer,
                                                      uint32_t site, uint32_t epoch) {
  return ((uint64_t)(status & 0xff) << 56) | ((uint64_t)(peer & 0xff) << 48) |
         ((uint64_t)(site & 0xff) << 40) | (uint64_t)epoch;
}

/* What a kernel needs to bound its waits; passed by value as a kernel
 * argument (pointers and constants only: graph-replay safe). */
struct SpinEnv {
  const uint32_t *abort_host;       /* host-mapped; nonzero = abort (may be NULL) */
  unsigned long long *err_dev;      /* device memory; first failure wins */
  unsigned long long *err_host;     /* host-mapped mirror of err_dev (may be NULL) */
  uint64_t timeout_ns;              /* per wait */
  wf_agree ag;                      /* the call's agreement (src/coll/agree.h); area NULL: none */
};

/* A slow wait's look at the agreement slots (src/coll/agree.h): SPIN_OK, or
 * WF_SPIN_MISMATCH / WF_SPIN_PEER_FAILED with the peer, and for a mismatch
 * the call number and both descriptors (mine, theirs) in desc[4]. A peer's
 * failure: site becomes its status, epoch the rank it named, with this
 * rank's own wait site (site on entry) above it, so that the report names
 * the operation this rank was in. */
__device__ __forceinline__ uint32_t agree_check(const SpinEnv &env, uint32_t &peer, uint32_t &site,
                                                uint32_t &epoch, uint64_t (&desc)[4]) {
  const uint64_t *row = &env.ag.area->slot[0][0];
  const uint64_t mw = ld_relaxed_sys(row + env.ag.me * 4);
#pragma unroll 1
  for (int p = 0; p < env.ag.world; p++) {
    if (p == env.ag.me) continue;
    const uint64_t pw = ld_relaxed_sys(row + p * 4);
    const uint32_t pc = (uint32_t)(pw >> 32);
    if (pc == WF_AGREE_FAILED) { /* the peer gave up: its status and the rank it named */
      peer = (uint32_t)p;
      epoch = ((uint32_t)pw & 0xff) | ((site & 0xff) << 8);
      site = (uint32_t)(pw >> 8) & 0xff;
      return WF_SPIN_PEER_FAILED;
    }
    if (pc != 0 && pc == (uint32_t)(mw >> 32) && (uint32_t)pw != (uint32_t)mw) {
      peer = (uint32_t)p;
      epoch = pc;
      desc[0] = ld_relaxed_sys(row + env.ag.me * 4 + 1);
      desc[1] = ld_relaxed_sys(row + env.ag.me * 4 + 2);
      desc[2] = ld_relaxed_sys(row + p * 4 + 1);
      desc[3] = ld_relaxed_sys(row + p * 4 + 2);
      return WF_SPIN_MISMATCH;
    }
  }
  return SPIN_OK;
}

/* Record the first failure (device word by CAS, then the host mirror: for a
 * mismatch both descriptors first, in the four words after the error word),
 * and mark this rank failed in every peer's agreement slot for it (so they
 * stop waiting for it now, not at their deadline). */
__device__ __forceinline__ void report_error(const SpinEnv &env, uint32_t status,
                                             uint32_t peer, uint32_t site, uint32_t epoch,
                                             const uint64_t *desc = nullptr) {
  if (status == SPIN_OK || status == SPIN_FAILED) return;
  unsigned long long e = err_pack(status, peer, site, epoch);
  if (atomicCAS(env.err_dev, 0ull, e) == 0ull) {
    if (env.err_host) {
      if (desc)
        for (int i = 0; i < 4; i++)
          asm volatile("st.volatile.global.u64 [%0], %1;" :: "l"(env.err_host + 1 + i), "l"(desc[i]) : "memory");
      asm volatile("st.volatile.global.u64 [%0], %1;" :: "l"(env.err_host), "l"(e) : "memory");
      __threadfence_system();
    }
    if (env.ag.area) {
      /* the rank this failure names: the peer, or for a peer's failure the one it named */
      const uint32_t named = status == WF_SPIN_PEER_FAILED ? epoch & 0xff : peer;
      const uint64_t mark = ((uint64_t)WF_AGREE_FAILED << 32) | ((uint64_t)(status & 0xff) << 8) | (named & 0xff);
      for (int p = 0; p < env.ag.world; p++)
        if (p != env.ag.me)
          st_relaxed_sys(reinterpret_cast<uint64_t *>(env.ag.area->peer_row[p]) + env.ag.me * 4, mark);
    }
  }
}

/* Block 0 of every kernel on an agreed workspace, after pdl_wait
 * (the previous call on this stream is complete): count the call and write
 * its announcement into every rank's slot for this rank. */
__device__ __forceinline__ void agree_announce(const wf_agree &g) {
  /* the block's last thread: not one of the threads whose flag releases
   * would then also wait for these stores */
  if (!g.area || blockIdx.x != 0 || threadIdx.x != blockDim.x - 1) return;
  const uint32_t c = g.area->calls + 1u;
  g.area->calls = c;
  uint64_t h = g.d0 * 0x9E3779B97F4A7C15ull ^ (g.d1 + 0x632BE59BD9B4E019ull);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  const uint64_t w = ((uint64_t)c << 32) | ((uint32_t)h | 1u);
#pragma unroll 1
  for (int p = 0; p < g.world; p++) {
    uint64_t *s = reinterpret_cast<uint64_t *>(g.area->peer_row[p]) + g.me * 4;
    st_relaxed_sys(s + 1, g.d0);
    st_relaxed_sys(s + 2, g.d1);
    st_relaxed_sys(s, w);
  }
}

/* Polls done() until it returns true.  The first kFast polls touch nothing
 * else (the common case finishes there); afterwards every kCheck polls it
 * reads %globaltimer (the deadline starts at the first check) and the device
 * error word, and naps between polls so that thousands of waiting threads do
 * not flood the memory system.  The host abort word is a PCIe read of one
 * host word, and such reads are serialised (~31 ns each on 2 x H200): if
 * every waiting thread read it, a call whose peer came 20 us late would last
 * threads x 31 ns and make the peer just as late next call, a self-feeding
 * slow state (measured 2026-11-30, see kernels/fused_norm.cu wait_until).  So
 * only thread 0 of a block reads it, after kHostAfterNs and then at most once
 * per kHostAfterNs: the worst burst (WF_MAX_GRID x 31 ns = 32 us) is shorter
 * than the wait that allows it.  An abort seen there is written to the
 * device error word, which every other waiting thread polls cheaply.
 * Returns SPIN_OK, or the failure after reporting it (peer/site/epoch name
 * the wait in the host's message). */
template <typename F>
__device__ __forceinline__ uint32_t bounded_spin(F done, const SpinEnv &env,
                                                 uint32_t peer, uint32_t site, uint32_t epoch) {
  constexpr int kFast = 64, kCheck = 16;
  constexpr uint64_t kSlowNs = 20000, kHostAfterNs = 100000;
#pragma unroll 1
  for (int i = 0; i < kFast; i++)
    if (done()) return SPIN_OK;
  const uint64_t t0 = globaltimer_ns();
  const bool host_reader = env.abort_host && threadIdx.x == 0;
  uint64_t next_host = kHostAfterNs;
  uint32_t nap = 32;
#pragma unroll 1
  for (;;) {
#pragma unroll 1
    for (int i = 0; i < kCheck; i++) {
      if (done()) return SPIN_OK;
      if (nap > 32) __nanosleep(nap);
    }
    const uint64_t waited = globaltimer_ns() - t0;
    uint32_t st = SPIN_OK;
    if (*(volatile unsigned long long *)env.err_dev != 0ull) st = SPIN_FAILED;
    else if (waited > env.timeout_ns) st = SPIN_TIMEOUT;
    else if (waited > kSlowNs) {
      if (host_reader && waited > next_host) {
        next_host = waited + kHostAfterNs;
        if (ld_relaxed_sys(env.abort_host) != 0u) st = SPIN_ABORT;
      }
      nap = nap < 2048 ? nap * 2 : 2048;
    }
    uint64_t desc[4];
    if (st == SPIN_OK && env.ag.area && waited > WF_AGREE_AFTER_NS)
      st = agree_check(env, peer, site, epoch, desc);
    if (st != SPIN_OK) {
      if (done()) return SPIN_OK;  /* arrived while we looked away */
      report_error(env, st, peer, site, epoch, st == WF_SPIN_MISMATCH ? desc : nullptr);
      return st;
    }
  }
}

/* The end of a call, block 0, after a __syncthreads: thread p (a peer)
 * compares p's announcement of this call with this rank's, so that calls
 * that differ yet completed (the same bytes, another dtype or reduction)
 * are reported before the host reads the output: every host wait reads the
 * error word. The peer announced before it sent anything this call has
 * received, so its slot is normally there; if it is not yet visible this
 * waits for it (bounded: site names the wait). Costs block 0 one local load
 * per peer. */
__device__ __forceinline__ void agree_verify(const SpinEnv &env, uint32_t site) {
  if (!env.ag.area || blockIdx.x != 0) return;
  const int p = (int)threadIdx.x;
  if (p >= env.ag.world || p == env.ag.me) return;
  if (*(volatile unsigned long long *)env.err_dev != 0ull) return; /* failed: said already */
  const uint64_t *row = &env.ag.area->slot[0][0];
  const uint64_t mw = ld_relaxed_sys(row + env.ag.me * 4);
  const uint32_t mc = (uint32_t)(mw >> 32);
  uint64_t pw = 0;
  const uint32_t st = bounded_spin(
      [&] {
        pw = ld_relaxed_sys(row + p * 4);
        const uint32_t pc = (uint32_t)(pw >> 32);
        return pc == WF_AGREE_FAILED || (int32_t)(pc - mc) >= 0;
      },
      env, (uint32_t)p, site, mc);
  if (st != SPIN_OK) return;
  if ((uint32_t)(pw >> 32) == WF_AGREE_FAILED) { /* the peer gave up: its announcement is gone */
    report_error(env, WF_SPIN_PEER_FAILED, (uint32_t)p, (uint32_t)(pw >> 8) & 0xff,
                 ((uint32_t)pw & 0xff) | ((site & 0xff) << 8));
    return;
  }
  if ((uint32_t)(pw >> 32) == mc && (uint32_t)pw != (uint32_t)mw) {
    const uint64_t desc[4] = {ld_relaxed_sys(row + env.ag.me * 4 + 1), ld_relaxed_sys(row + env.ag.me * 4 + 2),
                              ld_relaxed_sys(row + p * 4 + 1), ld_relaxed_sys(row + p * 4 + 2)};
    report_error(env, WF_SPIN_MISMATCH, (uint32_t)p, site, mc, desc);
  }
}

/* Wait until the 64-bit flag at p holds target's epoch word and at least
 * its step (see "Flags" above: equal epoch, so 0 and older calls never pass). */
__device__ __forceinline__ uint32_t wait_flag_geq(const uint64_t *p, uint64_t target,
                                                  const SpinEnv &env, uint32_t peer,
                                                  uint32_t site, uint32_t epoch) {
  return bounded_spin(
      [&] {
        const uint64_t v = ld_acquire_sys(p);
        return (v >> 32) == (target >> 32) && (uint32_t)v >= (uint32_t)target;
      },
      env, peer, site, epoch);
}
__device__ __forceinline__ uint32_t wait_flag_geq(const uint32_t *p, uint32_t target,
                                                  const SpinEnv &env, uint32_t peer,
                                                  uint32_t site, uint32_t epoch) {
  return bounded_spin([&] { return (int32_t)(ld_acquire_sys(p) - target) >= 0; },
                      env, peer, site, epoch);
}

/* Flag value for (epoch, step): step counts 1.. within a call; the epoch
 * word E + 1 is never 0 (E < kEpochWrap). */
__device__ __forceinline__ uint64_t flag_value(uint32_t epoch, uint32_t step) {
  return ((uint64_t)(epoch + 1u) << 32) | (uint64_t)step;
}

/* ------------------------------------------ programmatic dependent launch
 * pdl_wait: returns once the previous kernel in the stream has completed and
 * its memory is visible (a no-op when launched without the PDL attribute),
 * so everything the protocol assumes about kernel order still holds after
 * it.  pdl_launch_dependents: lets the next kernel's blocks be scheduled
 * (they then sit in their own pdl_wait), hiding its launch latency. */
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* ---------------------------------------------------------------- epochs */

/* E for this call (see the protocol above); all threads may call it. */
__device__ __forceinline__ uint32_t epoch_load(const uint32_t *epochs) {
  return *(volatile const uint32_t *)&epochs[blockIdx.x];
}
/* Epochs wrap here: divisible by 2 (flag/data parity) and 3 (Lamport
 * buffers), and E + 1 fits the flag's epoch word without reaching 0. */
constexpr uint32_t kEpochWrap = 3u << 30;

/* Call once per block at exit, after a __syncthreads that follows every
 * epoch_load of this block: every slot this block owns becomes E + 1
 * (mod kEpochWrap). */
__device__ __forceinline__ void epoch_advance(uint32_t *epochs, uint32_t e) {
  const uint32_t next = e + 1u == kEpochWrap ? 0u : e + 1u;
  for (uint32_t i = blockIdx.x + threadIdx.x * gridDim.x; i < WF_MAX_GRID;
       i += blockDim.x * gridDim.x)
    epochs[i] = next;
}

/* ---------------------------------------------------------------- launch */

/* ------------------------------------------------- grids (host side) */
inline uint64_t cdiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

/* Fewest blocks (at most cap) that take the same number of rounds as cap
 * blocks would: every block gets ceil or floor of the same share, so the
 * last wave is not a few stragglers. */
inline uint64_t balanced(uint64_t chunks, uint64_t cap) {
  if (chunks == 0) return 1;
  const uint64_t g0 = chunks < cap ? chunks : cap;
  return cdiv(chunks, cdiv(chunks, g0));
}

/* Blocks of kernel that fit on an SM at `threads` per block, cached in
 * *slot (one slot per kernel and block size). Grids are capped to what is
 * co-resident, so no block waits for a peer block that cannot be scheduled
 * until it finishes. Same binary, same GPUs: same cap on every rank. */
template <typename K> int resident(K kernel, int threads, int *slot) {
  if (*slot <= 0) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = 1;
    }
    *slot = n;
  }
  return *slot;
}

/* One launch; with pdl set, as a programmatic dependent launch (its blocks
 * may be scheduled before the previous kernel on the stream ends: they wait
 * in pdl_wait above). */
template <typename... KP, typename... AP>
inline cudaError_t launch_pdl(void (*kernel)(KP...), dim3 grid, dim3 block, cudaStream_t s, bool pdl,
                              AP &&...args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = s;
  if (pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<AP &&>(args)...);
}

/* The flag rows every workspace keeps (the all-reduce's, the fused
 * kernels'): one 64-bit flag per (call parity, phase, block, sender), in the
 * receiver's workspace from `rows` on. */
#define WF_FLAG_INDEX(par, phase, block, sender) \
  (((size_t)((par) * 2 + (phase)) * WF_MAX_GRID + (block)) * WF_MAX_WORLD + (sender))
template <typename B>   /* int, or blockIdx.x's unsigned as it is */
__device__ __forceinline__ uint64_t *flag_in(char *rows, uint32_t par, int phase, B block, int sender) {
  return reinterpret_cast<uint64_t *>(rows) + WF_FLAG_INDEX(par, phase, block, sender);
}

/* The first token of rank p's range when `tokens` rows are split over W
 * ranks as evenly as they go (the fused two-shots' reduce-scatter split). */
__device__ __forceinline__ int range_start(int p, int tokens, int W) {
  return (int)((int64_t)p * tokens / W);
}

}  // namespace wf
