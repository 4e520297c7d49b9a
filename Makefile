# weft — build, test and demo. `make demo` and `make test` are the two entry points;
# `make install` (mk/install.mk) installs it as a library.
#   WEFT_CUDA=0   host-only build even where nvcc exists (no kernels, seconds to build)
#   V=1           print the commands (default: one line per step)
#   -jN           overrides the default of one job per core
ifeq ($(origin CC),default)
  CC := gcc
endif
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
CUDA_ARCHS ?= 90
WEFT_CUDA ?= $(if $(NVCC),1,0)

# One job per core (the kernels take most of a build); a sub-make shares its
# parent's jobs, and `clean` must not race the targets after it.
ifeq ($(MAKELEVEL)$(filter clean,$(MAKECMDGOALS)),0)
  MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif

# Quiet rules: `$(call say,CC,target)` prints one line for a step and hides
# its command; V=1 shows the commands instead, -s prints nothing.
ifeq ($(V),1)
  say :=
else ifneq ($(findstring s,$(firstword -$(MAKEFLAGS))),)
  say := @
else
  say = @printf '  %-7s %s\n' '$(1)' '$(2)';
endif

BUILD   ?= build
LIB     := $(BUILD)/libweft.so
CFLAGS  ?= -O2
override CFLAGS  += -std=gnu11 -D_GNU_SOURCE -fPIC -fvisibility=hidden -Wall -Wextra -Werror -pthread -Isrc -MMD -MP
# -z nodelete: libweft stays mapped once loaded. Its threads (the store
# server, async workers, NCCL watchdogs) may still run when the Lua state
# closes, and LuaJIT's ffi.load unloads the library then: a thread left in
# unmapped code dies with SIGSEGV at exit (seen after an error with an NCCL
# communicator aborted: bench/results/gpu-tests-nvidia-h200-2026-12-07.md).
override LDFLAGS += -shared -pthread -Wl,--version-script=$(BUILD)/weft.map -Wl,-z,defs -Wl,-z,nodelete
LDLIBS  := -ldl -lrt -lm
# OpenSSL's libcrypto: the store's handshake (HMAC-SHA256, src/store/hmac.c).
# Headers from libssl-dev (scripts/ensure-deps installs it); at run time
# libweft.so needs libcrypto.so.3. CRYPTO_CFLAGS/CRYPTO_LIBS say where else
# they are (scripts/gpu-test: headers unpacked from .deps/, the system's
# libcrypto.so.3 where there is no libcrypto.so to link with).
CRYPTO_CFLAGS ?=
CRYPTO_LIBS   ?= -lcrypto
override CFLAGS += $(CRYPTO_CFLAGS)
LDLIBS  += $(CRYPTO_LIBS)

# Source lists: every .c under src/ and every .cu under kernels/, sub-folders
# included; and the kernel units the build writes (mk/kernel_units.mk: KERNEL_UNITS).
C_SRCS  := $(filter-out $(EXCLUDE),$(sort $(shell find src -name '*.c')))
CU_SRCS := $(filter-out $(EXCLUDE),$(sort $(shell find kernels -name '*.cu')))
include mk/kernel_units.mk
# (its rules come first: `make` alone still builds all)
.DEFAULT_GOAL := all
C_OBJS  := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(C_SRCS))
CU_OBJS :=

ifeq ($(WEFT_CUDA),1)
  CUDA_INC  := $(CUDA_HOME)/include
  override CFLAGS += -DWEFT_HAVE_CUDA=1 -isystem $(CUDA_INC) \
               -DWEFT_BUILD_INFO='"cuda=yes archs=$(CUDA_ARCHS)"'
  NVFLAGS   ?= -O3
  override NVFLAGS += -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden -Isrc -Ikernels \
               $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
               -DWEFT_HAVE_CUDA=1 --expt-relaxed-constexpr -MMD -MP
  # the units first: they hold most kernels, the long poles of a parallel build
  CU_OBJS   := $(KERNEL_UNIT_OBJS) $(patsubst kernels/%.cu,$(BUILD)/obj/%.cu.o,$(CU_SRCS))
  LDLIBS    := -L$(CUDA_HOME)/lib64 -l:libcudart_static.a -lstdc++ $(LDLIBS)
else
  override CFLAGS += -DWEFT_BUILD_INFO='"cuda=no"'
endif

# The flags a build dir was built with: objects are rebuilt when they change
# (WEFT_CUDA=0 then 1 in one dir must not link host-only objects with kernels).
# The file is rewritten only when they differ, so its date says when they did.
# (expanded when used, so what mk/*.mk add counts too)
BUILD_FLAGS = $(CC) $(CFLAGS) | $(NVCC) $(NVFLAGS) | $(LDFLAGS) $(LDLIBS)
# equal strings (the file read back may keep its final newline: strip both)
same = $(and $(findstring x$(strip $(1)),x$(strip $(2))),$(findstring x$(strip $(2)),x$(strip $(1))))

