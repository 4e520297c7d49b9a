-- weft.graph — CUDA-graph capture sequences (SGLang's graph_capture).
--
--   local g = weft.graph.capture(function(ctx) tp:all_reduce(x) end,
--                                {warmup = 1, groups = {tp, pp}})
--   g:replay()            -- on the current stream (or g:replay(stream))
--   g:destroy()
--
-- Semantics (as the seed's graph_capture, and as nccl-tests captures):
--  * a dedicated capture stream (non-blocking, one per process and kept;
--    opts.stream to use another)
--    first waits for the work already queued on the current stream, so
--    everything initialised before the capture is visible to it;
--  * every group is entered once, before warmup and capture
--    (group:graph_enter(ctx) / group:graph_exit(ctx), when it has them):
--    opts.groups, or by default the seed's set — the TP, PP, DCP, MoE EP and
--    MoE TP groups of weft.initialize_model_parallel (distinct objects), or
--    the world group when there are none. Entering sets up what a capture
--    cannot (collectives): the group's NCCL communicator, its custom
--    all-reduce workspace, and with opts.fusion = {max_tokens=, hidden=,
--    dtype=} its fusion workspace (the seed's pre_initialize_workspaces).
--    Every rank must capture with the same groups;
--  * opts.warmup runs fn that many times eagerly on the capture stream
--    before capturing (lazy setup such as NCCL connections happens then);
--  * while fn runs, the capture stream is the thread's current stream and
--    weft.graph.current() returns the context {stream=, mode="graph"}: the
--    policy reads it to pick the graph column of the eager/graph backend
--    table (docs/policy.md);
--  * the capture is thread-local mode: a synchronizing call or a store
--    collective inside fn fails with a clear error instead of corrupting
--    the capture; the capture is always ended, even when fn raises;
--  * device frees requested during the capture are deferred to its end.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C

local ffi_gc, ffi_new, ffi_string = ffi.gc, ffi.new, ffi.string
local type, pcall, error, setmetatable, tostring = type, pcall, error, setmetatable, tostring
local fmt = string.format

local M = {}

local Graph = {}
Graph.__index = Graph
M.Graph = Graph

local current_ctx = nil   -- the capture in progress on this (the Lua) thread

-- The capture context while a capture runs, else nil.
function M.current() return current_ctx end
function M.capturing() return current_ctx ~= nil end

local function cuda_mod()
  local cuda = require("weft.cuda")
  if not cuda.available() then error("weft: graph.capture: no CUDA device", 3) end
  return cuda
end

local function raw_destroy(h) C.weft_cuda_graph_destroy(h) end

-- Enters each distinct group once; returns the list entered (for exit).
local function enter_groups(groups, ctx)
  local entered, seen = {}, {}
  for i = 1, #(groups or {}) do
    local g = groups[i]
    if g ~= nil and not seen[g] then
      seen[g] = true
      if type(g.graph_enter) == "function" then g:graph_enter(ctx) end
      entered[#entered + 1] = g
    end
  end
  return entered
end

-- The seed's graph_capture set: TP, PP, then DCP, MoE EP, MoE TP (distinct
-- objects), from weft.dist; the world group when model parallel is not set up.
function M.default_groups()
  local dist = package.loaded["weft.dist"]
  if not dist or not dist.state or not dist.state.initialized then return {} end
  local groups, S = {}, dist.state
  for _, kind in ipairs { "tp", "pp", "dcp", "moe_ep", "moe_tp" } do
    local g = S.groups and S.groups[kind]
    if g then groups[#groups + 1] = g end
  end
  if #groups == 0 and S.world then groups[1] = S.world end
  return groups
end

local function exit_groups(entered, ctx)
  for i = #entered, 1, -1 do
    local g = entered[i]
    if type(g.graph_exit) == "function" then pcall(g.graph_exit, g, ctx) end
  end
end

function M.capture(fn, opts)
  if type(fn) ~= "function" then
    error("weft: graph.capture: expected a function to capture, got " .. type(fn), 2)
  end
  opts = opts or {}
  if current_ctx then error("weft: graph.capture: a capture is already in progress", 2) end
  local cuda = cuda_mod()
  local prev = cuda.current_stream()
  -- one capture stream per device, never destroyed: kernels that remember
  -- their last stream (weft_ar_run, the fusion run) never see a dead handle
  local stream = opts.stream
  if stream == nil then
    local dev = cuda.current_device()
    M._streams = M._streams or {}
    stream = M._streams[dev]
    if stream == nil then stream = cuda.stream(); M._streams[dev] = stream end
  end
  local own_stream = false
  if stream.handle == nil then
    error("weft: graph.capture: cannot capture on the legacy default stream", 2)
  end
  local groups = opts.groups or M.default_groups()
  local ctx = { stream = stream, mode = "graph", groups = groups, fusion = opts.fusion }
  local okg, entered = pcall(enter_groups, groups, ctx)
  if not okg then
    if own_stream then stream:destroy() end
    error("weft: graph.capture: entering the groups failed: " .. tostring(entered), 2)
  end
  stream:wait_stream(prev)      -- after entering: whatever set-up queued is visible too
  cuda.set_current_stream(stream)
  for _ = 1, opts.warmup or 0 do
    local ok, err = pcall(fn, ctx)
    if not ok then
      cuda.set_current_stream(prev)
      exit_groups(entered, ctx)
      error("weft: graph.capture: warmup failed: " .. tostring(err), 2)
    end
  end
  if (opts.warmup or 0) > 0 then stream:synchronize() end

  local rc = C.weft_cuda_graph_begin(stream.handle)
  if rc ~= 0 then
    local msg = ffi_string(C.weft_last_error())
    exit_groups(entered, ctx)
    cuda.set_current_stream(prev)
    error("weft: graph.capture: " .. msg, 2)
  end
  current_ctx = ctx
  cuda._capture_enter()
  local ok, err = pcall(fn, ctx)
  local out = ffi_new("weft_cuda_graph*[1]")
  local erc = C.weft_cuda_graph_end(stream.handle, out)   -- always end the capture
  local emsg = erc ~= 0 and ffi_string(C.weft_last_error()) or nil
  current_ctx = nil
  cuda._capture_leave()
  exit_groups(entered, ctx)
  cuda.set_current_stream(prev)
  if not ok then
    if out[0] ~= nil then C.weft_cuda_graph_destroy(out[0]) end
    error("weft: graph.capture: captured function failed: " .. tostring(err), 2)
  end
  if erc ~= 0 then error("weft: graph.capture: " .. emsg, 2) end
  return setmetatable({
    handle = ffi_gc(out[0], raw_destroy),
    stream = stream,
    own_stream = own_stream,
  }, Graph)
end

-- Launch on `stream` (a weft.cuda stream or raw handle), else the current stream.
function Graph:replay(stream)
  if self.handle == nil then error("weft: graph:replay: graph was destroyed", 2) end
  local h = stream
  if type(stream) == "table" then h = stream.handle end
  local rc = C.weft_cuda_graph_launch(self.handle, h)
  if rc ~= 0 then error("weft: graph:replay: " .. ffi_string(C.weft_last_error()), 2) end
end

function Graph:destroy()
  if self.handle ~= nil then
    ffi_gc(self.handle, nil)
    C.weft_cuda_graph_destroy(self.handle)
    self.handle = nil
  end
  if self.own_stream and self.stream then self.stream:destroy() end
  self.stream = nil
end

return M
