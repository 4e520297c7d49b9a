/* shm_reduce.c — element-wise reductions for the shm collectives and, through
 * weft_host_reduce, for every other host path (the store backend, the
 * gather-then-reduce fallbacks): one definition everywhere. One generic copy
 * of the kernels (SSE2 on x86-64) and, on x86-64, an AVX2 + F16C copy and an
 * AVX-512 one, picked at first use from the CPU's features. */
#include "shm.h"
#include "shm_vec.h"

#include <pthread.h>

typedef void (*wf_red_fn)(void *, const void *const *, int, size_t);
#define WF_RED_DTYPES (WEFT_F64 + 1)
#define WF_RED_OPS (WEFT_PROD + 1)

#define WF_KERN_FILE "shm_reduce_kern.h"
#define WF_VEC_AVX512 1
#include "shm_vec_multi.h"

static wf_red_fn table[WF_RED_DTYPES][WF_RED_OPS];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void init_table(void) {
  fill_table_gen(table);
#if defined(__x86_64__)
  if (wf_host_avx2()) {
    fill_table_avx2(table);
    /* twice the lanes for f16/bf16 only: their sums are bound by the
     * conversions (~2x faster); f32 and wider are bound by memory, and the
     * 512-bit units' wake-up after a sleep made 4-rank f32 calls ~7% slower */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && !wf_env_str("WEFT_NO_AVX512")) {
      static wf_red_fn wide[WF_RED_DTYPES][WF_RED_OPS];
      fill_table_avx512(wide);
      for (int op = 0; op < WF_RED_OPS; op++) {
        table[WEFT_F16][op] = wide[WEFT_F16][op];
        table[WEFT_BF16][op] = wide[WEFT_BF16][op];
      }
    }
  }
#endif
}

int wf_reduce_supported(int dtype, int op) {
  return dtype >= WEFT_F32 && dtype <= WEFT_F64 &&
         (op == WEFT_SUM || op == WEFT_MAX || op == WEFT_MIN || op == WEFT_PROD);
}

void wf_reduce(void *dst, const void *const *src, int n, size_t count, int dtype, int op) {
  pthread_once(&table_once, init_table);
  table[dtype][op](dst, src, n, count);
}

int weft_host_reduce(void *dst, const void *const *srcs, int n, size_t count, int dtype,
                     int op) {
  static const char OP[] = "weft_host_reduce";
  WF_CHECK_ARG(n >= 1 && (count == 0 || (dst && srcs)), "%s: need n >= 1 sources and a "
               "destination (n = %d)", OP, n);
  WF_CHECK_ARG(wf_reduce_supported(dtype, op), "%s: unsupported dtype %d / op %d (f32, f16, "
               "bf16, f64, i32, i64, u8 with sum, max, min, prod)", OP, dtype, op);
  if (count == 0) return 0;
  WF_CHECK_ARG(count <= SIZE_MAX / weft_dtype_size(dtype), "%s: %zu elements of %zu bytes "
               "overflows the address space", OP, count, weft_dtype_size(dtype));
  for (int j = 0; j < n; j++) WF_CHECK_ARG(srcs[j], "%s: source %d is NULL", OP, j);
  wf_reduce(dst, srcs, n, count, dtype, op);
  return 0;
}
