# Host all-reduce benchmark: weft (shared memory) vs Open MPI's MPI_Allreduce,
# side by side in one run, quiet and with a competing busy process, f32 and
# bf16, median and p99; results in bench/results/host-allreduce-*.{json,md}
# (docs/host-waits.md).
#   make bench-host [BENCH_HOST_ARGS="--load busy --worlds 2,4 --max 1048576"]
MPICC ?= mpicc
MPI_ALLREDUCE := $(BUILD)/mpi_allreduce

.PHONY: bench-host mpi-deps
bench: bench-host

# Installs Open MPI from Debian when missing (root), otherwise says what to do.
mpi-deps:
	@if ! command -v $(MPICC) >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "weft: installing openmpi-bin libopenmpi-dev from Debian"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq >/dev/null && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null; \
	  else \
	    echo "weft: Open MPI missing; as root, apt-get install openmpi-bin libopenmpi-dev" >&2; exit 1; \
	  fi; \
	fi

$(MPI_ALLREDUCE): bench/mpi_allreduce.c | mpi-deps
	@mkdir -p $(BUILD)
	$(MPICC) -O2 -Wall -Wextra -o $@ $<

# the cost of a cache line between CPUs 0 and 1, taken before each run
$(BUILD)/vcpu_pingpong: bench/vcpu_pingpong.c
	@mkdir -p $(BUILD)
	$(CC) -O2 -pthread -o $@ $<

bench-host: deps lib $(MPI_ALLREDUCE) $(BUILD)/vcpu_pingpong
	WEFT_LIB=$(abspath $(LIB)) luajit scripts/bench-host.lua --mpi $(MPI_ALLREDUCE) \
	  --line-probe $(BUILD)/vcpu_pingpong $(BENCH_HOST_ARGS)
