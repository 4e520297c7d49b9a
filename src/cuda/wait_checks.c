/* wait_checks.c — the checks of the layer above that the bounded host waits
 * run (wf_cuda_set_wait_checks, cuda_internal.h): src/coll/ installs them,
 * so the CUDA layer reads NCCL's and weft's kernels' errors without calling
 * up into the collectives. */
#include "cuda_internal.h"

static wf_wait_check g_pending, g_done;

void wf_cuda_set_wait_checks(wf_wait_check pending, wf_wait_check done) {
  if (pending) __atomic_store_n(&g_pending, pending, __ATOMIC_RELEASE);
  if (done) __atomic_store_n(&g_done, done, __ATOMIC_RELEASE);
}

int wf_cuda_check_pending(const char *op) {
  wf_wait_check f = __atomic_load_n(&g_pending, __ATOMIC_ACQUIRE);
  return f ? f(op) : 0;
}

int wf_cuda_check_done(const char *op) {
  wf_wait_check f = __atomic_load_n(&g_done, __ATOMIC_ACQUIRE);
  return f ? f(op) : 0;
}

static wf_stream_hook g_destroy;

void wf_cuda_set_stream_destroy_hook(wf_stream_hook f) {
  __atomic_store_n(&g_destroy, f, __ATOMIC_RELEASE);
}

void wf_cuda_stream_destroying(void *s) {
  wf_stream_hook f = __atomic_load_n(&g_destroy, __ATOMIC_ACQUIRE);
  if (f) f(s);
}
