# Served demo (scripts/serve/: nginx + libnginx-mod-http-lua runs rank 0,
# weft-run the other ranks) and weft.async (src/async.c, lua/weft/async.lua).
#   make serve-deps                 nginx + Lua module + wrk from Debian (root)
#   make serve [SERVE_ARGS="-n 4 --port 8080"]   start the demo (Ctrl-C stops it)
#   make test-serve                 the async and serve specs only
#   make bench-serve [BENCH_SERVE_ARGS="--ranks 2,4 --duration 5"]
.PHONY: serve-deps serve test-serve bench-serve
serve-deps:
	@scripts/serve/ensure-nginx
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; \
	  else echo "weft: wrk missing: as root, apt-get install wrk" >&2; exit 1; fi; }

serve: deps lib
	@scripts/serve/ensure-nginx
	WEFT_LIB=$(abspath $(LIB)) scripts/serve/start $(SERVE_ARGS)

test-serve: deps lib
	WEFT_LIB=$(abspath $(LIB)) scripts/run-tests tests/unit/async_spec.lua tests/unit/serve_spec.lua

bench-serve: deps lib serve-deps
	WEFT_LIB=$(abspath $(LIB)) luajit scripts/bench-serve.lua $(BENCH_SERVE_ARGS)
