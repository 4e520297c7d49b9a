/* cuda_internal.h — the CUDA runtime as the rest of the C core sees it
 * (src/cuda/cuda.c). Nothing here is exported.
 *
 *  - wf_cuda_init(): lazy, idempotent, thread-safe. 0 when a CUDA device is
 *    usable; WEFT_ENODEV ("no CUDA device ...") when there is no driver, no
 *    device, or the library was built without CUDA. Call it before touching
 *    wf_cu or any cuda* function.
 *  - wf_cu: Driver API entry points, resolved once through
 *    cudaGetDriverEntryPointByVersion (so nothing links libcuda directly).
 *    Valid only after wf_cuda_init() returned 0. The Driver API needs a
 *    current context: wf_cuda_init() and weft_cuda_set_device() make the
 *    device's primary context current on the calling thread (cudaSetDevice).
 *  - WF_CUDA_CHECK(call) / WF_CU_CHECK(call): on failure record
 *    "file:line: call: <cuda error name>: <string>" with wf_error and
 *    `return WEFT_ECUDA` from the enclosing function. Use them only in
 *    functions that return int and own nothing that needs cleanup at that
 *    point; otherwise use wf_cuda_err()/wf_cu_err() and clean up yourself.
 *  - wf_capture_active() (core/internal.h): 1 while the calling thread
 *    captures a CUDA graph through weft (weft_cuda_graph_begin, thread-local
 *    capture mode); cpugroup.c refuses store collectives then.
 *  - wf_cuda_set_wait_checks(): the checks of the layer above (src/coll/)
 *    that every bounded host wait runs.
 *
 * Code using wf_cu or CUDA types must sit inside `#if WEFT_HAVE_CUDA`; without
 * CUDA only the declarations outside that block exist (wf_cuda_init returns
 * WEFT_ENODEV). Never create a multicast object here
 * (cuMulticastCreate is deliberately absent). */
#ifndef WEFT_CUDA_INTERNAL_H
#define WEFT_CUDA_INTERNAL_H

#if WEFT_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif
#include <errno.h>
#include <stdarg.h>
#include "weft.h"

#ifdef __cplusplus
extern "C" {   /* the .cu files in kernels/ include this too */
#endif

#include "core/internal.h"

int wf_cuda_init(void);
/* Device of the calling thread (after wf_cuda_init; sets it from the default
 * device on first use). */
int wf_cuda_device(int *dev);

#if WEFT_HAVE_CUDA
/* Driver API table. Prototypes are those of the CUDA 12.0 ABI (the table is
 * filled with cudaVersion 12000, e.g. cuCtxGetDevice is the one-argument v1). */
struct wf_cu_api {
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop, unsigned long long flags);
  CUresult (*cuMemExportToShareableHandle)(void *shareable, CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType type,
                                           unsigned long long flags);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle,
                                             void *os_handle, CUmemAllocationHandleType type);
  CUresult (*cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment,
                                  CUdeviceptr addr, unsigned long long flags);
  CUresult (*cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags);
  CUresult (*cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                             size_t count);
  CUresult (*cuMemUnmap)(CUdeviceptr ptr, size_t size);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle handle);
  CUresult (*cuMemAddressFree)(CUdeviceptr ptr, size_t size);
  CUresult (*cuMemGetAllocationGranularity)(size_t *granularity, const CUmemAllocationProp *prop,
                                            CUmemAllocationGranularity_flags option);
  CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
  CUresult (*cuDeviceGetAttribute)(int *pi, CUdevice_attribute attrib, CUdevice dev);
  CUresult (*cuCtxGetDevice)(CUdevice *device);
  CUresult (*cuGetErrorString)(CUresult error, const char **str);
  CUresult (*cuPointerGetAttribute)(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);
};
extern struct wf_cu_api wf_cu;

/* Record a runtime / driver error (returns WEFT_ECUDA). */
int wf_cuda_err(const char *file, int line, const char *call, cudaError_t e);
int wf_cu_err(const char *file, int line, const char *call, CUresult r);

#define WF_CUDA_CHECK(call)                                              \
  do {                                                                   \
    cudaError_t wf_e_ = (call);                                          \
    if (wf_e_ != cudaSuccess)                                            \
      return wf_cuda_err(__FILE__, __LINE__, #call, wf_e_);              \
  } while (0)

#define WF_CU_CHECK(call)                                                \
  do {                                                                   \
    CUresult wf_r_ = (call);                                             \
    if (wf_r_ != CUDA_SUCCESS)                                           \
      return wf_cu_err(__FILE__, __LINE__, #call, wf_r_);                \
  } while (0)

/* Current weft stream of the calling thread (NULL = legacy default stream
 * unless weft_cuda_stream_set_current chose another). */
cudaStream_t wf_cuda_current_stream(void);
/* Bounded wait for a stream (polls, sleeps with backoff, polls NCCL errors);
 * refused while the calling thread captures. op names the caller. */
int wf_cuda_wait_stream(cudaStream_t s, int timeout_ms, const char *op);
#endif /* WEFT_HAVE_CUDA */

/* WEFT_CUDA_TIMEOUT_MS (default 300000), read once by wf_cuda_init. */
int wf_cuda_timeout_ms(void);
/* The checks every bounded host wait runs (src/cuda/cuda.c), installed by
 * the collectives above this layer when their first object is made, so the
 * CUDA layer never calls up into them: `pending` while a stream or event is
 * not done (NCCL's asynchronous errors: src/coll/nccl_watch.c), `done` once
 * it is (the error words of weft's kernels: src/coll/devcoll.c). Each returns
 * 0 or an error code with the message set under op. Either may be NULL (kept
 * as it is); thread-safe, idempotent. */
typedef int (*wf_wait_check)(const char *op);
void wf_cuda_set_wait_checks(wf_wait_check pending, wf_wait_check done);
int wf_cuda_check_pending(const char *op);
int wf_cuda_check_done(const char *op);
/* Told before weft destroys a stream (the same way up: src/coll/devcoll.c
 * installs it), so nothing above keeps asking a destroyed stream. */
typedef void (*wf_stream_hook)(void *stream);
void wf_cuda_set_stream_destroy_hook(wf_stream_hook f);
void wf_cuda_stream_destroying(void *stream);

#ifdef __cplusplus
}
#endif

#endif
