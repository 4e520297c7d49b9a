/* allreduce_bf16.cu — weft's own all-reduce kernels of
 * kernels/allreduce_kernels.cuh for bf16, with their launch: one of three
 * translation units, so that nvcc compiles them in parallel. */
#include "allreduce_kernels.cuh"

int wf_ar::launch_bf16(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch) {
  return ar_launch_t<__nv_bfloat16>(a, stream, grid, threads, launch);
}
