/* norm_host.c — weft_host_rmsnorm: residual add + RMSNorm on the host, f32
 * math over f32/f16/bf16 storage, the CPU twin of kernels/norm.cu (and the
 * host half of an shm all-reduce + norm). Vector code through GCC vector
 * extensions: SSE2 by default, AVX2 + F16C when the CPU has them. */
#include "core/internal.h"
#include "shm_vec.h"

#include <math.h>
#include <pthread.h>

#define WF_KERN_FILE "norm_host_kern.h"
#include "shm_vec_multi.h"

typedef void (*rows_fn)(const void *, const void *, const void *, void *, void *, int64_t,
                        size_t, float, int, int);
static rows_fn rows = norm_rows_gen;
static pthread_once_t rows_once = PTHREAD_ONCE_INIT;

static void pick(void) {
#if defined(__x86_64__)
  if (wf_host_avx2()) rows = norm_rows_avx2;
#endif
}

int weft_host_rmsnorm(const void *x, const void *residual, const void *weight, void *out,
                      void *residual_out, int64_t tokens, int64_t hidden, int dtype, float eps,
                      int flags) {
  static const char op[] = "weft_host_rmsnorm";
  WF_CHECK_ARG(dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16,
               "%s: dtype %d (want f32, f16 or bf16)", op, dtype);
  WF_CHECK_ARG(tokens >= 0 && hidden >= 1, "%s: bad shape %lld x %lld", op, (long long)tokens,
               (long long)hidden);
  WF_CHECK_ARG((flags & ~1) == 0, "%s: unknown flags 0x%x (1 = Gemma)", op, flags);
  WF_CHECK_ARG(eps >= 0.0f && isfinite(eps), "%s: eps must be finite and >= 0", op);
  if (tokens == 0) return 0;
  WF_CHECK_ARG(x && weight && out, "%s: NULL x, weight or out", op);
  pthread_once(&rows_once, pick);
  rows(x, residual, weight, out, residual_out, tokens, (size_t)hidden, eps, flags & 1, dtype);
  return 0;
}
