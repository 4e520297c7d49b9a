// devops.cu — small device utilities: seeded random fill, and the NaN mask
// and fix-up around NCCL's float max/min (below the fill).
//
// The generator is the host one's (src/host/hostops.c, weft_host_fill_random):
// element i is splitmix64's output function of key + (i + 1) * gamma with
// key = mix(seed ^ "WEFTRAND"). Uniform fills therefore match the host bit
// for bit; normal fills use the device's logf/sincosf, so they match to a few
// ulp (the same distribution, not promised to be the same values).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/cuda_internal.h"

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ uint64_t rnd(uint64_t key, uint64_t i) {
  return mix64(key + (i + 1) * kGamma);
}

__device__ __forceinline__ double uniform53(uint64_t x) {
  return (double)(x >> 11) * 0x1p-52 - 1.0;
}
__device__ __forceinline__ float uniform24(uint64_t x) {
  return (float)(x >> 40) * 0x1p-23f - 1.0f;
}

// Box-Muller pair for elements (j, j+1), j even, in double.
__device__ __forceinline__ void normal_pair64(uint64_t key, uint64_t j, double &a, double &b) {
  double u1 = ((double)(rnd(key, j) >> 11) + 1.0) * 0x1p-53;
  double u2 = (double)(rnd(key, j + 1) >> 11) * 0x1p-53;
  double r = sqrt(-2.0 * log(u1)), s, c;
  sincos(6.283185307179586 * u2, &s, &c);
  a = r * c;
  b = r * s;
}

__device__ __forceinline__ void normal_pair32(uint64_t key, uint64_t j, float &a, float &b) {
  float u1 = ((float)(rnd(key, j) >> 40) + 1.0f) * 0x1p-24f;
  float u2 = (float)(rnd(key, j + 1) >> 40) * 0x1p-24f;
  float r = sqrtf(-2.0f * logf(u1)), s, c;
  sincosf(6.2831853f * u2, &s, &c);
  a = r * c;
  b = r * s;
}

__device__ __forceinline__ int64_t int_value(double v, int dist) {
  double d = dist == 0 ? floor(16.0 * v) : rint(4.0 * v);
  d = fmin(fmax(d, -1e9), 1e9);
  return (int64_t)d;
}

// Stores value v (already in the distribution) as element i of dtype dt.
__device__ __forceinline__ void put(void *p, int dt, uint64_t i, float v, int dist) {
  switch (dt) {
  case WEFT_F32: ((float *)p)[i] = v; break;
  case WEFT_F16: {
    __half h = __float2half_rn(v);
    uint16_t u = __half_as_ushort(h);
    if (dist == 0 && u == 0x3c00u) u = 0x3bffu;   // [-1, 1) after rounding
    ((uint16_t *)p)[i] = u;
    break;
  }
  case WEFT_BF16: {
    __nv_bfloat16 h = __float2bfloat16_rn(v);
    uint16_t u = __bfloat16_as_ushort(h);
    if (dist == 0 && u == 0x3f80u) u = 0x3f7fu;
    ((uint16_t *)p)[i] = u;
    break;
  }
  default: {  // f8e4m3
    uint8_t u = (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    if (dist == 0 && u == 0x38u) u = 0x37u;
    ((uint8_t *)p)[i] = u;
    break;
  }
  }
}

__device__ __forceinline__ void put_int(void *p, int dt, uint64_t i, double v, int dist) {
  int64_t k = int_value(v, dist);
  if (dt == WEFT_I32) ((int32_t *)p)[i] = (int32_t)k;
  else if (dt == WEFT_I64) ((int64_t *)p)[i] = k;
  else ((uint8_t *)p)[i] = (uint8_t)(((k % 16) + 16) % 16);
}

// One thread per pair of elements (a Box-Muller pair shares its log/sqrt).
__global__ void fill_kernel(void *p, uint64_t count, int dt, uint64_t key, int dist) {
  const uint64_t npairs = (count + 1) / 2;
  for (uint64_t q = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; q < npairs;
       q += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t j = 2 * q;
    const bool two = j + 1 < count;
    const bool is_int = dt == WEFT_I32 || dt == WEFT_I64 || dt == WEFT_U8;
    if (dt == WEFT_F64 || is_int) {
      double a, b;
      if (dist == 0) {
        a = uniform53(rnd(key, j));
        b = uniform53(rnd(key, j + 1));
      } else {
        normal_pair64(key, j, a, b);
      }
      if (is_int) {
        put_int(p, dt, j, a, dist);
        if (two) put_int(p, dt, j + 1, b, dist);
      } else {
        ((double *)p)[j] = a;
        if (two) ((double *)p)[j + 1] = b;
      }
    } else {
      float a, b;
      if (dist == 0) {
        a = uniform24(rnd(key, j));
        b = uniform24(rnd(key, j + 1));
      } else {
        normal_pair32(key, j, a, b);
      }
      put(p, dt, j, a, dist);
      if (two) put(p, dt, j + 1, b, dist);
    }
  }
}

}  // namespace

