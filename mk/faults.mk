# Fault injection (issue 13): the specs named tests/faults/fault_<topic>_spec.lua
# whose describe() names carry #fault — killed and stopped ranks, hostile
# clients, freed buffers, a killed nginx worker, failed runs' leftovers;
# issue 24: copies past 2^31 and 2^32 bytes (fault_bigcopy, also #bigmem:
# pending without the memory), async x blocking calls across groups
# (fault_async_cross), a resumed rank writing into closed sockets
# (fault_sigpipe).
# `make test` runs them too, with everything else.
.PHONY: test-faults
test-faults: deps lib
	@scripts/run-tests --tags=fault

# The soak (issue 13): 200 k small + 2 k 4 MiB all-reduces on 4 ranks, every
# result checked exactly, RSS and descriptors sampled; writes
# bench/results/soak-<machine>-<date>.{json,md}. SOAK_ARGS=--quick to try it.
.PHONY: bench-soak
bench-soak: deps lib
	luajit scripts/bench-soak.lua $(SOAK_ARGS)
