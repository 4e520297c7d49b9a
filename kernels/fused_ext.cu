/* fused_ext.cu — the fusion patterns beyond AR + residual + RMSNorm
 * (host side and workspace layout: src/coll/fusion_ext.c,
 * fusion_ext_internal.h): MoE reduction / MoE finalize + all-reduce +
 * residual + RMSNorm, all-reduce + pre/post RMSNorm, reduce-scatter +
 * residual + RMSNorm (+ all-gather of the normalised rows).
 *
 * One kernel per (dtype, algorithm); the world size and the pattern are
 * arguments. A rank's contribution to a token is computed where it is pushed:
 * for the MoE patterns the weighted sum of its top_k expert outputs (plus the
 * shared expert's) in f32, rounded once to the dtype (what the unfused path
 * stores before its all-reduce); for the others the input row.
 *
 * One-shot: block b owns rows b, b+G, ...; it pushes its rows' contributions
 * into slot [rank] of every rank's one-shot inbox (its own included), raises
 * flag (parity, phase 0, b, rank) on every rank (release, system scope, after
 * a __syncthreads: cumulative over the block's stores), waits for the W flags
 * of block b in its own memory, then reduces its rows: the W slots summed in
 * rank order in f32, the epilogue of the pattern, the outputs.
 * Two-shot: tokens split in W ranges (range p = [pT/W, (p+1)T/W)); block b
 * pushes its rows of range p to p's reduce-scatter inbox, flags, waits; the
 * owner reduces its range (epilogue included) and pushes residual_out (the
 * reduce-scatter pattern: norm_out, and only when the all-gather is asked
 * for) to every peer's all-gather inbox, flags (phase 1), waits; every rank
 * then takes the peers' rows and normalises them itself (the same function
 * of the same bits: identical outputs on every rank).
 *
 * Numbers: every rank and both algorithms produce the same bits: the rank
 * sum has one order, and a row's sums of squares are reduced by block_sum
 * (kernels/fused_ext.cuh), whose order depends on hidden alone.
 *   MoE, MoE finalize: y = round(sum + residual) = residual_out,
 *                      norm_out = round(y * rsqrt(mean(y^2) + eps) * w)
 *   pre/post:          p = round(s * rsqrt(mean(s^2) + eps_pre) * w_pre) (s: the f32 sum),
 *                      y = round(p + residual) = residual_out, norm_out as above
 *   reduce-scatter:    as MoE, on this rank's slice (residual and outputs are
 *                      slices), gathered_out = the slices of every rank.
 * Epochs: one slot per block in the workspace (kernels/common.cuh
 * epoch_advance makes every slot E + 1, so the grid may change between
 * calls); data and flags alternate between two parities: a peer is at most
 * one call ahead (its next call waits for our flags of this one). A failed
 * wait (timeout, abort) leaves the kernel without advancing the epoch: the
 * workspace is poisoned and later launches return at once; the host reports
 * the packed error word. The grid is at most one block per SM (every block
 * resident; blocks pair by index across ranks). */
#include <cuda_runtime.h>

#include "fused_ext.cuh"
#include "coll/fusion_ext_internal.h"
#include "weft.h"

