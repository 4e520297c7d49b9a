/* fused_norm.cu — all-reduce fused with residual add + RMSNorm (+ FP8 quant).
 *
 * Two kernels over one workspace per rank (layout: src/fusion_internal.h,
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
 * weft_cuda_rmsnorm: the norm of residual_out). So every rank gets bit-equal
 * outputs, one-shot and two-shot agree bit for bit, and switching algorithm
 * with the size never changes the numbers.
 *
 * Rows map to blocks the same way in every phase (row i of a range -> block
 * i mod G), so in-place calls (out == in, residual_out == residual,
 * norm_out == in) are safe.
 *
 * Waits: wf::bounded_spin (abort word, deadline, device error word); a
 * failure makes the block skip its remaining work and return without
 * advancing its epoch (the workspace is then poisoned: every later launch
 * returns at once, the host reports the packed error). No block waits for
 * another block of its own grid, and the grid is at most what is resident,
 * so the blocks a peer waits for are always running.
 *
 * Programmatic dependent launch: every kernel starts with
 * griddepcontrol.wait (a no-op without the PDL launch attribute), so it may
 * be launched before its predecessor ends. trigger_completion_at_end = 0:
 * each block executes griddepcontrol.launch_dependents right after its
 * pushes, so the next kernel in the stream may be scheduled (and run its
 * prologue up to its own wait) while we wait for peers; = 1: only after the
 * block's last store. Either way the dependent's griddepcontrol.wait sees
 * all of this kernel's writes (it waits for the whole grid to complete and
 * flush); only the overlap differs. */
#include <cuda_runtime.h>
#include <cuda_fp8.h>

#include <mutex>

#include "common.cuh"
#include "fusion_internal.h"
#include "weft.h"

namespace {

using namespace wf;
static_assert(WF_FUSED_MAX_BLOCKS == WF_MAX_BLOCKS, "epoch slots / flag rows disagree");

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Elements per 16-byte vector; threads per block at most MAXT (f32 gets 512
 * so that its 128-register budget holds a 16384-wide row without spills);
 * VMAX vectors per thread cover hidden 16384. */
template <typename T> struct Geo {
  static constexpr int EPV = 16 / (int)sizeof(T);
  static constexpr int MAXT = sizeof(T) == 4 ? 512 : 1024;
  static constexpr int VMAX = WF_FUSED_MAX_HIDDEN / EPV / MAXT;
  /* residual_out vectors a thread keeps in registers between the sum and
   * the norm (the first; for wider rows it reads back its own store, an L1/L2
   * hit): this keeps every instantiation within its register budget with no
   * spills (check: make fusion-ptxas BUILD=...) */
  static constexpr int YK = 1;
};
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

/* Block-wide sum; every thread gets the result. red: [2][32] shared,
 * alternated by the caller's row parity (one barrier per row). The barrier
 * also ORs `fail` over the block into *any_fail (block-uniform). */
__device__ __forceinline__ float block_sum(float v, float (*red)[32], int parity, bool fail,
                                           bool *any_fail) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) red[parity][warp] = v;
  *any_fail = __syncthreads_or(fail) != 0;
  float s = 0.f;
  for (int w = 0; w < nwarps; w++) s += red[parity][w]; /* same order everywhere */
  return s;
}

/* Sum of squares of a packed vector (in f32). */
template <typename T> __device__ __forceinline__ float sumsq(uint4 yv) {
  float y[Geo<T>::EPV];
  Pack<T>::to_f32(yv, y);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < Geo<T>::EPV; e++) s += y[e] * y[e];
  return s;
}

/* Stores the norm of the packed residual_out vector yv (y * rstd * w) as
 * dtype and/or e4m3. */
