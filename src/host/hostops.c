/* hostops.c — host tensor helpers: aligned allocation, seeded random fill,
 * dtype conversion and error comparison (the CPU side of every reference). */
#include "core/internal.h"
#include "core/fpconv.h"
#include "host_arena.h"

#include <float.h>
#include <math.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

/* ---- allocation ---- */

void *weft_host_alloc(size_t bytes) {
  size_t n = (bytes + 63u) & ~(size_t)63u;
  if (n < bytes) { wf_error(WEFT_ENOMEM, "host_alloc: %zu bytes overflows", bytes); return NULL; }
  if (n == 0) n = 64; /* a valid, freeable pointer even for empty tensors */
  /* large tensors live in the shared arena (zeroed): peers can read them in
   * place (zero-copy host collectives) */
  void *p = bytes >= WF_ARENA_MIN ? wf_arena_alloc(n) : NULL;
  if (p) return p;
  if (posix_memalign(&p, 64, n) != 0 || !p) {
    wf_error(WEFT_ENOMEM, "host_alloc: cannot allocate %zu bytes", bytes);
    return NULL;
  }
  memset(p, 0, n);
  return p;
}

void weft_host_free(void *p) {
  if (!p) return;
  /* never under a worker's running operation (a closing Lua state frees in
   * any order): wait for it, or leak if it outlasts the bound */
  if (wf_in_use_any()) {
    size_t len = wf_arena_len(p);
    if (wf_wait_unused(p, len ? len : malloc_usable_size(p), NULL)) return;
  }
  if (!wf_arena_free(p)) free(p);
}

int weft_host_is_shared(const void *p, size_t bytes) {
  uint64_t off;
  return p && wf_arena_lookup(p, bytes, &off);
}

/* ---- dtype classes ---- */

static int is_float(int dt) {
  return dt == WEFT_F32 || dt == WEFT_F16 || dt == WEFT_BF16 || dt == WEFT_F64 ||
         dt == WEFT_F8E4M3;
}
static int is_int(int dt) { return dt == WEFT_I32 || dt == WEFT_I64 || dt == WEFT_U8; }
static int is_known(int dt) { return is_float(dt) || is_int(dt); }

/* ---- random fill ----
 * Counter-based: element i of a fill is a pure function of (seed, i, dtype,
 * dist), namely splitmix64's output function applied to key + (i+1)*gamma
 * with key = mix(seed). So a fill is deterministic, independent of how it is
 * chunked, and a device kernel can reproduce it exactly.
 *  uniform: u = k * 2^-(p-1) - 1 with k the top p bits (p = 24 for f32 and
 *           below, 53 for f64): exactly [-1, 1); after rounding to f16/bf16/
 *           f8 a value that rounded up to 1.0 is clamped to the next lower.
 *  normal:  Box-Muller on the pair (2j, 2j+1): z = r cos t for the even
 *           element, r sin t for the odd one (u1 in (0,1] so log is finite).
 *  ints:    uniform -> floor(16u) in [-16, 15]; normal -> rint(4z);
 *           u8 takes that value mod 16 (so [0, 15]). */

#define GAMMA 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

static inline uint64_t rnd(uint64_t key, uint64_t i) { return mix64(key + (i + 1) * GAMMA); }

static inline double uniform53(uint64_t x) { return (double)(x >> 11) * 0x1p-52 - 1.0; }
static inline float uniform24(uint64_t x) { return (float)(x >> 40) * 0x1p-23f - 1.0f; }

