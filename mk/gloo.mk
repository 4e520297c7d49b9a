# Gloo: host collectives across nodes (src/host/gloo_shim.cc, gloo_agree.cc), built only where
# Gloo's headers are (Debian: libgloo-dev). Without them src/host/gloo_stubs.c
# answers "built without Gloo" and the Lua layer keeps the store path.
#   make lib WEFT_GLOO=0   builds without it even where it is installed
GLOO_INC ?= /usr/include
WEFT_GLOO ?= $(if $(wildcard $(GLOO_INC)/gloo/allreduce.h),1,0)
CXX := $(if $(filter default,$(origin CXX)),g++,$(CXX))

ifeq ($(WEFT_GLOO),1)
  GLOO_OBJ := $(BUILD)/obj/host/gloo_shim.o $(BUILD)/obj/host/gloo_agree.o
  GLOO_HDRS := src/host/gloo_internal.h src/store/store_share.h src/store/store_proto.h src/weft.h \
    src/core/internal.h src/core/wait.h src/core/shape_word.h src/host/cpugroup.h
  override CFLAGS += -DWEFT_HAVE_GLOO=1   # override: the Makefile's CFLAGS are (CFLAGS=... on the command line)
  C_OBJS   += $(GLOO_OBJ)
  LDLIBS   += -lgloo -lstdc++
  $(LIB): $(GLOO_OBJ)
  $(BUILD)/obj/host/gloo_%.o: src/host/gloo_%.cc $(GLOO_HDRS)
	@mkdir -p $(dir $@)
	$(call say,CXX,$@)$(CXX) -std=c++17 -O2 -fPIC -fvisibility=hidden -Wall -Wextra -Werror -pthread -D_GNU_SOURCE \
	  -DWEFT_HAVE_GLOO=1 -Isrc $(if $(filter /usr/include,$(GLOO_INC)),,-isystem $(GLOO_INC)) -c $< -o $@
endif
