-- One rank of tests/unit/hostwait_spec.lua: the adaptive host wait's bounds and
-- the Lua call path of a host all-reduce. HW_MODE:
--   callpath   10^5 group:all_reduce calls allocate nothing per call and do
--              not consult the policy table; the argument checks still refuse
--   idle       every rank but the last waits HW_LATE_MS for it in a shm
--              all-reduce, then readers wait as long for the mq writer: CPU
--              time used while waiting ("IDLE_SHM/IDLE_MQ ok=true ms=<cpu ms>")
--   interrupt  rank 0 waits for a rank that never comes with the interrupt
--              armed on a pipe that holds a byte (what Ctrl-C does to the
--              REPL's signalfd)
--   late       the last rank never joins a call: the others time out
--   dead       the last rank dies HW_LATE_MS after the others started waiting
-- Lines: "<WHAT> ok=<bool> ms=<n> msg=<text>", "OK rank N checks=K" last.
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")

local ffi = require("ffi")
local weft = require("weft")
local W = require("helpers.rank_util")
local util = require("helpers.store_util")

ffi.cdef [[
typedef struct { long tv_sec, tv_usec; } hw_timeval;
typedef struct { hw_timeval ru_utime, ru_stime; long rest[14]; } hw_rusage;
int hw_getrusage(int who, hw_rusage *r) __asm__("getrusage");
int hw_pipe(int fds[2]) __asm__("pipe");
long hw_write(int fd, const void *p, size_t n) __asm__("write");
]]
local C = require("weft.internal.ffi").C

local mode = os.getenv("HW_MODE")
local late_ms = tonumber(os.getenv("HW_LATE_MS") or "") or 1500
local world = weft.init { timeout_ms = tonumber(os.getenv("HW_TIMEOUT_MS") or "") or 30000 }
local T = weft.tensor
local n, me = world.world_size, world.rank_in_group
local K = W.checker(me)
local check, say = K.check, W.say

local function cpu_ms()
  local r = ffi.new("hw_rusage")
  ffi.C.hw_getrusage(0, r)
  return (tonumber(r.ru_utime.tv_sec) + tonumber(r.ru_stime.tv_sec)) * 1000
         + (tonumber(r.ru_utime.tv_usec) + tonumber(r.ru_stime.tv_usec)) / 1000
end

local function sleep_ms(ms) os.execute(("sleep %.3f"):format(ms / 1000)) end

if mode == "callpath" then
  local policy = require("weft.policy")
  for _, dt in ipairs({ "f32", "bf16" }) do
    local x = T.full({ 256 }, 1, dt)  -- 1 KiB f32, 512 B bf16
    for _ = 1, 1000 do world:all_reduce(x) end
    local real, selects = policy.select, 0
    policy.select = function(...) selects = selects + 1; return real(...) end
    collectgarbage("collect")
    collectgarbage("stop")
    local k0 = collectgarbage("count")
    for _ = 1, 100000 do world:all_reduce(x) end
    local grew = collectgarbage("count") - k0
    collectgarbage("restart")
    policy.select = real
    -- one 16-byte object per call would be 1.6 MB: anything below 64 KiB is
    -- the JIT's own bookkeeping, not the call path
    check(grew < 64, "%s: %.1f KiB allocated over 10^5 calls", dt, grew)
    check(selects == 0, "%s: the policy table was consulted %d times (memo missed)", dt, selects)
    -- every argument check still refuses before anything is sent
    local function refuses(f, want)
      local ok, err = pcall(f)
      check(not ok and tostring(err):find(want, 1, true), "expected %q, got %s", want, tostring(err))
    end
    refuses(function() world:all_reduce({}) end, "must be a weft tensor")
    refuses(function() world:all_reduce(x, "avg") end, "unknown reduction")
    refuses(function() world:all_reduce(T.zeros({ 4, 4 }, dt):transpose(0, 1)) end, "not contiguous")
    refuses(function() world:all_reduce(T.zeros({ 4 }, "f8e4m3")) end, "cannot be reduced")
    x:fill_(1)
    world:all_reduce(x)
    check(x:to_table()[256] == n, "%s: sum after the loop is %s, want %d", dt, tostring(x:to_table()[256]), n)
  end
elseif mode == "idle" then
  local x = T.full({ 256 }, 1, "f32")
  world:all_reduce(x)
  if me == n - 1 then sleep_ms(late_ms) end
  local c0, t0 = cpu_ms(), util.now_ms()
  world:all_reduce(x)
  if me ~= n - 1 then
    W.report("IDLE_SHM", true, t0, ("cpu_ms=%d"):format(math.floor(cpu_ms() - c0)))
  end
  check(x:to_table()[1] == n * n, "sum after the late rank came")
  local q = require("weft.mq").new(world.cpu_group, { writer = 0, chunk_bytes = 4096, chunks = 4 })
  q:set_timeout(30000)
  world:barrier()
  if me == 0 then
    sleep_ms(late_ms)
    q:send_bytes("late")
  else
    c0, t0 = cpu_ms(), util.now_ms()
    local got = q:recv_bytes()
    W.report("IDLE_MQ", true, t0, ("cpu_ms=%d"):format(math.floor(cpu_ms() - c0)))
    check(got == "late", "mq message %q", tostring(got))
  end
  world:barrier()
  q:destroy()
  -- rank 0 hosts the store: leave together, or a rank still reading the
  -- barrier's reply sees the store's host gone
  weft.shutdown()
elseif mode == "interrupt" then
  local x = T.full({ 256 }, 1, "f32")
  world:all_reduce(x)
  if me == 0 then
    local fds = ffi.new("int[2]")
    assert(ffi.C.hw_pipe(fds) == 0)
    ffi.C.hw_write(fds[1], "x", 1)
    C.weft_interrupt_arm(fds[0], 0)
    local t0 = util.now_ms()
    local ok, err = pcall(world.all_reduce, world, x)
    W.report("INTERRUPT", ok, t0, err)
    C.weft_interrupt_arm(-1, 0)
  else
    sleep_ms(late_ms) -- never joins that call; its own next call finds the abort
    local ok, err = pcall(world.all_reduce, world, x)
    W.report("INTERRUPT_PEER", ok, util.now_ms(), err)
  end
elseif mode == "late" then
  local x = T.full({ 256 }, 1, "f32")
  world:all_reduce(x)
  if me == n - 1 then
    sleep_ms(late_ms) -- past the others' timeout
  else
    local t0 = util.now_ms()
    local ok, err = pcall(world.all_reduce, world, x)
    W.report("LATE", ok, t0, err)
  end
elseif mode == "dead" then
  local x = T.full({ 256 }, 1, "f32")
  world:all_reduce(x)
  if me == n - 1 then
    sleep_ms(late_ms)
    W.kill_self()
  end
  local t0 = util.now_ms()
  local ok, err = pcall(world.all_reduce, world, x)
  W.report("DEAD", ok, t0, err)
else
  error("HW_MODE?")
end
K.ok_line()
os.exit(K.failures == 0 and 0 or 1)