template <typename T>
__device__ __forceinline__ void store_norm(const wf_fused_args &a, size_t goff_bytes, int j,
                                           uint4 yv, float rstd, float inv_scale) {
  constexpr int EPV = Geo<T>::EPV;
  float x[EPV], g[EPV], n[EPV];
  Pack<T>::to_f32(yv, x);
  Pack<T>::to_f32(ld_vec((const char *)a.gamma + (size_t)j * 16), g);
  const float one = (a.flags & WF_FUSED_GEMMA) ? 1.f : 0.f;
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

/* ------------------------------------------------------------- one-shot */

template <typename T, int W>
__global__ void __launch_bounds__(Geo<T>::MAXT, 1) oneshot_kernel(const wf_fused_args a) {
  constexpr int EPV = Geo<T>::EPV, VMAX = Geo<T>::VMAX, YK = Geo<T>::YK;
  __shared__ float red[2][32];
  griddep_wait();
  char *const local = (char *)a.peer[a.rank];
  wf_fused_state *const st = (wf_fused_state *)(local + a.off_state);
  const uint32_t E = epoch_load(st->lamport_epoch); /* in flight with the check below */
  /* Poisoned by an earlier failure (epochs may disagree now): push nothing,
   * leave (a block-uniform decision), so the peers time out cleanly. */
  if (__syncthreads_or(threadIdx.x == 0 && *(volatile unsigned long long *)a.err_dev != 0ull))
    return;
  const SpinEnv env{a.abort_host, a.err_dev, a.err_host, a.timeout_ns};
  const int cur = (int)(E % 3u), clr = (int)((E + 2u) % 3u);
  const int NV = a.hidden / EPV, rank = a.rank;
  const size_t RB = (size_t)a.hidden * sizeof(T);
  const size_t slot = (size_t)a.tokens * RB;
  const uint64_t lam = a.off_lamport + (uint64_t)cur * a.lamport_buf_bytes;
  const char *const in = (const char *)a.in;

  /* Rows of this block: row(i) = blockIdx.x + i * G, i < n (n >= 1 since
   * G <= tokens). Streaming: row i + D is pushed before row i is consumed,
   * so the link keeps carrying this block's data while it waits, reduces
   * and normalises, and the re-read of its own input row hits L2. */
  constexpr int D = 2;
  const int n = (a.tokens - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  const uint64_t mine = lam + (uint64_t)rank * slot;
  auto push_row = [&](int i) {
    const size_t row = (size_t)blockIdx.x + (size_t)i * gridDim.x;
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < NV) {
        const size_t off = row * RB + (size_t)j * 16;
        const uint4 v = lamport_sanitize<T>(ld_vec(in + off));
#pragma unroll
        for (int q = 1; q < W; q++) st_vec((char *)a.peer[(rank + q) % W] + mine + off, v);
      }
    }
  };
  for (int i = 0; i < n && i < D; i++) push_row(i);
  if (!(a.flags & WF_FUSED_TRIGGER_AT_END)) griddep_launch();

  /* What call E - 1 wrote into buffer clr (the peers' slots, cb bytes each)
   * is cleared along the way: this block's share of the vectors, in n parts. */
  const uint64_t cb = st->lamport_bytes[clr];
  char *const cbase = local + a.off_lamport + (uint64_t)clr * a.lamport_buf_bytes;
  const size_t cvec = cb / 16, ctotal = (size_t)(W - 1) * cvec;
  const size_t clo = ctotal * blockIdx.x / gridDim.x, chi = ctotal * (blockIdx.x + 1) / gridDim.x;
  auto clear_part = [&](int i) {
    const size_t lo = clo + (chi - clo) * i / n, hi = clo + (chi - clo) * (i + 1) / n;
    const uint4 nz = lamport_empty_vec();
#pragma unroll 1
    for (int q = 0; q < W - 1; q++) { /* peer slot (rank + 1 + q) % W owns [q*cvec, (q+1)*cvec) */
      const size_t a0 = lo > q * cvec ? lo : q * cvec;
      const size_t a1 = hi < (q + 1) * cvec ? hi : (q + 1) * cvec;
      char *const sb = cbase + (size_t)((rank + 1 + q) % W) * cb - q * cb;
      for (size_t v = a0 + threadIdx.x; v < a1; v += blockDim.x) st_vec(sb + v * 16, nz);
    }
  };

  /* 3. poll own buffer, reduce, residual, norm */
  const char *const lamb = local + lam;
  const bool fp32_acc = (a.flags & WF_FUSED_FP32_ACC) != 0;
  const float inv_scale = load_inv_scale(a);
  bool failed = false;
  int parity = 0;
  for (int i = 0; i < n; i++, parity ^= 1) {
    if (i + D < n) push_row(i + D);
    clear_part(i);
    const size_t row = (size_t)blockIdx.x + (size_t)i * gridDim.x;
    uint4 y[YK];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < NV && !failed) {
        const size_t off = row * RB + (size_t)j * 16;
        /* the residual's load goes out before the wait, not after it */
        const uint4 rv = a.pattern == WF_FUSED_AR ? make_uint4(0, 0, 0, 0)
                                                  : ld_vec((const char *)a.res_in + off);
        float f[EPV];
        failed = !sum_ranks<T, W>(
            [&](int s) {
              return s == rank ? lamport_sanitize<T>(ld_vec(in + off))
                               : ld_vec_volatile(lamb + (size_t)s * slot + off);
            },
            [&](int s, uint4 &v) {
              if (s == rank || !lamport_pending(v)) return true;
              const char *p = lamb + (size_t)s * slot + off;
              return bounded_spin([&] { v = ld_vec_volatile(p); return !lamport_pending(v); },
                                  env, (uint32_t)s, WF_FUSED_SITE_LAMPORT, E) == SPIN_OK;
            },
            fp32_acc, f);
        if (!failed) {
          if (a.pattern == WF_FUSED_AR) {
            st_vec((char *)a.out + off, Pack<T>::from_f32(f));
          } else {
            float r[EPV];
            Pack<T>::to_f32(rv, r);
#pragma unroll
            for (int e = 0; e < EPV; e++) f[e] += r[e];
            const uint4 yv = Pack<T>::from_f32(f);
            if (k < YK) y[k < YK ? k : 0] = yv;
            ss += sumsq<T>(yv);
            st_vec((char *)a.res_out + off, yv);
          }
        }
      }
    }
    if (a.pattern != WF_FUSED_AR) {
      bool any_fail;
      const float tot = block_sum(ss, red, parity, failed, &any_fail);
      if (any_fail) { failed = true; break; } /* block-uniform */
      const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
      for (int k = 0; k < VMAX; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < NV)
          store_norm<T>(a, row * RB + (size_t)j * 16, j,
                        kept<YK>(y, k, (char *)a.res_out + row * RB + (size_t)j * 16), rstd,
                        inv_scale);
      }
    }
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) st->lamport_bytes[cur] = slot;
  if (__syncthreads_or(failed)) return; /* poisoned; the error word says why */
  epoch_advance(st->lamport_epoch, E);
  if (a.flags & WF_FUSED_TRIGGER_AT_END) griddep_launch();
}

