/* fused_norm_f16.cu — the fused all-reduce + residual + RMSNorm kernels of
 * kernels/fused_norm_kernels.cuh for f16, default mode. One of the translation
 * units that nvcc compiles in parallel. */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_f16(int algo, int world) { return pick_w<__half, false>(algo, world); }
