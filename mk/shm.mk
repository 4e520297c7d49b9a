# shm data plane: multi-process C test of src/shm*.c without the cpu group
# (fork()ed ranks attach by segment name): the full run with the kernels this
# CPU picks, then a quick run with the generic (non-AVX2) kernels.
#   make shm-test-c [SHM_TEST_ARGS=--quick]
SHM_TEST_SRCS := tests/c/shm_fork_test.c src/host/shm.c src/host/shm_seg.c src/host/shm_sync.c src/host/shm_zc.c src/host/host_arena.c \
                 src/host/shm_reduce.c src/core/futex.c src/core/wait.c src/core/interrupt.c src/core/error.c src/core/env.c src/core/version.c \
                 src/core/in_use.c

$(BUILD)/shm_fork_test: $(SHM_TEST_SRCS) $(wildcard src/host/shm*.h) src/core/internal.h src/core/wait.h src/weft.h src/core/fpconv.h
	@mkdir -p $(BUILD)
	$(CC) -O2 -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Isrc -Itests/c -o $@ $(SHM_TEST_SRCS) -lrt -lm

.PHONY: shm-test-c
shm-test-c: $(BUILD)/shm_fork_test
	timeout 600 $(BUILD)/shm_fork_test $(SHM_TEST_ARGS)
	WEFT_NO_AVX2=1 timeout 600 $(BUILD)/shm_fork_test --quick

# all_reduce timing with fork()ed ranks (no cpu group): make shm-bench-c SHM_BENCH_ARGS="-n 4 -s 4194304"
SHM_BENCH_SRCS := tests/c/shm_bench.c src/host/shm.c src/host/shm_seg.c src/host/shm_sync.c src/host/shm_zc.c src/host/host_arena.c src/host/shm_reduce.c src/core/interrupt.c \
                  src/core/futex.c src/core/wait.c src/core/error.c src/core/env.c src/core/version.c src/core/in_use.c

$(BUILD)/shm_bench: $(SHM_BENCH_SRCS) $(wildcard src/host/shm*.h) src/core/internal.h src/core/wait.h src/weft.h
	@mkdir -p $(BUILD)
	$(CC) -O2 -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -pthread -Isrc -Itests/c -o $@ $(SHM_BENCH_SRCS) -lrt -lm

.PHONY: shm-bench-c
shm-bench-c: $(BUILD)/shm_bench
	timeout 600 $(BUILD)/shm_bench $(SHM_BENCH_ARGS)