/* ------------------------------------------------------------- two-shot */

__device__ __forceinline__ int range_start(int p, int tokens, int W) {
  return (int)((int64_t)p * tokens / W);
}

template <typename T, int W>
__global__ void __launch_bounds__(Geo<T>::MAXT, 1) twoshot_kernel(const wf_fused_args a) {
  constexpr int EPV = Geo<T>::EPV, VMAX = Geo<T>::VMAX, YK = Geo<T>::YK;
  __shared__ float red[2][32];
  griddep_wait();
  char *const local = (char *)a.peer[a.rank];
  wf_fused_state *const st = (wf_fused_state *)(local + a.off_state);
  const uint32_t E = epoch_load(st->flag_epoch);
  if (__syncthreads_or(threadIdx.x == 0 && *(volatile unsigned long long *)a.err_dev != 0ull))
    return;
  const SpinEnv env{a.abort_host, a.err_dev, a.err_host, a.timeout_ns};
  const uint32_t par = E & 1u;
  const int NV = a.hidden / EPV, rank = a.rank, tid = threadIdx.x;
  const size_t RB = (size_t)a.hidden * sizeof(T);
  const int rows_per = (a.tokens + W - 1) / W;
  const size_t slot = (size_t)rows_per * RB;
  const char *const in = (const char *)a.in;
  /* flags[par][phase][block][sender] in the receiver's workspace */
  auto flag = [&](const void *base, int phase, int sender) {
    return (uint64_t *)((char *)base + a.off_flags) +
           (((size_t)(par * 2 + phase) * WF_MAX_BLOCKS + blockIdx.x) * 8 + sender);
  };

  /* 1. reduce-scatter push: my rows of range p into p's RS inbox slot [rank] */
#pragma unroll 1
  for (int i = 1; i < W; i++) {
    const int p = (rank + i) % W;
    const int ps = range_start(p, a.tokens, W), pn = range_start(p + 1, a.tokens, W) - ps;
    char *const dst = (char *)a.peer[p] + a.off_rs + (size_t)rank * slot;
    for (int r = blockIdx.x; r < pn; r += gridDim.x) {
      uint4 v[VMAX];
#pragma unroll
      for (int k = 0; k < VMAX; k++) {
        const int j = tid + k * blockDim.x;
        if (j < NV) v[k] = lamport_sanitize<T>(ld_vec(in + (size_t)(ps + r) * RB + (size_t)j * 16));
      }
#pragma unroll
      for (int k = 0; k < VMAX; k++) {
        const int j = tid + k * blockDim.x;
        if (j < NV) st_vec(dst + (size_t)r * RB + (size_t)j * 16, v[k]);
      }
    }
  }
  if (!(a.flags & WF_FUSED_TRIGGER_AT_END)) griddep_launch();
  __syncthreads(); /* every push of the block precedes the release below */
  if (tid < W && tid != rank) st_release_sys(flag(a.peer[tid], 0, rank), flag_value(E, 1));
  bool fail = tid < W && tid != rank &&
              wait_flag_geq(flag(local, 0, tid), flag_value(E, 1), env, (uint32_t)tid,
                            WF_FUSED_SITE_RS, E) != SPIN_OK;
  if (__syncthreads_or(fail)) return;

  /* 2. own rows: sum, residual, round, push to every peer's AG inbox, norm */
  const bool fp32_acc = (a.flags & WF_FUSED_FP32_ACC) != 0;
  const bool is_ar = a.pattern == WF_FUSED_AR;
  const float inv_scale = load_inv_scale(a);
  const uint64_t ag_mine = a.off_ag + (uint64_t)rank * slot;
  const char *const rs = local + a.off_rs;
  const int ms = range_start(rank, a.tokens, W), mn = range_start(rank + 1, a.tokens, W) - ms;
  int parity = 0;
  for (int r = blockIdx.x; r < mn; r += gridDim.x, parity ^= 1) {
    uint4 y[YK];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (j < NV) {
        const size_t off = (size_t)r * RB + (size_t)j * 16;
        const size_t goff = (size_t)(ms + r) * RB + (size_t)j * 16;
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
#pragma unroll
          for (int e = 0; e < EPV; e++) f[e] += res[e];
        }
        const uint4 yv = Pack<T>::from_f32(f);
        st_vec((char *)(is_ar ? a.out : a.res_out) + goff, yv);
#pragma unroll
        for (int i = 1; i < W; i++) st_vec((char *)a.peer[(rank + i) % W] + ag_mine + off, yv);
        if (k < YK) y[k < YK ? k : 0] = yv;
        if (!is_ar) ss += sumsq<T>(yv);
      }
    }
    if (!is_ar) {
      bool unused;
      const float tot = block_sum(ss, red, parity, false, &unused);
      const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
      for (int k = 0; k < VMAX; k++) {
        const int j = tid + k * blockDim.x;
        if (j < NV)
          store_norm<T>(a, (size_t)(ms + r) * RB + (size_t)j * 16, j,
                        kept<YK>(y, k, (char *)a.res_out + (size_t)(ms + r) * RB + (size_t)j * 16),
                        rstd, inv_scale);
      }
    }
  }
  __syncthreads();
  if (tid < W && tid != rank) st_release_sys(flag(a.peer[tid], 1, rank), flag_value(E, 2));

  /* 3. the peers' rows: copy y into residual_out (out), normalise */
  const char *const ag = local + a.off_ag;
