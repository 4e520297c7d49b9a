/* allreduce_f32.cu — weft's own all-reduce kernels of
 * kernels/allreduce_kernels.cuh for f32, with their launch: one of three
 * translation units, so that nvcc compiles them in parallel. */
#include "allreduce_kernels.cuh"

int wf_ar::launch_f32(const wf_ar_args *a, void *stream, int *grid, int *threads, bool launch) {
  return ar_launch_t<float>(a, stream, grid, threads, launch);
}
