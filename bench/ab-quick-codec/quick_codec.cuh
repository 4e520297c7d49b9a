/* quick_codec.cuh — the quick all-reduce's codec on the device: encode a
 * block of 32 elements (4 adjacent lanes, 8 elements each) into codes and
 * one f32 scale, decode them, and store / load them in an encoded region.
 * The wire formats are src/coll/quick_codec.h's; the CPU reference
 * (src/coll/quick_ref.c) repeats these exact f32 operations.  Shared by the
 * quick all-reduce (quick_allreduce.cu) and its fused AR + residual + RMSNorm
 * two-shot (quick_fused.cu), so both put the same bytes on the wire. */
#ifndef WEFT_QUICK_CODEC_CUH
#define WEFT_QUICK_CODEC_CUH

#include "common.cuh"

#include <cuda_fp8.h>

extern "C" {
#include "coll/quick_codec.h"
}

namespace {

using namespace wf;

constexpr unsigned kFull = 0xffffffffu;

/* ------------------------------------------------------------------ memory */

__device__ __forceinline__ void st_u32(void *p, uint32_t v) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_v2(void *p, uint32_t x, uint32_t y) {
  asm volatile("st.global.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ uint32_t ld_u32_cg(const void *p) {
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_v2_cg(const void *p) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

/* ------------------------------------------------------------------- codec */

template <int C> struct Codec {
  static constexpr int CB = C == WF_QR_INT8 ? 8 : C == WF_QR_INT4 ? 4 : C == WF_QR_FP8 ? 8 : 16;
  static constexpr float QM = C == WF_QR_INT8 ? 127.f : C == WF_QR_INT4 ? 7.f : 448.f;
  static constexpr uint64_t PB = (uint64_t)WF_QR_PART * CB + (C == WF_QR_FP ? 0 : WF_QR_PART);
};

/* max |x| of the block (4 adjacent lanes), and whether any element of it is
 * NaN or ±Inf: |x| as bits (sign cleared) orders as the floats do, NaN above
 * Inf, so one unsigned max gives both.  Every lane of the warp must call it
 * (shuffles). */
__device__ __forceinline__ float block_amax(const float (&x)[8], bool &bad) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) m = max(m, __float_as_uint(x[i]) & 0x7fffffffu);
  m = max(m, __shfl_xor_sync(kFull, m, 1));
  m = max(m, __shfl_xor_sync(kFull, m, 2));
  bad = m >= 0x7f800000u;
  return __uint_as_float(m);
}

/* Encode 8 f32 values (this lane's share of a block) -> codes and the
 * block's scale s.  Every lane of the warp must call it.  The integer codes
 * need no clamp: |x| <= a, so |x k r| <= QM (1 + 2^-24), which rounds to at
 * most QM (the CPU reference clamps; the bits are the same). */
template <int C>
__device__ __forceinline__ uint4 encode(const float (&x)[8], float &s) {
  bool bad;
  const float a = block_amax(x, bad);
  uint4 q = make_uint4(0, 0, 0, 0);
  if (bad) { s = __int_as_float(0x7fc00000); return q; }
  if (a == 0.f) { s = 0.f; return q; }
  constexpr float QM = Codec<C>::QM;
  const float k = a < 0x1p-60f ? 0x1p64f : 1.f; /* exact: keeps r finite for tiny blocks */
  const float r = __fdiv_rn(QM, __fmul_rn(a, k));
  s = __fdiv_rn(a, QM);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; i++) v[i] = __fmul_rn(__fmul_rn(x[i], k), r);
  if (C == WF_QR_INT8 || C == WF_QR_INT4) {
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int c = __float2int_rn(v[i]);
      if (C == WF_QR_INT8) w[i >> 2] |= ((uint32_t)c & 0xffu) << (8 * (i & 3));
      else w[0] |= ((uint32_t)c & 0xfu) << (4 * i);
    }
    q.x = w[0];
    q.y = w[1];
  } else { /* fp8 e4m3, round to nearest even, saturating */
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++)
      w[i >> 2] |= (uint32_t)__nv_cvt_float_to_fp8(v[i], __NV_SATFINITE, __NV_E4M3) << (8 * (i & 3));
    q.x = w[0];
    q.y = w[1];
  }
  return q;
}

/* Decode codes and scale -> 8 f32 values (q * s, one rounding). */
template <int C>
__device__ __forceinline__ void decode(uint4 q, float s, float (&y)[8]) {
  if (C == WF_QR_INT8) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const uint32_t w = i < 4 ? q.x : q.y;
      const int c = (int)(int8_t)((w >> (8 * (i & 3))) & 0xffu);
      y[i] = __fmul_rn((float)c, s);
    }
  } else if (C == WF_QR_INT4) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int c = ((int)(q.x << (28 - 4 * i))) >> 28; /* sign-extend nibble i */
      y[i] = __fmul_rn((float)c, s);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const uint32_t w = i < 4 ? q.x : q.y;
      const __nv_fp8x2_storage_t p = (__nv_fp8x2_storage_t)((w >> (8 * (i & 3))) & 0xffffu);
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(p, __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&h));
      y[i] = __fmul_rn(f.x, s);
      y[i + 1] = __fmul_rn(f.y, s);
    }
  }
}

/* Store / load vector t's codes (and, lane 0 of its block, the block's
 * scale) in an encoded region whose scales start at byte sc: a part of the
 * quick all-reduce (sc = WF_QR_PART * CB, the default) or a row of the fused
 * kernel (sc = vectors per row * CB). */
template <int C>
__device__ __forceinline__ void put(char *part, int t, uint4 q, float s,
                                    uint64_t sc = (uint64_t)WF_QR_PART * Codec<C>::CB) {
  if (C == WF_QR_FP) st_vec(part + (uint64_t)t * 16, q);
  else if (C == WF_QR_INT4) st_u32(part + (uint64_t)t * 4, q.x);
  else st_v2(part + (uint64_t)t * 8, q.x, q.y);
  if (C != WF_QR_FP && (t & 3) == 0)
    st_u32(part + sc + (uint64_t)(t >> 2) * 4, __float_as_uint(s));
}
template <int C>
__device__ __forceinline__ uint4 get(const char *part, int t, float &s,
                                     uint64_t sc = (uint64_t)WF_QR_PART * Codec<C>::CB) {
  uint4 q = make_uint4(0, 0, 0, 0);
  if (C == WF_QR_FP) return ld_vec_cg(part + (uint64_t)t * 16);
  if (C == WF_QR_INT4) q.x = ld_u32_cg(part + (uint64_t)t * 4);
  else { const uint2 v = ld_v2_cg(part + (uint64_t)t * 8); q.x = v.x; q.y = v.y; }
  s = __uint_as_float(ld_u32_cg(part + sc + (uint64_t)(t >> 2) * 4));
  return q;
}

/* One rank's contribution as f32 after the wire: encode then decode (fp:
 * the input itself). */
template <typename T, int C>
__device__ __forceinline__ void through_wire(uint4 raw, float (&y)[8]) {
  if (C == WF_QR_FP) { Pack<T>::to_f32(raw, y); return; }
  float x[8], s;
  Pack<T>::to_f32(raw, x);
  const uint4 q = encode<C>(x, s);
  decode<C>(q, s, y);
}

}  // namespace

#endif
