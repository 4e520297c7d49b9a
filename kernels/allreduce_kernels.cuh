/* allreduce_kernels.cuh — weft's own all-reduce (sum) over VMM workspaces shared by
 * the ranks of one node: bf16, f16, f32 (f32 accumulation), world sizes 2, 4,
 * 6, 8, any element count, 16-byte aligned pointers.  Three kernels, all
 * PUSH data with remote stores and poll only local memory (kernels/common.cuh
 * documents the epoch/flag protocol):
 *
 *  - ar_lamport (one-shot, latency): every rank stores its sanitised input
 *    into every peer's Lamport buffer; each rank polls its own buffer until
 *    no word is the sentinel, sums all ranks in rank order, writes out.  One
 *    NVLink trip, no fences.  Clears the previous call's buffer meanwhile.
 *  - ar_oneshot_flag (one-shot, bandwidth): rounds of 16 KiB per block;
 *    round r is pushed, then a release flag; round r-1 is reduced after the
 *    peers' flags for it arrived, so pushes and local reduction overlap.
 *  - ar_twoshot: per chunk, part j belongs to rank j: push parts to their
 *    owners (reduce-scatter), owner sums in rank order, writes its output and
 *    pushes the result to every peer (all-gather), peers copy it out.  A
 *    three-stage software pipeline over rounds.
 *
 * Every rank adds the same values in the same order (rank 0 first), so
 * results are bitwise identical on all ranks.  Inputs are read inside the
 * kernel and the epoch is in device memory: graph replays with new data in
 * the input buffer work.  In-place (in == out) is allowed: every element is
 * read before it is written, by the same thread.
 *
 * This header holds the kernels and their launch templates; the build writes
 * one translation unit per dtype (mk/kernel_units.mk: WF_AR_UNIT below) that
 * instantiates those of one dtype and exports its launch function, so that
 * nvcc compiles them in parallel; kernels/allreduce.cu keeps the entry points. */
#pragma once
#include "ar_layout.cuh"
#include "common.cuh"

extern "C" {
#include "coll/ar_internal.h"
#include "weft.h"
}

static_assert(WF_MAX_GRID == WF_MAX_GRID, "epoch slots must match common.cuh");

namespace {

using namespace wf;

struct KArgs {
  const char *in;
  char *out;
  uint64_t nvec;    /* 16-byte vectors, the last may be partial */
  int tail;         /* elements in the last vector when partial, else 0 */
  int rank;
  char *ws[WF_MAX_WORLD];
  uint64_t off_lamport, lamport_slot, off_data, data_par;
  int sub;          /* flag one-shot: sub-rounds per round */
  int split;        /* flag one-shot: pusher / reducer blocks */
  SpinEnv env;
};


template <typename T>
__device__ __forceinline__ uint4 load_in(const KArgs &a, uint64_t v) {
  if (a.tail && v == a.nvec - 1)
    return ld_vec_partial<T>(reinterpret_cast<const T *>(a.in + v * 16), a.tail);
  return ld_vec(a.in + v * 16);
}
/* Deterministic mode (D): the flag kernels sum the same sanitised values the
 * Lamport one-shot must use (bf16/f16 -0.0 -> +0.0, the f32 word 0x80008000
 * -> -0.0), so an all -0.0 element gives +0.0 on every path and the kernels
 * agree bit for bit at every size. Default (D false): the raw input. */
template <typename T, bool D>
__device__ __forceinline__ uint4 load_term(const KArgs &a, uint64_t v) {
  const uint4 x = load_in<T>(a, v);
  return D ? lamport_sanitize<T>(x) : x;
}
template <typename T>
__device__ __forceinline__ void store_out(const KArgs &a, uint64_t v, uint4 x) {
  if (a.tail && v == a.nvec - 1)
    st_vec_partial<T>(reinterpret_cast<T *>(a.out + v * 16), x, a.tail);
  else
    st_vec(a.out + v * 16, x);
}

/* ------------------------------------------------------------ Lamport one-shot */

/* This thread's U vectors of one step (v0, v0 + nthr, ...), raw (all loads
 * issued before any is used); vectors past the end read as 0 (never stored). */
template <typename T, int U>
__device__ __forceinline__ void lamport_load(const KArgs &a, uint64_t v0, uint64_t nthr, uint4 (&x)[U]) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const uint64_t v = v0 + u * nthr;
    x[u] = v < a.nvec ? load_in<T>(a, v) : make_uint4(0, 0, 0, 0);
  }
}
template <typename T, int U>
__device__ __forceinline__ void lamport_sanitize_all(uint4 (&x)[U]) {
#pragma unroll
  for (int u = 0; u < U; u++) x[u] = lamport_sanitize<T>(x[u]);
}

