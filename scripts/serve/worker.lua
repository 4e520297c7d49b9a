-- scripts/serve/worker.lua — ranks 1..N-1 of the served demo (started by
-- weft-run through scripts/serve/rank; rank 0 is nginx). Announces itself
-- (a file in WEFT_SERVE_DIR, so rank 0's event loop can wait for it without
-- blocking), brings the world up, then runs steps until rank 0 says stop or
-- a collective fails (a dead peer, a timeout), which ends this rank.
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
package.path = here .. "/?.lua;" .. package.path

local engine = require "serve_engine"
local cfg = engine.config()
local rank = tonumber(os.getenv("RANK") or "0")

if cfg.dir then
  local f = assert(io.open(("%s/ready.%d"):format(cfg.dir, rank), "w"))
  f:write(tostring(require("ffi").C.getpid()), "\n")   -- serve_engine declared getpid
  f:close()
end

local ok, e = pcall(engine.bringup, cfg)
if not ok then
  io.stderr:write(("weft-serve rank %d: bring-up failed: %s\n"):format(rank, tostring(e)))
  os.exit(1)
end

-- Rank 0 (the nginx worker) is on this node: when its process is gone (a
-- crash, kill -9; nginx then starts a new worker, which cannot rejoin), stop
-- instead of waiting forever for steps that will not come.
local rank0_pid
for _, p in ipairs(e.peers or {}) do if p.rank == 0 then rank0_pid = p.pid end end
local ffi = require "ffi"
pcall(ffi.cdef, "int kill(int pid, int sig);")
local function rank0_gone()
  return rank0_pid and ffi.C.kill(rank0_pid, 0) ~= 0 and ffi.errno() == 3   -- ESRCH
end

local idle_ms = math.max(100, cfg.heartbeat_ms * 2)
while true do
  local okr, msg = pcall(e.recv, e, idle_ms)
  if not okr then
    io.stderr:write(("weft-serve rank %d: %s\n"):format(rank, tostring(msg)))
    os.exit(1)
  end
  if not msg and rank0_gone() then
    io.stderr:write(("weft-serve rank %d: rank 0 (nginx worker, pid %d) is gone: stopping\n")
      :format(rank, rank0_pid))
    os.exit(1)
  end
  if msg then
    if msg.stop then break end
    local okx, err = pcall(e.execute, e, msg)
    if not okx then
      io.stderr:write(("weft-serve rank %d: step %s failed: %s\n"):format(rank, tostring(msg.s), tostring(err)))
      os.exit(1)
    end
  end
end
os.exit(0)
