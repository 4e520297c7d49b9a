# Message-queue broadcaster (src/host/mq.c, lua/weft/mq.lua): its spec, and its
# benchmark against the store path (bench/results/mq-broadcast-*.json/.md).
#   make test-mq
#   make bench-mq [BENCH_MQ_ARGS="--worlds 2,4,8 --out bench/results"]
.PHONY: test-mq bench-mq
test-mq: $(LIB)
	WEFT_LIB=$(abspath $(LIB)) scripts/run-tests tests/unit/mq_spec.lua

bench-mq: $(LIB)
	WEFT_LIB=$(abspath $(LIB)) luajit scripts/bench-mq.lua $(BENCH_MQ_ARGS)