namespace {

using namespace wfx;
static_assert(WF_MAX_GRID == WF_MAX_GRID, "epoch slots / flag rows disagree");

/* bf16/f16 rows of at most 16384: 2048 vectors = 2 per thread */
constexpr int VM = 2;

__device__ __forceinline__ uint64_t *flag_at(void *base, uint64_t off, int par, int phase, int block,
                                             int sender) {
  return flag_in((char *)base + off, (uint32_t)par, phase, block, sender);
}

/* This rank's contribution to vector j of token t (rounded to T). */
template <typename T>
__device__ __forceinline__ uint4 contribution(const wfx_args &a, const MoeIn &m, bool moe, int t,
                                              int j, size_t rb) {
  if (!moe) return ld_vec((const char *)a.input + (size_t)t * rb + (size_t)j * 16);
  float acc[Pack<T>::N];
  moe_vec<T, 2>(m, t, j, rb, acc);   /* 2: the two-shot kernel spills with 4 */
  return Pack<T>::from_f32(acc);
}

/* Raise (par, phase, block) on every rank, wait for every rank's; false
 * (uniform over the block) when a wait failed. */
__device__ __forceinline__ bool exchange(const wfx_args &a, const SpinEnv &env, int par, int phase,
                                         uint32_t E, uint32_t site) {
  __syncthreads();
  const int tid = threadIdx.x;
  const uint64_t v = flag_value(E, (uint32_t)phase + 1u);
  if (tid < a.world) st_release_sys(flag_at(a.peer[tid], a.off_flags, par, phase, blockIdx.x, a.rank), v);
  bool fail = false;
  if (tid < a.world)
    fail = wait_flag_geq(flag_at(a.peer[a.rank], a.off_flags, par, phase, blockIdx.x, tid), v, env,
                         (uint32_t)tid, site, E) != SPIN_OK;
  return !__syncthreads_or(fail);
}

/* Sum the W slots of a row (slot s at in0 + s * stride), apply the pattern's
 * epilogue with the residual at res (row), store residual_out / norm_out at
 * ro / no (rows; NULL: not stored); yv / nvv get the rounded residual_out and
 * norm vectors of this thread. */
template <typename T>
__device__ __forceinline__ void finish_row(const wfx_args &a, const char *in0, size_t stride,
                                           const char *res, char *ro, char *no, float *red,
                                           uint4 (&yv)[VM], uint4 (&nvv)[VM]) {
  constexpr int N = Pack<T>::N;
  const int nv = a.hidden / N, W = a.world;
  const bool pp = a.pattern == WEFT_FX_AR_PREPOST_RMSNORM, gemma = (a.flags & WEFT_FX_GEMMA) != 0;
  float f[VM][N];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < VM; k++) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < nv) {
      Pack<T>::to_f32(ld_vec_cg(in0 + (size_t)j * 16), f[k]);
      for (int s = 1; s < W; s++) acc_add<T>(f[k], ld_vec_cg(in0 + (size_t)s * stride + (size_t)j * 16));
      if (pp) {
        ss += sumsq_f32<T>(f[k]);
      } else {
        float r[N];
        Pack<T>::to_f32(ld_vec(res + (size_t)j * 16), r);
#pragma unroll
        for (int e = 0; e < N; e++) f[k][e] += r[e];
        yv[k] = Pack<T>::from_f32(f[k]);
        Pack<T>::to_f32(yv[k], f[k]);
        ss += sumsq_f32<T>(f[k]);
      }
    }
  }
  if (pp) {
    const float rstd1 = rsqrtf(block_sum(ss, red) / (float)a.hidden + a.eps_pre);
    ss = 0.f;
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) {
        const uint4 pv = norm_vec<T>(f[k], rstd1, ld_vec((const char *)a.weight_pre + (size_t)j * 16), gemma);
        float r[N];
        Pack<T>::to_f32(pv, f[k]);
        Pack<T>::to_f32(ld_vec(res + (size_t)j * 16), r);
#pragma unroll
        for (int e = 0; e < N; e++) f[k][e] += r[e];
        yv[k] = Pack<T>::from_f32(f[k]);
        Pack<T>::to_f32(yv[k], f[k]);
        ss += sumsq_f32<T>(f[k]);
      }
    }
  }
  const float rstd = rsqrtf(block_sum(ss, red) / (float)a.hidden + a.eps);
#pragma unroll
  for (int k = 0; k < VM; k++) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < nv) {
      nvv[k] = norm_vec<T>(f[k], rstd, ld_vec((const char *)a.weight + (size_t)j * 16), gemma);
      if (ro) st_vec(ro + (size_t)j * 16, yv[k]);
      if (no) st_vec(no + (size_t)j * 16, nvv[k]);
    }
  }
}

/* A peer's finished row y (residual_out): store it and its norm. */
template <typename T>
__device__ __forceinline__ void norm_of(const wfx_args &a, const char *yin, char *ro, char *no,
                                        float *red) {
  constexpr int N = Pack<T>::N;
  const int nv = a.hidden / N;
  const bool gemma = (a.flags & WEFT_FX_GEMMA) != 0;
  float f[VM][N];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < VM; k++) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < nv) {
      const uint4 y = ld_vec_cg(yin + (size_t)j * 16);
      st_vec(ro + (size_t)j * 16, y);
      Pack<T>::to_f32(y, f[k]);
      ss += sumsq_f32<T>(f[k]);
    }
  }
  const float rstd = rsqrtf(block_sum(ss, red) / (float)a.hidden + a.eps);
#pragma unroll
  for (int k = 0; k < VM; k++) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < nv)
      st_vec(no + (size_t)j * 16, norm_vec<T>(f[k], rstd, ld_vec((const char *)a.weight + (size_t)j * 16), gemma));
  }
}

