-- One rank of tests/faults/fault_async_cross_spec.lua's death case, started with the
-- plain per-rank environment (no weft-run, which would stop the others):
--   luajit async_death_ranks.lua <victim>
-- After a world barrier the victim kills itself (SIGKILL); the others wait in
-- an async world all_gather_object, whose progress worker reaches the store
-- through a connection of its own: the wait must still be ended by the death
-- (the store's tombstone), not by the 60 s timeout. Survivors print
--   ASYNC_DEATH <ms from submit to the error> <message on one line>
local ffi = require("ffi")
ffi.cdef [[ int getpid(void); int kill(int pid, int sig); ]]
local weft = require("weft")
local async = require("weft.async")
local now_ms = require("weft.internal.clock").now_ms

local victim = tonumber(arg[1])
local world = weft.init()
print("PID " .. ffi.C.getpid()); io.stdout:flush()
world:barrier()
if world.rank == victim then ffi.C.kill(ffi.C.getpid(), 9) end
local t0 = now_ms()
local h = async.all_gather_object(world, { world.rank })
local ok, err = pcall(h.wait, h)
print(("ASYNC_DEATH %d %s"):format(now_ms() - t0, ok and "no error" or (tostring(err):gsub("\n", " | "))))
io.stdout:flush()
pcall(weft.shutdown)
