/* fused_norm_kernels.cuh — all-reduce fused with residual add + RMSNorm (+ FP8 quant).
 *
 * Two kernels over one workspace per rank (layout: src/coll/fusion_internal.h,
 * protocol: kernels/common.cuh):
 *
 * One-shot (latency, Lamport). Every block pushes its rows of this rank's
 * input into slot [rank] of buffer E % 3 in every peer (16-byte remote
 * stores, sanitised so no word equals the "not yet written" sentinel
 * 0x80008000 = two -0.0 halves; bf16/f16 -0.0 is stored as +0.0), clears
 * buffer (E + 2) % 3 (= the one call E - 1 consumed; its size is in
 * state.lamport_bytes), then polls its own buffer until no word of a vector
 * is the sentinel (the data is its own flag, no barrier). Only one-shot
 * calls advance lamport_epoch.
 *
 * Two-shot (bandwidth). Tokens are split in W contiguous ranges; rank p owns
 * range p. Reduce-scatter: each block pushes its rows of range p to p's RS
 * inbox, flags (release.sys), waits for the peers' flags; the owner sums its
 * rows, adds the residual, rounds: y = residual_out (AR pattern: y = sum),
 * writes y locally and pushes it to every peer's AG inbox, flags; every rank
 * then copies the peers' y rows into residual_out (out) and normalises them.
 * Each direction of a link carries (W-1)/W of the tensor twice — the bytes
 * of one all-reduce, whatever the norm adds. Only two-shot calls advance
 * flag_epoch. One data set suffices (unlike the plain all-reduce's two): a
 * peer writes our RS inbox of call E+1 only after our AG flag of call E
 * (sent after we read the RS inbox), and our AG inbox only after our RS flag
 * of call E+1 (sent after we read the AG inbox of call E).
 *
 * Numbers. Both kernels sanitise the inputs alike (bf16/f16 -0.0 -> +0.0;
 * the two-shot too, though it needs no sentinel), sum the ranks in rank
 * order (f32, or the input precision without FP32_ACC), add the residual in
 * f32, round once: y = residual_out; and normalise y itself (the contract of
 * weft_cuda_rmsnorm: the norm of residual_out). The sum of squares has ONE
 * order whatever the grid: per 16-byte vector (elements in order), per chunk
 * of 32 consecutive vectors (a warp's xor butterfly), then the chunk
 * partials (lane l adds chunks l, l+32, ... in order, then a butterfly).
 * So every rank gets bit-equal outputs, one-shot (any cluster size) and
 * two-shot agree bit for bit, and switching algorithm or geometry with the
 * size never changes the numbers. The weight is w = gamma + (-0.0) (the
 * identity, so a -0.0 weight keeps its sign, as in y * rstd * gamma), or
 * gamma + 1 with GEMMA.
 *
 * One-shot geometry. A row may be split over a cluster of C blocks (C = 1,
 * 2, 4, 8; blocks q*C .. q*C+C-1 serve rows q, q+Q, ...): at a few tokens
 * one SM per row would push and poll the whole row by itself, while the
 * plain all-reduce spreads the same bytes over several SMs. Each block
 * pushes, polls and normalises its slice; the chunk partials go to every
 * block of the cluster by st.async, each completing 8 bytes on the
 * receiver's transaction barrier (mbarrier, one per row parity), which the
 * receiver waits on: no cluster-wide barrier, and nothing waits for this
 * block's global or NVLink stores to be flushed (barrier.cluster with
 * release semantics did; residual_out of the kept vectors is stored only
 * after the exchange as well). Each block arrives on barrier.cluster after
 * its first pushes (and after its mbarrier inits and their fence) and waits
 * on it after its first poll, just before its first remote store (a block
 * must have started, and initialised its barriers, before its shared memory
 * is written; neither side of that barrier delays the pushes the peer waits
 * for, and its latency hides behind the poll); a block finishes a row
 * only after every sibling's partials for it landed, so none exits while a
 * sibling may still write into it. A sibling a row ahead writes the other
 * parity's buffer, and cannot be two rows ahead (that needs this block's
 * partials of the row in between). A wait that fails is ORed into the
 * partials (a flag beside each), so all blocks of a cluster see the failure
 * at the same row and leave together; every block sends its partials of
 * every row it starts, so a receiver's wait ends once its siblings' own
 * (bounded) waits are over. The early exit of a
 * poisoned workspace is cluster-uniform because the error word changes
 * only through this grid's own timeouts (>= 20 us after its co-scheduled
 * blocks started) and pdl_wait precedes the read. The AR pattern needs
 * no reduction: its blocks are grouped the same way, without a cluster.
 *
 * Every 16-byte vector is read and written by the same thread in every
 * phase (two-shot: row i of a range -> block i mod G), so in-place calls
 * (out == in, residual_out == residual, norm_out == in) are safe.
 *
 * Waits: wait_until below (deadline and device error word per thread, the
 * host-mapped abort word at most once per block per 100 us: see there why
 * not wf::bounded_spin); a failure makes the block skip its remaining work
 * and return without advancing its epoch (the workspace is then poisoned:
 * every later launch returns at once, the host reports the packed error).
 * No block waits for another block of its own grid but those of its cluster
 * (co-scheduled by the hardware), and the grid is at most what is resident
 * (clusters: as cudaOccupancyMaxActiveClusters counts them), so the blocks a
 * peer waits for are always running. Across ranks the one-shot pairs no
 * blocks at all (its data are indexed by row), the two-shot pairs block b
 * with the peers' block b.
 *
 * Programmatic dependent launch: every kernel starts with
 * griddepcontrol.wait (a no-op without the PDL launch attribute), so it may
 * be launched before its predecessor ends. trigger_completion_at_end = 0:
 * each block executes griddepcontrol.launch_dependents at once (one-shot:
 * right after its own griddepcontrol.wait, as the plain all-reduce does;
 * two-shot: after its pushes), so the next kernel in the stream is
 * scheduled (and runs its prologue up to its own wait) while we wait for
 * peers; = 1: only after the block's last store. Either way the dependent's griddepcontrol.wait sees
 * all of this kernel's writes (it waits for the whole grid to complete and
 * flush); only the overlap differs.
 *
 * This header holds the kernels (device code only); the build writes one
 * translation unit per dtype and mode (f32: and algorithm, and for the
 * one-shot a range of worlds; mk/kernel_units.mk: WF_FUSED_UNIT and
 * WF_FUSED_ALGO_UNIT below) that instantiates those kernels and exports its
 * pick function, so that nvcc compiles them in parallel (one file of all 84
 * took most of a GPU build's wall time);
 * kernels/fused_norm.cu keeps the host side (geometry, occupancy, launch,
 * init). */
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "cluster.cuh"
#include "fused_twoshot.cuh"
#include "coll/fusion_internal.h"
#include "weft.h"

