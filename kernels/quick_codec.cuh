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
  /* 1 / QM rounded to nearest (see over_qm: int8 takes it) */
  static constexpr float RQ = C == WF_QR_INT8 ? 0x1.020408p-7f : C == WF_QR_INT4 ? 0x1.24924ap-3f : 0x1.24924ap-9f;
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

/* Integer codes without the conversion unit.  Rounding to an integer:
 * v + 1.5 * 2^23 (|v| <= 128) lands in [2^23, 2^24), where a float's ulp is
 * 1, so the one FADD rounds v to nearest even exactly as __float2int_rn does,
 * and the sum's low mantissa bits are the code in two's complement (the sum
 * is 0x4B400000 + c).  Back to a float: a code c offset to u = c + 2^(b-1)
 * >= 0, put under the exponent of 2^23 (0x4B000000 | u = 2^23 + u), minus
 * 2^23 + 2^(b-1): exactly c.  F2I and I2F issue at a quarter of the FP32
 * rate on sm_80/90, FADD at full rate: int8 measured 0.4-3.3 % faster this
 * way on an H100 (bench/results/quick-codec-ab-nvidia-h100-2026-12-08.md). */
constexpr float kRound = 12582912.0f;  /* 1.5 * 2^23 */
constexpr uint32_t kTwo23 = 0x4B000000u;  /* 2^23 as bits */
/* byte b (0-3) of x under 2^23's exponent: PRMT picks x's byte b for the
 * low byte and 0x4B00 00 from kTwo23 for the others */
__device__ __forceinline__ float under_two23(uint32_t x, int b) {
  return __uint_as_float(__byte_perm(x, kTwo23, 0x7540u | (uint32_t)b));
}
/* the low bytes of four words, packed: byte i of the result is a_i's byte 0 */
__device__ __forceinline__ uint32_t low_bytes(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
  return __byte_perm(__byte_perm(a0, a1, 0x0040u), __byte_perm(a2, a3, 0x0040u), 0x5410u);
}

/* a / QM rounded to nearest without a division: the quotient through the
 * rounded reciprocal, then one correction with the exact residual (an FMA).
 * Checked against a / QM for every positive finite float a (CPU, fmaf): equal
 * for QM = 127 and 7 everywhere, for 448 wherever a >= 2^-120 (below, the
 * quotient is subnormal and can be one ulp off), so fp8 keeps __fdiv_rn (a
 * branch for tiny blocks cost the fused two-shot 12-32 registers). */
template <int C>
__device__ __forceinline__ float over_qm(float a) {
  constexpr float QM = Codec<C>::QM, RQ = Codec<C>::RQ;
  const float q0 = __fmul_rn(a, RQ);
  return __fmaf_rn(__fmaf_rn(-q0, QM, a), RQ, q0);
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
  /* fp8: over_qm<448> is off below 2^-120; int4 keeps the division (see
   * below) */
  if (C == WF_QR_INT8) s = over_qm<C>(a);
  else s = __fdiv_rn(a, QM);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; i++) v[i] = __fmul_rn(__fmul_rn(x[i], k), r);
  if (C == WF_QR_INT8) {
    uint32_t m[8]; /* 0x4B400000 + code */
#pragma unroll
    for (int i = 0; i < 8; i++) m[i] = __float_as_uint(__fadd_rn(v[i], kRound));
    q.x = low_bytes(m[0], m[1], m[2], m[3]);
    q.y = low_bytes(m[4], m[5], m[6], m[7]);
  } else if (C == WF_QR_INT4) {
    /* the conversion unit, as before: int4 through FADD and PRMT (nibbles
     * from the even and odd codes' low bytes) measured no faster to
     * quantize and, decoded through 2^23's exponent, slower to reduce at 4
     * and 8 ranks (bench/results/quick-codec-ab-nvidia-h100-2026-12-08.md) */
    uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) w |= ((uint32_t)__float2int_rn(v[i]) & 0xfu) << (4 * i);
    q.x = w;
  } else { /* fp8 e4m3, round to nearest even, saturating: two per conversion */
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
      h[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i], v[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    q.x = __byte_perm(h[0], h[1], 0x5410u);
    q.y = __byte_perm(h[2], h[3], 0x5410u);
  }
  return q;
}

/* Decode codes and scale -> 8 f32 values (q * s, one rounding). */
template <int C>
__device__ __forceinline__ void decode(uint4 q, float s, float (&y)[8]) {
  if (C == WF_QR_INT8) { /* u = c + 128: the sign bit flipped */
    const uint32_t u[2] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 8; i++)
      y[i] = __fmul_rn(__fsub_rn(under_two23(u[i >> 2], i & 3), 8388736.0f), s); /* 2^23 + 128 */
  } else if (C == WF_QR_INT4) { /* the conversion unit, as before (see encode) */
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
