/* cuda.c — the CUDA runtime, resolved lazily: init, devices, Driver API table,
 * error recording, copies, streams, events and bounded waits.
 *
 * libcudart is linked statically and opens libcuda itself on the first call,
 * so this library loads on a machine without a driver; the first device call
 * then fails with WEFT_ENODEV. Driver entry points come from
 * cudaGetDriverEntryPointByVersion (no libcuda link, no multicast entries). */
#include "cuda_internal.h"

#if WEFT_HAVE_CUDA
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

struct wf_cu_api wf_cu;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_rc;                  /* result of the one-time init */
static char g_msg[512];           /* its message, replayed to every caller */
static int g_count;
static int g_default_dev;
static int g_timeout_ms;

static __thread int tl_dev = -1;  /* device this thread was put on */
static __thread cudaStream_t tl_stream;
static __thread cudaEvent_t tl_sync_ev;  /* for stream_wait_stream */

int wf_cuda_err(const char *file, int line, const char *call, cudaError_t e) {
  const char *base = strrchr(file, '/');
  return wf_error(WEFT_ECUDA, "%s:%d: %s: %s (%s)", base ? base + 1 : file, line, call,
                  cudaGetErrorString(e), cudaGetErrorName(e));
}

int wf_cu_err(const char *file, int line, const char *call, CUresult r) {
  const char *s = NULL;
  const char *base = strrchr(file, '/');
  if (wf_cu.cuGetErrorString) wf_cu.cuGetErrorString(r, &s);
  return wf_error(WEFT_ECUDA, "%s:%d: %s: %s (CUresult %d)", base ? base + 1 : file, line,
                  call, s ? s : "unknown driver error", (int)r);
}