namespace {

using namespace wf;
static_assert(WF_MAX_GRID == WF_MAX_GRID, "epoch slots / flag rows disagree");

/* Elements per 16-byte vector; threads per block at most MAXT (f32 gets 512
 * so that its 128-register budget holds a 16384-wide row without spills;
 * so does the one-shot with more than 2 ranks, whose state does not fit
 * the 64 registers of a 1024-thread block); VMAX vectors per thread cover
 * hidden 16384. */
template <typename T, int LB = 1024> struct Geo {
  static constexpr int EPV = 16 / (int)sizeof(T);
  static constexpr int MAXT = sizeof(T) == 4 ? 512 : LB;
  static constexpr int VMAX = WF_FUSED_MAX_HIDDEN / EPV / MAXT;
  /* residual_out vectors a thread keeps in registers between the sum and
   * the norm (the first; for wider rows it reads back its own store, an L1/L2
   * hit): this keeps every instantiation within its register budget with no
   * spills (check: make fusion-ptxas BUILD=...) */
  static constexpr int YK = 1;
  /* chunk partials (32 vectors each) of the longest row */
  static constexpr int NCMAX = WF_FUSED_MAX_HIDDEN / EPV / 32;
};
template <typename T, int W> using OneGeo = Geo<T, W <= 2 ? 1024 : 512>;
/* y[k] if kept, else the thread's own earlier store of it at p */
template <int YK>
__device__ __forceinline__ uint4 kept(const uint4 (&y)[YK], int k, const void *p) {
  return k < YK ? y[k < YK ? k : 0] : ld_vec(p);
}

/* a + b in the input precision (fp32_acc off), lane by lane. */
template <typename T> __device__ __forceinline__ uint32_t add_lowp_w(uint32_t a, uint32_t b);
template <> __device__ __forceinline__ uint32_t add_lowp_w<__nv_bfloat16>(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hadd2(*reinterpret_cast<__nv_bfloat162 *>(&a),
                             *reinterpret_cast<__nv_bfloat162 *>(&b));
  return *reinterpret_cast<uint32_t *>(&r);
}
template <> __device__ __forceinline__ uint32_t add_lowp_w<__half>(uint32_t a, uint32_t b) {
  __half2 r = __hadd2(*reinterpret_cast<__half2 *>(&a), *reinterpret_cast<__half2 *>(&b));
  return *reinterpret_cast<uint32_t *>(&r);
}
template <> __device__ __forceinline__ uint32_t add_lowp_w<float>(uint32_t a, uint32_t b) {
  return __float_as_uint(__uint_as_float(a) + __uint_as_float(b));
}
template <typename T> __device__ __forceinline__ uint4 add_lowp(uint4 a, uint4 b) {
  return make_uint4(add_lowp_w<T>(a.x, b.x), add_lowp_w<T>(a.y, b.y),
                    add_lowp_w<T>(a.z, b.z), add_lowp_w<T>(a.w, b.w));
}

/* Sum over the ranks s = 0..W-1, in rank order, into f32 (fp32_acc), or in
 * the input precision then widened. load(s) issues the load of rank s's
 * vector; ready(s, v) makes sure it is complete (one-shot: spins while a word
 * is still the Lamport sentinel) and returns false when the wait failed.
 * Vectors are fetched in chunks of at most 4 ranks (all of a chunk's loads in
 * flight at once) so that W up to 8 stays in the register budget; the order
 * of the additions does not depend on the chunking. */
template <typename T, int W, typename L, typename R>
__device__ __forceinline__ bool sum_ranks(L load, R ready, bool fp32_acc,
                                          float (&f)[Geo<T>::EPV]) {
  constexpr int C = W <= 4 ? W : (W + 1) / 2;
  uint4 t = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int s0 = 0; s0 < W; s0 += C) {
    uint4 v[C];
#pragma unroll
    for (int c = 0; c < C; c++)
      if (s0 + c < W) v[c] = load(s0 + c);
#pragma unroll
    for (int c = 0; c < C; c++) {
      if (s0 + c >= W) break;
      if (!ready(s0 + c, v[c])) return false;
      if (fp32_acc) {
        if (s0 + c == 0) acc_set<T>(f, v[c]); else acc_add<T>(f, v[c]);
      } else {
        t = s0 + c == 0 ? v[c] : add_lowp<T>(t, v[c]);
      }
    }
  }
  if (!fp32_acc) Pack<T>::to_f32(t, f);
  return true;
}

