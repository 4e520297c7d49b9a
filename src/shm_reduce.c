/* shm_reduce.c — element-wise reductions for the shm collectives: one generic
 * copy of the kernels (SSE2 on x86-64) and, on x86-64, an AVX2 + F16C copy
 * picked at first use from the CPU's features. */
#include "shm.h"
#include "shm_vec.h"

#include <pthread.h>

typedef void (*wf_red_fn)(void *, const void *const *, int, size_t);

#define WF_KERN_FILE "shm_reduce_kern.h"
#include "shm_vec_multi.h"

static wf_red_fn table[7][3];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void init_table(void) {
  fill_table_gen(table);
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      !wf_env_str("WEFT_NO_AVX2"))
    fill_table_avx2(table);
#endif
}

int wf_reduce_supported(int dtype, int op) {
  return (dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16 ||
          dtype == WEFT_F64 || dtype == WEFT_I32 || dtype == WEFT_I64) &&
         (op == WEFT_SUM || op == WEFT_MAX || op == WEFT_MIN);
}

void wf_reduce(void *dst, const void *const *src, int n, size_t count, int dtype, int op) {
  pthread_once(&table_once, init_table);
  table[dtype][op](dst, src, n, count);
}
