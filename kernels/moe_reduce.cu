// moe_reduce.cu — the local MoE reduction on one rank (weft_cuda_moe_reduce,
// the device twin of weft_host_moe_reduce): each token's top_k expert
// outputs weighted by their router scales, plus the shared expert's output,
// in f32, rounded once. With a weight it is also the whole end of an MoE
// layer on a group of one rank in one kernel: the reduction, the residual add
// and the RMSNorm (the fused patterns' single-rank case, and what
// scripts/gpu-fusion measures against copy bandwidth).
//
// One block per row (grid-stride over tokens); a thread keeps its vectors in
// registers between the sums and the norm, so every byte is read once and
// written once: top_k (+1 shared, +1 residual) rows in, 1-3 rows out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "fused_ext.cuh"
#include "cuda/cuda_internal.h"

namespace {

using namespace wfx;

struct LocalArgs {
  MoeIn m;
  void *out;
  const void *residual, *weight;
  void *residual_out, *norm_out;
  int32_t hidden;
  float eps;
  int gemma;
};

/* VM: vectors of a row per thread (1 up to 1024 vectors: hidden 8192 in
 * bf16/f16; 2 or 4 beyond), so a thread holds only the registers its row
 * needs and the expert loads of moe_vec stay in flight without spills (the
 * one kernel with kVM = 4 for every size spilled 300 bytes; VM 4, rows of
 * more than 2048 vectors, still spills ~100). */
template <typename T, int VM>
__global__ void __launch_bounds__(kMaxThreads) moe_reduce_kernel(const LocalArgs a) {
  constexpr int N = Pack<T>::N;
  __shared__ float red[33];
  const int nv = a.hidden / N;
  const size_t rb = (size_t)a.hidden * sizeof(T);
  const bool norm = a.weight != nullptr;
  for (int t = blockIdx.x; t < a.m.tokens; t += gridDim.x) {
    float y[VM][N];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) {
        const size_t off = (size_t)t * rb + (size_t)j * 16;
        /* the residual's load goes out with the experts' first batch */
        uint4 rv = make_uint4(0, 0, 0, 0);
        const bool res = norm && a.residual;
        moe_vec<T, VM == 1 ? kBatchMax : 2>(a.m, t, j, rb, y[k], res ? (const char *)a.residual + (size_t)t * rb : nullptr, &rv);
        const uint4 xv = Pack<T>::from_f32(y[k]);
        if (a.out) st_vec((char *)a.out + off, xv);
        if (norm) {
          /* residual_out = round(round(x) + residual): as the unfused path */
          Pack<T>::to_f32(xv, y[k]);
          if (res) {
            float r[N];
            Pack<T>::to_f32(rv, r);
#pragma unroll
            for (int e = 0; e < N; e++) y[k][e] += r[e];
          }
          const uint4 yv = Pack<T>::from_f32(y[k]);
          if (a.residual_out) st_vec((char *)a.residual_out + off, yv);
          Pack<T>::to_f32(yv, y[k]);
          ss += sumsq_f32<T>(y[k]);
        }
      }
    }
    if (!norm) continue;
    /* the weight (L2-resident) requested before the block sum, used after it */
    uint4 wv[VM];
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) wv[k] = ld_vec((const char *)a.weight + (size_t)j * 16);
    }
    const float tot = block_sum(ss, red);
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv)
        st_vec((char *)a.norm_out + (size_t)t * rb + (size_t)j * 16, norm_vec<T>(y[k], rstd, wv[k], a.gemma != 0));
    }
  }
}

/* Rows of one vector per thread (up to 1024 vectors: hidden 8192 of bf16):
 * the whole row's loads at once through shared memory. With its loads in
 * registers a thread keeps kBatchMax expert rows in flight and waits for them
 * before it issues the next batch: two or more memory round trips per row,
 * which one block per SM (hidden 7168: 896 threads at 64 registers) cannot
 * hide. Here each thread copies its vector of every row it needs (the shared
 * expert's, the residual's, the top_k experts') into its own slots of shared
 * memory with cp.async (no registers held), waits once, then sums from there:
 * one round trip per row, as a copy. Per element the same operations in the
 * same order as moe_vec (the same bits). Used where the slots fit in shared
 * memory (kStageMaxBytes). */
constexpr int kStageMaxBytes = 200 * 1024;

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
               "l"(gmem)
               : "memory");
