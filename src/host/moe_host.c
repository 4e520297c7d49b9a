/* moe_host.c — weft_host_moe_reduce: the local MoE reduction on the host (the
 * CPU twin of kernels/moe_reduce.cu and the first step of the host path of
 * the fused MoE patterns): f32 accumulation, the shared output first, then the
 * top_k weighted expert outputs in k order, rounded once to the dtype. */
#include "core/internal.h"
#include "core/fpconv.h"

#include <math.h>

static inline float ld(const void *p, int dt, size_t i) {
  switch (dt) {
  case WEFT_F32: return ((const float *)p)[i];
  case WEFT_F16: return wf_f16_to_f32(((const uint16_t *)p)[i]);
  default: return wf_bf16_to_f32(((const uint16_t *)p)[i]);
  }
}

static inline void st(void *p, int dt, size_t i, float v) {
  switch (dt) {
  case WEFT_F32: ((float *)p)[i] = v; break;
  case WEFT_F16: ((uint16_t *)p)[i] = wf_f32_to_f16(v); break;
  default: ((uint16_t *)p)[i] = wf_f32_to_bf16(v); break;
  }
}

int weft_host_moe_reduce(const void *input, const void *scales, int scales_dtype,
                         const int32_t *perm, int64_t expert_rows, const void *shared, void *out,
                         int64_t tokens, int64_t hidden, int top_k, int dtype) {
  static const char op[] = "weft_host_moe_reduce";
  WF_CHECK_ARG(dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16,
               "%s: dtype %d (want f32, f16 or bf16)", op, dtype);
  WF_CHECK_ARG(scales_dtype == WEFT_F32 || scales_dtype == dtype,
               "%s: scales dtype %d must be f32 or the input's", op, scales_dtype);
  WF_CHECK_ARG(tokens >= 0 && hidden >= 1, "%s: bad shape %lld x %lld", op, (long long)tokens,
               (long long)hidden);
  WF_CHECK_ARG(top_k >= 1 && top_k <= 16, "%s: top_k %d out of range [1, 16]", op, top_k);
  if (tokens == 0) return 0;
  WF_CHECK_ARG(input && scales && out, "%s: NULL input, scales or out", op);
  if (perm) {
    /* checked before anything is written: a refused call changes nothing */
    for (int64_t i = 0; i < tokens * top_k; i++)
      WF_CHECK_ARG(perm[i] >= 0 && perm[i] < expert_rows,
                   "%s: permutation entry [%lld][%lld] = %d outside [0, %lld) (expert rows)", op,
                   (long long)(i / top_k), (long long)(i % top_k), perm[i], (long long)expert_rows);
  }
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t j = 0; j < hidden; j++) {
      float acc = shared ? ld(shared, dtype, (size_t)(t * hidden + j)) : 0.0f;
      for (int k = 0; k < top_k; k++) {
        float s;
        int64_t row;
        if (perm) {
          s = ld(scales, scales_dtype, (size_t)(t * top_k + k));
          row = perm[t * top_k + k];
        } else {
          s = ld(scales, scales_dtype, (size_t)(k * tokens + t));
          row = k * tokens + t;
        }
        acc = fmaf(s, ld(input, dtype, (size_t)(row * hidden + j)), acc);
      }
      st(out, dtype, (size_t)(t * hidden + j), acc);
    }
  }
  return 0;
}
