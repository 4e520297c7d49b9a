# adaptive wait: C test of wf_wait_spin_on (src/core/wait.c), the spin the
# Gloo shim's small path runs on its partner's socket; no GPU, no peers.
#   make wait-test-c
WAIT_TEST_SRCS := tests/c/wait_spin_test.c src/core/wait.c src/core/env.c src/core/error.c src/core/version.c

$(BUILD)/wait_spin_test: $(WAIT_TEST_SRCS) src/core/wait.h src/core/futex.h src/core/internal.h
	@mkdir -p $(BUILD)
	$(CC) -O2 -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Isrc -o $@ $(WAIT_TEST_SRCS) -lm

.PHONY: wait-test-c
wait-test-c: $(BUILD)/wait_spin_test
	timeout 60 $(BUILD)/wait_spin_test
