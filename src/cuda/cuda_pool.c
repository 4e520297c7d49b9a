/* cuda_pool.c — caching device allocator: per-device free lists by size class,
 * so steady-state allocation never reaches cudaMalloc (which synchronizes
 * the device and cannot run inside a graph capture).
 *
 * Size classes: 4 per power of two from 512 B (so at most 25 % waste), one
 * free list per (device, class). Live blocks are found by pointer in a hash
 * table. A freed block is reused at once, in stream order; callers free only
 * what no other stream still reads. One mutex: allocation is not a hot loop. */
#include "cuda_internal.h"

#if WEFT_HAVE_CUDA
#include <pthread.h>
#include <stdlib.h>

#define MAX_DEV 64
#define MIN_SHIFT 9                 /* 512 B */
#define NCLASS (4 * (64 - MIN_SHIFT) + 1)
#define NBUCKET 4096

typedef struct block {
  void *ptr;
  size_t size;                      /* class size (what cudaMalloc got) */
  int dev, cls;
  struct block *next;
} block;

typedef struct devpool {
  block *free_list[NCLASS];
  weft_cuda_pool_stats st;
} devpool;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static devpool g_pool[MAX_DEV];
static block *g_live[NBUCKET];

static inline unsigned bucket(const void *p) {
  uintptr_t x = (uintptr_t)p >> 9;
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ull;
  return (unsigned)(x >> 52) & (NBUCKET - 1);
}

/* Smallest class holding n bytes; *size gets the class size. */
static int size_class(size_t n, size_t *size) {
  if (n <= ((size_t)1 << MIN_SHIFT)) {
    *size = (size_t)1 << MIN_SHIFT;
    return 0;
  }
  int e = 63 - __builtin_clzll((unsigned long long)(n - 1));   /* 2^e < n <= 2^(e+1) */
  size_t base = (size_t)1 << e, step = base >> 2;
  size_t q = (n - base + step - 1) / step;                      /* 1..4 quarters */
  *size = base + q * step;
  return (e - MIN_SHIFT) * 4 + (int)q;
}

static void trim_locked(int dev) {
  devpool *dp = &g_pool[dev];
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != dev) cudaSetDevice(dev);
  for (int c = 0; c < NCLASS; c++) {
    block *b = dp->free_list[c];
    while (b) {
      block *n = b->next;
      cudaFree(b->ptr);
      dp->st.cached_bytes -= (int64_t)b->size;
      dp->st.cached_blocks--;
      dp->st.device_frees++;
      free(b);
      b = n;
    }
    dp->free_list[c] = NULL;
  }
  if (cur != dev && cur >= 0) cudaSetDevice(cur);
  cudaGetLastError();
}

static int device_alloc(int dev, size_t size, void **p) {
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != dev) WF_CUDA_CHECK(cudaSetDevice(dev));
  /* cudaMalloc is not capturable: let it run beside a thread-local capture. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t e = cudaMalloc(p, size);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    if (wf_tl_capture_depth == 0) {   /* cudaFree would break a capture */
      trim_locked(dev);
      e = cudaMalloc(p, size);
    }
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (cur != dev && cur >= 0) cudaSetDevice(cur);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return wf_error(WEFT_ENOMEM, "cuda alloc: cuda:%d: out of memory for %zu bytes "
                    "(pool: %lld bytes in use, %lld cached)", dev, size,
                    (long long)g_pool[dev].st.in_use_bytes, (long long)g_pool[dev].st.cached_bytes);
  }
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "cudaMalloc", e);
  return 0;
}

int weft_cuda_malloc(void **p, size_t bytes, int dev) {
  WF_CHECK_ARG(p, "cuda alloc: NULL out-parameter");
  *p = NULL;
  int rc, cur;
  if ((rc = wf_cuda_device(&cur))) return rc;
  int n = 0;
  weft_cuda_device_count(&n);
  if (dev < 0) dev = cur;
  if (dev >= n || dev >= MAX_DEV)
    return wf_error(WEFT_EINVAL, "cuda alloc: cuda:%d does not exist (%d device(s))", dev, n);
  size_t size;
  int cls = size_class(bytes, &size);
  if (size < bytes) return wf_error(WEFT_EINVAL, "cuda alloc: %zu bytes is too large", bytes);
  pthread_mutex_lock(&g_mu);
  devpool *dp = &g_pool[dev];
  block *b = dp->free_list[cls];
  if (b) {
    dp->free_list[cls] = b->next;
    dp->st.cached_bytes -= (int64_t)b->size;
    dp->st.cached_blocks--;
    dp->st.hits++;
  } else {
    void *ptr = NULL;
    b = malloc(sizeof *b);
    rc = b ? device_alloc(dev, size, &ptr)
           : wf_error(WEFT_ENOMEM, "cuda alloc: out of host memory");
    if (rc) {
      free(b);
      pthread_mutex_unlock(&g_mu);
      return rc;
    }
    *b = (block){.ptr = ptr, .size = size, .dev = dev, .cls = cls};
    dp->st.device_allocs++;
    dp->st.misses++;
  }
  unsigned h = bucket(b->ptr);
  b->next = g_live[h];
  g_live[h] = b;
  dp->st.in_use_bytes += (int64_t)b->size;
  dp->st.in_use_blocks++;
  if (dp->st.in_use_bytes > dp->st.peak_bytes) dp->st.peak_bytes = dp->st.in_use_bytes;
  *p = b->ptr;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

int weft_cuda_free(void *p) {
  if (!p) return 0;
  pthread_mutex_lock(&g_mu);
  block **pp = &g_live[bucket(p)];
  while (*pp && (*pp)->ptr != p) pp = &(*pp)->next;
  block *b = *pp;
  if (!b) {
    pthread_mutex_unlock(&g_mu);
    return wf_error(WEFT_EINVAL, "cuda free: %p was not allocated by weft's pool "
                    "(or was freed already)", p);
  }
  *pp = b->next;
  devpool *dp = &g_pool[b->dev];
  dp->st.in_use_bytes -= (int64_t)b->size;
  dp->st.in_use_blocks--;
  b->next = dp->free_list[b->cls];
  dp->free_list[b->cls] = b;
  dp->st.cached_bytes += (int64_t)b->size;
  dp->st.cached_blocks++;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

static int pick_dev(int *dev, const char *op) {
  int rc, cur, n = 0;
  if ((rc = wf_cuda_device(&cur))) return rc;
  weft_cuda_device_count(&n);
  if (*dev < 0) *dev = cur;
  if (*dev >= n || *dev >= MAX_DEV)
    return wf_error(WEFT_EINVAL, "%s: cuda:%d does not exist (%d device(s))", op, *dev, n);
  return 0;
}

int weft_cuda_pool_stats_get(int dev, weft_cuda_pool_stats *out) {
  WF_CHECK_ARG(out, "cuda pool_stats: NULL out-parameter");
  int rc = pick_dev(&dev, "cuda pool_stats");
  if (rc) return rc;
  pthread_mutex_lock(&g_mu);
  *out = g_pool[dev].st;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

int weft_cuda_pool_trim(int dev) {
  int rc = pick_dev(&dev, "cuda pool_trim");
  if (rc) return rc;
  if (wf_tl_capture_depth > 0)
    return wf_error(WEFT_ESTATE, "cuda pool_trim: refused while this thread captures a graph");
  pthread_mutex_lock(&g_mu);
  trim_locked(dev);
  pthread_mutex_unlock(&g_mu);
  return 0;
}

#endif /* WEFT_HAVE_CUDA */
