-- A rank that holds captured graphs (a weft.graph_runner at TP 2) exits on an
-- error (issue 37 item 1): the launcher must report the error and exit 1, and
-- no rank may die of a signal at exit.
--   scripts/weft-mps -n 2 -- scripts/weft-run -n 2 tests/helpers/graph_exit_error.lua [runner|fused|quick|nccl|nccl_abort|async|plain]
local weft = require("weft")
local T = require("weft.tensor")
local cuda = require("weft.cuda")
local mode = arg[1] or "runner"
weft.init()
weft.initialize_model_parallel { tp = 2 }
local tp = weft.tp()
local DEV = "cuda:" .. cuda.current_device()
if mode == "runner" then
  local runner = require("weft.graph_runner").new {
    sizes = { 1, 2 }, groups = { tp },
    alloc = function(m) return { x = T.ones({ m, 1024 }, "bf16", DEV) } end,
    step = function(bs, b) local x = b.x:narrow(0, 0, bs); tp:all_reduce(x); return x end,
  }
  runner:run(2)
elseif mode == "fused" then
  local x, r = T.ones({ 4, 4096 }, "bf16", DEV), T.ones({ 4, 4096 }, "bf16", DEV)
  tp:fused_allreduce_rmsnorm(x, r, T.ones({ 4096 }, "bf16", DEV), 1e-6)
elseif mode == "nccl" or mode == "nccl_abort" then
  -- NCCL takes one GPU per rank, and the ranks may share one here: each rank
  -- makes a communicator of its own (one rank): at the exit its streams and
  -- 64 all-reduces of 4 MiB, not waited for, are alive, as a TP group's are
  local world = weft.world()
  local cg = require("weft.cpugroup").new(world.cpu_group.store, "exit-nccl-" .. world.rank,
                                          { world.rank }, 0, 30000)
  local c = require("weft.nccl").new(cg)
  local x = T.ones({ 1048576 }, "f32", DEV)
  for _ = 1, 64 do c:all_reduce(x.ptr, x.ptr, x.numel, "f32", "sum") end
  -- nccl_abort: the communicator ended as weft ends one on an error or a
  -- timeout (ncclCommAbort, no finalize), then the exit on the error
  if mode == "nccl_abort" then c:abort() end
  error("boom")
elseif mode == "async" then
  -- host collectives in flight on the group's progress worker at the exit
  local async = require("weft.async")
  local pending = {}
  for i = 1, 8 do pending[i] = async.all_reduce(tp, T.ones({ 262144 }, "f32")) end
  error("boom")
elseif mode ~= "plain" then
  local x = T.ones({ 4096 }, "bf16", DEV)
  tp:all_reduce(x)
end
cuda.synchronize()
error("boom")
