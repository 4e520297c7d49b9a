# GPU helpers (gpu-test itself is in the Makefile: it runs scripts/gpu-test).
#   make gpu-deps    download LuaJIT + busted .debs into .deps/ (needs network)
#   make gpu-bench   on the GPU machine: build, then scripts/bench under 2 ranks
.PHONY: gpu-deps gpu-bench
gpu-deps:
	scripts/fetch-gpu-deps
gpu-bench:
	scripts/gpu-test bench