#define RESOLVE(name)                                                              \
  do {                                                                             \
    enum cudaDriverEntryPointQueryResult q_;                                       \
    void *fn_ = NULL;                                                              \
    cudaError_t e_ = cudaGetDriverEntryPointByVersion(#name, &fn_, 12000,          \
                                                      cudaEnableDefault, &q_);     \
    if (e_ != cudaSuccess || q_ != cudaDriverEntryPointSuccess || !fn_) {          \
      snprintf(g_msg, sizeof g_msg, "cuda init: driver entry point %s not found "  \
               "(driver too old?)", #name);                                        \
      return WEFT_ECUDA;                                                           \
    }                                                                              \
    memcpy(&wf_cu.name, &fn_, sizeof fn_);                                         \
  } while (0)

static int resolve_driver(void) {
  RESOLVE(cuMemCreate);
  RESOLVE(cuMemExportToShareableHandle);
  RESOLVE(cuMemImportFromShareableHandle);
  RESOLVE(cuMemAddressReserve);
  RESOLVE(cuMemMap);
  RESOLVE(cuMemSetAccess);
  RESOLVE(cuMemUnmap);
  RESOLVE(cuMemRelease);
  RESOLVE(cuMemAddressFree);
  RESOLVE(cuMemGetAllocationGranularity);
  RESOLVE(cuDeviceGet);
  RESOLVE(cuDeviceGetAttribute);
  RESOLVE(cuCtxGetDevice);
  RESOLVE(cuGetErrorString);
  RESOLVE(cuPointerGetAttribute);
  return 0;
}

/* All WEFT_ and CUDA-related environment of this module, read once here. */
static void init_once(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n <= 0) {
    snprintf(g_msg, sizeof g_msg, "no CUDA device (%s)",
             e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports 0 devices");
    cudaGetLastError();
    g_rc = WEFT_ENODEV;
    return;
  }
  g_count = n;
  long want = wf_env_long("WEFT_DEVICE", -1);
  if (want >= 0) {
    if (want >= n) {
      snprintf(g_msg, sizeof g_msg, "cuda init: WEFT_DEVICE=%ld but only %d device(s)", want, n);
      g_rc = WEFT_EINVAL;
      return;
    }
    g_default_dev = (int)want;
  } else {
    long lr = wf_env_long("LOCAL_RANK", 0);
    g_default_dev = (int)((lr < 0 ? 0 : lr) % n);
  }
  g_timeout_ms = (int)wf_env_long("WEFT_CUDA_TIMEOUT_MS", 300000);
  if (g_timeout_ms <= 0) g_timeout_ms = 300000;
  /* Make the primary context exist before resolving driver calls. */
  e = cudaSetDevice(g_default_dev);
  if (e == cudaSuccess) e = cudaFree(NULL);
  if (e != cudaSuccess) {
    snprintf(g_msg, sizeof g_msg, "cuda init: cuda:%d: %s", g_default_dev, cudaGetErrorString(e));
    cudaGetLastError();
    g_rc = WEFT_ECUDA;
    return;
  }
  g_rc = resolve_driver();
  if (g_rc == 0) {
    tl_dev = g_default_dev;
    wf_log(1, "cuda: %d device(s), default cuda:%d", n, g_default_dev);
  }
}

int wf_cuda_init(void) {
  pthread_once(&g_once, init_once);
  if (g_rc) return wf_error(g_rc, "%s", g_msg);
  return 0;
}

/* Init, then put a thread that never chose a device on the default one. */
static int ensure(void) {
  if (tl_dev >= 0) return 0;
  int rc = wf_cuda_init();
  if (rc) return rc;
  if (tl_dev < 0) {
    WF_CUDA_CHECK(cudaSetDevice(g_default_dev));
    tl_dev = g_default_dev;
  }
  return 0;
}

int wf_cuda_device(int *dev) {
  int rc = ensure();
  if (rc) return rc;
  *dev = tl_dev;
  return 0;
}

int wf_cuda_timeout_ms(void) { return g_timeout_ms > 0 ? g_timeout_ms : 300000; }

cudaStream_t wf_cuda_current_stream(void) { return tl_stream; }

/* ---- devices ---- */

int weft_cuda_device_count(int *n) {
  WF_CHECK_ARG(n, "cuda device_count: NULL out-parameter");
  pthread_once(&g_once, init_once);
  *n = (g_rc == WEFT_ENODEV) ? 0 : g_count;
  return 0;
}

int weft_cuda_set_device(int dev) {
  int rc = wf_cuda_init();
  if (rc) return rc;
  if (dev < 0 || dev >= g_count)
    return wf_error(WEFT_EINVAL, "cuda set_device: cuda:%d does not exist (%d device(s))", dev,
                    g_count);
  if (dev == tl_dev) return 0;
  if (wf_tl_capture_depth > 0)
    return wf_error(WEFT_ESTATE, "cuda set_device: refused while this thread captures a graph");
  WF_CUDA_CHECK(cudaSetDevice(dev));
  tl_dev = dev;
  /* The current stream belongs to the old device. */
  tl_stream = NULL;
  if (tl_sync_ev) {
    cudaEventDestroy(tl_sync_ev);
    tl_sync_ev = NULL;
  }
  return 0;
}

int weft_cuda_get_device(int *dev) {
  WF_CHECK_ARG(dev, "cuda get_device: NULL out-parameter");
  return wf_cuda_device(dev);
}

int weft_cuda_device_name(int dev, char *buf, size_t len) {
  WF_CHECK_ARG(buf && len > 0, "cuda device_name: NULL buffer");
  int rc = ensure();
  if (rc) return rc;
  if (dev < 0) dev = tl_dev;
  if (dev >= g_count) return wf_error(WEFT_EINVAL, "cuda device_name: no cuda:%d", dev);
  struct cudaDeviceProp p;
  WF_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  snprintf(buf, len, "%s", p.name);
  return 0;
}

int weft_cuda_pointer_device(const void *p, int *dev) {
  WF_CHECK_ARG(dev, "cuda pointer_device: NULL out-parameter");
  int rc = ensure();
  if (rc) return rc;
  *dev = -1;
  if (!p) return 0;
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return 0;  /* not known to CUDA: pageable host memory */
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) *dev = a.device;
  return 0;
}

/* ---- bounded waits ----
 * The host waits of the API (synchronize, copy, stream/event waits) also
 * read the error words of weft's own kernels once the work is done
 * (wf_cuda_check_done: devcoll.c), as the waits poll NCCL's async errors: a custom
 * all-reduce or fusion kernel that gave up on a peer is reported where its
 * wrong output would be read, not at the next call. */

