-- Ranks for tests/faults/fault_cleanup_spec.lua: a run that fails in one of several
-- ways while rank 0 is creating a shared segment (its name exists in
-- /dev/shm until every rank attached). Each rank writes its pid to
-- <dir>/pid.<rank> first, so the spec can look for the names of its own run.
--   luajit cleanup_ranks.lua <mode> <dir>
-- modes: error  — rank 1 raises while rank 0 creates the world's segment
--        bad_tp — rank 1 passes tp = 3 (2 ranks), rank 0 tp = 2
--        kill9  — rank 1 kills rank 0 with SIGKILL while it creates
--        init   — rank 1 fails weft.init (the store rejects its secret)
local ffi = require("ffi")
local shm_names = require("weft.internal.shm_names")
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int kill(int pid, int sig);")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite);")

local mode, dir = arg[1], arg[2]
local rank = tonumber(os.getenv("RANK"))
local function put(name, text)
  local f = assert(io.open(dir .. "/" .. name, "w"))
  f:write(text, "\n")
  f:close()
end
put("pid." .. rank, tostring(ffi.C.getpid()))

-- rank 1: wait (bounded) until rank 0 holds a name in /dev/shm; records it
local function await_rank0_name()
  local pid0
  for _ = 1, 1000 do
    local f = io.open(dir .. "/pid.0")
    if f then pid0 = tonumber(f:read("*l")); f:close() end
    if pid0 then
      local names = shm_names.of({ pid0 })
      if #names > 0 then put("saw.1", table.concat(names, " ")); return pid0 end
    end
    ffi.C.poll(nil, 0, 10)
  end
  return pid0
end

local weft = require("weft")
local T = weft.tensor
if mode == "init" then
  if rank == 1 then   -- a secret that differs from rank 0's
    ffi.C.setenv("WEFT_STORE_SECRET", "not-the-secret-of-rank-0", 1)
  end
  weft.init()
  error("init should have failed on rank 1")
end
local w = weft.init()
local x = T.full({ 1024 }, rank + 1, "f32")
if mode == "error" then
  if rank == 1 then
    await_rank0_name()
    error("rank 1 fails on purpose mid-run")
  end
  w:all_reduce(x)
elseif mode == "bad_tp" then
  -- (the ranks agree on the arguments before any group exists, so rank 0
  -- holds no name here; the run must still leave nothing)
  if rank == 1 then weft.initialize_model_parallel { tp = 3 } end
  weft.initialize_model_parallel { tp = 2 }
  weft.tp():all_reduce(x)
elseif mode == "kill9" then
  if rank == 1 then
    local pid0 = await_rank0_name()
    ffi.C.kill(pid0, 9)
    error("rank 1 killed rank 0")
  end
  w:all_reduce(x)
end