extern "C" int weft_cuda_fill_random(void *p, size_t count, int dtype, uint64_t seed, int dist,
                                     void *stream) {
  int dev;
  int rc = wf_cuda_device(&dev);
  if (rc) return rc;
  WF_CHECK_ARG(weft_dtype_size(dtype) > 0, "cuda fill_random: unknown dtype %d", dtype);
  WF_CHECK_ARG(dist == 0 || dist == 1,
               "cuda fill_random: dist must be 0 (uniform) or 1 (normal), got %d", dist);
  if (count == 0) return 0;
  WF_CHECK_ARG(p, "cuda fill_random: NULL buffer for %zu elements", count);
  const uint64_t key = mix64(seed ^ 0x5745465452414e44ull);  // "WEFTRAND", as on the host
  const uint64_t npairs = (count + 1) / 2;
  const int threads = 256;
  uint64_t blocks = (npairs + threads - 1) / threads;
  if (blocks > 132 * 32) blocks = 132 * 32;  // grid-stride beyond a few waves
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  fill_kernel<<<(unsigned)blocks, threads, 0, s>>>(p, (uint64_t)count, dtype, key, dist);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "fill_random kernel launch", e);
  return 0;
}

// ---------------------------------------------------------------- NaN pass
// NCCL's float max/min use fmaxf/fminf and __hmax/__hmin, which drop NaN (the
// result is NaN only where every rank holds one); torch propagates it. weft
// runs, on the call's stream: mask[i] = isnan(x[i]) on every rank, NCCL max
// of the u8 mask, NCCL max/min of the data, then fixup writes the dtype's
// quiet NaN where the mask is set. The tests are on the bits (no float
// compare, so -ffast-math or FTZ cannot change them). Vector path: one
// 16-byte load of x and one word of mask per thread when both are aligned;
// the rest (or everything, unaligned) one element per thread.
namespace {

template <typename U_, U_ kAbs_, U_ kInf_, U_ kQnan_> struct FloatBits {
  using U = U_;
  static constexpr U kAbs = kAbs_, kInf = kInf_, kQnan = kQnan_;
  static constexpr int V = 16 / sizeof(U);   // elements per 16-byte vector
};
using F32Bits = FloatBits<uint32_t, 0x7fffffffu, 0x7f800000u, 0x7fc00000u>;
using F64Bits = FloatBits<uint64_t, 0x7fffffffffffffffull, 0x7ff0000000000000ull, 0x7ff8000000000000ull>;
using F16Bits = FloatBits<uint16_t, 0x7fff, 0x7c00, 0x7e00>;
using BF16Bits = FloatBits<uint16_t, 0x7fff, 0x7f80, 0x7fc0>;

// V mask bytes as one word
template <int V> struct MaskWord;
template <> struct MaskWord<2> { using W = uint16_t; };
template <> struct MaskWord<4> { using W = uint32_t; };
template <> struct MaskWord<8> { using W = unsigned long long; };

template <typename B> __device__ __forceinline__ bool is_nan(typename B::U u) {
  return (u & B::kAbs) > B::kInf;
}

template <typename B>
__global__ void nan_mask_kernel(const typename B::U *x, uint8_t *mask, uint64_t count, uint64_t nvec) {
  using U = typename B::U;
  using W = typename MaskWord<B::V>::W;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (uint64_t q = tid; q < nvec; q += stride) {
    uint4 v = reinterpret_cast<const uint4 *>(x)[q];
    U e[B::V];
    memcpy(e, &v, 16);
    W w = 0;
#pragma unroll
    for (int j = 0; j < B::V; j++) w |= (W)(is_nan<B>(e[j]) ? 1 : 0) << (8 * j);
    reinterpret_cast<W *>(mask)[q] = w;
  }
  for (uint64_t i = nvec * B::V + tid; i < count; i += stride) mask[i] = is_nan<B>(x[i]) ? 1 : 0;
}

template <typename B>
__global__ void nan_fixup_kernel(typename B::U *x, const uint8_t *mask, uint64_t count, uint64_t nvec) {
  using W = typename MaskWord<B::V>::W;
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (uint64_t q = tid; q < nvec; q += stride) {
    const W w = reinterpret_cast<const W *>(mask)[q];
    if (w == 0) continue;                       // the common case: read only the mask
#pragma unroll
    for (int j = 0; j < B::V; j++)
      if ((w >> (8 * j)) & 0xff) x[q * B::V + j] = B::kQnan;
  }
  for (uint64_t i = nvec * B::V + tid; i < count; i += stride)
    if (mask[i]) x[i] = B::kQnan;
}

template <typename B>
cudaError_t launch_nan(bool fixup, void *x, uint8_t *mask, uint64_t count, cudaStream_t s) {
  const bool vec = (uintptr_t)x % 16 == 0 && (uintptr_t)mask % B::V == 0;
  const uint64_t nvec = vec ? count / B::V : 0;
  const uint64_t items = nvec + (count - nvec * B::V);
  const int threads = 256;
  uint64_t blocks = (items + threads - 1) / threads;
  if (blocks > 132 * 16) blocks = 132 * 16;     // grid-stride beyond a few waves
  using U = typename B::U;
  if (fixup) nan_fixup_kernel<B><<<(unsigned)blocks, threads, 0, s>>>((U *)x, mask, count, nvec);
  else nan_mask_kernel<B><<<(unsigned)blocks, threads, 0, s>>>((const U *)x, mask, count, nvec);
  return cudaGetLastError();
}

int nan_pass(const char *what, bool fixup, void *x, uint8_t *mask, size_t count, int dtype, void *stream) {
  int dev;
  int rc = wf_cuda_device(&dev);
  if (rc) return rc;
  WF_CHECK_ARG(dtype == WEFT_F32 || dtype == WEFT_F64 || dtype == WEFT_F16 || dtype == WEFT_BF16,
               "cuda %s: dtype %d is not a float dtype (f32, f64, f16, bf16)", what, dtype);
  if (count == 0) return 0;
  WF_CHECK_ARG(x && mask, "cuda %s: NULL %s for %zu elements", what, x ? "mask" : "data", count);
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  cudaError_t e;
  switch (dtype) {
  case WEFT_F32: e = launch_nan<F32Bits>(fixup, x, mask, count, s); break;
  case WEFT_F64: e = launch_nan<F64Bits>(fixup, x, mask, count, s); break;
  case WEFT_F16: e = launch_nan<F16Bits>(fixup, x, mask, count, s); break;
  default: e = launch_nan<BF16Bits>(fixup, x, mask, count, s); break;
  }
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, fixup ? "nan_fixup kernel launch" : "nan_mask kernel launch", e);
  return 0;
}

}  // namespace

extern "C" int weft_cuda_nan_mask(const void *x, uint8_t *mask, size_t count, int dtype, void *stream) {
  return nan_pass("nan_mask", false, (void *)x, mask, count, dtype, stream);
}

extern "C" int weft_cuda_nan_fixup(void *x, const uint8_t *mask, size_t count, int dtype, void *stream) {
  return nan_pass("nan_fixup", true, x, (uint8_t *)mask, count, dtype, stream);
}