/* Deterministic mode (DET): the rank sum rounded to the dtype before the
 * residual is added, exactly as the unfused path (weft's all-reduce into
 * the dtype, then the norm kernel) computes it, so fused and unfused agree
 * bit for bit. The default keeps the f32 sum (one rounding fewer). */
template <typename T> __device__ __forceinline__ void round_sum(float (&f)[Geo<T>::EPV]) {
  Pack<T>::to_f32(Pack<T>::from_f32(f), f);
}

/* ------------------------------------------------------------- waiting */

/* Why not wf::bounded_spin (kernels/common.cuh): once a wait there is older
 * than 20 us, EVERY waiting thread reads the host-mapped abort word at every
 * check. Those reads of one host word over PCIe are serialised, ~31 ns each,
 * so a call whose peer came 20 us late lasted (waiting threads) x 31 ns
 * (65536 threads: 2 ms; 2 x H200, 2026-11-30, seven points of the table
 * matched threads x 30-33 ns); its peer then waited that long in the next
 * call and did the same: a stable slow state (0.5 GB/s) until the graph
 * replays ended. The one-shot waits in every thread, so it is exposed most.
 * Here the host word is read by at most one thread per block per
 * kHostEveryNs, and only after kHostAfterNs: the worst read burst
 * (WF_MAX_GRID x 31 ns = 32 us) is shorter than the wait that allows it, so
 * a late peer costs its lateness once and never feeds itself. The deadline
 * (%globaltimer) and the device error word stay per thread (cheap). */
constexpr uint64_t kNapAfterNs = 20000;    /* then nap between polls (up to kNapMaxNs) */
constexpr uint32_t kNapMaxNs = 1024;
constexpr uint64_t kHostAfterNs = 100000;  /* first read of the host abort word */
constexpr uint64_t kHostEveryNs = 100000;  /* then at most one per block per this */

/* The block's turn to read the host word (gate: shared, 0 at block entry). */
__device__ __forceinline__ bool host_turn(unsigned long long *gate, uint64_t now) {
  const unsigned long long next = *(volatile unsigned long long *)gate;
  return now >= next && atomicCAS(gate, next, (unsigned long long)(now + kHostEveryNs)) == next;
}

/* Polls done() until true; SPIN_OK, or the failure after reporting it. */
template <typename F>
__device__ __forceinline__ uint32_t wait_until(F done, const SpinEnv &env, unsigned long long *gate,
                                               bool old_spin, uint32_t peer, uint32_t site,
                                               uint32_t epoch) {
  constexpr int kFast = 64, kCheck = 16;
#pragma unroll 1
  for (int i = 0; i < kFast; i++)
    if (done()) return SPIN_OK;
  const uint64_t t0 = globaltimer_ns();
  uint32_t nap = 0;
#pragma unroll 1
  for (;;) {
#pragma unroll 1
    for (int i = 0; i < kCheck; i++) {
      if (done()) return SPIN_OK;
      if (nap) __nanosleep(nap);
    }
    const uint64_t now = globaltimer_ns(), waited = now - t0;
    uint32_t st = SPIN_OK;
    if (*(volatile unsigned long long *)env.err_dev != 0ull) st = SPIN_FAILED;
    else if (waited > env.timeout_ns) st = SPIN_TIMEOUT;
    else if (waited > kNapAfterNs) {
      nap = nap ? (2 * nap < kNapMaxNs ? 2 * nap : kNapMaxNs) : 64;
      if (env.abort_host && (old_spin || (waited > kHostAfterNs && host_turn(gate, now))) &&
          ld_relaxed_sys(env.abort_host) != 0u)
        st = SPIN_ABORT;
    }
    uint64_t desc[4];
    if (st == SPIN_OK && env.ag.area && waited > WF_AGREE_AFTER_NS)
      st = agree_check(env, peer, site, epoch, desc);
    if (st != SPIN_OK) {
      if (done()) return SPIN_OK; /* arrived while we looked away */
      report_error(env, st, peer, site, epoch, st == WF_SPIN_MISMATCH ? desc : nullptr);
      return st;
    }
  }
}

/* fused_bench's phase clock: trace[i] += cycles since entry (t0, in shared
 * memory: no register held across the kernel for it); one thread. */
__device__ __forceinline__ void stamp(const wf_fused_args &a, bool tr, int i, const long long &t0) {
  if (tr) atomicAdd(a.trace + i, (unsigned long long)(clock64() - *(volatile const long long *)&t0));
}

/* ------------------------------------------- sum of squares, one order */

/* Sum of squares of a packed vector (in f32, elements in order). */
template <typename T> __device__ __forceinline__ float sumsq(uint4 yv) { return vec_sumsq<T>(yv); }

/* The calling warp's 32 consecutive vectors form chunk `chunk` of the row;
 * s is this lane's vector's sum of squares (0 for a vector past the row end
 * or a lane whose wait failed). Their xor-butterfly sum (the same bits in
 * every lane, whatever the geometry), with the OR of the lanes' failures,
 * goes to red[chunk] of this block (C == 1) or of every block of the
 * cluster (C > 1: st.async completing on each block's mbarrier mb, or,
 * mb == NULL, plain remote stores for barrier.cluster). Whole warps only. */
__device__ __forceinline__ void put_chunk(uint2 *red, int chunk, float s, bool fail, int C,
                                          const uint64_t *mb = nullptr) {
  s = warp_xor_sum(s);
  const uint32_t f = __any_sync(0xffffffffu, fail) ? 1u : 0u;
  const int lane = threadIdx.x & 31;
  const uint2 v = make_uint2(__float_as_uint(s), f);
  if (C == 1) {
    if (lane == 0) red[chunk] = v;
  } else if (lane < C) { /* lane r writes block r's copy */
    if (mb) st_async_cluster(&red[chunk], mb, (uint32_t)lane, v);
    else st_shared_cluster(&red[chunk], (uint32_t)lane, v);
  }
}

