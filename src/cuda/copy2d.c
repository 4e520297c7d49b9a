/* copy2d.c — strided (2-D) device copies for the group layer: the dim
 * permutes of all_gather / reduce_scatter / gather along a dim other than
 * the outermost ([W][outer][inner] <-> [outer][W][inner]) in one call per
 * rank instead of one copy per row. Async on the stream; capturable. */
#include "cuda_internal.h"

#if WEFT_HAVE_CUDA

int weft_cuda_memcpy2d_async(void *dst, size_t dpitch, const void *src, size_t spitch,
                             size_t width, size_t height, void *stream) {
  int dev;
  int rc = wf_cuda_device(&dev);   /* lazy init, thread's device */
  if (rc) return rc;
  if (width == 0 || height == 0) return 0;
  WF_CHECK_ARG(dst && src, "cuda copy2d: NULL %s pointer", dst ? "source" : "destination");
  WF_CHECK_ARG(dpitch >= width && spitch >= width,
               "cuda copy2d: pitches (dst %zu, src %zu) must be at least the row width %zu",
               dpitch, spitch, width);
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  WF_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, s));
  return 0;
}

#else

int weft_cuda_memcpy2d_async(void *dst, size_t dpitch, const void *src, size_t spitch,
                             size_t width, size_t height, void *stream) {
  (void)dst; (void)dpitch; (void)src; (void)spitch; (void)width; (void)height; (void)stream;
  return wf_error(WEFT_ENODEV, "cuda copy2d: no CUDA device (weft built without CUDA)");
}

#endif
