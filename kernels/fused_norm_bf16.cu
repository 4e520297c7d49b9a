/* fused_norm_bf16.cu — the fused all-reduce + residual + RMSNorm kernels of
 * kernels/fused_norm_kernels.cuh for bf16, default mode. One of the
 * translation units that nvcc compiles in parallel. */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_bf16(int algo, int world) { return pick_w<__nv_bfloat16, false>(algo, world); }