# `make demo` on a machine without a GPU (CI, a laptop with nvcc): the demo
# takes the host path there, so it runs on a host-only library built in
# seconds into $(HOST_BUILD) instead of waiting for the kernels.
HOST_BUILD := $(BUILD)/host
HAVE_GPU   := $(if $(wildcard /dev/nvidia[0-9]*),1,0)

.PHONY: FORCE all lib host-lib deps test test-c test-lua demo gpu-test bench clean check-exports
all: lib

lib: $(LIB)
ifeq ($(origin WEFT_CUDA)$(WEFT_CUDA),file0)
	@echo "weft: nvcc not found: built host-only (no CUDA kernels, device calls report 'no CUDA device'; WEFT_CUDA=0 says it on purpose)"
endif

host-lib:
	@$(MAKE) --no-print-directory lib BUILD=$(HOST_BUILD) WEFT_CUDA=0

$(BUILD)/flags: FORCE
	@$(if $(call same,$(file <$@),$(BUILD_FLAGS)),:,$(shell mkdir -p $(BUILD))$(file >$@,$(BUILD_FLAGS)):)
FORCE:

$(BUILD)/weft.map: src/weft.h scripts/gen-exports
	@mkdir -p $(BUILD)
	$(call say,GEN,$@)scripts/gen-exports src/weft.h > $@

$(BUILD)/obj/%.o: src/%.c $(BUILD)/flags
	@mkdir -p $(dir $@)
	$(call say,CC,$@)$(CC) $(CFLAGS) -c $< -o $@

# the one file that needs libssl-dev's headers: say what to install
$(BUILD)/obj/store/hmac.o: src/store/hmac.c $(BUILD)/flags
	@mkdir -p $(dir $@)
	@printf '#include <openssl/evp.h>\n' | $(CC) $(CFLAGS) -E -x c - -o /dev/null 2>/dev/null || \
	  { echo "weft: OpenSSL's headers are missing (openssl/evp.h): as root, apt-get install libssl-dev (or run scripts/ensure-deps)" >&2; exit 1; }
	$(call say,CC,$@)$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.cu.o: kernels/%.cu $(BUILD)/flags
	@mkdir -p $(dir $@)
	$(call say,NVCC,$@)$(NVCC) $(NVFLAGS) -c $< -o $@

$(BUILD)/obj/cdef.c: src/weft.h scripts/gen-cdef
	@mkdir -p $(dir $@)
	$(call say,GEN,$@)CC=$(CC) scripts/gen-cdef src/weft.h > $@

$(BUILD)/obj/cdef.o: $(BUILD)/obj/cdef.c $(BUILD)/flags
	$(call say,CC,$@)$(CC) $(CFLAGS) -c $< -o $@

# kernels first: they are the long poles of a parallel build
$(LIB): $(CU_OBJS) $(C_OBJS) $(BUILD)/obj/cdef.o $(BUILD)/weft.map $(BUILD)/flags
	$(call say,LD,$@ ($(if $(CU_OBJS),CUDA kernels for sm_$(CUDA_ARCHS),host-only)))$(CC) $(LDFLAGS) -o $@ $(C_OBJS) $(CU_OBJS) $(BUILD)/obj/cdef.o $(LDLIBS)

# header dependencies, written by the compilers (-MMD)
-include $(C_OBJS:.o=.d) $(CU_OBJS:.o=.d) $(BUILD)/obj/cdef.d

# Installs what is missing from Debian (scripts/ensure-deps: LuaJIT, busted,
# libssl-dev, lua-cjson; optional packages never stop it).
deps:
	@scripts/ensure-deps

# `make test` / `make demo`: deps first, since the build needs what it
# installs (OpenSSL's headers), even when make runs jobs in parallel
ifneq ($(filter test demo,$(MAKECMDGOALS)),)
host-lib $(C_OBJS) $(CU_OBJS) $(BUILD)/obj/cdef.o $(BUILD)/obj/store/hmac.o: | deps
endif

# The full library: a kernel that no longer compiles fails the tests.
test: deps lib
	@scripts/run-tests

ifeq ($(WEFT_CUDA)$(HAVE_GPU),10)
demo: deps host-lib
	@echo "weft: no GPU here: the demo runs on the host-only $(HOST_BUILD)/libweft.so (\`make lib\` builds the CUDA kernels)"
	$(call say,RUN,scripts/weft-run -n 4 scripts/demo.lua)WEFT_LIB=$(abspath $(HOST_BUILD)/libweft.so) scripts/weft-run -n 4 scripts/demo.lua
else
demo: deps lib
	$(call say,RUN,scripts/weft-run -n 4 scripts/demo.lua)WEFT_LIB=$(abspath $(LIB)) scripts/weft-run -n 4 scripts/demo.lua
endif

gpu-test:
	scripts/gpu-test $(GPU_TEST_ARGS)

check-exports: $(LIB)
	@scripts/check-exports $(LIB) src/weft.h

clean:
	rm -rf $(BUILD)
-include $(filter-out mk/kernel_units.mk,$(wildcard mk/*.mk))
