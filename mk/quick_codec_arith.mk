# the quick codec's float facts (tests/c/quick_codec_arith_test.c): no GPU; built
# for this CPU (its fma instruction: 4 x faster than libm's), run where built
#   make quick-codec-arith-test-c
$(BUILD)/quick_codec_arith_test: tests/c/quick_codec_arith_test.c
	@mkdir -p $(BUILD)
	$(CC) -O2 -march=native -std=gnu11 -Wall -Wextra -Werror -ffp-contract=off -o $@ $< -lm

.PHONY: quick-codec-arith-test-c
quick-codec-arith-test-c: $(BUILD)/quick_codec_arith_test
	timeout 120 $(BUILD)/quick_codec_arith_test
