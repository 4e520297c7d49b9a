/* shm_vec_multi.h — compile the kernel header named by WF_KERN_FILE (a quoted
 * file name) once per target: a generic copy, suffix _gen (16-byte vectors:
 * SSE2 on x86-64), and on x86-64 an AVX2 + F16C copy, suffix _avx2, for the
 * caller to pick at run time from the CPU's features. No include guard: each
 * kernel file includes it once. Needs shm_vec.h. */

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
#endif

#undef WF_KERN_FILE
