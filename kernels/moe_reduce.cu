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

template <typename T>
void launch_vm(int vm, unsigned blocks, int threads, cudaStream_t s, const LocalArgs &a) {
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
  case WEFT_F32: launch_vm<float>(vm, (unsigned)blocks, threads, s, a); break;
  case WEFT_F16: launch_vm<__half>(vm, (unsigned)blocks, threads, s, a); break;
  default: launch_vm<__nv_bfloat16>(vm, (unsigned)blocks, threads, s, a); break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "moe_reduce kernel launch", e);
  return 0;
}
