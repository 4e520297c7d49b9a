# Fault injection (issue 13): the specs named tests/fault_<topic>_spec.lua
# whose describe() names carry #fault — killed and stopped ranks, hostile
# clients, freed buffers, a killed nginx worker, failed runs' leftovers.
# `make test` runs them too, with everything else.
.PHONY: test-faults
test-faults: deps lib
	@scripts/run-tests --tags=fault
