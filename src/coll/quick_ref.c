/* quick_ref.c — the CPU reference of the quick all-reduce
 * (kernels/quick_allreduce.cu): the same codec (src/coll/quick_codec.h) and
 * the same sequence of f32 operations, one IEEE rounding each, so the
 * kernel's output equals this bit for bit (NaN payloads aside).  Tests
 * compare the kernel with it, and check it against an f64 reference and the
 * documented bounds (docs/quick-allreduce.md) on the CPU.  Host only.
 * x86-64 does f32 arithmetic in SSE (no excess precision, no FMA unless
 * asked for): the operations below are exactly the kernel's. */
#include "core/fpconv.h"
#include "core/internal.h"
#include "quick_codec.h"
#include "weft.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One block of WF_QR_BLOCK values through the wire: encode, then decode
 * (the kernel's encode + decode). */
static void through_wire(int codec, const float *x, float *y) {
  float a = 0.f;
  int bad = 0;
  for (int i = 0; i < WF_QR_BLOCK; i++) {
    const float ax = fabsf(x[i]);
    bad |= !(ax <= FLT_MAX);
    a = fmaxf(a, ax);
  }
  if (bad) {
    for (int i = 0; i < WF_QR_BLOCK; i++) y[i] = NAN;
    return;
  }
  if (a == 0.f) {
    for (int i = 0; i < WF_QR_BLOCK; i++) y[i] = 0.f;
    return;
  }
  const float qm = wf_qr_qmax(codec);
  const float k = a < 0x1p-60f ? 0x1p64f : 1.f;
  volatile float ak = a * k; /* volatile: one rounding per operation, never contracted */
  const float r = qm / ak;
  const float s = a / qm;
  for (int i = 0; i < WF_QR_BLOCK; i++) {
    volatile float xk = x[i] * k;
    const float v = xk * r;
    float d;
    if (codec == WF_QR_FP8) {
      d = wf_f8e4m3_to_f32(wf_f32_to_f8e4m3(v));
    } else {
      float c = rintf(v); /* round to nearest even, as __float2int_rn */
      if (c > qm) c = qm;
      if (c < -qm) c = -qm;
      d = (float)(int)c; /* an integer code: -0 becomes +0, as in the kernel */
    }
    y[i] = d * s;
  }
}

static float load(int dtype, const void *p, size_t i) {
  const uint16_t h = ((const uint16_t *)p)[i];
  return dtype == WEFT_BF16 ? wf_bf16_to_f32(h) : wf_f16_to_f32(h);
}
static void store(int dtype, void *p, size_t i, float v) {
  ((uint16_t *)p)[i] = dtype == WEFT_BF16 ? wf_f32_to_bf16(v) : wf_f32_to_f16(v);
}

/* One block of WF_QR_BLOCK elements from `start` (n of them real, the rest
 * +0 as the kernel pads): every rank's block through the wire, the f32 sum in
 * rank order, that sum through the wire once more (the owner's encode and
 * every rank's decode) into y. */
static void reduce_block(int codec, int dtype, int world, const void *const *inputs, size_t start, int n,
                         float *y) {
  enum { B = WF_QR_BLOCK };
  float x[B], d[B], acc[B];
  for (int p = 0; p < world; p++) {
    for (int i = 0; i < B; i++) x[i] = i < n ? load(dtype, inputs[p], start + (size_t)i) : 0.f;
    if (codec == WF_QR_FP) memcpy(d, x, sizeof d);
    else through_wire(codec, x, d);
    for (int i = 0; i < B; i++) {
      volatile float sum = p == 0 ? d[i] : acc[i] + d[i];
      acc[i] = sum;
    }
  }
  if (codec == WF_QR_FP) memcpy(y, acc, sizeof acc);
  else through_wire(codec, acc, y);
}

int weft_qr_reference(int codec, int dtype, int world, const void *const *inputs, void *out, size_t count) {
  WF_CHECK_ARG(codec >= 0 && codec < WF_QR_NCODECS, "quick reference: codec %d unknown (0 fp, 1 int8, 2 int4, 3 fp8)",
               codec);
  WF_CHECK_ARG(dtype == WEFT_BF16 || dtype == WEFT_F16, "quick reference: dtype %d is not bf16 or f16", dtype);
  WF_CHECK_ARG(world >= 1 && world <= 64, "quick reference: world %d out of range", world);
  WF_CHECK_ARG(inputs && out, "quick reference: NULL buffer");
  for (int p = 0; p < world; p++) WF_CHECK_ARG(inputs[p], "quick reference: input %d is NULL", p);
  float y[WF_QR_BLOCK];
  for (size_t b0 = 0; b0 < count; b0 += WF_QR_BLOCK) {
    const size_t n = count - b0 < WF_QR_BLOCK ? count - b0 : WF_QR_BLOCK;
    reduce_block(codec, dtype, world, inputs, b0, (int)n, y);
    for (size_t i = 0; i < n; i++) store(dtype, out, b0 + i, y[i]);
  }
  return 0;
}

int weft_qr_wire_bytes(int codec, size_t count, size_t *bytes) {
  WF_CHECK_ARG(codec >= 0 && codec < WF_QR_NCODECS && bytes, "quick wire bytes: bad codec %d or NULL", codec);
  *bytes = (size_t)wf_qr_wire_bytes(codec, (count * 2 + 15) / 16);
  return 0;
}

/* The fused quick two-shot (kernels/quick_fused.cu) on the CPU. Per row:
 * blocks of 32 from the row's start (the last one padded with +0), every
 * rank's block through the wire, the f32 sum in rank order through the wire
 * once more (the owner's encode + every rank's decode), rounded to the dtype
 * (the all-reduced value a); residual_out = dtype(a + residual) in one f32
 * addition (the kernel's bits); norm_out = residual_out * rstd * w in f64
 * with rstd = 1 / sqrt(mean(residual_out^2) + eps), rounded to the dtype. */
int weft_qr_fused_reference(int codec, int dtype, int world, const void *const *inputs, const void *residual,
                            const void *weight, float eps, int gemma, int64_t tokens, int64_t hidden,
                            void *sum_out, void *residual_out, void *norm_out) {
  WF_CHECK_ARG(codec >= 0 && codec < WF_QR_NCODECS, "quick fused reference: codec %d unknown (0 fp, 1 int8, 2 int4, "
               "3 fp8)", codec);
  WF_CHECK_ARG(dtype == WEFT_BF16 || dtype == WEFT_F16, "quick fused reference: dtype %d is not bf16 or f16", dtype);
  WF_CHECK_ARG(world >= 1 && world <= 64, "quick fused reference: world %d out of range", world);
  WF_CHECK_ARG(inputs && residual && residual_out, "quick fused reference: NULL buffer");
  WF_CHECK_ARG(!norm_out || weight, "quick fused reference: norm_out needs weight");
  WF_CHECK_ARG(tokens >= 0 && hidden >= 1, "quick fused reference: %lld x %lld", (long long)tokens, (long long)hidden);
  for (int p = 0; p < world; p++) WF_CHECK_ARG(inputs[p], "quick fused reference: input %d is NULL", p);
  enum { B = WF_QR_BLOCK };
  float y[B];
  for (int64_t t = 0; t < tokens; t++) {
    const size_t row = (size_t)t * (size_t)hidden;
    for (int64_t b0 = 0; b0 < hidden; b0 += B) {
      const int n = hidden - b0 < B ? (int)(hidden - b0) : B;
      reduce_block(codec, dtype, world, inputs, row + (size_t)b0, n, y);
      for (int i = 0; i < n; i++) {
        const size_t k = row + (size_t)b0 + (size_t)i;
        uint16_t *ao = sum_out ? (uint16_t *)sum_out + k : NULL;
        const uint16_t ab = dtype == WEFT_BF16 ? wf_f32_to_bf16(y[i]) : wf_f32_to_f16(y[i]);
        if (ao) *ao = ab;
        const float a = dtype == WEFT_BF16 ? wf_bf16_to_f32(ab) : wf_f16_to_f32(ab);
        volatile float r = a + load(dtype, residual, k);
        store(dtype, residual_out, k, r);
      }
    }
    if (norm_out) {
      double ss = 0;
      for (int64_t i = 0; i < hidden; i++) {
        const double v = load(dtype, residual_out, row + (size_t)i);
        ss += v * v;
      }
      const double rstd = 1.0 / sqrt(ss / (double)hidden + (double)eps);
      for (int64_t i = 0; i < hidden; i++) {
        const double w = (double)load(dtype, weight, (size_t)i) + (gemma ? 1.0 : 0.0);
        store(dtype, norm_out, row + (size_t)i, (float)((double)load(dtype, residual_out, row + (size_t)i) * rstd * w));
      }
    }
  }
  return 0;
}