/* Every thread walks its vectors in steps of U * nthr and software-pipelines
 * them: step j is pushed, then step j-1 is polled and reduced, and step j's
 * share of the previous buffer is cleared.  Small calls are one step (push,
 * then poll); large ones keep NVLink busy with pushes while earlier steps
 * are reduced from local memory.  Latency path: step 0's input is loaded
 * before the epoch (both loads in flight at once: one memory latency before
 * the first remote store, not two), and each thread keeps its own
 * sanitised input in registers for the reduction (no second read). */
template <typename T, int W>
__global__ void __launch_bounds__(WF_AR_LAMPORT_THREADS, W <= 4 ? 3 : 2) ar_lamport(KArgs a) {
  constexpr int U = W <= 2 ? 4 : (W <= 4 ? 2 : 1);
  pdl_wait(); /* before any memory access: the previous kernel is complete */
  pdl_launch_dependents();
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t nthr = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t nvec = a.nvec, step = U * nthr;
  uint4 x[U], xp[U]; /* this step's own input; the previous step's */
  lamport_load<T, U>(a, tid, nthr, x); /* independent of the epoch: issued first */
  agree_announce(a.env.ag);
  const uint32_t E = epoch_load(epochs_of(a));
  uint64_t *lb = lbytes_of(a);
  const uint64_t l0 = lb[0], l1 = lb[1], l2 = lb[2]; /* all at once: no load waits on E */
  const int me = a.rank;
  const uint32_t buf = E % 3, prev = (E + 2) % 3;
  const uint64_t steps = nvec <= step ? 1 : (nvec + step - 1) / step;
  const uint64_t clear_vec = (prev == 0 ? l0 : prev == 1 ? l1 : l2) / 16;
  const char *lam_me = a.ws[me] + a.off_lamport;
  char *clear_base = a.ws[me] + a.off_lamport + (uint64_t)prev * (W - 1) * a.lamport_slot;

  bool ok = true;
  for (uint64_t j = 0; j <= steps; j++) {
    if (j < steps) { /* push step j: my sanitised input into every peer's slot for me */
      const uint64_t v0 = j * step + tid;
      if (j > 0) lamport_load<T, U>(a, v0, nthr, x);
      lamport_sanitize_all<T, U>(x);
#pragma unroll
      for (int k = 1; k < W; k++) {
        const int q = (me + k) % W; /* staggered: peers' links start evenly loaded */
        char *dst = a.ws[q] + a.off_lamport +
                    ((uint64_t)buf * (W - 1) + pslot(me, q)) * a.lamport_slot;
#pragma unroll
        for (int u = 0; u < U; u++)
          if (v0 + u * nthr < nvec) st_vec(dst + (v0 + u * nthr) * 16, x[u]);
      }
    }
    if (j == 0 && tid == 0) lb[buf] = nvec * 16; /* read by call E + 1 (its "previous") */
    { /* clear step j's share of the previous call's buffer (the rest after the loop) */
      const uint64_t c0 = j * step + tid;
      const uint4 empty = lamport_empty_vec();
#pragma unroll
      for (int u = 0; u < U; u++) {
        const uint64_t v = c0 + u * nthr;
        if (j < steps && v < clear_vec)
#pragma unroll
          for (int k = 0; k < W - 1; k++) st_vec(clear_base + k * a.lamport_slot + v * 16, empty);
      }
    }
    if (j >= 1 && ok) { /* poll and reduce step j-1 */
      const uint64_t v0 = (j - 1) * step + tid;
      uint4 r[W][U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const uint64_t v = v0 + u * nthr;
        if (v >= nvec) continue;
#pragma unroll
        for (int p = 0; p < W; p++)
          r[p][u] = p == me ? xp[u]
                            : ld_vec_volatile(lam_me + ((uint64_t)buf * (W - 1) + pslot(p, me)) *
                                                           a.lamport_slot + v * 16);
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const uint64_t v = v0 + u * nthr;
        if (v >= nvec || !ok) continue;
#pragma unroll
        for (int p = 0; p < W; p++) {
          if (p == me || !ok || !lamport_pending(r[p][u])) continue;
          const char *addr = lam_me + ((uint64_t)buf * (W - 1) + pslot(p, me)) * a.lamport_slot + v * 16;
          uint4 got;
          const uint32_t st = bounded_spin(
              [&] {
                got = ld_vec_volatile(addr);
                return !lamport_pending(got);
              },
              a.env, p, WF_AR_SITE_LAMPORT, E);
          if (st != SPIN_OK) ok = false;
          r[p][u] = got;
        }
        if (!ok) continue;
        float acc[Pack<T>::N];
        acc_set<T>(acc, r[0][u]);
#pragma unroll
        for (int p = 1; p < W; p++) acc_add<T>(acc, r[p][u]);
        store_out<T>(a, v, Pack<T>::from_f32(acc));
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) xp[u] = x[u];
  }
  /* the previous call may have been larger than this one */
  const uint4 empty = lamport_empty_vec();
  for (uint64_t v = steps * step + tid; v < clear_vec; v += nthr)
#pragma unroll
    for (int k = 0; k < W - 1; k++) st_vec(clear_base + k * a.lamport_slot + v * 16, empty);
  __syncthreads();
  agree_verify(a.env, WF_AR_SITE_AGREE);
  epoch_advance(epochs_of(a), E);
}

/* ------------------------------------------------ flag-based one-shot (push) */

/* One round of a block: CV = blockDim x U x S vectors from `base`, in S
 * sub-rounds of U vectors per thread. */
template <typename T, int W, int U, bool D>
__device__ __forceinline__ void flag_push(const KArgs &a, uint64_t base, int S, uint32_t par) {
  const int me = a.rank, t = threadIdx.x;
  const uint64_t nvec = a.nvec, slot = nvec * 16;
#pragma unroll 1
  for (int s = 0; s < S; s++) {
    const uint64_t b0 = base + (uint64_t)s * blockDim.x * U;
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const uint64_t v = b0 + u * blockDim.x + t;
      if (v < nvec) x[u] = load_term<T, D>(a, v);
    }
#pragma unroll
    for (int k = 1; k < W; k++) {
      const int q = (me + k) % W; /* staggered: peers' links start evenly loaded */
      char *dst = a.ws[q] + a.off_data + par * a.data_par + pslot(me, q) * slot;
#pragma unroll
      for (int u = 0; u < U; u++) {
        const uint64_t v = b0 + u * blockDim.x + t;
        if (v < nvec) st_vec(dst + v * 16, x[u]);
      }
    }
  }
}

