-- The eager device call path (issue: the Lua call path must stay at the
-- launch floor): host time per call of group:all_reduce on an 8 KiB bf16
-- device tensor, beside the C call it makes (weft_ar_run through
-- weft.backends.custom_ar) and a bare empty-kernel launch (cuLaunchKernel of a PTX
-- `ret`, the same stream), all from this rank's thread, back to back.
--
--   scripts/weft-mps -n 2 -- scripts/weft-run -n 2 scripts/bench-eager-call.lua
--
-- Batches of 256 calls (short of the launch queue's depth, so the host never
-- waits for the GPU), a synchronize between batches; per call the median and
-- the fastest batch of each kind, and the KiB the Lua heap grew per 10^5
-- group:all_reduce calls. Prints one `eager ...` line on rank 0.
-- Ranks sharing one GPU under MPS: these are host-side costs, not speed.
local ffi = require("ffi")
local weft = require("weft")
local cuda = require("weft.cuda")
local db = require("weft.backends.device_backends")
local world = weft.init()
local now = weft.now_us
local DEV = "cuda:" .. cuda.current_device()

ffi.cdef [[
typedef int CUresult_b; typedef void *CUmodule_b; typedef void *CUfunction_b; typedef void *CUcontext_b;
CUresult_b cuCtxGetCurrent(CUcontext_b *ctx);
CUresult_b cuModuleLoadData(CUmodule_b *m, const void *image);
CUresult_b cuModuleGetFunction(CUfunction_b *f, CUmodule_b m, const char *name);
CUresult_b cuLaunchKernel(CUfunction_b f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shmem, void *stream, void **params, void **extra);
CUresult_b cuModuleUnload(CUmodule_b m);
]]
local cu = ffi.load("cuda")
local PTX = ".version 7.8\n.target sm_90\n.address_size 64\n.visible .entry weft_noop() { ret; }\n"

local x = weft.tensor.randn({ 4096 }, "bf16", DEV)       -- 8 KiB
world:all_reduce(x)                                      -- builds the workspace, warms the policy memo
cuda.synchronize()
local d = db.ensure_ar(world)
assert(d.ar, "no custom all-reduce workspace: " .. tostring(d.ar_why))
local ar, ptr, n = d.ar, x.ptr, x.numel

local ctx = ffi.new("CUcontext_b[1]")
assert(cu.cuCtxGetCurrent(ctx) == 0 and ctx[0] ~= nil, "no current CUDA context")
local mod, fn = ffi.new("CUmodule_b[1]"), ffi.new("CUfunction_b[1]")
assert(cu.cuModuleLoadData(mod, PTX) == 0, "cuModuleLoadData failed")
assert(cu.cuModuleGetFunction(fn, mod[0], "weft_noop") == 0, "cuModuleGetFunction failed")
local f = fn[0]

local B, ROUNDS = 256, tonumber(os.getenv("WEFT_EAGER_ROUNDS") or "") or 400
local kinds = {
  lua = function() for _ = 1, B do world:all_reduce(x) end end,
  c = function() for _ = 1, B do ar:run(ptr, ptr, n, "bf16", "auto") end end,
  empty = function() for _ = 1, B do cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nil, nil, nil) end end,
}
local order = { "lua", "c", "empty" }
local t = { lua = {}, c = {}, empty = {} }
for _, k in ipairs(order) do
  for r = 1, ROUNDS do t[k][r] = 0 end   -- sized up front: the heap figure is the calls' alone
  kinds[k]()
end
cuda.synchronize()
world:barrier()
collectgarbage("collect"); collectgarbage("stop")
local k0, lua_calls = collectgarbage("count"), 0
for r = 1, ROUNDS do
  for _, k in ipairs(order) do
    local t0 = now(); kinds[k](); local t1 = now()
    cuda.synchronize()
    t[k][r] = (t1 - t0) / B
    if k == "lua" then lua_calls = lua_calls + B end
  end
end
local grew = collectgarbage("count") - k0
collectgarbage("restart")
assert(ar:check_error() == nil, "the all-reduce reported an error")
local function median(a) table.sort(a); return a[math.floor((#a + 1) / 2)] end
local function fastest(a) local m = math.huge; for _, v in ipairs(a) do if v < m then m = v end end; return m end
if world.rank == 0 then
  print(("eager world=%d dtype=bf16 bytes=8192 lua_us=%.3f c_us=%.3f empty_us=%.3f lua_min_us=%.3f c_min_us=%.3f"
         .. " empty_min_us=%.3f lua_minus_c_us=%.3f lua_minus_empty_us=%.3f alloc_kib_per_1e5=%.1f")
        :format(world.world_size, median(t.lua), median(t.c), median(t.empty), fastest(t.lua), fastest(t.c),
                fastest(t.empty), median(t.lua) - median(t.c), median(t.lua) - median(t.empty),
                grew * 1e5 / lua_calls))
  io.stdout:flush()
end
cu.cuModuleUnload(mod[0])
x:free()
weft.shutdown()
