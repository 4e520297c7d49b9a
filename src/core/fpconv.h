/* fpconv.h — scalar float conversions shared by host references (C only).
 *
 * All narrowing conversions round to nearest, ties to even, and handle ±0,
 * subnormals, Inf and NaN:
 *   f16  (IEEE binary16): overflow -> ±Inf, NaN stays NaN (quieted).
 *   bf16 (top half of f32): overflow -> ±Inf, NaN stays NaN (quieted).
 *   f8e4m3 ("e4m3fn", OCP FP8): no Inf; NaN = 0x7f/0xff; SATURATING: any
 *     finite or infinite value with |v| >= 448 becomes ±448 (0x7e/0xfe), like
 *     CUDA's __NV_SATFINITE / PTX cvt.rn.satfinite.e4m3x2.
 * Widening conversions are exact.
 *
 * The f32 fast paths are bit tricks that rely on the default FP environment
 * (round-to-nearest, no flush-to-zero): never build with -ffast-math.
 * The f64 entry points round once, directly from double (no double rounding
 * through f32). Everything is static inline so an FP8/RMSNorm reference in
 * another file can use it without a call. */
#ifndef WEFT_FPCONV_H
#define WEFT_FPCONV_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t wf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float wf_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- bf16 ---- */
static inline float wf_bf16_to_f32(uint16_t h) { return wf_bits_f32((uint32_t)h << 16); }

static inline uint16_t wf_f32_to_bf16(float f) {
  uint32_t x = wf_f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
  /* RNE on the low 16 bits; a carry into the exponent gives the right
   * next binade / Inf, and subnormals round the same way. */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

/* ---- f16 ---- */
static inline float wf_f16_to_f32(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    return wf_bits_f32(wf_f32_bits(v) | s);
  }
  if (e == 31) return wf_bits_f32(s | 0x7f800000u | (m << 13));
  return wf_bits_f32(s | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t wf_f32_to_f16(float f) {
  uint32_t x = wf_f32_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) { /* |f| >= 65536: Inf, NaN or overflow */
    if (x > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((x >> 13) & 0x3ffu);
    return sign | 0x7c00u;
  }
  if (x < 0x38800000u) { /* |f| < 2^-14: f16 subnormal or zero */
    /* Adding 0.5f puts the f16 quantum 2^-24 at the f32 ulp, so the FPU's
     * own RNE does the rounding. */
    float r = wf_bits_f32(x) + 0.5f;
    return sign | (uint16_t)(wf_f32_bits(r) - 0x3f000000u);
  }
  uint32_t odd = (x >> 13) & 1u;
  x = x - (112u << 23) + 0xfffu + odd; /* rebias 127 -> 15, RNE */
  return sign | (uint16_t)(x >> 13);  /* a carry past 65504 yields Inf */
}

/* ---- f8e4m3 (fn) ---- */
static inline float wf_f8e4m3_to_f32(uint8_t v) {
  uint32_t s = (uint32_t)(v & 0x80u) << 24, e = (v >> 3) & 0xfu, m = v & 7u;
  if (e == 0xf && m == 7) return wf_bits_f32(s | 0x7fc00000u);
  if (e == 0) {
    float r = (float)m * 0.001953125f; /* m * 2^-9 */
    return wf_bits_f32(wf_f32_bits(r) | s);
  }
  return wf_bits_f32(s | ((e + 120u) << 23) | (m << 20));
}

static inline uint8_t wf_f32_to_f8e4m3(float f) {
  uint32_t x = wf_f32_bits(f);
  uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7f;  /* NaN */
  if (x >= 0x43e00000u) return sign | 0x7e; /* |f| >= 448 (and Inf): saturate */
  if (x < 0x3c800000u) {                    /* |f| < 2^-6: subnormal or zero */
    float r = wf_bits_f32(x) + 16384.0f;    /* ulp of 2^14 is 2^-9, the f8 quantum */
    return sign | (uint8_t)(wf_f32_bits(r) - 0x46800000u);
  }
  uint32_t odd = (x >> 20) & 1u;
  x = x - (120u << 23) + 0x7ffffu + odd; /* rebias 127 -> 7, RNE; < 448 stays < 0x7f */
  return sign | (uint8_t)(x >> 20);
}

/* ---- from f64, rounding once ----
 * Generic encoder for a small binary float with `eb` exponent and `mb`
 * mantissa bits. satfn: the e4m3fn convention (no Inf, all-ones NaN,
 * saturate); otherwise IEEE (overflow to Inf). Returns the bit pattern. */
static inline uint32_t wf_f64_to_minifloat(double v, int eb, int mb, int satfn) {
  uint64_t b;
  memcpy(&b, &v, 8);
  const uint32_t sign = (uint32_t)(b >> 63) << (eb + mb);
  const int bias = (1 << (eb - 1)) - 1;
  const uint32_t expall = (1u << eb) - 1;
  const uint32_t maxfin = satfn ? ((1u << (eb + mb)) - 2u)
                                : (((expall - 1u) << mb) | ((1u << mb) - 1u));
  const uint32_t ovf = satfn ? (sign | maxfin) : (sign | (expall << mb));
  double a = fabs(v);
  if (a != a) return satfn ? (sign | ((1u << (eb + mb)) - 1u))
                           : (sign | (expall << mb) | (1u << (mb - 1)));
  if (isinf(a)) return ovf;
  if (a < ldexp(1.0, 1 - bias)) { /* subnormal range: quantum 2^(1-bias-mb) */
    double r = rint(ldexp(a, bias - 1 + mb)); /* exact scaling, RNE */
    return sign | (uint32_t)r;                /* 2^mb encodes the min normal */
  }
  int e;
  (void)frexp(a, &e);
  e -= 1; /* a in [2^e, 2^(e+1)) */
  double r = rint(ldexp(a, mb - e)); /* in [2^mb, 2^(mb+1)] */
  if (r >= ldexp(1.0, mb + 1)) { r = ldexp(1.0, mb); e += 1; }
  if (e + bias > (int)expall) return ovf;
  uint32_t bits = ((uint32_t)(e + bias) << mb) | ((uint32_t)r - (1u << mb));
  if (bits > maxfin) return ovf;
  return sign | bits;
}

static inline uint16_t wf_f64_to_f16(double v) { return (uint16_t)wf_f64_to_minifloat(v, 5, 10, 0); }
static inline uint16_t wf_f64_to_bf16(double v) { return (uint16_t)wf_f64_to_minifloat(v, 8, 7, 0); }
static inline uint8_t wf_f64_to_f8e4m3(double v) { return (uint8_t)wf_f64_to_minifloat(v, 4, 3, 1); }

#endif
