/* fused_norm_f32_det_twoshot.cu — the fused all-reduce + residual + RMSNorm
 * kernels of kernels/fused_norm_kernels.cuh for f32, deterministic mode
 * (WF_FUSED_DETERMINISTIC), the twoshot. One of the translation units that
 * nvcc compiles in parallel (f32's kernels, the longest to compile, in one
 * file per algorithm). */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_f32_det_twoshot(int world) { return pick_one<float, true, false>(world); }
