/* fused_norm_bf16_det.cu — the fused all-reduce + residual + RMSNorm kernels
 * of kernels/fused_norm_kernels.cuh for bf16, deterministic mode
 * (WF_FUSED_DETERMINISTIC). One of the translation units that nvcc compiles in
 * parallel. */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_bf16_det(int algo, int world) { return pick_w<__nv_bfloat16, true>(algo, world); }
