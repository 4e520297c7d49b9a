-- A simulated GPU machine for scripts/weft-tune on the CPU (tests/unit/tune_spec.lua):
-- runs under scripts/weft-run -n 2, replaces weft.cuda, weft.nccl, weft.graph
-- and the device entry points of libweft (weft_ar_*, weft_fusion_*,
-- weft_cuda_*) with host fakes, then runs the real script with its real
-- policy, device backends, cpu groups and files. "Device memory" is host
-- memory; a collective gives world x the local input (the same function for
-- NCCL and weft's kernels, so the output checks compare like with like); the
-- fused kernel and the norm kernel are weft_host_rmsnorm. Time is simulated:
-- every launch advances its stream's clock by a cost model (below), events
-- read the clocks, and a CUDA graph records launches and replays them.
-- TUNE_SIM_DRIFT=1: once the before/after starts, NCCL gets 3x slower at
-- 256 KiB (the tuned choice there turns out slower than the built-in one: the
-- script must fold the fresh numbers in and derive again).
local ffi = require("ffi")
local real = require("weft.internal.ffi")
local RC = real.C

local W = tonumber(os.getenv("WORLD_SIZE"))
local RANK = tonumber(os.getenv("RANK"))
local DRIFT = os.getenv("TUNE_SIM_DRIFT") == "1"
local ROOT = os.getenv("TUNE_SIM_ROOT") or "."

---------------------------------------------------------------- cost model (µs)
local MiB = 1048576
-- crossovers inside 1 KiB .. 256 KiB, so a test run stays small: one-shot up
-- to 16 KiB, two-shot at 64 KiB, NCCL at 256 KiB; fused one-shot up to 64 KiB
local MODEL = {
  nccl = function(b) return 6 + b / 50e3 end,
  oneshot = function(b) return 2 + b / 10e3 end,
  oneshot_flag = function(b) return 3 + b / 12e3 end,
  twoshot = function(b) return 4 + b / 30e3 end,
  fused_oneshot = function(b) return 4 + b / 15e3 end,
  fused_twoshot = function(b) return 7 + b / 40e3 end,
  norm = function(b) return 2 + b / 1000e3 end,
}
-- the quick all-reduce's codecs (--quick-codecs): int8 and int4 beat the
-- exact backends from 256 KiB, fp8 never (up to 256 KiB)
MODEL.quick_int8 = function(b) return 6 + b / 60e3 end
MODEL.quick_int4 = function(b) return 6 + b / 90e3 end
MODEL.quick_fp8 = function(b) return 9 + b / 60e3 end
local AUTO_ONESHOT_MAX = 32768      -- the simulated auto: one-shot up to here, then two-shot
MODEL.auto = function(b) return b <= AUTO_ONESHOT_MAX and MODEL.oneshot(b) or MODEL.twoshot(b) end
MODEL.fused_auto = MODEL.fused_oneshot
local phase = "measure"
local function cost(name, bytes)
  local c = MODEL[name](bytes)
  if DRIFT and phase == "compare" and name == "nccl" and bytes == 262144 then c = c * 3 end
  return c
end

---------------------------------------------------------------- clocks, launches, graphs
local clocks = {}
local function skey(s)
  if type(s) == "table" then s = s.handle end
  if s == nil then return "legacy" end
  return tostring(tonumber(ffi.cast("uintptr_t", s)))
end
local timing = false      -- inside bench.time_runs: replays only advance clocks
local recording = nil     -- the launch list of the graph being captured

local function launch(stream, us, work)
  local k = skey(stream)
  local function run(key)
    clocks[key] = (clocks[key] or 0) + us
    if not timing then work() end
  end
  if recording then recording[#recording + 1] = run
  else run(k) end
end

local next_addr = 0x7000
local function fake_ptr(ct)
  next_addr = next_addr + 0x100
  return ffi.cast(ct or "void *", next_addr)
end
local function key_of(p) return tonumber(ffi.cast("uintptr_t", p)) end

---------------------------------------------------------------- "kernels"
local ESIZE = { [0] = 4, [1] = 2, [2] = 2 }
local scratch, scratch_n = nil, 0
local function f32_scratch(n)
  if n > scratch_n then
    scratch = ffi.gc(ffi.cast("float *", RC.weft_host_alloc(n * 4)), RC.weft_host_free)
    scratch_n = n
  end
  return scratch
end

-- out = W * in (in dtype); a stand-in for any sum over the ranks
local function times_world(inp, out, count, dtype)
  local f = f32_scratch(count)
  assert(RC.weft_host_convert(inp, dtype, f, 0, count) == 0)
  for i = 0, count - 1 do f[i] = f[i] * W end
  assert(RC.weft_host_convert(f, 0, out, dtype, count) == 0)
end

local F = {}
local ar_state, fz_state = {}, {}

function F.weft_ar_create(_, max_bytes, out)
  local h = fake_ptr("weft_ar *")
  ar_state[key_of(h)] = { max = tonumber(max_bytes) }
  out[0] = h
  return 0
end
function F.weft_ar_destroy() return 0 end
function F.weft_ar_info(h, r, w, mb, lb, om)
  local st = ar_state[key_of(h)]
  if r ~= nil then r[0] = RANK end
  if w ~= nil then w[0] = W end
  if mb ~= nil then mb[0] = st.max end
  if lb ~= nil then lb[0] = math.min(st.max, 16 * MiB) end
  if om ~= nil then om[0] = math.min(st.max, 8 * MiB) end
  return 0
end
local WHY = ffi.new("char[16]", "simulated")
function F.weft_ar_resolve(_, count, dtype, algo, kind, why)
  algo = algo % 256
  if algo == 0 then kind[0] = tonumber(count) * ESIZE[dtype] <= AUTO_ONESHOT_MAX and 1 or 2   -- as MODEL.auto
  else kind[0] = algo end
  if why ~= nil then why[0] = WHY end
  return 0
end
local ALGO_NAME = { [0] = "auto", [1] = "oneshot", [2] = "twoshot", [3] = "oneshot_flag",
                    [5] = "quick_int8", [6] = "quick_int4", [7] = "quick_fp8" }
function F.weft_ar_run(h, inp, out, count, dtype, algo, stream)
  local st = ar_state[key_of(h)]
  local bytes = tonumber(count) * ESIZE[dtype]
  assert(bytes <= st.max, "simulated weft_ar_run: over the workspace")
  count = tonumber(count)
  launch(stream, cost(ALGO_NAME[algo % 256], bytes), function() times_world(inp, out, count, dtype) end)
  return 0
end
function F.weft_ar_check_error() return 0 end
function F.weft_ar_set_timeout() return 0 end
function F.weft_ar_abort() return 0 end

function F.weft_fusion_preflight(_, _, ok) ok[0] = 1; return 0 end
function F.weft_fusion_create(_, o, out)
  local h = fake_ptr("weft_fusion *")
  fz_state[key_of(h)] = { max_tokens = tonumber(o.max_tokens), hidden = tonumber(o.hidden), esize = ESIZE[o.dtype] }
  out[0] = h
  return 0
end
function F.weft_fusion_destroy() return 0 end
function F.weft_fusion_check_error() return 0 end
function F.weft_fusion_sufficient(h, tokens, hidden, dtype, _, ok)
  local st = fz_state[key_of(h)]
  ok[0] = (tonumber(tokens) <= st.max_tokens and tonumber(hidden) <= st.hidden and ESIZE[dtype] <= st.esize) and 1 or 0
  return 0
end
local FALGO = { [0] = "fused_auto", [1] = "fused_oneshot", [2] = "fused_twoshot" }
function F.weft_fusion_resolve(_, p, algo, why)
  algo[0] = p.algo == 0 and 1 or p.algo
  if why ~= nil then why[0] = WHY end
  return 0
end
function F.weft_fusion_run(h, p)
  local st = fz_state[key_of(h)]
  local tokens, hidden, dtype = tonumber(p.tokens), tonumber(p.hidden), p.dtype
  assert(tokens <= st.max_tokens and hidden <= st.hidden, "simulated weft_fusion_run: over the workspace")
  -- the launch copies its parameters, as a kernel launch does
  local x, r, w, no, ro, eps, gemma = p.input, p.residual, p.weight, p.norm_out, p.residual_out, p.eps,
                                      (p.flags % 2 == 1) and 1 or 0
  local n = tokens * hidden
  launch(p.stream, cost(FALGO[p.algo], n * ESIZE[dtype]), function()
    local tmp = ffi.gc(RC.weft_host_alloc(n * ESIZE[dtype]), RC.weft_host_free)
    times_world(x, tmp, n, dtype)
    assert(RC.weft_host_rmsnorm(tmp, r, w, no, ro, tokens, hidden, dtype, eps, gemma) == 0)
  end)
  return 0
end

function F.weft_cuda_fill_random(p, count, dtype, seed, dist)
  return RC.weft_host_fill_random(p, count, dtype, seed, dist)
end
function F.weft_cuda_memcpy(dst, src, n) ffi.copy(dst, src, n); return 0 end
function F.weft_cuda_rmsnorm(x, r, w, o, ro, tokens, hidden, dtype, eps, flags, stream)
  launch(stream, cost("norm", tonumber(tokens * hidden) * ESIZE[dtype]), function()
    assert(RC.weft_host_rmsnorm(x, r, w, o, ro, tokens, hidden, dtype, eps, flags) == 0)
  end)
  return 0
end

local C = setmetatable(F, { __index = RC })

---------------------------------------------------------------- modules
local wffi = setmetatable({ C = C }, { __index = real })
package.loaded["weft.internal.ffi"] = wffi

local Stream = {}
Stream.__index = Stream
function Stream:synchronize() end
function Stream:wait_stream() end
function Stream:wait_event() end
function Stream:destroy() self.handle = nil end
function Stream:capturing() return recording ~= nil end

local Event = {}
Event.__index = Event
function Event:record(s) self.t = clocks[skey(s)] or 0; return self end
function Event:synchronize() end
function Event:elapsed(later) return (later.t - self.t) / 1000 end
function Event:destroy() end

local cuda = {}
function cuda.available() return true end
function cuda.device_count() return W end
function cuda.current_device() return tonumber(os.getenv("LOCAL_RANK")) or RANK end
function cuda.set_device() end
function cuda.device_name() return "Sim GPU" end
function cuda.synchronize() end
function cuda.alloc(n)
  local p = RC.weft_host_alloc(math.max(n, 64))
  assert(p ~= nil, "simulated alloc")
  return p
end
function cuda.free(p) if p ~= nil then RC.weft_host_free(p) end end
function cuda.copy(dst, src, n) ffi.copy(dst, src, n) end
function cuda.copy_async(dst, src, n) ffi.copy(dst, src, n) end
function cuda.memset(p, v, n) ffi.fill(p, n, v) end
function cuda.fill_random(p, count, code, seed, dist) assert(RC.weft_host_fill_random(p, count, code, seed or 0, dist or 0) == 0) end
function cuda.stream() return setmetatable({ handle = fake_ptr(), owned = true }, Stream) end
function cuda.current_stream() return setmetatable({ handle = nil }, Stream) end
function cuda.set_current_stream() end
function cuda.wrap_stream(h) return setmetatable({ handle = h }, Stream) end
function cuda.stream_handle(s) if type(s) == "table" then return s.handle end return s end
function cuda.event() return setmetatable({ t = 0 }, Event) end
function cuda.pointer_device() return cuda.current_device() end
function cuda.capturing() return recording ~= nil end
function cuda._capture_enter() end
function cuda._capture_leave() end
package.loaded["weft.cuda"] = cuda

local Comm = {}
Comm.__index = Comm
local DCODE = { f32 = 0, f16 = 1, bf16 = 2 }
function Comm:all_reduce(inp, out, count, dtype, _, stream)
  local d = type(dtype) == "number" and dtype or DCODE[dtype]
  count = tonumber(count)
  out = out or inp
  launch(stream, cost("nccl", count * ESIZE[d]), function() times_world(inp, out, count, d) end)
end
function Comm:synchronize() end
function Comm:set_timeout() end
function Comm:abort() end
function Comm:destroy() self.handle = nil end
local nccl = { DTYPES = DCODE }
function nccl.version() return 22803 end
function nccl.available() return true end
function nccl.new(cg)
  return setmetatable({ handle = fake_ptr(), name = cg.name, rank = cg.my_index, size = cg.size,
                        device = cuda.current_device(), blocking = true }, Comm)
end
package.loaded["weft.nccl"] = nccl

local graph = {}
local current = nil
function graph.current() return current end
function graph.capturing() return current ~= nil end
function graph.default_groups() return {} end
function graph.capture(fn, o)
  o = o or {}
  local ctx = { mode = "graph", stream = o.stream, groups = o.groups, fusion = o.fusion }
  for _ = 1, o.warmup or 0 do fn(ctx) end
  local list = {}
  recording, current = list, ctx
  local ok, err = pcall(fn, ctx)
  recording, current = nil, nil
  if not ok then error("weft: graph.capture: captured function failed: " .. tostring(err), 2) end
  return {
    replay = function(_, s) local k = skey(s); for i = 1, #list do list[i](k) end end,
    destroy = function() list = {} end,
  }
end
package.loaded["weft.graph"] = graph

-- replays inside bench.time_runs only move the clocks (the data work is
-- done by warmups, references and check replays)
local bench = require("weft.tools.bench")
local time_runs = bench.time_runs
bench.time_runs = function(...)
  timing = true
  local ok, r = pcall(time_runs, ...)
  timing = false
  if not ok then error(r, 0) end
  return r
end

-- the before/after starts with the first tuned file loaded
local policy = require("weft.policy")
local load_file = policy.load_file
policy.load_file = function(...)
  phase = "compare"
  return load_file(...)
end

---------------------------------------------------------------- the script
-- TUNE_SIM_SCRIPT: another script to run on the simulated machine (the GPU
-- graph-runner helper, to check its plumbing on the CPU)
local script = os.getenv("TUNE_SIM_SCRIPT") or (ROOT .. "/scripts/weft-tune")
local args = { [0] = script }
for i = 1, #arg do args[i] = arg[i] end
_G.arg = args
dofile(script)