#else
  *(uint4 *)smem = *(const uint4 *)gmem;
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
#endif
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads) moe_reduce_staged_kernel(const LocalArgs a) {
  constexpr int N = Pack<T>::N;
  extern __shared__ uint4 stage[]; /* [slot][blockDim.x]: slot 0 shared, 1 residual, 2.. experts */
  __shared__ float red[33];
  const int nv = a.hidden / N, tid = threadIdx.x, bd = blockDim.x, K = a.m.top_k;
  const size_t rb = (size_t)a.hidden * sizeof(T), col = (size_t)tid * 16;
  const bool norm = a.weight != nullptr, res = norm && a.residual != nullptr;
  const MoeIn &m = a.m;
  for (int t = blockIdx.x; t < m.tokens; t += gridDim.x) {
    float y[N];
    float ss = 0.f;
    bool bad = false;
    if (tid < nv) {
      if (m.shared) cp_async16(&stage[tid], (const char *)m.shared + (size_t)t * rb + col);
      if (res) cp_async16(&stage[bd + tid], (const char *)a.residual + (size_t)t * rb + col);
      for (int k = 0; k < K; k++) {
        int64_t r;
        if (m.perm) {
          r = m.perm[(int64_t)t * K + k];
          if (r < 0 || r >= m.expert_rows) { bad = true; continue; }
        } else {
          r = (int64_t)k * m.tokens + t;
        }
        cp_async16(&stage[(size_t)(2 + k) * bd + tid], (const char *)m.input + (size_t)r * rb + col);
      }
      cp_async_wait_all();
      /* as moe_vec: the shared expert first, then the top_k rows by fma in k order */
      if (m.shared) Pack<T>::to_f32(stage[tid], y);
      else
#pragma unroll
        for (int e = 0; e < N; e++) y[e] = 0.f;
      for (int k = 0; k < K; k++) {
        int64_t si;
        if (m.perm) {
          si = (int64_t)t * K + k;
          const int32_t r = m.perm[si];
          if (r < 0 || r >= m.expert_rows) continue;
        } else {
          si = (int64_t)k * m.tokens + t;
        }
        const float sc = m.scales_f32 ? scalar_f32<float>(m.scales, si) : scalar_f32<T>(m.scales, si);
        float x[N];
        Pack<T>::to_f32(stage[(size_t)(2 + k) * bd + tid], x);
#pragma unroll
        for (int e = 0; e < N; e++) y[e] = __fmaf_rn(sc, x[e], y[e]);
      }
      if (bad)
#pragma unroll
        for (int e = 0; e < N; e++) y[e] = __int_as_float(0x7fc00000);
      const size_t off = (size_t)t * rb + col;
      const uint4 xv = Pack<T>::from_f32(y);
      if (a.out) st_vec((char *)a.out + off, xv);
      if (norm) {
        /* residual_out = round(round(x) + residual): as the unfused path */
        Pack<T>::to_f32(xv, y);
        if (res) {
          float r[N];
          Pack<T>::to_f32(stage[bd + tid], r);
#pragma unroll
          for (int e = 0; e < N; e++) y[e] += r[e];
        }
        const uint4 yv = Pack<T>::from_f32(y);
        if (a.residual_out) st_vec((char *)a.residual_out + off, yv);
        Pack<T>::to_f32(yv, y);
        ss = sumsq_f32<T>(y);
      }
    }
    if (!norm) continue;
    const uint4 wv = tid < nv ? ld_vec((const char *)a.weight + col) : make_uint4(0, 0, 0, 0);
    const float rstd = rsqrtf(block_sum(ss, red) / (float)a.hidden + a.eps);
    if (tid < nv) st_vec((char *)a.norm_out + (size_t)t * rb + col, norm_vec<T>(y, rstd, wv, a.gemma != 0));
  }
}

/* WEFT_MOE_LOCAL_STAGE=0 (read once): the register-batched kernel for every
 * row, to measure the staged one against it (bench/moe_local_bench.cu); the
 * same bits either way */
bool stage_enabled() {
  static const bool on = [] {
    const char *e = getenv("WEFT_MOE_LOCAL_STAGE");
    return !(e && e[0] == '0' && e[1] == 0);
  }();
  return on;
}

/* Dynamic shared memory above 48 KiB needs the kernel's opt-in, once per
 * device (a bit per device of the first 64; others ask every time). */
