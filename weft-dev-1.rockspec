-- weft as a rock: the Makefile builds libweft.so and installs it with the Lua
-- layer and the tools (mk/install.mk). From a checkout (luajit2 is Lua 5.1):
--   luarocks --lua-version 5.1 make --tree /tmp/rocks weft-dev-1.rockspec
--   /tmp/rocks/bin/weft-run -n 4 my_experiment.lua
-- WEFT_CUDA=0 in the environment builds host-only (no kernels, seconds).
rockspec_format = "3.0"
package = "weft"
version = "dev-1"
source = {
  url = "git+file://.",   -- built from the checkout it sits in (`luarocks make`)
}
description = {
  summary = "Tensor-parallel communication for multi-GPU LLM serving, driven from LuaJIT",
  detailed = [[
A small C core (rendezvous store, control-plane group, host shared-memory
communicator, NCCL, CUDA VMM workspaces, graph capture, fused all-reduce +
RMSNorm kernels) with group construction, backend policies and CUDA-graph
capture in Lua. Needs LuaJIT (the FFI): the tools run under `luajit`.
]],
}
-- lua-cjson (weft.internal.json: weft-topo --json, weft-plot, benchmark results) is
-- Debian's lua-cjson, found on Lua 5.1's system path: not a rock dependency,
-- which would build a second copy from the network; weft loads without it.
dependencies = {
  "lua == 5.1",
}
build = {
  type = "make",
  build_target = "lib",
  install_target = "install",
  -- the same CFLAGS for both steps, or `make install` would rebuild
  build_variables = { CFLAGS = "$(CFLAGS)" },
  install_variables = {
    CFLAGS = "$(CFLAGS)",
    PREFIX = "$(PREFIX)",
    LUADIR = "$(LUADIR)",
    LIBDIR = "$(LIBDIR)",
    BINDIR = "$(BINDIR)",
    -- header and pkg-config file stay in the rock's own folder
    INCLUDEDIR = "$(PREFIX)/include",
    PKGCONFIGDIR = "$(PREFIX)/pkgconfig",
  },
}
deploy = {
  -- the tools are LuaJIT scripts (`#!/usr/bin/env luajit`) that find the
  -- modules beside their own folder: luarocks' wrappers would run them
  -- under its own Lua, which has no FFI
  wrap_bin_scripts = false,
}
