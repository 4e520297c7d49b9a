-- Rank script for launcher_spec's folding checks. usage: launcher_fold.lua MODE TOKEN
--   same   every rank raises the same error (SIGTERM blocked, so each gets to
--          write its report before it exits)
--   differ rank 0 raises "boom 0", the others "boom <rank>" (SIGTERM blocked)
--   half   rank 1 writes half a line to stderr and waits; rank 0 exits 3
--   warn   every rank writes weft's warning "shared by all", then one of its
--          own, then a plain line, and exits 0
local ffi = require("ffi")
ffi.cdef [[
int poll(void *fds, unsigned long nfds, int timeout);
int sigemptyset(void *set);
int sigaddset(void *set, int sig);
int sigprocmask(int how, const void *set, void *old);
]]
local C = ffi.C
local function sleep(s) C.poll(nil, 0, math.floor(s * 1000)) end
local mode, rank = arg[1], tonumber(os.getenv("RANK"))
if mode == "same" or mode == "differ" then
  local set = ffi.new("unsigned long[16]")
  C.sigemptyset(set); C.sigaddset(set, 15)
  C.sigprocmask(0, set, nil)
  sleep(0.5 + 0.1 * rank)   -- every rank has blocked SIGTERM before the first fails
  error(mode == "same" and "boom: every rank" or ("boom " .. rank))
elseif mode == "warn" then
  io.stderr:write("weft: warning: shared by all (like 'built without Gloo')\n")
  io.stderr:write(("weft: warning: rank %d only\n"):format(rank))
  io.stderr:write("not a warning\n")
elseif mode == "half" then
  if rank == 0 then sleep(0.5); os.exit(3) end
  io.stderr:write("luajit")
  sleep(30)
end
