/* allreduce.cu — the entry points of weft's own all-reduce: launch (by dtype),
 * shape query and workspace init. The kernels, and how they work, are in
 * kernels/allreduce_kernels.cuh, instantiated per dtype in units the build
 * writes (mk/kernel_units.mk). */
#include "allreduce_kernels.cuh"

namespace {

/* Fill with the Lamport sentinel (workspace init). */
__global__ void fill_empty(uint4 *p, uint64_t n) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    p[i] = lamport_empty_vec();
}
}  // namespace

/* Launch (launch = false: only compute the grid and block size a call would use). */
static int ar_launch(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch) {
  switch (a->dtype) {
    case WEFT_F32: return wf_ar::launch_f32(a, stream, grid, threads, launch);
    case WEFT_F16: return wf_ar::launch_f16(a, stream, grid, threads, launch);
    case WEFT_BF16: return wf_ar::launch_bf16(a, stream, grid, threads, launch);
    default: return (int)cudaErrorInvalidValue;
  }
}

extern "C" int wf_ar_launch(const wf_ar_args *a, void *stream) {
  int g, t;
  return ar_launch(a, stream, &g, &t, true);
}

extern "C" int wf_ar_shape(const wf_ar_args *a, int *grid, int *threads) {
  return ar_launch(a, NULL, grid, threads, false);
}

extern "C" int wf_ar_fill_empty(void *p, uint64_t bytes, void *stream) {
  const uint64_t n = bytes / 16;
  if (!n) return 0;
  uint64_t g = (n + 255) / 256;
  if (g > 4096) g = 4096;
  fill_empty<<<(unsigned)g, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<uint4 *>(p), n);
  return (int)cudaGetLastError();
}
