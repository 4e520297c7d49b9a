/* shm_vec_kern.h — per-target vector types, loads and stores (no include
 * guard: a kernel file includes it once per `#pragma GCC target` region).
 * Before including, define KN(x) (this copy's name, e.g. x##_gen / x##_avx2)
 * and WF_VB (vector bytes: 16 for SSE2, 32 for AVX2, 64 for AVX-512); define
 * WF_KERN_F16C where F16C is enabled on 32-byte vectors, WF_KERN_F16C512 on
 * 64-byte ones. GCC vector extensions make the same source compile
 * to the target's vector instructions without relying on the auto-vectorizer
 * (which -O2 barely runs). At its end it includes the kernel header
 * WF_KERN_FILE, then undefines this copy's names. Included through
 * shm_vec_multi.h. Needs shm_vec.h. */

#define WF_AI static inline __attribute__((always_inline))

typedef float KN(vf) __attribute__((vector_size(WF_VB)));
typedef uint32_t KN(vu) __attribute__((vector_size(WF_VB)));
typedef int32_t KN(vi) __attribute__((vector_size(WF_VB)));
typedef uint16_t KN(vh) __attribute__((vector_size(WF_VB / 2)));
typedef double KN(vd) __attribute__((vector_size(WF_VB)));
typedef int64_t KN(vl) __attribute__((vector_size(WF_VB)));
typedef uint64_t KN(vul) __attribute__((vector_size(WF_VB)));
typedef uint8_t KN(vb8) __attribute__((vector_size(WF_VB)));
#define VF KN(vf)
#define VU KN(vu)
#define VI KN(vi)
#define VH KN(vh)
#define VD KN(vd)
#define VL KN(vl)
#define VUL KN(vul)
#define VB8 KN(vb8)
#define LF (WF_VB / 4) /* float lanes */

#ifdef WF_KERN_F16C
WF_AI VF KN(vh2f)(VH h) { return (VF)_mm256_cvtph_ps((__m128i)h); }
WF_AI VH KN(vf2h)(VF f) {
  return (VH)_mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#elif defined(WF_KERN_F16C512)
WF_AI VF KN(vh2f)(VH h) { return (VF)_mm512_cvtph_ps((__m256i)h); }
WF_AI VH KN(vf2h)(VF f) {
  return (VH)_mm512_cvtps_ph((__m512)f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
WF_AI VF KN(vh2f)(VH h) {
  VU w = __builtin_convertvector(h, VU) << 16;
  VU sign = w & 0x80000000u, two_w = w + w;
  VF norm = (VF)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  VF den = (VF)((two_w >> 17) | (126u << 23)) - 0.5f;
  VU m = (VU)(two_w < (1u << 27));
  return (VF)(sign | ((m & (VU)den) | (~m & (VU)norm)));
}
WF_AI VH KN(vf2h)(VF f) {
  VU w = (VU)f, shl1 = w + w, sign = w & 0x80000000u;
  VF base = ((VF)(w & 0x7fffffffu) * 0x1.0p+112f) * 0x1.0p-110f;
  VU bias = shl1 & 0xFF000000u;
  VU lt = (VU)(bias < 0x71000000u);
  bias = (lt & 0x71000000u) | (~lt & bias);
  base = (VF)((bias >> 1) + 0x07800000u) + base;
  VU bits = (VU)base;
  VU nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  VU nan = (VU)(shl1 > 0xFF000000u);
  VU r = (sign >> 16) | ((nan & (0x7E00u | ((w >> 13) & 0x3FFu))) | (~nan & nonsign));
  return __builtin_convertvector(r, VH);
}
#endif

#ifdef WF_KERN_F16C512
/* GCC splits these widenings and narrowings into 256-bit halves: one
 * instruction each instead (vpmovzxwd, vpmovdw) */
#define WF_WIDEN(h) ((VU)_mm512_cvtepu16_epi32((__m256i)(h)))
#define WF_NARROW(u) ((VH)_mm512_cvtepi32_epi16((__m512i)(u)))
#else
#define WF_WIDEN(h) __builtin_convertvector(h, VU)
#define WF_NARROW(u) __builtin_convertvector(u, VH)
#endif
WF_AI VF KN(vb2f)(VH h) { return (VF)(WF_WIDEN(h) << 16); }
WF_AI VH KN(vf2b)(VF f) {
  VU x = (VU)f;
  VU r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  VU nan = (VU)((VI)(x & 0x7fffffffu) > 0x7f800000); /* |x| fits: signed compare is one op */
  return WF_NARROW((nan & ((x >> 16) | 0x40u)) | (~nan & r));
}
#undef WF_WIDEN
#undef WF_NARROW

/* LF floats from p (f32, f16 or bf16 storage; dt is a compile-time constant
 * at every call site, so the branches fold away). */
WF_AI VF KN(vload)(const void *p, int dt) {
  if (dt == WEFT_F32) { VF v; memcpy(&v, p, sizeof v); return v; }
  VH h;
  memcpy(&h, p, sizeof h);
  return dt == WEFT_F16 ? KN(vh2f)(h) : KN(vb2f)(h);
}
WF_AI void KN(vstore)(void *p, VF v, int dt) {
  if (dt == WEFT_F32) { memcpy(p, &v, sizeof v); return; }
  VH h = dt == WEFT_F16 ? KN(vf2h)(v) : KN(vf2b)(v);
  memcpy(p, &h, sizeof h);
}
WF_AI float KN(sload)(const void *p, size_t i, int dt) {
  if (dt == WEFT_F32) return ((const float *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return dt == WEFT_F16 ? wf_sh2f(h) : wf_sb2f(h);
}
WF_AI void KN(sstore)(void *p, size_t i, float v, int dt) {
  if (dt == WEFT_F32) { ((float *)p)[i] = v; return; }
  ((uint16_t *)p)[i] = dt == WEFT_F16 ? wf_sf2h(v) : wf_sf2b(v);
}

/* this copy's kernels, then forget its names for the next copy */
#include WF_KERN_FILE
#undef VF
#undef VU
#undef VI
#undef VH
#undef VD
#undef VL
#undef VUL
#undef VB8
#undef LF
#undef WF_VB
#undef KN