#pragma unroll 1
  for (int i = 1; i < W; i++) {
    const int p = (rank + W - i) % W;
    fail = tid == 0 && wait_flag_geq(flag(local, 1, p), flag_value(E, 2), env, (uint32_t)p,
                                     WF_FUSED_SITE_AG, E) != SPIN_OK;
    if (__syncthreads_or(fail)) return;
    const int ps = range_start(p, a.tokens, W), pn = range_start(p + 1, a.tokens, W) - ps;
    for (int r = blockIdx.x; r < pn; r += gridDim.x, parity ^= 1) {
      uint4 y[YK];
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < VMAX; k++) {
        const int j = tid + k * blockDim.x;
        if (j < NV) {
          const size_t goff = (size_t)(ps + r) * RB + (size_t)j * 16;
          const uint4 yv = ld_vec_cg(ag + (size_t)p * slot + (size_t)r * RB + (size_t)j * 16);
          if (k < YK) y[k < YK ? k : 0] = yv;
          st_vec((char *)(is_ar ? a.out : a.res_out) + goff, yv);
          if (!is_ar) ss += sumsq<T>(yv);
        }
      }
      if (!is_ar) {
        bool unused;
        const float tot = block_sum(ss, red, parity, false, &unused);
        const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
        for (int k = 0; k < VMAX; k++) {
          const int j = tid + k * blockDim.x;
          if (j < NV)
            store_norm<T>(a, (size_t)(ps + r) * RB + (size_t)j * 16, j,
                          kept<YK>(y, k, (char *)a.res_out + (size_t)(ps + r) * RB + (size_t)j * 16),
                          rstd, inv_scale);
        }
      }
    }
  }
  __syncthreads();
  epoch_advance(st->flag_epoch, E);
  if (a.flags & WF_FUSED_TRIGGER_AT_END) griddep_launch();
}

