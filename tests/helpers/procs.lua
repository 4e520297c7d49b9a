-- Process and file plumbing shared by the test drivers that run
-- scripts/weft-run for real (launcher_util, repl_tmux): the repository root,
-- a clock and a sleep, shell quoting, whole files, temporary directories and
-- the rank processes a run left behind. POSIX calls under private names.
local ffi = require("ffi")
local now_ns = require("weft.internal.clock").now_ns

local P = {}

if not pcall(function() return ffi.C.weft_pr_poll end) then
  ffi.cdef [[ int weft_pr_poll(void *fds, unsigned long n, int timeout) __asm__("poll"); ]]
end
local C = ffi.C

local src = debug.getinfo(1, "S").source:sub(2)
P.ROOT = (src:match("^(.*)/tests/helpers/[^/]*$")) or "."

function P.now() return now_ns() * 1e-9 end   -- monotonic seconds
function P.sleep(s) C.weft_pr_poll(nil, 0, math.floor(s * 1000)) end
function P.q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

function P.slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a"); f:close()
  return s
end
function P.spit(path, s)
  local f = assert(io.open(path, "wb")); f:write(s); f:close()
end

-- a new private directory /tmp/<prefix>.XXXXXX
function P.tmpdir(prefix)
  local p = io.popen("mktemp -d /tmp/" .. prefix .. ".XXXXXX")
  local d = p:read("*l"); p:close()
  return d
end

-- "pid command-line" lines of the live processes whose command line matches
-- the pgrep pattern (bracket one character, e.g. `[.]`, so that pgrep's own
-- shell, whose command line holds the pattern, does not match)
function P.pgrep(pattern)
  local p = io.popen("pgrep -af '" .. pattern .. "'")
  local s = p:read("*a"); p:close()
  return s
end

-- SIGKILL the processes of such a list (their pids only)
function P.kill_listed(list)
  for line in list:gmatch("[^\n]+") do
    local pid = line:match("^(%d+) ")
    if pid then os.execute("kill -9 " .. pid .. " 2>/dev/null") end
  end
end

return P
