/* fused_ext.cuh — device pieces shared by kernels/moe_reduce.cu (the local
 * MoE reduction, alone or with residual + RMSNorm on one rank) and
 * kernels/fused_ext.cu (the same fused with all-reduce / reduce-scatter):
 * the MoE partial of one 16-byte vector, the row geometry, and a block sum
 * whose order depends on hidden alone (so every kernel, grid and rank that
 * normalises a row gets the same bits). */
#pragma once

#include <math.h>
#include <stdint.h>

#include "common.cuh"

namespace wfx {

using namespace wf;

/* Vectors of a row a thread holds: hidden 16384 of f32 is 4096 vectors = 4 x 1024. */
constexpr int kVM = 4;
constexpr int kMaxThreads = 1024;

/* threads per row: one vector each up to 1024, a multiple of 32; a pure
 * function of the row's vector count (the block sum's order follows it) */
__host__ __device__ __forceinline__ int row_threads(int nv) {
  const int per = (nv + kMaxThreads - 1) / kMaxThreads;
  const int t = (nv + per - 1) / per;
  return (t + 31) / 32 * 32;
}

/* What the MoE partial of a token needs (see weft.h weft_host_moe_reduce). */
struct MoeIn {
  const void *input;        /* MOE: [top_k][tokens][hidden]; FINALIZE: [expert_rows][hidden] */
  const void *scales;       /* MOE: [top_k][tokens]; FINALIZE: [tokens][top_k] */
  const int32_t *perm;      /* FINALIZE, else NULL */
  const void *shared;       /* optional [tokens][hidden] */
  int64_t expert_rows;
  int32_t tokens, top_k, scales_f32;
};

template <typename T> __device__ __forceinline__ float scalar_f32(const void *p, int64_t i);
template <> __device__ __forceinline__ float scalar_f32<float>(const void *p, int64_t i) {
  return ((const float *)p)[i];
}
template <> __device__ __forceinline__ float scalar_f32<__nv_bfloat16>(const void *p, int64_t i) {
  return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
template <> __device__ __forceinline__ float scalar_f32<__half>(const void *p, int64_t i) {
  return __half2float(((const __half *)p)[i]);
}

/* The MoE partial of vector j of token t in f32: shared first, then the top_k
 * weighted outputs in k order by fma (as weft_host_moe_reduce); a bad
 * permutation entry makes it NaN. The loads go out in batches of kBatch
 * rows (permutation entries and scales first, then the rows, then the fmas
 * in k order: the same bits as one row at a time): a thread keeps up to
 * kBatch + 1 16-byte loads in flight instead of one, which a row of 512-896
 * threads needs to approach copy bandwidth (fewer where a thread holds
 * several vectors of its row: registers). first: a vector loaded by the
 * caller beside the first batch (the residual), returned in *first_out. */
constexpr int kBatchMax = 4;

template <typename T, int kBatch = kBatchMax>
__device__ __forceinline__ void moe_vec(const MoeIn &m, int t, int j, size_t rb,
                                        float (&acc)[Pack<T>::N], const void *first = nullptr,
                                        uint4 *first_out = nullptr) {
  constexpr int N = Pack<T>::N;
  const size_t col = (size_t)j * 16;
  uint4 sv = make_uint4(0, 0, 0, 0);
  if (m.shared) sv = ld_vec((const char *)m.shared + (size_t)t * rb + col);
  if (first) *first_out = ld_vec((const char *)first + col);
  bool bad = false;
  for (int k0 = 0; k0 < m.top_k; k0 += kBatch) {
    int64_t row[kBatch];
    float s[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; i++) {
      const int k = k0 + i;
      row[i] = -1;
      s[i] = 0.f;
      if (k < m.top_k) {
        int64_t si, r;
        if (m.perm) {
          si = (int64_t)t * m.top_k + k;
          r = m.perm[si];
          if (r < 0 || r >= m.expert_rows) { bad = true; r = -1; }
        } else {
          si = (int64_t)k * m.tokens + t;
          r = si;
        }
        row[i] = r;
        if (r >= 0) s[i] = m.scales_f32 ? scalar_f32<float>(m.scales, si) : scalar_f32<T>(m.scales, si);
      }
    }
    uint4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; i++)
      if (row[i] >= 0) v[i] = ld_vec((const char *)m.input + (size_t)row[i] * rb + col);
    if (k0 == 0) {
      if (m.shared) Pack<T>::to_f32(sv, acc);
      else
#pragma unroll
        for (int e = 0; e < N; e++) acc[e] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; i++) {
      if (row[i] >= 0) {
        float x[N];
        Pack<T>::to_f32(v[i], x);
#pragma unroll
        for (int e = 0; e < N; e++) acc[e] = __fmaf_rn(s[i], x[e], acc[e]);
      }
    }
  }
  if (bad)
#pragma unroll
    for (int e = 0; e < N; e++) acc[e] = __int_as_float(0x7fc00000);
}

/* Sum of s over the block, the same bits in every thread; red: 33 floats of
 * shared memory. Order: warp butterfly, then warp partials in warp order by
 * a butterfly of warp 0's lanes (fixed by blockDim, i.e. by hidden). */
__device__ __forceinline__ float block_sum(float s, float *red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  s = warp_xor_sum(s);
  if (lane == 0) red[warp] = s;
  __syncthreads();
  float t = lane < nw ? red[lane] : 0.f;
  t = warp_xor_sum(t);
  __syncthreads(); /* red is reused by the next call */
  return t;
}

/* sum of squares of a vector in f32 (element order) */
template <typename T> __device__ __forceinline__ float sumsq_f32(const float (&f)[Pack<T>::N]) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < Pack<T>::N; e++) s = __fmaf_rn(f[e], f[e], s);
  return s;
}

/* round(y * rstd * w), w = gamma + (-0.0) or gamma + 1 (Gemma) */
template <typename T>
__device__ __forceinline__ uint4 norm_vec(const float (&y)[Pack<T>::N], float rstd, uint4 gv,
                                          bool gemma) {
  constexpr int N = Pack<T>::N;
  float g[N], o[N];
  Pack<T>::to_f32(gv, g);
#pragma unroll
  for (int e = 0; e < N; e++) o[e] = y[e] * rstd * (g[e] + (gemma ? 1.0f : -0.0f));
  return Pack<T>::from_f32(o);
}

}  // namespace wfx
