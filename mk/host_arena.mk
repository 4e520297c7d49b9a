# shared host arena: C test of src/host/host_arena.c behind weft_host_alloc
# (threads, fork()ed children, a peer mapping the arena), no GPU needed.
#   make host-arena-test-c
HOST_ARENA_TEST_SRCS := tests/c/host_arena_test.c src/host/host_arena.c src/host/hostops.c src/core/error.c src/core/in_use.c \
                        src/core/env.c src/core/version.c

$(BUILD)/host_arena_test: $(HOST_ARENA_TEST_SRCS) src/host/host_arena.h src/core/internal.h src/weft.h src/core/fpconv.h
	@mkdir -p $(BUILD)
	$(CC) -O2 -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Isrc -o $@ $(HOST_ARENA_TEST_SRCS) -lm

.PHONY: host-arena-test-c
host-arena-test-c: $(BUILD)/host_arena_test
	timeout 120 $(BUILD)/host_arena_test