template <typename T, int ALGO>
__global__ void __launch_bounds__(kMaxThreads) fx_kernel(const wfx_args a) {
  constexpr int N = Pack<T>::N;
  __shared__ float red[33];
  pdl_wait();
  agree_announce(a.agree);
  const int tid = threadIdx.x, W = a.world, rank = a.rank, G = gridDim.x, b = blockIdx.x;
  char *const local = (char *)a.peer[rank];
  wfx_state *const st = (wfx_state *)local;
  const uint32_t E = epoch_load(st->epoch);
  /* a poisoned workspace: leave (uniformly) */
  if (__syncthreads_or(tid == 0 && *(volatile unsigned long long *)a.err_dev != 0ull)) return;
  if (a.flags & WEFT_FX_PDL) pdl_launch_dependents();
  const int par = (int)(E & 1u);
  const SpinEnv env{a.abort_host, a.err_dev, a.err_host, a.timeout_ns, a.agree};
  const size_t rb = (size_t)a.hidden * sizeof(T);
  const int nv = a.hidden / N;
  const bool moe = a.pattern == WEFT_FX_MOE_AR_RMSNORM || a.pattern == WEFT_FX_MOE_FINALIZE_AR_RMSNORM;
  const MoeIn m{a.input, a.scales, a.perm, a.shared, a.expert_rows, a.tokens, a.top_k, a.scales_f32};
  uint4 yv[VM], nvv[VM];

  if (ALGO == WFX_ONESHOT) {
    const uint64_t mine = a.off_os + ((uint64_t)par * W + rank) * a.os_slot;
    for (int t = b; t < a.tokens; t += G) {
#pragma unroll
      for (int k = 0; k < VM; k++) {
        const int j = tid + k * blockDim.x;
        if (j < nv) {
          const uint4 v = contribution<T>(a, m, moe, t, j, rb);
          const size_t off = (size_t)t * rb + (size_t)j * 16;
          for (int i = 1; i <= W; i++) st_vec((char *)a.peer[(rank + i) % W] + mine + off, v);
        }
      }
    }
    if (!exchange(a, env, par, 0, E, WFX_SITE_PUSH | ((uint32_t)a.pattern << 4))) return;
    const char *const in0 = local + a.off_os + (uint64_t)par * W * a.os_slot;
    for (int t = b; t < a.tokens; t += G) {
      const size_t off = (size_t)t * rb;
      finish_row<T>(a, in0 + off, a.os_slot, (const char *)a.residual + off, (char *)a.residual_out + off,
                    (char *)a.norm_out + off, red, yv, nvv);
    }
  } else {
    const int T_ = a.tokens;
    const bool rs = a.pattern == WEFT_FX_RS_RMSNORM;
    const uint64_t mine = ((uint64_t)par * W + rank) * a.rs_slot;
    /* 1. reduce-scatter: rows of range p to p (own range last) */
    for (int i = 1; i <= W; i++) {
      const int p = (rank + i) % W, ps = range_start(p, T_, W), pn = range_start(p + 1, T_, W) - ps;
      char *const dst = (char *)a.peer[p] + a.off_rs + mine;
      for (int r = b; r < pn; r += G) {
#pragma unroll
        for (int k = 0; k < VM; k++) {
          const int j = tid + k * blockDim.x;
          if (j < nv)
            st_vec(dst + (size_t)r * rb + (size_t)j * 16, contribution<T>(a, m, moe, ps + r, j, rb));
        }
      }
    }
    if (!exchange(a, env, par, 0, E, WFX_SITE_PUSH | ((uint32_t)a.pattern << 4))) return;
    /* 2. own range: reduce, epilogue, outputs; push to the peers' all-gather inbox */
    const int ms = range_start(rank, T_, W), mn = range_start(rank + 1, T_, W) - ms;
    const bool gather = !rs || a.gathered_out != nullptr;
    const char *const in0 = local + a.off_rs + (uint64_t)par * W * a.rs_slot;
    for (int r = b; r < mn; r += G) {
      const size_t lo = (size_t)(rs ? r : ms + r) * rb; /* residual / outputs row */
      finish_row<T>(a, in0 + (size_t)r * rb, a.rs_slot, (const char *)a.residual + lo,
                    (char *)a.residual_out + lo, (char *)a.norm_out + lo, red, yv, nvv);
      if (gather) {
#pragma unroll
        for (int k = 0; k < VM; k++) {
          const int j = tid + k * blockDim.x;
          if (j < nv) {
            const uint4 v = rs ? nvv[k] : yv[k];
            const size_t off = (size_t)r * rb + (size_t)j * 16;
            if (rs) st_vec((char *)a.gathered_out + (size_t)(ms + r) * rb + (size_t)j * 16, v);
            for (int i = 1; i < W; i++) st_vec((char *)a.peer[(rank + i) % W] + a.off_ag + mine + off, v);
          }
        }
      }
    }
    if (gather) {
      if (!exchange(a, env, par, 1, E, WFX_SITE_GATHER | ((uint32_t)a.pattern << 4))) return;
      /* 3. the peers' rows */
      for (int i = 1; i < W; i++) {
        const int p = (rank + W - i) % W, ps = range_start(p, T_, W), pn = range_start(p + 1, T_, W) - ps;
        const char *const src = local + a.off_ag + ((uint64_t)par * W + p) * a.rs_slot;
        for (int r = b; r < pn; r += G) {
          const size_t go = (size_t)(ps + r) * rb;
          if (rs) {
#pragma unroll
            for (int k = 0; k < VM; k++) {
              const int j = tid + k * blockDim.x;
              if (j < nv)
                st_vec((char *)a.gathered_out + go + (size_t)j * 16, ld_vec_cg(src + (size_t)r * rb + (size_t)j * 16));
            }
          } else {
            norm_of<T>(a, src + (size_t)r * rb, (char *)a.residual_out + go, (char *)a.norm_out + go, red);
          }
        }
      }
    }
  }
  __syncthreads();
  agree_verify(env, WFX_SITE_AGREE);
  epoch_advance(st->epoch, E);
}