/* After the barrier that follows every put_chunk of the row: the total over
 * the NC chunk partials in the fixed order, in every thread; *any_fail: some
 * wait of the row failed (uniform over the block and the cluster). */
template <int NCM>
__device__ __forceinline__ float row_total(const uint2 *red, int NC, bool *any_fail) {
  const int lane = threadIdx.x & 31;
  float s = 0.f;
  uint32_t f = 0;
#pragma unroll
  for (int m = 0; m < NCM / 32; m++) {
    const int idx = lane + 32 * m;
    if (idx < NC) {
      const uint2 v = red[idx];
      s += __uint_as_float(v.x);
      f |= v.y;
    }
  }
  s = warp_xor_sum(s);
  *any_fail = __any_sync(0xffffffffu, f != 0u);
  return s;
}

/* Stores the norm of the packed residual_out vector yv (y * rstd * w) as
 * dtype and/or e4m3; gv: the weight vector. */
template <typename T>
__device__ __forceinline__ void store_norm(const wf_fused_args &a, size_t goff_bytes, uint4 gv,
                                           uint4 yv, float rstd, float inv_scale) {
  constexpr int EPV = Geo<T>::EPV;
  float x[EPV], g[EPV], n[EPV];
  Pack<T>::to_f32(yv, x);
  Pack<T>::to_f32(gv, g);
  /* -0.0 is the identity of addition (+0.0 is not: -0 + +0 = +0), so a
   * weight of -0.0 keeps its sign, as in the plain product y * rstd * gamma */
  const float one = (a.flags & WF_FUSED_GEMMA) ? 1.f : -0.f;
#pragma unroll
  for (int e = 0; e < EPV; e++) n[e] = x[e] * rstd * (g[e] + one);
  if (a.norm_out) st_vec((char *)a.norm_out + goff_bytes, Pack<T>::from_f32(n));
  if (a.pattern == WF_FUSED_ARN_FP8) {
    /* element index of this vector = goff_bytes / sizeof(T): one e4m3 byte each */
    char *q = (char *)a.quant_out + goff_bytes / sizeof(T);
    uint32_t w[EPV / 2];
#pragma unroll
    for (int e = 0; e < EPV; e += 2)
      w[e / 2] = __nv_cvt_float2_to_fp8x2(make_float2(n[e] * inv_scale, n[e + 1] * inv_scale),
                                          __NV_SATFINITE, __NV_E4M3);
    if constexpr (EPV == 8)
      *reinterpret_cast<uint2 *>(q) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
    else
      *reinterpret_cast<uint32_t *>(q) = w[0] | (w[1] << 16);
  }
}

__device__ __forceinline__ float load_inv_scale(const wf_fused_args &a) {
  return a.pattern == WF_FUSED_ARN_FP8 ? 1.f / *a.scale : 1.f;
}

/* ceil(a / b) with a 32-bit division when a allows it (b >= 1) */
__device__ __forceinline__ uint64_t cdiv_fast(uint64_t a, uint32_t b) {
  return a < (1ull << 31) ? (uint64_t)(((uint32_t)a + b - 1u) / b) : (a + b - 1u) / b;
}

/* ------------------------------------------------------------- one-shot */

