// norm.cu — standalone residual add + RMSNorm (the unfused path, and the
// baseline every fused kernel must beat).
//
//   v            = x + residual                     (f32)
//   residual_out = round_T(v)
//   out          = round_T(residual_out * rsqrt(mean(v^2) + eps) * w)
//                  (w -> 1 + w with the Gemma flag; all math in f32)
//
// FlashInfer/vLLM fused_add_rmsnorm semantics, as weft_host_rmsnorm: the
// statistics come from the f32 sum, the output scales the residual as the next
// layer sees it (rounded to the storage dtype). One block per row; the row is read once with 16-byte vector
// loads and kept in registers (VPT vectors per thread) across the block
// reduction, then written once: 2 reads + 2 writes of the row, the minimum.
// Rows that do not fit the vector path (hidden * size not a multiple of 16,
// unaligned pointers, rows over 64 KiB) take a generic two-pass kernel.
// Aliasing: out may be x and residual_out may be residual, since every
// element is read by the thread that later writes it, before the reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"
#include "cuda/cuda_internal.h"

namespace {

constexpr int kMaxThreads = 512;

template <typename T> struct Vec;

template <> struct Vec<float> {
  static constexpr int N = 4;
  __device__ static void load(uint4 v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 store(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
  __device__ static float one(float v) { return v; }
  __device__ static float from(float v) { return v; }
};

// 16-bit storage: 8 elements per uint4, converted a pair at a time through the
// type's 2-vector (H2); D supplies the pair conversions to2/from2.
template <typename H2, typename D> struct Vec16 {
  static constexpr int N = 8;
  __device__ static float2 w2f(uint32_t w) {
    H2 h;
    memcpy(&h, &w, 4);
    return D::to2(h);
  }
  __device__ static uint32_t f2w(float a, float b) {
    H2 h = D::from2(a, b);
    uint32_t w;
    memcpy(&w, &h, 4);
    return w;
  }
  __device__ static void load(uint4 v, float (&f)[8]) {
    float2 a = w2f(v.x), b = w2f(v.y), c = w2f(v.z), d = w2f(v.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
  }
  __device__ static uint4 store(const float (&f)[8]) {
    return make_uint4(f2w(f[0], f[1]), f2w(f[2], f[3]), f2w(f[4], f[5]), f2w(f[6], f[7]));
  }
};

template <> struct Vec<__nv_bfloat16> : Vec16<__nv_bfloat162, Vec<__nv_bfloat16>> {
  __device__ static float2 to2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
  __device__ static __nv_bfloat162 from2(float a, float b) { return __floats2bfloat162_rn(a, b); }
  __device__ static float one(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};

template <> struct Vec<__half> : Vec16<__half2, Vec<__half>> {
  __device__ static float2 to2(__half2 h) { return __half22float2(h); }
  __device__ static __half2 from2(float a, float b) { return __floats2half2_rn(a, b); }
  __device__ static float one(__half v) { return __half2float(v); }
  __device__ static __half from(float v) { return __float2half_rn(v); }
};

// Sum over the block; every thread gets the total. red has 32 floats.
__device__ __forceinline__ float block_sum(float v, float *red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nwarps = (blockDim.x + 31) >> 5;
  if (nwarps == 1) return v;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Vector path: nvec 16-byte vectors per row, VPT per thread, all in registers.
template <typename T, int VPT>
__global__ void __launch_bounds__(kMaxThreads)
rmsnorm_vec(const T *x, const T *res, const T *w, T *out, T *res_out, int nvec, int hidden,
            float eps, bool gemma) {
  constexpr int N = Vec<T>::N;
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * (size_t)hidden;
  const uint4 *xv = reinterpret_cast<const uint4 *>(x + row);
  const uint4 *rv = res ? reinterpret_cast<const uint4 *>(res + row) : nullptr;
  const uint4 *wv = reinterpret_cast<const uint4 *>(w);

  // Loads first (x, then residual): 2 * VPT 16-byte requests in flight.
  uint4 s[VPT];      // x, then the rounded sums (packed): what residual_out gets
#pragma unroll
  for (int v = 0; v < VPT; v++) {
    const int i = threadIdx.x + v * blockDim.x;
    if (i < nvec) s[v] = xv[i];
  }
  float ss = 0.f;    // sum of squares of the f32 (unrounded) sums
  if (rv) {
    uint4 r[VPT];
#pragma unroll
    for (int v = 0; v < VPT; v++) {
      const int i = threadIdx.x + v * blockDim.x;
      if (i < nvec) r[v] = rv[i];
    }
#pragma unroll
    for (int v = 0; v < VPT; v++) {
      const int i = threadIdx.x + v * blockDim.x;
      if (i < nvec) {
        float a[N], b[N];
        Vec<T>::load(s[v], a);
        Vec<T>::load(r[v], b);
#pragma unroll
        for (int j = 0; j < N; j++) {
          a[j] += b[j];
          ss += a[j] * a[j];
        }
        s[v] = Vec<T>::store(a);
      }
    }
  } else {
#pragma unroll
    for (int v = 0; v < VPT; v++) {
      const int i = threadIdx.x + v * blockDim.x;
      if (i < nvec) {
        float a[N];
        Vec<T>::load(s[v], a);
#pragma unroll
        for (int j = 0; j < N; j++) ss += a[j] * a[j];
      }
    }
  }
  // Weights (L2-resident) requested now, consumed after the reduction.
  uint4 wr[VPT];
#pragma unroll
  for (int v = 0; v < VPT; v++) {
    const int i = threadIdx.x + v * blockDim.x;
    if (i < nvec) wr[v] = __ldg(wv + i);
  }
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / (float)hidden + eps);
  const float add = gemma ? 1.f : 0.f;
  uint4 *ov = reinterpret_cast<uint4 *>(out + row);
  uint4 *rov = res_out ? reinterpret_cast<uint4 *>(res_out + row) : nullptr;
#pragma unroll
  for (int v = 0; v < VPT; v++) {
    const int i = threadIdx.x + v * blockDim.x;
    if (i < nvec) {
      if (rov) rov[i] = s[v];
      float a[N], g[N];
      Vec<T>::load(s[v], a);
      Vec<T>::load(wr[v], g);
#pragma unroll
      for (int j = 0; j < N; j++) a[j] = a[j] * inv * (g[j] + add);
      ov[i] = Vec<T>::store(a);
    }
  }
}

// Generic path: any hidden and alignment. Pass 1 reduces without storing (so
// aliasing stays safe), pass 2 recomputes the sum and writes both outputs.
template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
rmsnorm_generic(const T *x, const T *res, const T *w, T *out, T *res_out, int hidden, float eps,
                bool gemma) {
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * (size_t)hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float a = Vec<T>::one(x[row + i]);
    if (res) a += Vec<T>::one(res[row + i]);
    ss += a * a;
  }
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / (float)hidden + eps);
  const float add = gemma ? 1.f : 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    T sv = x[row + i];
    if (res) sv = Vec<T>::from(Vec<T>::one(sv) + Vec<T>::one(res[row + i]));
    if (res_out) res_out[row + i] = sv;
    out[row + i] = Vec<T>::from(Vec<T>::one(sv) * inv * (Vec<T>::one(w[i]) + add));
  }
}

// Deterministic mode (WEFT_RMSNORM_DETERMINISTIC): the arithmetic of
// kernels/fused_norm.cu with WF_FUSED_DETERMINISTIC, so that weft's all-reduce
// followed by this kernel gives the fused kernel's bits: y = round(x + res)
// (x is the all-reduce's rounded sum), the sum of squares of the ROUNDED y in
// the one order of kernels/common.cuh (vec_sumsq, warp_xor_sum per chunk of
// 32 vectors, chunk partials lane l = l, l+32, ..., then a butterfly),
// rstd = rsqrtf(total / hidden + eps), out = y * rstd * (w + (-0.0) or 1).
// One block per row, any block size (a multiple of 32): the order does not
// depend on it. Every vector is read and written by one thread (aliasing as
// above); the thread reads its own residual_out stores back for the norm.
constexpr int kDetMaxChunks = 256;   // 8192 vectors: hidden 65536 (bf16/f16), 32768 (f32)
constexpr int kDetThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kDetThreads)
rmsnorm_det(const T *x, const T *res, const T *w, T *out, T *res_out, int nvec, int hidden,
            float eps, bool gemma) {
  __shared__ float red[kDetMaxChunks];
  const size_t row = (size_t)blockIdx.x * (size_t)hidden;
  const char *xr = reinterpret_cast<const char *>(x + row);
  const char *rr = res ? reinterpret_cast<const char *>(res + row) : nullptr;
  char *yr = reinterpret_cast<char *>((res_out ? res_out : out) + row);
  const int lane = threadIdx.x & 31, wbase = threadIdx.x - lane, nc = (nvec + 31) / 32;
  for (int k = 0; wbase + k * (int)blockDim.x < nvec; k++) {   // warp-uniform
    const int j = threadIdx.x + k * blockDim.x;
    float s = 0.f;
    uint4 yv = make_uint4(0, 0, 0, 0);
    if (j < nvec) {
      yv = wf::ld_vec(xr + (size_t)j * 16);
      if (rr) {
        float a[wf::Pack<T>::N], b[wf::Pack<T>::N];
        wf::Pack<T>::to_f32(yv, a);
        wf::Pack<T>::to_f32(wf::ld_vec(rr + (size_t)j * 16), b);
#pragma unroll
        for (int e = 0; e < wf::Pack<T>::N; e++) a[e] += b[e];
        yv = wf::Pack<T>::from_f32(a);
      }
      s = wf::vec_sumsq<T>(yv);
    }
    s = wf::warp_xor_sum(s);
    if (lane == 0) red[(wbase + k * (int)blockDim.x) / 32] = s;
    // y goes to residual_out (or, without one, to out: overwritten below by
    // the same thread) so that pass 2 needs no registers across the barrier
    if (j < nvec) wf::st_vec(yr + (size_t)j * 16, yv);
  }
  __syncthreads();
  float tot = 0.f;
  for (int i = lane; i < nc; i += 32) tot += red[i];
  tot = wf::warp_xor_sum(tot);
  const float rstd = rsqrtf(tot / (float)hidden + eps);
  const float one = gemma ? 1.f : -0.f;   // -0.0: the identity of addition, as the fused kernel
  const char *wr = reinterpret_cast<const char *>(w);
  char *orow = reinterpret_cast<char *>(out + row);
  for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
    float y[wf::Pack<T>::N], g[wf::Pack<T>::N], n[wf::Pack<T>::N];
    wf::Pack<T>::to_f32(wf::ld_vec(yr + (size_t)j * 16), y);
    wf::Pack<T>::to_f32(wf::ld_vec(wr + (size_t)j * 16), g);
#pragma unroll
    for (int e = 0; e < wf::Pack<T>::N; e++) n[e] = y[e] * rstd * (g[e] + one);
    wf::st_vec(orow + (size_t)j * 16, wf::Pack<T>::from_f32(n));
  }
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <typename T>
cudaError_t launch_det(const void *x, const void *res, const void *w, void *out, void *res_out,
                       int64_t tokens, int64_t hidden, float eps, bool gemma, cudaStream_t s) {
  const int nvec = (int)(hidden / wf::Pack<T>::N);
  int threads = (nvec + 31) / 32 * 32;
  if (threads > kDetThreads) threads = kDetThreads;
  rmsnorm_det<T><<<(unsigned)tokens, threads, 0, s>>>(
      static_cast<const T *>(x), static_cast<const T *>(res), static_cast<const T *>(w),
      static_cast<T *>(out), static_cast<T *>(res_out), nvec, (int)hidden, eps, gemma);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const void *x, const void *res, const void *w, void *out, void *res_out,
                   int64_t tokens, int64_t hidden, float eps, bool gemma, cudaStream_t s) {
  constexpr int N = Vec<T>::N;
  const T *xp = static_cast<const T *>(x), *rp = static_cast<const T *>(res),
          *wp = static_cast<const T *>(w);
  T *op = static_cast<T *>(out), *rop = static_cast<T *>(res_out);
  const dim3 grid((unsigned)tokens);
  const int nvec = (int)(hidden / N);
  const bool vec_ok = hidden % N == 0 && aligned16(x) && aligned16(w) && aligned16(out) &&
                      (!res || aligned16(res)) && (!res_out || aligned16(res_out)) &&
                      nvec <= 8 * kMaxThreads;
  if (vec_ok) {
    // Smallest VPT giving <= 256 threads; rows of 32..64 KiB use 8 and up to 512.
    int vpt = 1;
    while (vpt < 8 && (nvec + vpt - 1) / vpt > 256) vpt *= 2;
    int threads = (nvec + vpt - 1) / vpt;
    threads = (threads + 31) / 32 * 32;
    switch (vpt) {
    case 1: rmsnorm_vec<T, 1><<<grid, threads, 0, s>>>(xp, rp, wp, op, rop, nvec, (int)hidden, eps, gemma); break;
    case 2: rmsnorm_vec<T, 2><<<grid, threads, 0, s>>>(xp, rp, wp, op, rop, nvec, (int)hidden, eps, gemma); break;
    case 4: rmsnorm_vec<T, 4><<<grid, threads, 0, s>>>(xp, rp, wp, op, rop, nvec, (int)hidden, eps, gemma); break;
    default: rmsnorm_vec<T, 8><<<grid, threads, 0, s>>>(xp, rp, wp, op, rop, nvec, (int)hidden, eps, gemma); break;
    }
  } else {
    int threads = hidden >= 4096 ? 512 : hidden >= 1024 ? 256 : 128;
    rmsnorm_generic<T><<<grid, threads, 0, s>>>(xp, rp, wp, op, rop, (int)hidden, eps, gemma);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" int weft_cuda_rmsnorm(const void *x, const void *residual, const void *weight,
                                 void *out, void *residual_out, int64_t tokens, int64_t hidden,
                                 int dtype, float eps, int flags, void *stream) {
  int dev;
  int rc = wf_cuda_device(&dev);
  if (rc) return rc;
  WF_CHECK_ARG(tokens >= 0 && hidden > 0 && hidden <= (1 << 30),
               "cuda rmsnorm: bad shape %lld x %lld", (long long)tokens, (long long)hidden);
  WF_CHECK_ARG(tokens < (1ll << 31), "cuda rmsnorm: %lld tokens exceed the grid limit",
               (long long)tokens);
  WF_CHECK_ARG(dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16,
               "cuda rmsnorm: dtype %d is not f32, f16 or bf16", dtype);
  WF_CHECK_ARG((flags & ~(WEFT_RMSNORM_GEMMA | WEFT_RMSNORM_DETERMINISTIC)) == 0,
               "cuda rmsnorm: unknown flags %d", flags);
  WF_CHECK_ARG(eps >= 0.f, "cuda rmsnorm: eps must be >= 0");
  if (tokens == 0) return 0;
  WF_CHECK_ARG(x && weight && out, "cuda rmsnorm: NULL %s",
               !x ? "input" : !weight ? "weight" : "output");
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  const bool gemma = (flags & WEFT_RMSNORM_GEMMA) != 0;
  cudaError_t e;
  if (flags & WEFT_RMSNORM_DETERMINISTIC) {
    const int64_t es = dtype == WEFT_F32 ? 4 : 2, epv = 16 / es;
    WF_CHECK_ARG(hidden % epv == 0 && hidden / epv <= 32 * kDetMaxChunks,
                 "cuda rmsnorm: deterministic mode needs hidden a multiple of %lld and at most %lld "
                 "(got %lld)", (long long)epv, (long long)(epv * 32 * kDetMaxChunks), (long long)hidden);
    WF_CHECK_ARG(aligned16(x) && aligned16(weight) && aligned16(out) &&
                 (!residual || aligned16(residual)) && (!residual_out || aligned16(residual_out)),
                 "cuda rmsnorm: deterministic mode needs 16-byte aligned tensors");
    switch (dtype) {
    case WEFT_F32: e = launch_det<float>(x, residual, weight, out, residual_out, tokens, hidden, eps, gemma, s); break;
    case WEFT_F16: e = launch_det<__half>(x, residual, weight, out, residual_out, tokens, hidden, eps, gemma, s); break;
    default: e = launch_det<__nv_bfloat16>(x, residual, weight, out, residual_out, tokens, hidden, eps, gemma, s); break;
    }
    if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "rmsnorm kernel launch", e);
    return 0;
  }
  switch (dtype) {
  case WEFT_F32: e = launch<float>(x, residual, weight, out, residual_out, tokens, hidden, eps, gemma, s); break;
  case WEFT_F16: e = launch<__half>(x, residual, weight, out, residual_out, tokens, hidden, eps, gemma, s); break;
  default: e = launch<__nv_bfloat16>(x, residual, weight, out, residual_out, tokens, hidden, eps, gemma, s); break;
  }
  if (e != cudaSuccess)
    return wf_cuda_err(__FILE__, __LINE__, "rmsnorm kernel launch", e);
  return 0;
}
