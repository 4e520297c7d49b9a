# store: C-level tests of the store (HMAC-SHA256 known answers, threads).
.PHONY: test-store-c
test-store-c: $(LIB)
	@mkdir -p $(BUILD)/tests
	$(CC) -O2 -Wall -Wextra -Werror -Isrc $(CRYPTO_CFLAGS) tests/c/store_hmac_test.c src/store/hmac.c $(CRYPTO_LIBS) -o $(BUILD)/tests/store_hmac_test
	$(CC) -O2 -Wall -Wextra -Werror -Isrc tests/c/store_threads_test.c $(LIB) -pthread -Wl,-rpath,$(abspath $(BUILD)) -o $(BUILD)/tests/store_threads_test
	$(BUILD)/tests/store_hmac_test
	$(BUILD)/tests/store_threads_test
