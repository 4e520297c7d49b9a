# store: C-level tests of the store (SHA-256 known answers, threads).
.PHONY: test-store-c
test-store-c: $(LIB)
	@mkdir -p $(BUILD)/tests
	$(CC) -O2 -Wall -Wextra -Werror -Isrc tests/c/store_sha256_test.c src/store/sha256.c -o $(BUILD)/tests/store_sha256_test
	$(CC) -O2 -Wall -Wextra -Werror -Isrc tests/c/store_threads_test.c $(LIB) -pthread -Wl,-rpath,$(abspath $(BUILD)) -o $(BUILD)/tests/store_threads_test
	$(BUILD)/tests/store_sha256_test
	$(BUILD)/tests/store_threads_test
