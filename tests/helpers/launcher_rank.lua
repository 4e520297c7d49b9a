-- Rank script for launcher_spec. Arguments (key=value, any order):
--   fail=R code=C   rank R exits with code C after 0.3 s
--   kill=R          rank R kills itself with SIGKILL after 0.3 s
--   stubborn=R      rank R ignores SIGTERM (only SIGKILL stops it)
--   catch           every rank waits for SIGTERM/SIGINT and reports it, exit 0
--   tree            every rank starts a child rank script (same pgrp) and waits
-- Every rank prints "ready <rank>" and then waits (60 s unless a mode ends it).
local ffi = require("ffi")
ffi.cdef [[
int poll(void *fds, unsigned long nfds, int timeout);
int kill(int pid, int sig);
int getpid(void);
void *signal(int sig, void *handler);
int sigemptyset(void *set);
int sigaddset(void *set, int sig);
int sigprocmask(int how, const void *set, void *old);
int sigtimedwait(const void *set, void *info, const void *timeout);
]]
if not pcall(ffi.typeof, "weft_lr_sigset") then
  ffi.cdef [[ typedef struct { unsigned long val[16]; } weft_lr_sigset;
              typedef struct { long s; long ns; } weft_lr_timespec; ]]
end
local C = ffi.C
io.stdout:setvbuf("line")

local opt = {}
for _, a in ipairs(arg) do
  local k, v = a:match("^(%w+)=(.*)$")
  opt[k or a] = v or true
end
local rank = tonumber(os.getenv("RANK"))
local function sleep(s) C.poll(nil, 0, math.floor(s * 1000)) end

if tonumber(opt.stubborn) == rank then C.signal(15, ffi.cast("void *", 1)) end
if opt.catch then
  local set = ffi.new("weft_lr_sigset")
  C.sigemptyset(set); C.sigaddset(set, 15); C.sigaddset(set, 2)
  C.sigprocmask(0, set, nil)
  print("ready " .. rank)
  local ts = ffi.new("weft_lr_timespec", 60, 0)
  local sig = C.sigtimedwait(set, nil, ts)
  print("rank " .. rank .. " got signal " .. sig)
  os.exit(0)
end
if opt.tree and not opt.child then
  print("ready " .. rank)
  os.execute("luajit " .. arg[0] .. " child " .. table.concat(arg, " "))
  os.exit(0)
end
print((opt.child and "child ready " or "ready ") .. rank)
if tonumber(opt.fail) == rank then sleep(0.3); os.exit(tonumber(opt.code) or 1) end
if tonumber(opt.kill) == rank then sleep(0.3); C.kill(C.getpid(), 9) end
for _ = 1, 60 do sleep(1) end
