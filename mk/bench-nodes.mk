# Host all-reduce across simulated nodes (needs root): weft flat Gloo,
# hierarchical, the store path and Open MPI side by side (docs/nodes.md).
#   make bench-nodes [BENCH_NODES_ARGS="--repeat 3 --max 67108864"]
.PHONY: bench-nodes
bench-nodes: deps lib $(BUILD)/mpi_allreduce
	luajit scripts/bench-nodes.lua --mpi $(BUILD)/mpi_allreduce $(BENCH_NODES_ARGS)
