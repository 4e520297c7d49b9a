/* shm_vec_multi.h — compile the kernel header named by WF_KERN_FILE (a quoted
 * file name) once per target: a generic copy, suffix _gen (16-byte vectors:
 * SSE2 on x86-64), and on x86-64 an AVX2 + F16C copy, suffix _avx2, for the
 * caller to pick at run time from the CPU's features. No include guard: each
 * kernel file includes it once. Needs shm_vec.h. */

#ifndef WF_HOST_AVX2_DEFINED
#define WF_HOST_AVX2_DEFINED
#include "core/internal.h"
/* The one place that picks the copy: AVX2 + F16C where the CPU has both,
 * unless WEFT_NO_AVX2 is set (the generic copy then runs on any CPU, as
 * tests/unit/generic_kernels_spec.lua runs the reduction specs). */
static inline int wf_host_avx2(void) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && !wf_env_str("WEFT_NO_AVX2");
#else
  return 0;
#endif
}
#endif

#define KN(x) x##_gen
#define WF_VB 16
#include "shm_vec_kern.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#include <immintrin.h>
#define KN(x) x##_avx2
#define WF_VB 32
#define WF_KERN_F16C 1
#include "shm_vec_kern.h"
#undef WF_KERN_F16C
#pragma GCC pop_options

/* Opt-in (define WF_VEC_AVX512 before including): an AVX-512 copy, suffix
 * _avx512, 64-byte vectors. It computes with the generic copy's element-wise
 * operations (F16C's conversions, as the AVX2 copy), so its results are the
 * same bits; it only halves the instructions per element (bf16/f16 sums are
 * bound by the conversions, not by memory). */
#ifdef WF_VEC_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,f16c")
#define KN(x) x##_avx512
#define WF_VB 64
#define WF_KERN_F16C512 1
#include "shm_vec_kern.h"
#undef WF_KERN_F16C512
#pragma GCC pop_options
#endif
#endif

#undef WF_KERN_FILE