template <typename T, int W, int U, bool D>
__device__ __forceinline__ void flag_reduce(const KArgs &a, uint64_t base, int S, const char *region_me) {
  const int me = a.rank, t = threadIdx.x;
  const uint64_t nvec = a.nvec, slot = nvec * 16;
#pragma unroll 1
  for (int s = 0; s < S; s++) {
    const uint64_t b0 = base + (uint64_t)s * blockDim.x * U;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const uint64_t v = b0 + u * blockDim.x + t;
      if (v >= nvec) continue;
      uint4 x[W];
#pragma unroll
      for (int p = 0; p < W; p++)
        x[p] = p == me ? load_term<T, D>(a, v) : ld_vec_cg(region_me + pslot(p, me) * slot + v * 16);
      float acc[Pack<T>::N];
      acc_set<T>(acc, x[0]);
#pragma unroll
      for (int p = 1; p < W; p++) acc_add<T>(acc, x[p]);
      store_out<T>(a, v, Pack<T>::from_f32(acc));
    }
  }
}

/* Rounds of CV vectors; round r of block b is chunk b + r * G.
 * Interleaved (split = 0): every block pushes round r, releases a flag per
 * peer, then reduces round r-1 once the peers' flags for it arrived.
 * Split (split = 1, G even): blocks [0, G/2) only push (never wait on a
 * peer), blocks [G/2, G) only reduce; reducer q handles pusher q's chunks.
 * A reducer also waits for its own GPU's pusher q (a flag in its own
 * workspace, phase-1 row, sender = me: a slot no other kernel uses), since
 * with in == out it overwrites the input that pusher reads. */
