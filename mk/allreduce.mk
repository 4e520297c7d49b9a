# weft's own all-reduce (src/cuda/vmm.c, src/coll/allreduce.c, kernels/allreduce.cu,
# the kernels in kernels/allreduce_kernels.cuh, one unit per dtype written by the
# build: allreduce_<dtype>, mk/kernel_units.mk):
# the validate-then-benchmark harness, NCCL side by side (bench/ar_bench.cu).
#   make ar-bench [BUILD=...]   builds $(BUILD)/ar_bench against $(LIB)
#   scripts/gpu-ar              builds, runs 2 ranks on 2 GPUs, results in $OUT
# NCCL is dlopen'ed at run time (WEFT_NCCL_LIB, else libnccl.so.2), so the
# harness builds without NCCL headers or libraries.
AR_BENCH := $(BUILD)/ar_bench

.PHONY: ar-bench
ar-bench: $(AR_BENCH)

# the parts bench/ar_bench.cu includes (one translation unit), one per mode
AR_BENCH_PARTS := $(addprefix bench/ar_,validate.inc.cu dead_peer.inc.cu leaks.inc.cu timing.inc.cu \
                    sweep.inc.cu link.inc.cu)

$(AR_BENCH): bench/ar_bench.cu $(AR_BENCH_PARTS) bench/machine_tag.h src/weft.h $(LIB)
	@mkdir -p $(BUILD)
	$(NVCC) -O2 -std=c++17 $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
	  -Isrc -o $@ $< -L$(BUILD) -lweft -Xlinker -rpath,$(abspath $(BUILD)) -ldl -lpthread

# The descriptor exchange of src/cuda/vmm_fdx.c with real processes (no GPU).
AR_FDX_SRCS := tests/c/ar_fdx_test.c src/cuda/vmm_fdx.c src/core/error.c src/core/env.c
$(BUILD)/ar_fdx_test: $(AR_FDX_SRCS) src/cuda/vmm_fdx.h src/core/internal.h src/weft.h
	@mkdir -p $(BUILD)
	$(CC) -O2 -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Isrc -o $@ $(AR_FDX_SRCS)

.PHONY: ar-fdx-test
ar-fdx-test: $(BUILD)/ar_fdx_test
	timeout 120 $(BUILD)/ar_fdx_test
