-- A rank that holds captured graphs (a weft.graph_runner at TP 2) exits on an
-- error (issue 37 item 1): the launcher must report the error and exit 1, and
-- no rank may die of a signal at exit.
--   scripts/weft-mps -n 2 -- scripts/weft-run -n 2 tests/helpers/graph_exit_error.lua [runner|fused|quick|plain]
local weft = require "weft"
local T = require "weft.tensor"
local cuda = require "weft.cuda"
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
elseif mode ~= "plain" then
  local x = T.ones({ 4096 }, "bf16", DEV)
  tp:all_reduce(x)
end
cuda.synchronize()
error("boom")