template <typename T, int W, bool D>
__global__ void __launch_bounds__(WF_AR_FLAG_THREADS, W <= 2 ? 2 : 1) ar_oneshot_flag(KArgs a) {
  constexpr int U = WF_AR_FLAG_UNROLL;
  pdl_wait(); /* before any memory access: the previous kernel is complete */
  pdl_launch_dependents();
  agree_announce(a.env.ag);
  const uint32_t E = epoch_load(epochs_of(a));
  const uint32_t par = E & 1;
  const int me = a.rank, t = threadIdx.x, b = blockIdx.x, G = gridDim.x;
  const int S = a.sub > 0 ? a.sub : 1;
  const uint64_t nvec = a.nvec, CV = (uint64_t)blockDim.x * U * S;
  const uint64_t nchunks = (nvec + CV - 1) / CV;
  const char *region_me = a.ws[me] + a.off_data + par * a.data_par;

  lamport_maintain<W>(a, a, E, 0);

  bool ok = true;
  if (!a.split) {
    const uint64_t R = (uint64_t)b < nchunks ? (nchunks - 1 - b) / G + 1 : 0;
    for (uint64_t r = 0; r <= R; r++) {
      if (r < R) { /* push round r */
        flag_push<T, W, U, D>(a, (b + r * G) * CV, S, par);
        __syncthreads(); /* all pushes of the round before the release below */
        if (t < W && t != me) st_release_sys(flag_ptr(a, t, par, 0, b, me), flag_value(E, r + 1));
      }
      if (r >= 1) { /* reduce round r-1 */
        const uint64_t rr = r - 1;
        if (t < W && t != me) {
          uint64_t *f = flag_ptr(a, me, par, 0, b, t);
          ok = wait_flag_geq(f, flag_value(E, rr + 1), a.env, t, WF_AR_SITE_ONESHOT, E) == SPIN_OK;
          if (rr + 1 == R) st_relaxed_sys(f, 0ull); /* last round: nothing older than a call stays */
        }
        if (!__syncthreads_and(ok)) break;
        flag_reduce<T, W, U, D>(a, (b + rr * G) * CV, S, region_me);
      }
    }
  } else {
    const int P = G / 2;
    const int q = b < P ? b : b - P;
    const uint64_t R = q < P && (uint64_t)q < nchunks ? (nchunks - 1 - q) / P + 1 : 0;
    if (b < P) { /* pusher: peers' rows (phase 0) and my own progress (phase 1, sender me) */
      for (uint64_t r = 0; r < R; r++) {
        flag_push<T, W, U, D>(a, (q + r * P) * CV, S, par);
        __syncthreads(); /* the round's loads and stores before the releases */
        if (t < W) st_release_sys(flag_ptr(a, t, par, t == me ? 1 : 0, q, me), flag_value(E, r + 1));
      }
    } else { /* reducer */
      for (uint64_t r = 0; r < R; r++) {
        if (t < W) {
          uint64_t *f = t == me ? flag_ptr(a, me, par, 1, q, me) : flag_ptr(a, me, par, 0, q, t);
          ok = wait_flag_geq(f, flag_value(E, r + 1), a.env, t,
                             t == me ? WF_AR_SITE_PUSHER : WF_AR_SITE_ONESHOT, E) == SPIN_OK;
          if (r + 1 == R) st_relaxed_sys(f, 0ull);
        }
        if (!__syncthreads_and(ok)) break;
        flag_reduce<T, W, U, D>(a, (q + r * P) * CV, S, region_me);
      }
    }
  }
  __syncthreads();
  agree_verify(a.env, WF_AR_SITE_AGREE);
  epoch_advance(epochs_of(a), E);
}

/* ------------------------------------------------------------------ two-shot */

