# Fused all-reduce + residual + RMSNorm (src/coll/fusion.c, kernels/fused_norm.cu:
# the host side; the kernels: kernels/fused_norm_kernels.cuh, instantiated in
# the units fused_norm_<dtype>[_det][_<algo>] that the build writes from
# mk/kernel_units.mk, files that nvcc compiles in parallel):
#   make fused-bench      build $(BUILD)/fused_bench (validate-then-benchmark harness)
#   make fusion-ptxas     compile the kernels with -Xptxas -v; fail on any spill
#   make gpu-fusion       scripts/gpu-fusion: build, check and benchmark on 2 GPUs
# The harness links the library's objects (not libweft.so), so it shares the
# library's one static CUDA runtime.
FUSED_BENCH := $(BUILD)/fused_bench
# the parts bench/fused_bench.cu includes (one translation unit)
FUSED_BENCH_PARTS := $(addprefix bench/fused_,reference.inc.cu tests.inc.cu timing.inc.cu sweep.inc.cu \
                       skew.inc.cu results.inc.cu)

# the fused_norm*.cu include src/coll/fusion_internal.h and the kernels'
# header, which the generic rule does not list (-MMD does, after a first build)
FUSED_NORM_UNITS := $(filter $(BUILD)/gen/kernels/fused_norm%,$(KERNEL_UNIT_SRCS))
FUSED_NORM_SRCS  := $(wildcard kernels/fused_norm*.cu) $(FUSED_NORM_UNITS)
$(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(notdir $(FUSED_NORM_SRCS))): src/coll/fusion_internal.h kernels/fused_norm_kernels.cuh

.PHONY: fused-bench fusion-ptxas gpu-fusion
fused-bench: $(FUSED_BENCH)

ifeq ($(WEFT_CUDA),1)
$(FUSED_BENCH): bench/fused_bench.cu $(FUSED_BENCH_PARTS) bench/machine_tag.h $(C_OBJS) $(CU_OBJS) $(BUILD)/obj/cdef.o
	@mkdir -p $(BUILD)
	$(NVCC) -O2 -std=c++17 -Isrc $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
	  -Xcompiler -pthread -o $@ bench/fused_bench.cu $(C_OBJS) $(CU_OBJS) $(BUILD)/obj/cdef.o \
	  -ldl -lrt -lm $(CRYPTO_LIBS) $(if $(filter 1,$(WEFT_GLOO)),-lgloo -lstdc++)   # the Gloo shim is among the objects; libcrypto: src/store/hmac.c
else
$(FUSED_BENCH):
	@echo "weft: fused_bench needs nvcc (CUDA)" >&2; exit 1
endif

fusion-ptxas: $(FUSED_NORM_UNITS)
	@mkdir -p $(BUILD)
	@rm -f $(BUILD)/fusion-ptxas.txt
	for f in $(FUSED_NORM_SRCS); do \
	  $(NVCC) $(NVFLAGS) -Xptxas -v -c $$f -o $(BUILD)/fusion-ptxas.o 2>> $(BUILD)/fusion-ptxas.txt || exit 1; done
	@awk '/Compiling entry/ {k=$$0} /spill stores/ { if ($$5 != 0 || $$9 != 0) { print "spill: " k; bad=1 } } \
	  END { exit bad }' $(BUILD)/fusion-ptxas.txt && echo "fusion-ptxas: no spills"

gpu-fusion:
	scripts/gpu-fusion

# The single-rank kernels of weft.fusion_ext (kernels/moe_reduce.cu, the
# norm kernel) against a copy kernel moving the same bytes, on one GPU
# (bench/moe_local_bench.cu; scripts/gpu-fusion --ext / --ext-only).
MOE_LOCAL_BENCH := $(BUILD)/moe_local_bench
.PHONY: moe-local-bench
moe-local-bench: $(MOE_LOCAL_BENCH)
ifeq ($(WEFT_CUDA),1)
# against libweft.so, as bench/ar_bench.cu (the library's objects alone lack
# libcrypto, which libweft.so links)
$(MOE_LOCAL_BENCH): bench/moe_local_bench.cu bench/machine_tag.h src/weft.h $(LIB)
	@mkdir -p $(BUILD)
	$(NVCC) -O2 -std=c++17 -Isrc $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
	  -o $@ $< -L$(BUILD) -lweft -Xlinker -rpath,$(abspath $(BUILD)) -ldl -lpthread
else
$(MOE_LOCAL_BENCH):
	@echo "weft: moe_local_bench needs nvcc (CUDA)" >&2; exit 1
endif