template <typename T, int W, bool DET>
__global__ void __launch_bounds__(OneGeo<T, W>::MAXT, 1) oneshot_kernel(const wf_fused_args a) {
  using G = OneGeo<T, W>;
  constexpr int EPV = G::EPV, VMAX = G::VMAX, YK = G::YK, NCM = G::NCMAX;
  __shared__ uint2 red[2][NCM];
  __shared__ uint64_t mbar[2];        /* clustered: red[i]'s transaction barrier */
  __shared__ unsigned long long gate; /* host abort word: this block's next turn */
  __shared__ long long t0;            /* fused_bench's phase clock: entry */
  const bool norm = a.pattern != WF_FUSED_AR;
  /* C blocks per row group; block c of group q (c = %cluster_ctarank when
   * launched as a cluster, which the norm patterns are when C > 1) */
  const int C = a.cluster, lc = __ffs(C) - 1; /* C: a power of 2 */
  const int c = (int)blockIdx.x & (C - 1), q = (int)blockIdx.x >> lc, Q = (int)gridDim.x >> lc;
  const bool clustered = norm && C > 1;
  const int NV = a.hidden / EPV, NC = (NV + 31) / 32, rank = a.rank;
  /* this thread's vectors of a row: j0, j0 + CT, ... (block c of the group
   * takes every C-th run of blockDim.x vectors) */
  const int CT = (int)blockDim.x << lc, j0 = c * (int)blockDim.x + (int)threadIdx.x;
  const int wbase = j0 & ~31; /* the warp's first vector (blockDim.x is a multiple of 32) */
  const size_t RB = (size_t)a.hidden * sizeof(T);
  const char *const in = (const char *)a.in;
  const int probe = a.probe;
  const bool reduce = norm && !(probe & (WF_FUSED_PROBE_NO_REDUCE | WF_FUSED_PROBE_NO_NORM));
  /* the chunk partials travel by st.async on transaction barriers, or
   * (probe) by plain remote stores and barrier.cluster.arrive.release */
  const bool use_mbar = clustered && !(probe & WF_FUSED_PROBE_CLUSTER_BARRIER);
  pdl_wait();
  agree_announce(a.agree);
  /* Dependents may be scheduled now: every block of this grid is resident
   * (the grid is at most what is), and their griddepcontrol.wait still
   * waits for this whole grid to complete and flush. (Probe: after the
   * pushes, as before.) */
  const bool late_trigger = (probe & WF_FUSED_PROBE_LATE_TRIGGER) != 0;
  if (!(a.flags & WF_FUSED_TRIGGER_AT_END) && !late_trigger) pdl_launch_dependents();
  const bool tr = a.trace && blockIdx.x == 0 && threadIdx.x == 0;
  if (tr) t0 = clock64();
  /* The first vector this thread pushes (row q exists: Q <= tokens) is
   * loaded before anything else: it does not depend on the epoch, so its
   * latency overlaps that of the state loads and the error check below (one
   * memory latency before the first remote store, not two). */
  const bool pre = !(probe & WF_FUSED_PROBE_LATE_INPUT) && j0 < NV;
  const uint4 x0 = pre ? ld_vec(in + (size_t)q * RB + (size_t)j0 * 16) : make_uint4(0, 0, 0, 0);
  char *const local = (char *)a.peer[a.rank];
  wf_fused_state *const st = (wf_fused_state *)(local + a.off_state);
  /* Everything else that does not depend on the epoch goes out at once: the
   * epoch, the three Lamport byte counts, the error word, and the weight of
   * the first vector (it then stays in registers for every row). */
  const uint32_t E = epoch_load(st->lamport_epoch);
  const uint64_t lb0 = st->lamport_bytes[0], lb1 = st->lamport_bytes[1], lb2 = st->lamport_bytes[2];
  /* a plain (L1-cached) load: one L2 request per block, not one per warp
   * on the same line from every SM (a hot spot at 128+ blocks) */
  const unsigned long long err0 = *a.err_dev;
  const uint4 g0 = norm && j0 < NV ? ld_vec((const char *)a.gamma + (size_t)j0 * 16)
                                   : make_uint4(0, 0, 0, 0);
  if (threadIdx.x == 0) gate = 0;
  /* Poisoned by an earlier failure (epochs may disagree now): push nothing,
   * leave, so the peers time out. Every thread reads the word itself (no
   * barrier on the latency path; the L1 copy is this kernel's: L1 holds no
   * global data across launches): it changes only through this grid's own
   * timeouts, >= 20 us after its blocks started, so the decision is
   * uniform over the block and the cluster. (gate is read only by a wait
   * older than 100 us, long after thread 0's store above.) */
  if (err0 != 0ull) return;
  stamp(a, tr, WF_FUSED_TR_CHECKED, t0);
  /* "started" (and the mbarriers initialised): arrived on after this
   * block's first pushes (nothing the peer waits for waits for the fence),
   * waited on before the first remote store into a sibling (probe: no
   * cluster barrier at all, where no such store happens) */
  const bool csync = clustered && !((probe & WF_FUSED_PROBE_NO_CLUSTER_SYNC) &&
                                    (probe & (WF_FUSED_PROBE_NO_REDUCE | WF_FUSED_PROBE_NO_NORM)));
  const bool early_wait = (probe & WF_FUSED_PROBE_EARLY_CLUSTER_WAIT) != 0;
  const bool early_init = (probe & WF_FUSED_PROBE_EARLY_MBAR_INIT) != 0;
  auto cluster_start = [&] {
    if (use_mbar && threadIdx.x == 0) {
      mbar_init(&mbar[0]);
      mbar_init(&mbar[1]);
      mbar_init_fence();
    }
    if (csync) cluster_arrive_relaxed();
  };
  if (early_init) cluster_start();
  const SpinEnv env{a.abort_host, a.err_dev, a.err_host, a.timeout_ns, a.agree};
  const int cur = (int)(E % 3u), clr = (int)((E + 2u) % 3u);
  const size_t slot = (size_t)a.tokens * RB;
  const uint64_t lam = a.off_lamport + (uint64_t)cur * a.lamport_buf_bytes;

  /* Rows of this group: row(i) = q + i * Q, i < n (n >= 1 since Q <=
   * tokens). Streaming: row i + D (D: push_ahead) is pushed before row i is consumed, so
   * the link keeps carrying this block's data while it waits, reduces and
   * normalises, and the re-read of its own input row hits L2. */
  const int D = a.push_ahead;
  const int n = (a.tokens - q + Q - 1) / Q;
  const uint64_t mine = lam + (uint64_t)rank * slot;
  auto push_row = [&](int i) {
    const size_t row = (size_t)q + (size_t)i * Q;
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = j0 + k * CT;
      if (j < NV) {
        const size_t off = row * RB + (size_t)j * 16;
        const uint4 v = lamport_sanitize<T>(pre && i == 0 && k == 0 ? x0 : ld_vec(in + off));
#pragma unroll
        for (int p = 1; p < W; p++) st_vec((char *)a.peer[(rank + p) % W] + mine + off, v);
      }
    }
  };
  for (int i = 0; i < n && i < D; i++) push_row(i);
  if (!early_init) cluster_start();
  if (late_trigger && !(a.flags & WF_FUSED_TRIGGER_AT_END)) pdl_launch_dependents();
  stamp(a, tr, WF_FUSED_TR_PUSHED, t0);

  /* What call E - 1 wrote into buffer clr (the peers' slots, cb bytes each)
   * is cleared along the way: this block's share of the vectors, in n
   * parts. Two divisions per call, 32-bit whenever the counts allow (always,
   * in practice): a 64-bit division costs hundreds of cycles on the latency
   * path. */
  const uint64_t cb = clr == 0 ? lb0 : clr == 1 ? lb1 : lb2;
  char *const cbase = local + a.off_lamport + (uint64_t)clr * a.lamport_buf_bytes;
  const uint64_t cvec = cb / 16, ctotal = (uint64_t)(W - 1) * cvec;
  const uint64_t cper = cdiv_fast(ctotal, gridDim.x);
  const uint64_t clo = (uint64_t)blockIdx.x * cper, chi = clo + cper < ctotal ? clo + cper : ctotal;
  const uint64_t cpart = cdiv_fast(cper, (uint32_t)n);
  auto clear_part = [&](int i) {
    const uint64_t b0 = clo + (uint64_t)i * cpart, b1 = b0 + cpart < chi ? b0 + cpart : chi;
    if (b0 >= b1) return;
    const uint4 nz = lamport_empty_vec();
#pragma unroll 1
    for (int p = 0; p < W - 1; p++) { /* peer slot (rank + 1 + p) % W owns [p*cvec, (p+1)*cvec) */
      const uint64_t s0 = (uint64_t)p * cvec;
      const uint64_t a0 = b0 > s0 ? b0 : s0, a1 = b1 < s0 + cvec ? b1 : s0 + cvec;
      char *const sb = cbase + (size_t)((rank + 1 + p) % W) * cb - s0 * 16;
      for (uint64_t v = a0 + threadIdx.x; v < a1; v += blockDim.x) st_vec(sb + v * 16, nz);
    }
  };

  /* poll own buffer, reduce, residual, norm */
  const char *const lamb = local + lam;
  const bool fp32_acc = (a.flags & WF_FUSED_FP32_ACC) != 0;
  const bool old_spin = (probe & WF_FUSED_PROBE_OLD_SPIN) != 0;
  const float inv_scale = load_inv_scale(a);
  /* residual_out of the kept vectors is stored after the norm's exchange
   * (nothing on the way to it waits for those stores) */
  const bool defer = norm && !(probe & WF_FUSED_PROBE_NO_NORM);
  bool failed = false;
  int parity = 0;
  for (int i = 0; i < n; i++, parity ^= 1) {
    if (i + D < n) push_row(i + D);
    clear_part(i);
    if (csync && i == 0 && early_wait) cluster_wait_acquire(); /* probe: the earlier place */
    if (i == 0) stamp(a, tr, WF_FUSED_TR_CLEARED, t0);
    const size_t row = (size_t)q + (size_t)i * Q;
    /* this block's chunk partials arrive in red[parity] from every block:
     * NC of them, 8 bytes each */
    if (use_mbar && reduce && threadIdx.x == 0) mbar_expect(&mbar[parity], (uint32_t)NC * 8u);
    uint4 y[YK];
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = j0 + k * CT;
      float s = 0.f;
      if (j < NV && !failed) {
        const size_t off = row * RB + (size_t)j * 16;
        /* the residual's load goes out before the wait, not after it */
        const uint4 rv = norm && !(probe & WF_FUSED_PROBE_NO_RESIDUAL_LOAD)
                             ? ld_vec((const char *)a.res_in + off) : make_uint4(0, 0, 0, 0);
        float f[EPV];
        failed = !sum_ranks<T, W>(
            [&](int r) {
              /* own term: re-read (an L1/L2 hit in flight with the poll) rather
               * than x0 kept in registers through the wait */
              return r == rank ? lamport_sanitize<T>(ld_vec(in + off))
                               : ld_vec_volatile(lamb + (size_t)r * slot + off);
            },
            [&](int r, uint4 &v) {
              if (r == rank || !lamport_pending(v)) return true;
              const char *p = lamb + (size_t)r * slot + off;
              return wait_until([&] { v = ld_vec_volatile(p); return !lamport_pending(v); }, env,
                                &gate, old_spin, (uint32_t)r, WF_FUSED_SITE_LAMPORT, E) == SPIN_OK;
            },
            fp32_acc, f);
        if (i == 0 && k == 0) stamp(a, tr, WF_FUSED_TR_ARRIVED, t0);
        if (!failed) {
          if (!norm) {
            st_vec((char *)a.out + off, Pack<T>::from_f32(f));
          } else {
            float r[EPV];
            Pack<T>::to_f32(rv, r);
            if (DET) round_sum<T>(f); /* deterministic: as all_reduce + the norm kernel */
#pragma unroll
            for (int e = 0; e < EPV; e++) f[e] += r[e];
            const uint4 yv = Pack<T>::from_f32(f);
            if (k < YK) y[k < YK ? k : 0] = yv;
            s = sumsq<T>(yv);
            /* the kept vectors are stored with the norm, after the exchange */
            if (k >= YK || !defer) st_vec((char *)a.res_out + off, yv);
          }
        }
      }
      /* Every block of the cluster has started (and initialised its
       * barriers) before the first partials go to it. Waited on here, after
       * this thread's first poll, not before it: the barrier's latency hides
       * behind the wait for the peer's data. Every thread gets here at k == 0. */
      if (csync && i == 0 && k == 0 && !early_wait) cluster_wait_acquire();
      /* warp-uniform: the warp's chunk exists */
      if (reduce && wbase + k * CT < NV)
        put_chunk(red[parity], (wbase + k * CT) / 32, s, failed, clustered ? C : 1,
                  use_mbar ? &mbar[parity] : nullptr);
    }
    if (norm && !(probe & WF_FUSED_PROBE_NO_NORM)) {
      float tot = (float)a.hidden; /* NO_REDUCE probe: any value (rstd ~ 1) */
      if (reduce) {
        if (use_mbar) {
          /* every block of the group sends its partials (failed ones too,
           * flagged), so this completes once the slowest sibling's bounded
           * waits are over; the (i >> 1)-th use of mbar[parity]. Bounded all
           * the same (a sibling that never sends is a bug, not a hang). */
          const uint32_t ph = (uint32_t)(i >> 1) & 1u;
          if (!mbar_done(&mbar[parity], ph)) {
            const uint64_t w0 = globaltimer_ns();
            bool late = false;
            while (!mbar_done(&mbar[parity], ph))
              if (globaltimer_ns() - w0 > env.timeout_ns) { late = true; break; }
            if (late) {
              report_error(env, SPIN_TIMEOUT, (uint32_t)rank, WF_FUSED_SITE_ROW, E);
              failed = true;
              break;
            }
          }
        } else if (clustered) {
          cluster_arrive_release();
          cluster_wait_acquire();
        } else {
          __syncthreads();
        }
        bool any_fail;
        tot = row_total<NCM>(red[parity], NC, &any_fail);
        if (any_fail) { failed = true; break; } /* uniform over the block and the cluster */
      } else if (failed) {
        break; /* probe: no cluster barrier follows, leaving alone is safe */
      }
      if (i == 0) stamp(a, tr, WF_FUSED_TR_REDUCED, t0);
      const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
      for (int k = 0; k < VMAX; k++) {
        const int j = j0 + k * CT;
        if (j < NV) {
          const size_t off = row * RB + (size_t)j * 16;
          if (k < YK) st_vec((char *)a.res_out + off, y[k < YK ? k : 0]);
          store_norm<T>(a, off, k == 0 ? g0 : ld_vec((const char *)a.gamma + (size_t)j * 16),
                        kept<YK>(y, k, (char *)a.res_out + off), rstd, inv_scale);
        }
      }
      if (i == 0) stamp(a, tr, WF_FUSED_TR_STORED, t0);
    }
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) st->lamport_bytes[cur] = slot;
  if (__syncthreads_or(failed)) return; /* poisoned; the error word says why */
  agree_verify(env, WF_FUSED_SITE_AGREE);
  epoch_advance(st->lamport_epoch, E);
  if (a.flags & WF_FUSED_TRIGGER_AT_END) pdl_launch_dependents();
  if (tr) {
    stamp(a, tr, WF_FUSED_TR_END, t0);
    atomicAdd(a.trace + WF_FUSED_TR_CALLS, 1ull);
  }
}

