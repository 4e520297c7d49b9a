/* quick_allreduce_bf16.cu — the quick all-reduce's kernels of
 * kernels/quick_allreduce_kernels.cuh for bf16, with their launch and the
 * codec steps: one of two translation units, so that nvcc compiles them in
 * parallel. */
#include "quick_allreduce_kernels.cuh"

int wf_qr::launch_bf16(const wf_ar_args *a, void *stream, int *grid, bool launch) {
  return q_launch_t<__nv_bfloat16>(a, stream, grid, launch);
}

int wf_qr::step_bf16(int step, int codec, int world, const void *in, void *wire, void *out, uint64_t nvec, int tail,
                   cudaStream_t s) {
  return (int)step_t<__nv_bfloat16>(step, codec, world, in, wire, out, nvec, tail, s);
}
