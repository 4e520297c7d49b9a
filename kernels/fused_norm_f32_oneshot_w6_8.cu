/* fused_norm_f32_oneshot_w6_8.cu — the fused all-reduce + residual + RMSNorm
 * kernels of kernels/fused_norm_kernels.cuh for f32, default mode, the one-
 * shot at worlds 6 to 8. One of the translation units that nvcc compiles in
 * parallel (f32's one-shot kernels, the longest to compile, in two files). */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_f32_oneshot_w6_8(int world) { return pick_one<float, false, true, 6, 8>(world); }