template <typename T, int W, bool D>
__global__ void __launch_bounds__(WF_AR_FLAG_THREADS, W <= 2 ? 2 : 1) ar_twoshot(KArgs a) {
  constexpr int U = WF_AR_TWOSHOT_UNROLL(W);
  pdl_wait(); /* before any memory access: the previous kernel is complete */
  pdl_launch_dependents();
  agree_announce(a.env.ag);
  const uint32_t E = epoch_load(epochs_of(a));
  const uint32_t par = E & 1;
  const int me = a.rank, t = threadIdx.x, b = blockIdx.x, G = gridDim.x;
  const uint64_t nvec = a.nvec, PV = (uint64_t)blockDim.x * U, CW = PV * W;
  const uint64_t nchunks = (nvec + CW - 1) / CW;
  const uint64_t R = (uint64_t)b < nchunks ? (nchunks - 1 - b) / G + 1 : 0;
  const uint64_t slot = nchunks * PV * 16;
  /* slots: [0, W-1) reduce-scatter inputs, [W-1, 2W-2) all-gather results */
  char *region_me = a.ws[me] + a.off_data + par * a.data_par;

  lamport_maintain<W>(a, a, E, 0);

  twoshot_rounds<W>(
      a, E, R, WF_AR_SITE_RS, WF_AR_SITE_AG,
      [&](uint64_t c) { /* A: push part q of chunk c to rank q */
#pragma unroll(W > 4 ? 1 : W)
        for (int k = 1; k < W; k++) {
          const int q = (me + k) % W;
          char *dst = a.ws[q] + a.off_data + par * a.data_par + pslot(me, q) * slot;
          uint4 x[U];
#pragma unroll
          for (int u = 0; u < U; u++) {
            const uint64_t l = u * blockDim.x + t, v = c * CW + q * PV + l;
            if (v < nvec) x[u] = load_term<T, D>(a, v);
          }
#pragma unroll
          for (int u = 0; u < U; u++) {
            const uint64_t l = u * blockDim.x + t, v = c * CW + q * PV + l;
            if (v < nvec) st_vec(dst + (c * PV + l) * 16, x[u]);
          }
        }
      },
      [&](uint64_t c) { /* B: reduce my part of chunk c, push the result */
#pragma unroll(W > 4 ? 1 : U) /* keeps W = 6, 8 under the 128-register cap */
        for (int u = 0; u < U; u++) {
          const uint64_t l = u * blockDim.x + t, v = c * CW + me * PV + l, sv = c * PV + l;
          if (v >= nvec) continue;
          /* loads in batches of up to 4 ranks: in flight, yet under the register cap */
          constexpr int CH = W > 4 ? 4 : W;
          float acc[Pack<T>::N];
#pragma unroll
          for (int p0 = 0; p0 < W; p0 += CH) {
            uint4 x[CH];
#pragma unroll
            for (int j = 0; j < CH; j++) {
              const int p = p0 + j;
              if (p < W)
                x[j] = p == me ? load_term<T, D>(a, v) : ld_vec_cg(region_me + pslot(p, me) * slot + sv * 16);
            }
#pragma unroll
            for (int j = 0; j < CH; j++) {
              if (p0 + j >= W) continue;
              if (p0 + j == 0) acc_set<T>(acc, x[j]);
              else acc_add<T>(acc, x[j]);
            }
          }
          const uint4 res = Pack<T>::from_f32(acc);
#pragma unroll
          for (int k = 1; k < W; k++) {
            const int q = (me + k) % W;
            st_vec(a.ws[q] + a.off_data + par * a.data_par + (W - 1 + pslot(me, q)) * slot + sv * 16,
                   res);
          }
          store_out<T>(a, v, res);
        }
      },
      [&](uint64_t c) { /* C: copy the peers' results of chunk c out */
#pragma unroll(W > 4 ? 1 : W)
        for (int k = 1; k < W; k++) {
          const int p = (me + k) % W;
          const char *src = region_me + (W - 1 + pslot(p, me)) * slot;
          uint4 x[U];
#pragma unroll
          for (int u = 0; u < U; u++) {
            const uint64_t l = u * blockDim.x + t, v = c * CW + p * PV + l;
            if (v < nvec) x[u] = ld_vec_cg(src + (c * PV + l) * 16);
          }
#pragma unroll
          for (int u = 0; u < U; u++) {
            const uint64_t l = u * blockDim.x + t, v = c * CW + p * PV + l;
            if (v < nvec) store_out<T>(a, v, x[u]);
          }
        }
      });
  __syncthreads();
  agree_verify(a.env, WF_AR_SITE_AGREE);
  epoch_advance(epochs_of(a), E);
}


/* ------------------------------------------------------------------ launch */

int esize_of(int dtype) { return dtype == WEFT_F32 ? 4 : 2; }

