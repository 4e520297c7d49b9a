/* quick_allreduce.cu — the entry points of the quick all-reduce: launch and
 * shape query (by dtype), the codec steps alone. The kernels, and how they
 * work, are in kernels/quick_allreduce_kernels.cuh, instantiated per dtype
 * in units the build writes (mk/kernel_units.mk). */
#include "quick_allreduce_kernels.cuh"

static int q_launch(const wf_ar_args *a, void *stream, int *grid, bool launch) {
  switch (a->dtype) {
    case WEFT_F16: return wf_qr::launch_f16(a, stream, grid, launch);
    case WEFT_BF16: return wf_qr::launch_bf16(a, stream, grid, launch);
    default: return (int)cudaErrorInvalidValue;
  }
}

extern "C" int wf_qr_launch(const wf_ar_args *a, void *stream) {
  int g;
  return q_launch(a, stream, &g, true);
}

extern "C" int wf_qr_shape(const wf_ar_args *a, int *grid, int *threads) {
  *threads = WF_QR_THREADS;
  return q_launch(a, NULL, grid, false);
}

extern "C" int wf_qr_step(int step, int codec, int dtype, int world, const void *in, void *wire, void *out,
                          uint64_t count, void *stream) {
  const uint64_t nvec = wf_ar_nvec(count, 2);
  const int tail = (int)((count * 2) % 16) / 2;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case WEFT_F16: return wf_qr::step_f16(step, codec, world, in, wire, out, nvec, tail, s);
    case WEFT_BF16: return wf_qr::step_bf16(step, codec, world, in, wire, out, nvec, tail, s);
    default: return (int)cudaErrorInvalidValue;
  }
}