/* ------------------------------------------------------------- two-shot */

template <typename T, int W, bool DET>
__global__ void __launch_bounds__(Geo<T>::MAXT, 1) twoshot_kernel(const wf_fused_args a) {
  constexpr int EPV = Geo<T>::EPV, VMAX = Geo<T>::VMAX, YK = Geo<T>::YK, NCM = Geo<T>::NCMAX;
  __shared__ uint2 red[2][NCM];
  __shared__ unsigned long long gate; /* host abort word: this block's next turn */
  pdl_wait();
  agree_announce(a.agree);
  char *const local = (char *)a.peer[a.rank];
  wf_fused_state *const st = (wf_fused_state *)(local + a.off_state);
  const uint32_t E = epoch_load(st->flag_epoch);
  const bool is_ar = a.pattern == WF_FUSED_AR;
  if (threadIdx.x == 0) gate = 0;
  if (__syncthreads_or(threadIdx.x == 0 && *(volatile unsigned long long *)a.err_dev != 0ull))
    return;
  const SpinEnv env{a.abort_host, a.err_dev, a.err_host, a.timeout_ns, a.agree};
  const bool old_spin = (a.probe & WF_FUSED_PROBE_OLD_SPIN) != 0;
  /* the flag at p holds target's epoch word and at least its step (kernels/common.cuh) */
  auto wait_flag = [&](const uint64_t *p, uint64_t target, uint32_t peer, uint32_t site) {
    return wait_until(
        [&] {
          const uint64_t v = ld_acquire_sys(p);
          return (v >> 32) == (target >> 32) && (uint32_t)v >= (uint32_t)target;
        },
        env, &gate, old_spin, peer, site, E);
  };
  const int NV = a.hidden / EPV, NC = (NV + 31) / 32, rank = a.rank, tid = threadIdx.x;
  const int wbase = tid - (tid & 31); /* the warp's first vector */
  const size_t RB = (size_t)a.hidden * sizeof(T);
  const int rows_per = (a.tokens + W - 1) / W;
  const size_t slot = (size_t)rows_per * RB;
  const char *const in = (const char *)a.in;
  const bool fp32_acc = (a.flags & WF_FUSED_FP32_ACC) != 0;
  const float inv_scale = load_inv_scale(a);
  const uint64_t ag_mine = a.off_ag + (uint64_t)rank * slot;
  const char *const rs = local + a.off_rs;
  const char *const ag = local + a.off_ag;

  /* after the row's put_chunk calls: total (one order), rstd, norm outputs */
  auto norm_row = [&](int grow, const uint4 (&y)[YK], int par2) {
    __syncthreads();
    bool unused;
    const float tot = row_total<NCM>(red[par2], NC, &unused);
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (j < NV) {
        const size_t goff = (size_t)grow * RB + (size_t)j * 16;
        store_norm<T>(a, goff, ld_vec((const char *)a.gamma + (size_t)j * 16),
                      kept<YK>(y, k, (char *)a.res_out + goff), rstd, inv_scale);
      }
    }
  };
  /* 1. my part of row grow (row r of its owner's range) into the owner's RS inbox */
  auto push = [&](char *dst, int grow, int r) {
    uint4 v[VMAX];
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (j < NV) v[k] = lamport_sanitize<T>(ld_vec(in + (size_t)grow * RB + (size_t)j * 16));
    }
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (j < NV) st_vec(dst + (size_t)r * RB + (size_t)j * 16, v[k]);
    }
  };
  /* 2. an own row: sum, residual, round, push to every peer's AG inbox, norm */
  auto own = [&](int grow, int r, int parity) {
    uint4 y[YK];
#pragma unroll(W > 4 ? 1 : VMAX) /* keeps f32 with 8 ranks under its register budget */
    for (int k = 0; k < VMAX; k++) {
      const int j = tid + k * blockDim.x;
      float s = 0.f;
      if (j < NV) {
        const size_t off = (size_t)r * RB + (size_t)j * 16;
        const size_t goff = (size_t)grow * RB + (size_t)j * 16;
        float f[EPV];
        sum_ranks<T, W>(
            [&](int s) {
              return s == rank ? lamport_sanitize<T>(ld_vec(in + goff))
                               : ld_vec_cg(rs + (size_t)s * slot + off);
            },
            [](int, uint4 &) { return true; }, fp32_acc, f);
        if (!is_ar) {
          float res[EPV];
          Pack<T>::to_f32(ld_vec((const char *)a.res_in + goff), res);
          if (DET) round_sum<T>(f); /* deterministic: as all_reduce + the norm kernel */
#pragma unroll
          for (int e = 0; e < EPV; e++) f[e] += res[e];
        }
        const uint4 yv = Pack<T>::from_f32(f);
        st_vec((char *)(is_ar ? a.out : a.res_out) + goff, yv);
#pragma unroll
        for (int i = 1; i < W; i++) st_vec((char *)a.peer[(rank + i) % W] + ag_mine + off, yv);
        if (k < YK) y[k < YK ? k : 0] = yv;
        if (!is_ar) s = sumsq<T>(yv);
      }
      if (!is_ar && wbase + k * (int)blockDim.x < NV)
        put_chunk(red[parity], (wbase + k * (int)blockDim.x) / 32, s, false, 1);
    }
    if (!is_ar) norm_row(grow, y, parity);
  };
  /* 3. a peer's row: copy y into residual_out (out), normalise */
  auto pull = [&](int p, int grow, int r, int parity) {
    uint4 y[YK];
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = tid + k * blockDim.x;
      float s = 0.f;
      if (j < NV) {
        const size_t goff = (size_t)grow * RB + (size_t)j * 16;
        const uint4 yv = ld_vec_cg(ag + (size_t)p * slot + (size_t)r * RB + (size_t)j * 16);
        if (k < YK) y[k < YK ? k : 0] = yv;
        st_vec((char *)(is_ar ? a.out : a.res_out) + goff, yv);
        if (!is_ar) s = sumsq<T>(yv);
      }
      if (!is_ar && wbase + k * (int)blockDim.x < NV)
        put_chunk(red[parity], (wbase + k * (int)blockDim.x) / 32, s, false, 1);
    }
    if (!is_ar) norm_row(grow, y, parity);
  };
  fused_twoshot_ranges<W>(a, env, st, E, slot, wait_flag, push, own, pull);
}

