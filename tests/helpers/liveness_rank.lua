-- One rank of tests/faults/fault_liveness_spec.lua, started with the plain per-rank
-- environment (RANK, WORLD_SIZE, MASTER_PORT...; no weft-run supervision):
--   luajit liveness_rank.lua <scenario> <victim> <dir>
-- The victim kills itself with SIGKILL (or stops itself with SIGSTOP) at the
-- scenario's point, after writing the monotonic time of that moment to
-- <dir>/death. Survivors print lines the spec reads:
--   PID <pid>
--   FAIL <ms since the death> <error message on one line>
--   SHUTDOWN <ms since the death> ok|<error>
local ffi = require("ffi")
ffi.cdef [[ int getpid(void); int kill(int pid, int sig); ]]
local weft = require("weft")
local now_ms = require("weft.internal.clock").now_ms

local scenario, victim, dir = arg[1], tonumber(arg[2]), arg[3]
local rank = tonumber(os.getenv("RANK"))
local world_size = tonumber(os.getenv("WORLD_SIZE"))
local SIGKILL, SIGSTOP = 9, 19

local function say(fmt, ...) io.stdout:write(fmt:format(...), "\n"); io.stdout:flush() end
say("PID %d", ffi.C.getpid())

local function die(sig)
  local f = assert(io.open(dir .. "/death", "w"))
  f:write(("%.3f\n"):format(now_ms()))
  f:close()
  io.stdout:flush()
  ffi.C.kill(ffi.C.getpid(), sig or SIGKILL)
end

local function death_ms()
  local f = io.open(dir .. "/death")
  local t = f and tonumber(f:read("*l"))
  if f then f:close() end
  return t and (now_ms() - t) or -1
end

local function sleep_ms(ms) os.execute(("sleep %.3f"):format(ms / 1000)) end

local function survive(fn)
  local ok, err = pcall(fn)
  if ok then say("NOFAIL"); return end
  say("FAIL %d %s", death_ms(), tostring(err):gsub("\n", " | "))
  local sok, serr = pcall(weft.shutdown)
  say("SHUTDOWN %d %s", death_ms(), sok and "ok" or tostring(serr):gsub("\n", " | "))
end

local me_victim = rank == victim

if scenario == "before_init" then
  -- the victim never gets to weft.init
  if me_victim then die() end
  survive(function() weft.init() end)
elseif scenario == "in_init" then
  -- the victim connects and registers (init's first step), then dies while
  -- the others build the world group
  if me_victim then
    local st = weft.store.open { host = "127.0.0.1", port = tonumber(os.getenv("MASTER_PORT")),
                                 timeout_ms = 60000 }
    st:register_rank(rank, world_size)
    die()
  end
  survive(function() weft.init() end)
elseif scenario == "in_mp_init" then
  -- the victim dies after weft.init, while the others build the model-parallel groups
  survive(function()
    weft.init()
    if me_victim then die() end
    weft.initialize_model_parallel { tp = world_size }
    weft.tp():barrier()   -- creating the groups may need no word from every rank
  end)
elseif scenario == "between" or scenario == "stopped" then
  -- the victim dies (or stops) between collectives; the others' next ones fail
  survive(function()
    local w = weft.init()
    w:barrier()
    local x = weft.tensor.full({ 256 }, 1, "f32")
    w:all_reduce(x)
    if me_victim then die(scenario == "stopped" and SIGSTOP or SIGKILL) end
    sleep_ms(300)
    w:barrier()
    w:all_reduce(x)
  end)
elseif scenario == "in_barrier" or scenario == "in_shm" or scenario == "in_bcast" then
  -- the others are already blocked in a collective when the victim dies
  survive(function()
    local w = weft.init()
    w:barrier()
    local x = weft.tensor.full({ 1024 }, 1, "f32")
    if scenario == "in_shm" then w:all_reduce(x) end   -- the segment exists: its barrier waits
    if me_victim then sleep_ms(1000); die() end
    if scenario == "in_barrier" then
      w:barrier()
    elseif scenario == "in_shm" then
      w:all_reduce(x)
    else
      w:broadcast_object(rank == victim and "x" or nil, victim)
    end
  end)
elseif scenario == "raise_in_barrier" or scenario == "end_in_barrier" then
  -- the victim leaves without the second barrier, not killed: its script
  -- raises (or ends) and the Lua state closes, store handle and all
  if me_victim then
    local w = weft.init()
    w:barrier()
    sleep_ms(1000)
    local f = assert(io.open(dir .. "/death", "w"))
    f:write(("%.3f\n"):format(now_ms()))
    f:close()
    if scenario == "raise_in_barrier" then error("boom: this rank raises without its barrier", 0) end
    os.exit(0, true)
  end
  survive(function()
    local w = weft.init()
    w:barrier()
    w:barrier()
  end)
else
  error("unknown scenario " .. tostring(scenario))
end
os.exit(0, false)