/* wf::resident with a cache of 33 slots per kernel, by threads / 32 */
template <typename K> int resident_by_size(K kernel, int threads, int *cache) {
  return resident(kernel, threads, &cache[threads / 32 < 32 ? threads / 32 : 32]);
}

struct Shape {
  int grid, threads;
};

/* The launch shape: a deterministic function of the call (size, world,
 * kind) and the handle's agreed parameters, so every rank launches the same
 * grid. Automatic choices:
 *  - Lamport: spread the vectors over all SMs, one per thread, with blocks
 *    of 64-256 threads (a 64 KiB call is 64 blocks of 64 threads, not 16 of
 *    256: per-SM push and poll work, not the link, dominates small calls);
 *    larger calls fill the co-resident grid and loop.
 *  - flag one-shot / two-shot: 512 threads, blocks_per_sm per SM, and the
 *    round count balanced across blocks. */
template <typename KL, typename KF, typename K2>
Shape shape_for(const wf_ar_args *a, uint64_t nvec, KL lam, KF flag, K2 two, int *occ /* [3][33] */) {
  const int sms = a->sms > 0 ? a->sms : 1;
  const uint64_t bps = (uint64_t)(a->blocks_per_sm > 0 ? a->blocks_per_sm : 2);
  Shape sh;
  uint64_t g, cap;
  if (a->kind == WF_AR_LAMPORT) {
    int t = a->threads > WF_AR_LAMPORT_THREADS ? WF_AR_LAMPORT_THREADS : a->threads;
    if (t <= 0) {
      const uint64_t per = cdiv(cdiv(nvec, (uint64_t)sms), 32) * 32;
      t = per < 64 ? 64 : per > WF_AR_LAMPORT_THREADS ? WF_AR_LAMPORT_THREADS : (int)per;
    }
    sh.threads = t;
    cap = (uint64_t)sms * resident_by_size(lam, t, &occ[0]);
    g = a->grid > 0 ? (uint64_t)a->grid : cdiv(nvec, (uint64_t)t);
    if (g > cap) g = cap;
  } else if (a->kind == WF_AR_ONESHOT_FLAG) {
    const int t = a->threads > 0 ? a->threads : WF_AR_FLAG_THREADS;
    sh.threads = t;
    const uint64_t r = (uint64_t)resident_by_size(flag, t, &occ[33]);
    cap = (uint64_t)sms * (bps < r ? bps : r);
    const uint64_t cv = (uint64_t)t * WF_AR_FLAG_UNROLL * (uint64_t)(a->sub > 0 ? a->sub : 1);
    const uint64_t chunks = cdiv(nvec, cv);
    if (a->split) {
      if (cap > WF_MAX_GRID) cap = WF_MAX_GRID;
      g = a->grid > 0 ? (uint64_t)a->grid : 2 * balanced(chunks, cap / 2 > 0 ? cap / 2 : 1);
      if (g > cap) g = cap;
      g &= ~(uint64_t)1; /* pushers and reducers pair up */
      if (g < 2) g = 2;  /* (2 blocks always fit: one per SM at least) */
    } else {
      g = a->grid > 0 ? (uint64_t)a->grid : balanced(chunks, cap);
      if (g > cap) g = cap;
    }
  } else {
    sh.threads = WF_AR_FLAG_THREADS; /* fixed: the two-shot data layout depends on it */
    const uint64_t r = (uint64_t)resident_by_size(two, WF_AR_FLAG_THREADS, &occ[66]);
    cap = (uint64_t)sms * (bps < r ? bps : r);
    const uint64_t per = (uint64_t)WF_AR_FLAG_THREADS * WF_AR_TWOSHOT_UNROLL(a->world) * a->world;
    g = a->grid > 0 ? (uint64_t)a->grid : balanced(cdiv(nvec, per), cap);
    if (g > cap) g = cap;
  }
  if (g < 1) g = 1;
  if (g > WF_MAX_GRID) g = WF_MAX_GRID;
  if (a->kind == WF_AR_ONESHOT_FLAG && a->split) g &= ~(uint64_t)1;
  sh.grid = (int)g;
  return sh;
}

template <typename K>
cudaError_t launch_k(K kernel, int grid, int threads, const KArgs &k, int pdl, cudaStream_t s) {
  return launch_pdl(kernel, dim3(grid), dim3(threads), s, pdl != 0, k);
}