template <typename T> bool staged_smem_ok(int bytes, int dev) {
  static unsigned long long done = 0;
  if (bytes <= 48 * 1024) return true;
  const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
  if (bit && (__atomic_load_n(&done, __ATOMIC_ACQUIRE) & bit)) return true;
  if (cudaFuncSetAttribute(moe_reduce_staged_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kStageMaxBytes) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  __atomic_fetch_or(&done, bit, __ATOMIC_RELEASE);
  return true;
}

template <typename T>
void launch_vm(int vm, unsigned blocks, int threads, cudaStream_t s, const LocalArgs &a, int dev) {
  const int slots = 2 + a.m.top_k, bytes = slots * threads * 16;
  if (vm == 1 && bytes <= kStageMaxBytes && stage_enabled() && staged_smem_ok<T>(bytes, dev)) {
    moe_reduce_staged_kernel<T><<<blocks, threads, bytes, s>>>(a);
    return;
  }
  switch (vm) {
  case 1: moe_reduce_kernel<T, 1><<<blocks, threads, 0, s>>>(a); break;
  case 2: moe_reduce_kernel<T, 2><<<blocks, threads, 0, s>>>(a); break;
  default: moe_reduce_kernel<T, kVM><<<blocks, threads, 0, s>>>(a); break;
  }
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

}  // namespace

extern "C" int weft_cuda_moe_reduce(const void *input, const void *scales, int scales_dtype,
                                    const int32_t *perm, int64_t expert_rows, const void *shared,
                                    void *out, const void *residual, const void *weight,
                                    void *residual_out, void *norm_out, int64_t tokens,
                                    int64_t hidden, int top_k, int dtype, float eps, int flags,
                                    void *stream) {
  static const char op[] = "cuda moe_reduce";
  int dev;
  int rc = wf_cuda_device(&dev);
  if (rc) return rc;
  WF_CHECK_ARG(dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16,
               "%s: dtype %d is not f32, f16 or bf16", op, dtype);
  WF_CHECK_ARG(scales_dtype == WEFT_F32 || scales_dtype == dtype,
               "%s: scales dtype %d must be f32 or the input's", op, scales_dtype);
  const int64_t es = dtype == WEFT_F32 ? 4 : 2;
  WF_CHECK_ARG(tokens >= 0 && tokens < (1ll << 31) && hidden >= 1 && (hidden * es) % 16 == 0 &&
                   hidden * es / 16 <= (int64_t)kVM * kMaxThreads,
               "%s: shape %lld x %lld: hidden must fill 16-byte vectors, at most %lld of them", op,
               (long long)tokens, (long long)hidden, (long long)kVM * kMaxThreads);
  WF_CHECK_ARG(top_k >= 1 && top_k <= 16, "%s: top_k %d out of range [1, 16]", op, top_k);
  WF_CHECK_ARG((flags & ~WEFT_RMSNORM_GEMMA) == 0, "%s: unknown flags %d", op, flags);
  WF_CHECK_ARG(eps >= 0.f, "%s: eps must be >= 0", op);
  if (tokens == 0) return 0;
  WF_CHECK_ARG(input && scales, "%s: NULL input or scales", op);
  WF_CHECK_ARG(weight ? norm_out != nullptr : out != nullptr, "%s: nothing to write (out or norm_out)", op);
  WF_CHECK_ARG(aligned16(input) && (!shared || aligned16(shared)) && (!out || aligned16(out)) &&
                   (!residual || aligned16(residual)) && (!weight || aligned16(weight)) &&
                   (!residual_out || aligned16(residual_out)) && (!norm_out || aligned16(norm_out)),
               "%s: tensors must be 16-byte aligned", op);
  LocalArgs a;
  a.m.input = input;
  a.m.scales = scales;
  a.m.perm = perm;
  a.m.shared = shared;
  a.m.expert_rows = expert_rows;
  a.m.tokens = (int32_t)tokens;
  a.m.top_k = top_k;
  a.m.scales_f32 = scales_dtype == WEFT_F32;
  a.out = out;
  a.residual = residual;
  a.weight = weight;
  a.residual_out = residual_out;
  a.norm_out = norm_out;
  a.hidden = (int32_t)hidden;
  a.eps = eps;
  a.gemma = (flags & WEFT_RMSNORM_GEMMA) != 0;
  const int threads = row_threads((int)(hidden * es / 16));
  const int64_t blocks = tokens < 65535 ? tokens : 65535;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  const int nv = (int)(hidden * es / 16), vm = (nv + threads - 1) / threads;
  switch (dtype) {
  case WEFT_F32: launch_vm<float>(vm, (unsigned)blocks, threads, s, a, dev); break;
  case WEFT_F16: launch_vm<__half>(vm, (unsigned)blocks, threads, s, a, dev); break;
  default: launch_vm<__nv_bfloat16>(vm, (unsigned)blocks, threads, s, a, dev); break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "moe_reduce kernel launch", e);
  return 0;
}
