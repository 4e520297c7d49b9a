/* fused_norm_f32_oneshot_w2_5.cu — the fused all-reduce + residual + RMSNorm
 * kernels of kernels/fused_norm_kernels.cuh for f32, default mode, the one-
 * shot at worlds 2 to 5. One of the translation units that nvcc compiles in
 * parallel (f32's one-shot kernels, the longest to compile, in two files). */
#include "fused_norm_kernels.cuh"

kernel_fn wf_fused::pick_f32_oneshot_w2_5(int world) { return pick_one<float, false, true, 2, 5>(world); }