/* D: the deterministic-mode flag kernels (the Lamport one-shot is one
 * kernel for both modes: it always sanitises). Each instantiation has its own
 * occupancy cache: the grid is capped to what that kernel keeps resident. */
template <typename T, int W, bool D>
cudaError_t launch_twd(const wf_ar_args *a, const KArgs &k, int *grid_out, int *threads_out,
                       cudaStream_t s, bool launch) {
  static int occ[3 * 33];
  const Shape sh = shape_for(a, k.nvec, ar_lamport<T, W>, ar_oneshot_flag<T, W, D>, ar_twoshot<T, W, D>, occ);
  *grid_out = sh.grid;
  *threads_out = sh.threads;
  if (!launch) return cudaSuccess; /* shape query only */
  KArgs ka = k; /* the call's descriptor: what every rank must launch alike */
  ka.env.ag.d0 = wf_agree_d0(WF_AGREE_AR, (unsigned)a->kind, (unsigned)a->dtype, 0, (unsigned)sh.grid,
                             (unsigned)sh.threads, (unsigned)(k.sub & 15) | (k.split ? 16u : 0u) | (D ? 32u : 0u));
  ka.env.ag.d1 = a->count;
  switch (a->kind) {
    case WF_AR_LAMPORT: return launch_k(ar_lamport<T, W>, sh.grid, sh.threads, ka, a->pdl, s);
    case WF_AR_ONESHOT_FLAG: return launch_k(ar_oneshot_flag<T, W, D>, sh.grid, sh.threads, ka, a->pdl, s);
    case WF_AR_TWOSHOT: return launch_k(ar_twoshot<T, W, D>, sh.grid, sh.threads, ka, a->pdl, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int W>
cudaError_t launch_tw(const wf_ar_args *a, const KArgs &k, int *g, int *t, cudaStream_t s, bool launch) {
  return a->determ ? launch_twd<T, W, true>(a, k, g, t, s, launch)
                   : launch_twd<T, W, false>(a, k, g, t, s, launch);
}

template <typename T>
cudaError_t launch_t(const wf_ar_args *a, const KArgs &k, int *g, int *t, cudaStream_t s, bool launch) {
  switch (a->world) {
    case 2: return launch_tw<T, 2>(a, k, g, t, s, launch);
    case 4: return launch_tw<T, 4>(a, k, g, t, s, launch);
    case 6: return launch_tw<T, 6>(a, k, g, t, s, launch);
    case 8: return launch_tw<T, 8>(a, k, g, t, s, launch);
    default: return cudaErrorInvalidValue;
  }
}

/* Launch one dtype (launch = false: only compute the grid and block size a
 * call would use). */
template <typename T>
int ar_launch_t(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch) {
  KArgs k;
  const int es = esize_of(a->dtype);
  k.in = static_cast<const char *>(a->in);
  k.out = static_cast<char *>(a->out);
  k.nvec = wf_ar_nvec(a->count, es);
  k.tail = (int)((a->count * es) % 16) / es;
  k.rank = a->rank;
  for (int i = 0; i < WF_MAX_WORLD; i++) k.ws[i] = a->ws[i];
  k.off_lamport = a->off_lamport;
  k.lamport_slot = a->lamport_slot;
  k.off_data = a->off_data;
  k.data_par = a->data_par;
  k.sub = a->sub > 0 ? a->sub : 1;
  k.split = a->split ? 1 : 0;
  k.env.abort_host = a->abort_host;
  k.env.err_dev = reinterpret_cast<unsigned long long *>(a->ws[a->rank] + WF_AR_OFF_ERR);
  k.env.err_host = a->err_host;
  k.env.timeout_ns = a->timeout_ns;
  k.env.ag = a->agree;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return (int)launch_t<T>(a, k, grid, threads, s, launch);
}

}  // namespace

/* ar_launch_t of one dtype: each defined by WF_AR_UNIT in a unit the build
 * writes (mk/kernel_units.mk) */
namespace wf_ar {
int launch_bf16(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch);
int launch_f16(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch);
int launch_f32(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch);
}  // namespace wf_ar

#define WF_AR_UNIT(name, T)                                                                           \
  int wf_ar::launch_##name(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch) { \
    return ar_launch_t<T>(a, stream, grid, threads, launch);                                          \
  }