typedef void (*kernel_fn)(const wfx_args);

kernel_fn pick(int dtype, int algo) {
  if (dtype == WEFT_F16) return algo == WFX_ONESHOT ? fx_kernel<__half, WFX_ONESHOT> : fx_kernel<__half, WFX_TWOSHOT>;
  if (dtype == WEFT_BF16)
    return algo == WFX_ONESHOT ? fx_kernel<__nv_bfloat16, WFX_ONESHOT> : fx_kernel<__nv_bfloat16, WFX_TWOSHOT>;
  return nullptr;
}

/* One block per SM at most (so every block is resident: blocks pair by index
 * across ranks), at most one per row; 8 under the shared-GPU test mode (MPS
 * slices: the SM count is the whole GPU's, not the slice's). */
int grid_of(const wfx_args *a, int algo, int *blocks, int *threads) {
  if (!pick(a->dtype, algo) || a->hidden < 8 || a->world < 2) return (int)cudaErrorInvalidValue;
  const int nv = a->hidden / 8;
  if (nv > VM * kMaxThreads) return (int)cudaErrorInvalidValue;
  *threads = row_threads(nv);
  const int work = algo == WFX_ONESHOT ? a->tokens : (a->tokens + a->world - 1) / a->world;
  int cap = a->shared_gpu ? 8 : (a->num_sms > 0 ? a->num_sms : 1);
  if (cap > WF_MAX_GRID) cap = WF_MAX_GRID;
  *blocks = work < 1 ? 1 : work < cap ? work : cap;
  return 0;
}

}  // namespace

extern "C" int wfx_grid(const wfx_args *a, int algo, int *blocks, int *threads) {
  return grid_of(a, algo, blocks, threads);
}

extern "C" int wfx_launch(const wfx_args *a, int algo, void *stream) {
  int blocks, threads;
  int e = grid_of(a, algo, &blocks, &threads);
  if (e) return e;
  wfx_args args = *a; /* the call's descriptor: what every rank must launch alike */
  args.agree.d0 = wf_agree_d0(WF_AGREE_EXT, (unsigned)algo, (unsigned)a->dtype, (unsigned)a->pattern,
                              (unsigned)blocks, (unsigned)threads,
                              (unsigned)a->flags & (WEFT_FX_GEMMA | WEFT_FX_SCALES_DTYPE));
  args.agree.d1 = ((uint64_t)(uint32_t)a->tokens << 32) | (uint32_t)a->hidden;
  return (int)wf::launch_pdl(pick(a->dtype, algo), dim3((unsigned)blocks), dim3((unsigned)threads),
                             (cudaStream_t)stream, (a->flags & WEFT_FX_PDL) != 0, args);
}