typedef void (*kernel_fn)(const wf_fused_args);

/* WF_FUSED_WORLD2_ONLY: a quick build (scripts/gpu-fusion --fast-build)
 * that instantiates the kernels for 2 ranks only; other sizes then fail at
 * launch with cudaErrorInvalidValue. ONE: the one-shot kernels, else the
 * two-shot ones; worlds LO..HI only (only those are instantiated). */
template <typename T, bool D, bool ONE, int LO = 2, int HI = 8> kernel_fn pick_one(int world) {
#define WF_CASE(w)                                                          \
  case w:                                                                   \
    if constexpr (w < LO || w > HI) return nullptr;                         \
    else if constexpr (ONE) return oneshot_kernel<T, w, D>;                 \
    else return twoshot_kernel<T, w, D>;
  switch (world) {
    WF_CASE(2)
#ifndef WF_FUSED_WORLD2_ONLY
    WF_CASE(3) WF_CASE(4) WF_CASE(5) WF_CASE(6) WF_CASE(7) WF_CASE(8)
#endif
  }
#undef WF_CASE
  return nullptr;
}
template <typename T, bool D> kernel_fn pick_w(int algo, int world) {
  return algo == WF_FUSED_ONESHOT ? pick_one<T, D, true>(world) : pick_one<T, D, false>(world);
}

}  // namespace