static int capturing_refusal(const char *op) {
  return wf_error(WEFT_ESTATE, "%s: refused while this thread captures a CUDA graph "
                  "(a synchronizing call would invalidate the capture)", op);
}

/* Poll until done, sleeping with backoff; also polls NCCL communicators so a
 * failed collective becomes an error instead of an endless wait. */
int wf_cuda_wait_stream(cudaStream_t s, int timeout_ms, const char *op) {
  if (wf_tl_capture_depth > 0) return capturing_refusal(op);
  int64_t deadline = wf_now_ms() + timeout_ms;
  int us = 0, polls = 0;
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return 0;
    if (e != cudaErrorNotReady) return wf_cuda_err(__FILE__, __LINE__, op, e);
    int rc = wf_cuda_check_pending(op);
    if (rc) return rc;
    if (wf_now_ms() > deadline)
      return wf_error(WEFT_ETIMEOUT, "%s: stream did not finish within %d ms "
                      "(WEFT_CUDA_TIMEOUT_MS; a collective waiting for a peer?)", op, timeout_ms);
    /* short work finishes within microseconds: yield first, then sleep */
    if (++polls <= 100) sched_yield();
    else wf_backoff(&us, 200);
  }
}

static int wait_event(cudaEvent_t ev, const char *op) {
  if (wf_tl_capture_depth > 0) return capturing_refusal(op);
  int64_t deadline = wf_now_ms() + wf_cuda_timeout_ms();
  int us = 0;
  for (;;) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return 0;
    if (e != cudaErrorNotReady) return wf_cuda_err(__FILE__, __LINE__, op, e);
    int rc = wf_cuda_check_pending(op);
    if (rc) return rc;
    if (wf_now_ms() > deadline)
      return wf_error(WEFT_ETIMEOUT, "%s: event not reached within %d ms", op,
                      wf_cuda_timeout_ms());
    wf_backoff(&us, 200);
  }
}

static inline cudaStream_t pick(void *stream) {
  return stream ? (cudaStream_t)stream : tl_stream;
}

int weft_cuda_synchronize(void) {
  int rc = ensure();
  if (rc) return rc;
  if (wf_tl_capture_depth > 0) return capturing_refusal("cuda synchronize");
  /* Bounded: an event on the legacy stream, which waits for every blocking
   * stream; non-blocking streams are covered by the device sync after it. */
  rc = wf_cuda_wait_stream(tl_stream, wf_cuda_timeout_ms(), "cuda synchronize");
  if (rc) return rc;
  rc = wf_cuda_wait_stream(NULL, wf_cuda_timeout_ms(), "cuda synchronize");
  if (rc) return rc;
  WF_CUDA_CHECK(cudaDeviceSynchronize());
  return wf_cuda_check_done("cuda synchronize");
}

/* ---- copies ---- */

int weft_cuda_memcpy(void *dst, const void *src, size_t bytes) {
  int rc = ensure();
  if (rc) return rc;
  if (bytes == 0) return 0;
  WF_CHECK_ARG(dst && src, "cuda copy: NULL %s pointer (%zu bytes)", dst ? "source" : "destination",
               bytes);
  cudaStream_t s = tl_stream;
  rc = wf_cuda_wait_stream(s, wf_cuda_timeout_ms(), "cuda copy");
  if (rc) return rc;
  WF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  rc = wf_cuda_wait_stream(s, wf_cuda_timeout_ms(), "cuda copy");
  return rc ? rc : wf_cuda_check_done("cuda copy");
}

int weft_cuda_memcpy_async(void *dst, const void *src, size_t bytes, void *stream) {
  int rc = ensure();
  if (rc) return rc;
  if (bytes == 0) return 0;
  WF_CHECK_ARG(dst && src, "cuda copy_async: NULL %s pointer", dst ? "source" : "destination");
  WF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, pick(stream)));
  return 0;
}

int weft_cuda_memset(void *p, int value, size_t bytes, void *stream) {
  int rc = ensure();
  if (rc) return rc;
  if (bytes == 0) return 0;
  WF_CHECK_ARG(p, "cuda memset: NULL pointer");
  WF_CUDA_CHECK(cudaMemsetAsync(p, value, bytes, pick(stream)));
  return 0;
}

/* ---- streams ---- */

