-- Ranks of tests/faults/fault_sigpipe_spec.lua (issue 24 item 5): a loop of Gloo
-- all-reduces of SIGPIPE_NUMEL f32; the last rank is stopped (SIGSTOP) past
-- the timeout and then continued; the others fail at the timeout and exit
-- at once without weft.shutdown (their sockets close under the stopped
-- rank, rank 0's store with them). The resumed rank writes into closed
-- sockets: it must get an error ("ENDED <message>", exit code 3), never be
-- killed by SIGPIPE, and find its own SIGPIPE disposition (default) and
-- signal mask (SIGPIPE not blocked) as they were. Before that, every rank
-- checks that a SIGPIPE it had pending (blocked) before a Gloo call is still
-- pending after it: weft consumes only what its own writes raised.
--   sigpipe_ranks.lua direct   a weft.gloo communicator on the world's cpu group
--   sigpipe_ranks.lua group    world:all_reduce (WEFT_HOST_BACKEND=gloo, across nodes)
local weft = require("weft")
local ffi = require("ffi")
ffi.cdef [[
int getpid(void);
int raise(int sig);
void *signal(int sig, void *handler);
typedef struct { unsigned long v[16]; } sp_sigset;
int sigemptyset(sp_sigset *s);
int sigaddset(sp_sigset *s, int sig);
int sigismember(const sp_sigset *s, int sig);
int sigpending(sp_sigset *s);
int pthread_sigmask(int how, const sp_sigset *set, sp_sigset *old);
typedef struct { long s, ns; } sp_timespec;
int sigtimedwait(const sp_sigset *set, void *info, const sp_timespec *timeout);
]]
local C = ffi.C
local SIGPIPE, SIG_BLOCK, SIG_SETMASK = 13, 0, 2
local mode = arg[1] or "direct"
local numel = tonumber(os.getenv("SIGPIPE_NUMEL") or "256")
local TMO = tonumber(os.getenv("WEFT_TIMEOUT_MS"))

local function say(s) io.stdout:write(s, "\n"); io.stdout:flush() end

local world = weft.init()
local victim = world.world_size - 1
local buf = weft.tensor.ones({ numel }, "f32")
local run
if mode == "direct" then
  local c = require("weft.gloo").new(world.cpu_group)
  c:set_timeout(TMO)
  run = function() c:all_reduce(buf.ptr, buf.ptr, numel, 0, 0) end
else
  run = function() world:all_reduce(buf) end
end

-- a SIGPIPE of the application's own, pending (blocked) across a Gloo call, stays pending
local pipe, old, pend = ffi.new("sp_sigset"), ffi.new("sp_sigset"), ffi.new("sp_sigset")
C.sigemptyset(pipe); C.sigaddset(pipe, SIGPIPE)
C.pthread_sigmask(SIG_BLOCK, pipe, old)
C.raise(SIGPIPE)
run()
C.sigpending(pend)
local kept = C.sigismember(pend, SIGPIPE) == 1
C.sigtimedwait(pipe, nil, ffi.new("sp_timespec", 0, 0))
C.pthread_sigmask(SIG_SETMASK, old, nil)
say(("OWN_PENDING_KEPT %s"):format(tostring(kept)))

if world.rank == victim then
  local pid = C.getpid()
  os.execute(("(sleep 0.2; kill -STOP %d; sleep %.1f; kill -CONT %d) >/dev/null 2>&1 &")
             :format(pid, TMO / 1000 + 1.5, pid))
end
local ok, err = pcall(function() for _ = 1, 1e9 do run() end end)
say(("ENDED %s"):format((tostring(err):gsub("\n", " "))))
if world.rank ~= victim then os.exit(0) end -- at once: sockets close under the stopped rank
-- the resumed rank: SIGPIPE's disposition and this thread's mask are the application's
local prev = C.signal(SIGPIPE, nil)
C.signal(SIGPIPE, prev)
local cur = ffi.new("sp_sigset")
C.pthread_sigmask(SIG_BLOCK, nil, cur)
say(("RESUMED disposition_default=%s pipe_blocked=%s"):format(tostring(prev == nil),
    tostring(C.sigismember(cur, SIGPIPE) == 1)))
os.exit(3)