/* the kernel of (algo, world) for one dtype and mode, nullptr if none (_det:
 * WF_FUSED_DETERMINISTIC): each defined in a unit the build writes
 * (mk/kernel_units.mk), by WF_FUSED_UNIT; f32's, the longest to compile, by
 * WF_FUSED_ALGO_UNIT, one unit per algorithm, the one-shot in two (worlds
 * 2-5, 6-8) */
namespace wf_fused {
kernel_fn pick_bf16(int algo, int world);
kernel_fn pick_bf16_det(int algo, int world);
kernel_fn pick_f16(int algo, int world);
kernel_fn pick_f16_det(int algo, int world);
kernel_fn pick_f32_oneshot_w2_5(int world);
kernel_fn pick_f32_oneshot_w6_8(int world);
kernel_fn pick_f32_twoshot(int world);
kernel_fn pick_f32_det_oneshot_w2_5(int world);
kernel_fn pick_f32_det_oneshot_w6_8(int world);
kernel_fn pick_f32_det_twoshot(int world);
}  // namespace wf_fused

#define WF_FUSED_UNIT(name, T, D) \
  kernel_fn wf_fused::pick_##name(int algo, int world) { return pick_w<T, D>(algo, world); }
#define WF_FUSED_ALGO_UNIT(name, T, D, ONE, LO, HI) \
  kernel_fn wf_fused::pick_##name(int world) { return pick_one<T, D, ONE, LO, HI>(world); }
