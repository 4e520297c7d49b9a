/* shm_vec.h — branch-free scalar f16/bf16 conversions for the host kernels
 * (shm reductions, host RMSNorm); the vector forms are in shm_vec_kern.h.
 * They round to nearest even and agree with fpconv.h on every input, NaN
 * included (NaN stays NaN, quieted, with the top bits of its payload). */
#ifndef WF_SHM_VEC_H
#define WF_SHM_VEC_H

#include <stdint.h>
#include <string.h>

static inline uint32_t wf_sv_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float wf_sv_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* f16 -> f32, exact (Maratyszcza's FP16 trick: normals by rescaling the
 * shifted bits, subnormals by a magic subtraction). */
static inline float wf_sh2f(uint16_t h) {
  uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
  float norm = wf_sv_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  float den = wf_sv_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return wf_sv_float(sign | (two_w < (1u << 27) ? wf_sv_bits(den) : wf_sv_bits(norm)));
}

/* f32 -> f16, RNE, overflow to Inf, NaN -> quiet NaN keeping the top payload
 * bits (as F16C's vcvtps2ph and fpconv.h do: every kernel copy and the
 * scalar tails give the same bits). */
static inline uint16_t wf_sf2h(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t w = wf_sv_bits(f), shl1 = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1 & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = wf_sv_float((bias >> 1) + 0x07800000u) + base;
  uint32_t bits = wf_sv_bits(base);
  uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u | ((w >> 13) & 0x3FFu) : nonsign));
}

static inline float wf_sb2f(uint16_t h) { return wf_sv_float((uint32_t)h << 16); }

static inline uint16_t wf_sf2b(float f) {
  uint32_t x = wf_sv_bits(f);
  uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (uint16_t)(((x & 0x7fffffffu) > 0x7f800000u) ? ((x >> 16) | 0x40u) : r);
}

#endif