/* ------------------------------------------------------------ host side */

__global__ void fill_u32_kernel(uint32_t *p, size_t n, uint32_t v) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = v;
}

typedef void (*kernel_fn)(const wf_fused_args);

template <typename T> kernel_fn pick_w(int algo, int world) {
#define WF_CASE(w) \
  case w: return algo == WF_FUSED_ONESHOT ? oneshot_kernel<T, w> : twoshot_kernel<T, w>;
  switch (world) {
    WF_CASE(2) WF_CASE(3) WF_CASE(4) WF_CASE(5) WF_CASE(6) WF_CASE(7) WF_CASE(8)
  }
#undef WF_CASE
  return nullptr;
}

kernel_fn pick(int dtype, int algo, int world) {
  switch (dtype) {
  case WEFT_BF16: return pick_w<__nv_bfloat16>(algo, world);
  case WEFT_F16: return pick_w<__half>(algo, world);
  case WEFT_F32: return pick_w<float>(algo, world);
  }
  return nullptr;
}

/* Resident blocks per SM for (kernel, threads), cached: deterministic for a
 * given binary and device, hence equal on every rank of a homogeneous node. */
int blocks_per_sm(kernel_fn k, int threads, int *out) {
  struct entry { kernel_fn k; int threads, n; };
  static entry cache[256];
  static int used = 0;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; i++)
    if (cache[i].k == k && cache[i].threads == threads) { *out = cache[i].n; return 0; }
  int n = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, threads, 0);
  if (e != cudaSuccess) return (int)e;
  if (n < 1) n = 1;
  if (used < 256) { cache[used].k = k; cache[used].threads = threads; cache[used].n = n; used++; }
  *out = n;
  return 0;
}

int geometry(const wf_fused_args *a, int algo, kernel_fn *kf, int *blocks, int *threads) {
  const int esz = a->dtype == WEFT_F32 ? 4 : 2;
  const int maxt = esz == 4 ? Geo<float>::MAXT : Geo<__nv_bfloat16>::MAXT;
  const int vmax = esz == 4 ? Geo<float>::VMAX : Geo<__nv_bfloat16>::VMAX;
  const int nv = a->hidden * esz / 16;
  const int per = (nv + maxt - 1) / maxt;
  int t = (nv + per - 1) / per;
  t = (t + 31) / 32 * 32;
  const kernel_fn k = pick(a->dtype, algo, a->world);
  if (!k || nv < 1 || per > vmax) return (int)cudaErrorInvalidValue;
  int bps = 1;
  int e = blocks_per_sm(k, t, &bps);
  if (e) return e;
  const int work = algo == WF_FUSED_ONESHOT ? a->tokens : (a->tokens + a->world - 1) / a->world;
  long g = (long)(a->num_sms > 0 ? a->num_sms : 1) * bps;
  if (g > work) g = work;
  if (g > WF_MAX_BLOCKS) g = WF_MAX_BLOCKS;
  if (g < 1) g = 1;
  *kf = k;
  *blocks = (int)g;
  *threads = t;
  return 0;
}

}  // namespace

extern "C" int wf_fused_grid(const wf_fused_args *a, int algo, int *blocks, int *threads) {
  kernel_fn k;
  return geometry(a, algo, &k, blocks, threads);
}

extern "C" int wf_fused_launch(const wf_fused_args *a, int algo, void *stream) {
  kernel_fn k;
  int blocks, threads;
  int e = geometry(a, algo, &k, &blocks, &threads);
  if (e) return e;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = (cudaStream_t)stream;
  if (a->flags & WF_FUSED_PDL) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return (int)cudaLaunchKernelEx(&cfg, k, *a);
}

extern "C" int wf_fused_init(void *base, uint64_t lamport_off, uint64_t lamport_bytes,
                             uint64_t zero_bytes, int dtype, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  cudaError_t e = cudaMemsetAsync(base, 0, zero_bytes, s);
  if (e != cudaSuccess) return (int)e;
  (void)dtype; /* the sentinel word is the same for every dtype */
  const uint32_t pat = kLamportEmpty;
  const size_t n = lamport_bytes / 4;
  if (n) fill_u32_kernel<<<1024, 256, 0, s>>>((uint32_t *)((char *)base + lamport_off), n, pat);
  return (int)cudaGetLastError();
}
