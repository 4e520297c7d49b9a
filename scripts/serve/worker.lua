-- scripts/serve/worker.lua — ranks 1..N-1 of the served demo (started by
-- weft-run through scripts/serve/rank; rank 0 is nginx). Announces itself
-- (a file in WEFT_SERVE_DIR, so rank 0's event loop can wait for it without
-- blocking), brings the world up, then runs steps until rank 0 says stop or
-- a collective fails (a dead peer, a timeout), which ends this rank.
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
package.path = here .. "/?.lua;" .. package.path

-- A stop that was asked for (Ctrl-C on scripts/serve/start, SIGTERM: weft-run
-- forwards them to every rank) is quiet and exits 0. luajit would turn SIGINT
-- into an "interrupted!" error wherever this rank happens to be, and rank 0
-- stopping first makes the next collective fail: so both signals are blocked
-- here and looked at (sigpending) whenever the loop wakes or a call fails.
local ffi = require("ffi")
pcall(ffi.cdef, [[
typedef struct { unsigned long val[16]; } weft_serve_sigset;
int sigemptyset(weft_serve_sigset *set);
int sigaddset(weft_serve_sigset *set, int sig);
int sigismember(const weft_serve_sigset *set, int sig);
int sigprocmask(int how, const weft_serve_sigset *set, weft_serve_sigset *old);
int sigpending(weft_serve_sigset *set);
]])
local SIGINT, SIGTERM, SIG_BLOCK = 2, 15, 0
do
  local set = ffi.new("weft_serve_sigset")
  ffi.C.sigemptyset(set)
  ffi.C.sigaddset(set, SIGINT)
  ffi.C.sigaddset(set, SIGTERM)
  ffi.C.sigprocmask(SIG_BLOCK, set, nil)
end
local pending_set = ffi.new("weft_serve_sigset")
local function stop_requested()
  if ffi.C.sigpending(pending_set) ~= 0 then return false end
  return ffi.C.sigismember(pending_set, SIGINT) == 1 or ffi.C.sigismember(pending_set, SIGTERM) == 1
end
-- ends this rank: quietly with 0 when a stop was asked for, else with the message and 1
local function fail(msg)
  if stop_requested() then os.exit(0) end
  io.stderr:write(msg, "\n")
  os.exit(1)
end

local engine = require("serve_engine")
local cfg = engine.config()
local rank = tonumber(os.getenv("RANK") or "0")

if cfg.dir then
  local f = assert(io.open(("%s/ready.%d"):format(cfg.dir, rank), "w"))
  f:write(tostring(require("ffi").C.getpid()), "\n")   -- serve_engine declared getpid
  f:close()
end

local ok, e = pcall(engine.bringup, cfg)
if not ok then fail(("weft-serve rank %d: bring-up failed: %s"):format(rank, tostring(e))) end

-- Rank 0 (the nginx worker) is on this node: when its process is gone (a
-- crash, kill -9; nginx then starts a new worker, which cannot rejoin), stop
-- instead of waiting forever for steps that will not come.
local rank0_pid
for _, p in ipairs(e.peers or {}) do if p.rank == 0 then rank0_pid = p.pid end end
pcall(ffi.cdef, "int kill(int pid, int sig);")
local function rank0_gone()
  return rank0_pid and ffi.C.kill(rank0_pid, 0) ~= 0 and ffi.errno() == 3   -- ESRCH
end

local idle_ms = math.max(100, cfg.heartbeat_ms * 2)
while true do
  local okr, msg = pcall(e.recv, e, idle_ms)
  if not okr then fail(("weft-serve rank %d: %s"):format(rank, tostring(msg))) end
  if stop_requested() then os.exit(0) end
  if not msg and rank0_gone() then
    fail(("weft-serve rank %d: rank 0 (nginx worker, pid %d) is gone: stopping"):format(rank, rank0_pid))
  end
  if msg then
    if msg.stop then break end
    local okx, err = pcall(e.execute, e, msg)
    if not okx then fail(("weft-serve rank %d: step %s failed: %s"):format(rank, tostring(msg.s), tostring(err))) end
  end
end
os.exit(0)
