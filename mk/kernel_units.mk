# Kernel units: the translation units that instantiate the kernel templates of
# a header for one dtype (mode, algorithm, worlds), written by the build into
# $(BUILD)/gen/kernels/<unit>.cu, so that nvcc compiles them in parallel (all
# of a header's kernels in one file took most of a GPU build's wall time).
# One line per unit: the header in kernels/, then the header's macro that
# defines the unit's exports (the functions the entry points call).
# The Makefile includes this file before its source lists: CU_OBJS holds
# $(BUILD)/obj/<unit>.cu.o.
kernel_unit.allreduce_bf16                   := allreduce_kernels.cuh       WF_AR_UNIT(bf16, __nv_bfloat16)
kernel_unit.allreduce_f16                    := allreduce_kernels.cuh       WF_AR_UNIT(f16, __half)
kernel_unit.allreduce_f32                    := allreduce_kernels.cuh       WF_AR_UNIT(f32, float)
kernel_unit.quick_allreduce_bf16             := quick_allreduce_kernels.cuh WF_QR_UNIT(bf16, __nv_bfloat16)
kernel_unit.quick_allreduce_f16              := quick_allreduce_kernels.cuh WF_QR_UNIT(f16, __half)
kernel_unit.fused_norm_bf16                  := fused_norm_kernels.cuh      WF_FUSED_UNIT(bf16, __nv_bfloat16, false)
kernel_unit.fused_norm_f16                   := fused_norm_kernels.cuh      WF_FUSED_UNIT(f16, __half, false)
kernel_unit.fused_norm_bf16_det              := fused_norm_kernels.cuh      WF_FUSED_UNIT(bf16_det, __nv_bfloat16, true)
kernel_unit.fused_norm_f16_det               := fused_norm_kernels.cuh      WF_FUSED_UNIT(f16_det, __half, true)
# f32's, the longest to compile: one unit per algorithm, the one-shot in two
# (worlds 2-5, 6-8); the arguments: T, deterministic, one-shot, worlds lo..hi
kernel_unit.fused_norm_f32_oneshot_w2_5      := fused_norm_kernels.cuh      WF_FUSED_ALGO_UNIT(f32_oneshot_w2_5, float, false, true, 2, 5)
kernel_unit.fused_norm_f32_oneshot_w6_8      := fused_norm_kernels.cuh      WF_FUSED_ALGO_UNIT(f32_oneshot_w6_8, float, false, true, 6, 8)
kernel_unit.fused_norm_f32_twoshot           := fused_norm_kernels.cuh      WF_FUSED_ALGO_UNIT(f32_twoshot, float, false, false, 2, 8)
kernel_unit.fused_norm_f32_det_oneshot_w2_5  := fused_norm_kernels.cuh      WF_FUSED_ALGO_UNIT(f32_det_oneshot_w2_5, float, true, true, 2, 5)
kernel_unit.fused_norm_f32_det_oneshot_w6_8  := fused_norm_kernels.cuh      WF_FUSED_ALGO_UNIT(f32_det_oneshot_w6_8, float, true, true, 6, 8)
kernel_unit.fused_norm_f32_det_twoshot       := fused_norm_kernels.cuh      WF_FUSED_ALGO_UNIT(f32_det_twoshot, float, true, false, 2, 8)

# every kernel_unit.<name> above
KERNEL_UNITS     := $(sort $(patsubst kernel_unit.%,%,$(filter kernel_unit.%,$(.VARIABLES))))
KERNEL_UNIT_SRCS := $(KERNEL_UNITS:%=$(BUILD)/gen/kernels/%.cu)
KERNEL_UNIT_OBJS := $(KERNEL_UNITS:%=$(BUILD)/obj/%.cu.o)

# a hand-written kernels/<unit>.cu would be a second definition of its exports
$(foreach u,$(filter $(KERNEL_UNITS:%=kernels/%.cu),$(CU_SRCS)),\
  $(error $(u): mk/kernel_units.mk writes this unit into $(BUILD)/gen/kernels/; delete one of them))

define newline


endef
# the text of unit $(1)
kernel_unit_text = /* $(1).cu: written by the build from mk/kernel_units.mk (do not edit) */$(newline)$\
  \#include "$(firstword $(kernel_unit.$(1)))"$(newline)$\
  $(wordlist 2,$(words $(kernel_unit.$(1))),$(kernel_unit.$(1)))

write_file = $(shell mkdir -p $(dir $(1)))$(file >$(1),$(2))
space := $(subst ,, )
# say's GEN line, printed by make itself (not under -s)
say_gen = $(if $(filter @,$(value say)),,$(info $(space)$(space)GEN     $(1)))

# Checked on every run, rewritten only when its text changes (as $(BUILD)/flags),
# so that an edited line recompiles its unit alone. The recipe runs no command
# (it expands to nothing), so make starts no job for it and goes on at once to
# the unit's compile: the units, the long poles, still start first under -j.
$(KERNEL_UNIT_SRCS): $(BUILD)/gen/kernels/%.cu: FORCE
	$(if $(call same,$(file <$@),$(call kernel_unit_text,$*)),,$(call write_file,$@,$(call kernel_unit_text,$*))$(call say_gen,$@))

$(KERNEL_UNIT_OBJS): $(BUILD)/obj/%.cu.o: $(BUILD)/gen/kernels/%.cu $(BUILD)/flags
	@mkdir -p $(dir $@)
	$(call say,NVCC,$@)$(NVCC) $(NVFLAGS) -c $< -o $@

# The dependency files of a build dir from before the units were written name
# the hand-written kernels/<unit>.cu they replace: with nothing to make there,
# the object is rebuilt from its unit (and its new .d names the unit).
$(KERNEL_UNITS:%=kernels/%.cu):