/* standard normal for element i */
static inline double normal_at(uint64_t key, uint64_t i) {
  uint64_t j = i & ~(uint64_t)1;
  double u1 = ((double)(rnd(key, j) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
  double u2 = (double)(rnd(key, j + 1) >> 11) * 0x1p-53;     /* [0, 1) */
  double r = sqrt(-2.0 * log(u1)), s, c;
  sincos(6.283185307179586 * u2, &s, &c);
  return (i & 1) ? r * s : r * c;
}

static inline int64_t int_value(double v, int dist) {
  double d = dist == 0 ? floor(16.0 * v) : rint(4.0 * v);
  if (d > 1e9) d = 1e9;
  if (d < -1e9) d = -1e9;
  return (int64_t)d;
}

/* f32 values for elements [base, base+n), base even. Normal pairs use float
 * math (24-bit u1 in (0,1]: tails to 5.77 sigma), plenty for test data. */
#define FILL_CHUNK 1024
static void gen_f32(uint64_t key, size_t base, size_t n, int dist, float *out) {
  size_t i;
  if (dist == 0) {
    for (i = 0; i < n; i++) out[i] = uniform24(rnd(key, base + i));
    return;
  }
  for (i = 0; i < n; i += 2) {
    uint64_t j = base + i;
    float u1 = ((float)(rnd(key, j) >> 40) + 1.0f) * 0x1p-24f;
    float u2 = (float)(rnd(key, j + 1) >> 40) * 0x1p-24f;
    float r = sqrtf(-2.0f * logf(u1)), sn, cs;
    sincosf(6.2831853f * u2, &sn, &cs);
    out[i] = r * cs;
    if (i + 1 < n) out[i + 1] = r * sn;
  }
}

int weft_host_fill_random(void *p, size_t count, int dtype, uint64_t seed, int dist) {
  WF_CHECK_ARG(is_known(dtype), "host_fill_random: unknown dtype %d", dtype);
  WF_CHECK_ARG(dist == 0 || dist == 1, "host_fill_random: dist must be 0 (uniform) or 1 (normal), got %d", dist);
  WF_CHECK_ARG(p || count == 0, "host_fill_random: NULL buffer for %zu elements", count);
  WF_CHECK_ARG(count <= SIZE_MAX / weft_dtype_size(dtype), "host_fill_random: %zu elements "
               "of %zu bytes overflows the address space", count, weft_dtype_size(dtype));
  const uint64_t key = mix64(seed ^ 0x5745465452414e44ULL); /* "WEFTRAND" */
  size_t i = 0;

  if (dtype == WEFT_F64) {
    double *o = p;
    if (dist == 0) for (; i < count; i++) o[i] = uniform53(rnd(key, i));
    else {
      /* both halves of a Box-Muller pair from one log/sqrt */
      for (; i + 1 < count; i += 2) {
        double u1 = ((double)(rnd(key, i) >> 11) + 1.0) * 0x1p-53;
        double u2 = (double)(rnd(key, i + 1) >> 11) * 0x1p-53;
        double r = sqrt(-2.0 * log(u1)), s, c;
        sincos(6.283185307179586 * u2, &s, &c);
        o[i] = r * c;
        o[i + 1] = r * s;
      }
      for (; i < count; i++) o[i] = normal_at(key, i);
    }
    return 0;
  }
  if (is_int(dtype)) {
    for (; i < count; i++) {
      double v = dist == 0 ? uniform53(rnd(key, i)) : normal_at(key, i);
      int64_t k = int_value(v, dist);
      if (dtype == WEFT_I32) ((int32_t *)p)[i] = (int32_t)k;
      else if (dtype == WEFT_I64) ((int64_t *)p)[i] = k;
      else ((uint8_t *)p)[i] = (uint8_t)(((k % 16) + 16) % 16);
    }
    return 0;
  }
  /* f32 / f16 / bf16 / f8: f32 values in chunks, then rounded once */
  float buf[FILL_CHUNK];
  for (size_t base = 0; base < count; base += FILL_CHUNK) {
    size_t n = count - base < FILL_CHUNK ? count - base : FILL_CHUNK;
    gen_f32(key, base, n, dist, buf);
    switch (dtype) {
    case WEFT_F32: memcpy((float *)p + base, buf, n * sizeof(float)); break;
    case WEFT_F16: {
      uint16_t *o = (uint16_t *)p + base;
      for (i = 0; i < n; i++) o[i] = wf_f32_to_f16(buf[i]);
      if (dist == 0) for (i = 0; i < n; i++) if (o[i] == 0x3c00u) o[i] = 0x3bffu;
      break;
    }
    case WEFT_BF16: {
      uint16_t *o = (uint16_t *)p + base;
      for (i = 0; i < n; i++) o[i] = wf_f32_to_bf16(buf[i]);
      if (dist == 0) for (i = 0; i < n; i++) if (o[i] == 0x3f80u) o[i] = 0x3f7fu;
      break;
    }
    default: {
      uint8_t *o = (uint8_t *)p + base;
      for (i = 0; i < n; i++) o[i] = wf_f32_to_f8e4m3(buf[i]);
      if (dist == 0) for (i = 0; i < n; i++) if (o[i] == 0x38u) o[i] = 0x37u;
      break;
    }
    }
  }
  return 0;
}

/* ---- conversion ----
 * An f64 destination gets every NaN as the one quiet NaN 0x7ff8000000000000,
 * also for f64 -> f64: LuaJIT (2.1 GC64 interpreter) does not canonicalize
 * NaNs read from FFI arrays, and a NaN with the sign and high payload bits
 * set is taken for a tagged GC value and crashes it. The Lua side reads
 * float data only through an f64 conversion. */

static inline double canon(double v) { return v != v ? (double)NAN : v; }

static inline double load_f64(const void *p, int dt, size_t i) {
  switch (dt) {
  case WEFT_F32: return ((const float *)p)[i];
  case WEFT_F16: return wf_f16_to_f32(((const uint16_t *)p)[i]);
  case WEFT_BF16: return wf_bf16_to_f32(((const uint16_t *)p)[i]);
  case WEFT_F64: return ((const double *)p)[i];
  case WEFT_F8E4M3: return wf_f8e4m3_to_f32(((const uint8_t *)p)[i]);
  case WEFT_I32: return ((const int32_t *)p)[i];
  case WEFT_I64: return (double)((const int64_t *)p)[i];
  default: return ((const uint8_t *)p)[i];
  }
}

static inline int64_t load_i64(const void *p, int dt, size_t i) {
  switch (dt) {
  case WEFT_I32: return ((const int32_t *)p)[i];
  case WEFT_I64: return ((const int64_t *)p)[i];
  default: return ((const uint8_t *)p)[i];
  }
}

static inline void store_i64(void *p, int dt, size_t i, int64_t v) {
  switch (dt) {
  case WEFT_I32: ((int32_t *)p)[i] = v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v; break;
  case WEFT_I64: ((int64_t *)p)[i] = v; break;
  default: ((uint8_t *)p)[i] = v > 255 ? 255 : v < 0 ? 0 : (uint8_t)v; break;
  }
}

/* float -> int: round to nearest even, saturate, NaN -> 0 */
static inline int64_t f64_to_i64_sat(double v) {
  if (v != v) return 0;
  v = rint(v);
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

static inline void store_f64(void *p, int dt, size_t i, double v) {
  switch (dt) {
  case WEFT_F32: ((float *)p)[i] = (float)v; break;
  case WEFT_F16: ((uint16_t *)p)[i] = wf_f64_to_f16(v); break;
  case WEFT_BF16: ((uint16_t *)p)[i] = wf_f64_to_bf16(v); break;
  case WEFT_F64: ((double *)p)[i] = v; break;
  case WEFT_F8E4M3: ((uint8_t *)p)[i] = wf_f64_to_f8e4m3(v); break;
  default: store_i64(p, dt, i, f64_to_i64_sat(v)); break;
  }
}

int weft_host_convert(const void *src, int src_dtype, void *dst, int dst_dtype, size_t count) {
  WF_CHECK_ARG(is_known(src_dtype), "host_convert: unknown source dtype %d", src_dtype);
  WF_CHECK_ARG(is_known(dst_dtype), "host_convert: unknown destination dtype %d", dst_dtype);
  if (count == 0) return 0;
  WF_CHECK_ARG(src && dst, "host_convert: NULL buffer (src %p, dst %p) for %zu elements", src, dst, count);
  {
    size_t es = weft_dtype_size(src_dtype) > weft_dtype_size(dst_dtype) ? weft_dtype_size(src_dtype)
                                                                       : weft_dtype_size(dst_dtype);
    WF_CHECK_ARG(count <= SIZE_MAX / es, "host_convert: %zu elements of %zu bytes overflows "
                 "the address space", count, es);
  }
  size_t i;
  if (src_dtype == WEFT_F64 && dst_dtype == WEFT_F64) {
    const double *s = src;
    double *d = dst;
    for (i = 0; i < count; i++) d[i] = canon(s[i]);
    return 0;
  }
  if (src_dtype == dst_dtype) {
    memmove(dst, src, count * weft_dtype_size(src_dtype));
    return 0;
  }
  /* fast paths for the pairs that carry the bulk of test data */
  if (src_dtype == WEFT_F32) {
    const float *s = src;
    switch (dst_dtype) {
    case WEFT_BF16: for (i = 0; i < count; i++) ((uint16_t *)dst)[i] = wf_f32_to_bf16(s[i]); return 0;
    case WEFT_F16: for (i = 0; i < count; i++) ((uint16_t *)dst)[i] = wf_f32_to_f16(s[i]); return 0;
    case WEFT_F8E4M3: for (i = 0; i < count; i++) ((uint8_t *)dst)[i] = wf_f32_to_f8e4m3(s[i]); return 0;
    case WEFT_F64: for (i = 0; i < count; i++) ((double *)dst)[i] = canon(s[i]); return 0;
    default: break;
    }
  }
  if (dst_dtype == WEFT_F32) {
    float *d = dst;
    switch (src_dtype) {
    case WEFT_BF16: for (i = 0; i < count; i++) d[i] = wf_bf16_to_f32(((const uint16_t *)src)[i]); return 0;
    case WEFT_F16: for (i = 0; i < count; i++) d[i] = wf_f16_to_f32(((const uint16_t *)src)[i]); return 0;
    case WEFT_F8E4M3: for (i = 0; i < count; i++) d[i] = wf_f8e4m3_to_f32(((const uint8_t *)src)[i]); return 0;
    default: break;
    }
  }
  if (dst_dtype == WEFT_F64) {
    double *d = dst;
    for (i = 0; i < count; i++) d[i] = canon(load_f64(src, src_dtype, i));
    return 0;
  }
  /* f16 <-> bf16 <-> f8 go through f32, which is exact for all of them */
  if (is_float(src_dtype) && src_dtype != WEFT_F64 && is_float(dst_dtype)) {
    for (i = 0; i < count; i++) {
      float v = (float)load_f64(src, src_dtype, i);
      switch (dst_dtype) {
      case WEFT_F16: ((uint16_t *)dst)[i] = wf_f32_to_f16(v); break;
      case WEFT_BF16: ((uint16_t *)dst)[i] = wf_f32_to_bf16(v); break;
      default: ((uint8_t *)dst)[i] = wf_f32_to_f8e4m3(v); break;
      }
    }
    return 0;
  }
  if (is_int(src_dtype) && is_int(dst_dtype)) {
    for (i = 0; i < count; i++) store_i64(dst, dst_dtype, i, load_i64(src, src_dtype, i));
    return 0;
  }
  /* everything else (f64 sources, int <-> float) rounds once from double */
  for (i = 0; i < count; i++) {
    if (src_dtype == WEFT_I64 && dst_dtype == WEFT_F32)
      ((float *)dst)[i] = (float)((const int64_t *)src)[i]; /* one rounding */
    else
      store_f64(dst, dst_dtype, i, load_f64(src, src_dtype, i));
  }
  return 0;
}

/* ---- comparison ----
 * max_abs = max |a - b|; max_rel = max |a - b| / max(|b|, 1e-30).
 * NaN in exactly one of a, b (or a diff that is infinite: Inf vs finite,
 * +Inf vs -Inf) gives Inf for both; NaN in both, or equal infinities at the
 * same place, count as equal. */
#define REL_TINY 1e-30

static inline void cmp_one(double x, double y, double *ma, double *mr) {
  int nx = x != x, ny = y != y;
  if (nx || ny) {
    if (nx != ny) { *ma = INFINITY; *mr = INFINITY; }
    return;
  }
  if (x == y) return; /* also equal infinities */
  double d = fabs(x - y);
  double r = isinf(d) ? INFINITY : d / fmax(fabs(y), REL_TINY);
  if (d > *ma) *ma = d;
  if (r > *mr) *mr = r;
}

int weft_host_compare(const void *a, const void *b, size_t count, int dtype,
                      double *max_abs, double *max_rel) {
  WF_CHECK_ARG(is_known(dtype), "host_compare: unknown dtype %d", dtype);
  WF_CHECK_ARG((a && b) || count == 0, "host_compare: NULL buffer for %zu elements", count);
  WF_CHECK_ARG(count <= SIZE_MAX / weft_dtype_size(dtype), "host_compare: %zu elements of %zu "
               "bytes overflows the address space", count, weft_dtype_size(dtype));
  double ma = 0.0, mr = 0.0;
  size_t i;
  if (dtype == WEFT_F64) {
    const double *x = a, *y = b;
    for (i = 0; i < count; i++) cmp_one(x[i], y[i], &ma, &mr);
  } else if (dtype == WEFT_F32) {
    const float *x = a, *y = b;
    for (i = 0; i < count; i++) cmp_one(x[i], y[i], &ma, &mr);
  } else {
    for (i = 0; i < count; i++) cmp_one(load_f64(a, dtype, i), load_f64(b, dtype, i), &ma, &mr);
  }
  if (max_abs) *max_abs = ma;
  if (max_rel) *max_rel = mr;
  return 0;
}
