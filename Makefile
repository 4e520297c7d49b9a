# weft — build, test and demo. `make demo` and `make test` are the two entry points.
ifeq ($(origin CC),default)
  CC := gcc
endif
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
CUDA_ARCHS ?= 90
WEFT_CUDA ?= $(if $(NVCC),1,0)

BUILD   ?= build
LIB     := $(BUILD)/libweft.so
CFLAGS  ?= -O2
CFLAGS  += -std=gnu11 -D_GNU_SOURCE -fPIC -fvisibility=hidden -Wall -Wextra -Werror -pthread -Isrc
LDFLAGS += -shared -pthread -Wl,--version-script=$(BUILD)/weft.map -Wl,-z,defs
LDLIBS  := -ldl -lrt -lm

C_SRCS  := $(filter-out $(EXCLUDE),$(sort $(wildcard src/*.c src/*/*.c)))
CU_SRCS := $(filter-out $(EXCLUDE),$(sort $(wildcard kernels/*.cu)))
C_OBJS  := $(patsubst src/%.c,$(BUILD)/obj/%.o,$(C_SRCS))
CU_OBJS :=

ifeq ($(WEFT_CUDA),1)
  CUDA_INC  := $(CUDA_HOME)/include
  CFLAGS    += -DWEFT_HAVE_CUDA=1 -isystem $(CUDA_INC) \
               -DWEFT_BUILD_INFO='"cuda=yes archs=$(CUDA_ARCHS)"'
  NVFLAGS   ?= -O3
  NVFLAGS   += -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden -Isrc -Ikernels \
               $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
               -DWEFT_HAVE_CUDA=1 --expt-relaxed-constexpr
  CU_OBJS   := $(patsubst kernels/%.cu,$(BUILD)/obj/%.cu.o,$(CU_SRCS))
  LDLIBS    := -L$(CUDA_HOME)/lib64 -l:libcudart_static.a -lstdc++ $(LDLIBS)
else
  CFLAGS    += -DWEFT_BUILD_INFO='"cuda=no"'
endif

.PHONY: all lib deps test test-c test-lua demo gpu-test bench clean check-exports
all: lib

lib: $(LIB)
	@if [ "$(WEFT_CUDA)" != 1 ]; then echo "weft: nvcc not found: built host-only (no CUDA kernels, device calls report 'no CUDA device')"; fi

$(BUILD)/weft.map: src/weft.h scripts/gen-exports
	@mkdir -p $(BUILD)
	scripts/gen-exports src/weft.h > $@

$(BUILD)/obj/%.o: src/%.c src/weft.h src/core/internal.h $(wildcard src/*.h src/*/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.cu.o: kernels/%.cu $(wildcard kernels/*.cuh) src/weft.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(BUILD)/obj/cdef.c: src/weft.h scripts/gen-cdef
	@mkdir -p $(dir $@)
	CC=$(CC) scripts/gen-cdef src/weft.h > $@

$(BUILD)/obj/cdef.o: $(BUILD)/obj/cdef.c
	$(CC) $(CFLAGS) -c $< -o $@

$(LIB): $(C_OBJS) $(CU_OBJS) $(BUILD)/obj/cdef.o $(BUILD)/weft.map
	$(CC) $(LDFLAGS) -o $@ $(C_OBJS) $(CU_OBJS) $(BUILD)/obj/cdef.o $(LDLIBS)

# Installs LuaJIT (OpenResty's luajit2) and busted from Debian when missing.
deps:
	@scripts/ensure-deps

test: deps lib
	@scripts/run-tests

demo: deps lib
	scripts/weft-run -n 4 scripts/demo.lua

gpu-test:
	scripts/gpu-test

check-exports: $(LIB)
	@scripts/check-exports $(LIB) src/weft.h

clean:
	rm -rf $(BUILD)
-include $(wildcard mk/*.mk)
