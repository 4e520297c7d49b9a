/* fused_norm_f32_twoshot.cu — the fused all-reduce + residual + RMSNorm
 * kernels of kernels/fused_norm_kernels.cuh for f32, default mode, the
 * twoshot. One of the translation units that nvcc compiles in parallel (f32's
 * kernels, the longest to compile, in one file per algorithm). */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_f32_twoshot(int world) { return pick_one<float, false, false>(world); }