int weft_cuda_stream_create(int nonblocking, void **out) {
  WF_CHECK_ARG(out, "cuda stream_create: NULL out-parameter");
  *out = NULL;
  int rc = ensure();
  if (rc) return rc;
  cudaStream_t s;
  WF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, nonblocking ? cudaStreamNonBlocking
                                                          : cudaStreamDefault));
  *out = s;
  return 0;
}

int weft_cuda_stream_destroy(void *stream) {
  if (!stream) return 0;
  int rc = ensure();
  if (rc) return rc;
  if (tl_stream == (cudaStream_t)stream) tl_stream = NULL;
  wf_cuda_stream_destroying(stream);
  WF_CUDA_CHECK(cudaStreamDestroy((cudaStream_t)stream));
  return 0;
}

int weft_cuda_stream_synchronize(void *stream) {
  int rc = ensure();
  if (rc) return rc;
  rc = wf_cuda_wait_stream(pick(stream), wf_cuda_timeout_ms(), "cuda stream synchronize");
  return rc ? rc : wf_cuda_check_done("cuda stream synchronize");
}

int weft_cuda_stream_wait_stream(void *stream, void *other) {
  int rc = ensure();
  if (rc) return rc;
  cudaStream_t s = pick(stream), o = pick(other);
  if (s == o) return 0;
  if (!tl_sync_ev) WF_CUDA_CHECK(cudaEventCreateWithFlags(&tl_sync_ev, cudaEventDisableTiming));
  WF_CUDA_CHECK(cudaEventRecord(tl_sync_ev, o));
  WF_CUDA_CHECK(cudaStreamWaitEvent(s, tl_sync_ev, 0));
  return 0;
}

int weft_cuda_stream_set_current(void *stream) {
  int rc = ensure();
  if (rc) return rc;
  tl_stream = (cudaStream_t)stream;
  return 0;
}

int weft_cuda_stream_get_current(void **stream) {
  WF_CHECK_ARG(stream, "cuda stream_get_current: NULL out-parameter");
  int rc = ensure();
  if (rc) return rc;
  *stream = tl_stream;
  return 0;
}

/* ---- events ---- */

int weft_cuda_event_create(int timing, void **out) {
  WF_CHECK_ARG(out, "cuda event_create: NULL out-parameter");
  *out = NULL;
  int rc = ensure();
  if (rc) return rc;
  cudaEvent_t ev;
  WF_CUDA_CHECK(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
  *out = ev;
  return 0;
}

int weft_cuda_event_destroy(void *event) {
  if (!event) return 0;
  int rc = ensure();
  if (rc) return rc;
  WF_CUDA_CHECK(cudaEventDestroy((cudaEvent_t)event));
  return 0;
}

int weft_cuda_event_record(void *event, void *stream) {
  WF_CHECK_ARG(event, "cuda event_record: NULL event");
  int rc = ensure();
  if (rc) return rc;
  WF_CUDA_CHECK(cudaEventRecord((cudaEvent_t)event, pick(stream)));
  return 0;
}

int weft_cuda_event_synchronize(void *event) {
  WF_CHECK_ARG(event, "cuda event_synchronize: NULL event");
  int rc = ensure();
  if (rc) return rc;
  rc = wait_event((cudaEvent_t)event, "cuda event synchronize");
  return rc ? rc : wf_cuda_check_done("cuda event synchronize");
}

int weft_cuda_event_elapsed(void *start, void *end, float *ms) {
  WF_CHECK_ARG(start && end && ms, "cuda event_elapsed: NULL argument");
  int rc = ensure();
  if (rc) return rc;
  rc = wait_event((cudaEvent_t)end, "cuda event elapsed");
  if (!rc) rc = wf_cuda_check_done("cuda event elapsed");
  if (rc) return rc;
  WF_CUDA_CHECK(cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)end));
  return 0;
}

int weft_cuda_stream_wait_event(void *stream, void *event) {
  WF_CHECK_ARG(event, "cuda stream_wait_event: NULL event");
  int rc = ensure();
  if (rc) return rc;
  WF_CUDA_CHECK(cudaStreamWaitEvent(pick(stream), (cudaEvent_t)event, 0));
  return 0;
}

#endif /* WEFT_HAVE_CUDA */
