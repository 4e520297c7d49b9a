-- Test utilities for tests/unit/launcher_spec.lua: run scripts/weft-run for real
-- (foreground or background), read what it wrote, find stray rank processes.
local ffi = require("ffi")
local P = require("helpers.procs")

local U = {}

ffi.cdef [[
int getpid(void);
]]
local C = ffi.C

U.ROOT = P.ROOT
U.TOKEN = "tok" .. C.getpid()          -- marks the rank processes of this test run

U.now, U.sleep, U.q = P.now, P.sleep, P.q
local slurp = P.slurp
local function tmpdir() return P.tmpdir("weft-launcher-test") end

local function cleanup(dir) os.execute("rm -rf " .. U.q(dir)) end

-- Runs `scripts/weft-run <args>` (args: a shell-quoted string) to completion.
-- Returns { out =, err =, rc =, elapsed = seconds }.
function U.run(args)
  local dir = tmpdir()
  local t0 = U.now()
  os.execute(("cd %s && scripts/weft-run %s >%s/out 2>%s/err </dev/null; echo $? >%s/rc")
             :format(U.q(U.ROOT), args, dir, dir, dir))
  local r = { out = slurp(dir .. "/out"), err = slurp(dir .. "/err"),
              rc = tonumber(slurp(dir .. "/rc")), elapsed = U.now() - t0 }
  cleanup(dir)
  return r
end

-- Starts weft-run in the background; returns a handle with :out() :err()
-- :pid() :rc() (nil while running) :wait(timeout) and :cleanup().
function U.start(args)
  local h = { dir = tmpdir(), t0 = U.now() }
  os.execute(("cd %s && ( scripts/weft-run %s >%s/out 2>%s/err </dev/null & echo $! >%s/pid; wait $!; echo $? >%s/rc.tmp; mv %s/rc.tmp %s/rc ) >/dev/null 2>&1 &")
             :format(U.q(U.ROOT), args, h.dir, h.dir, h.dir, h.dir, h.dir, h.dir))
  function h:out() return slurp(self.dir .. "/out") or "" end
  function h:err() return slurp(self.dir .. "/err") or "" end
  function h:pid() return tonumber(slurp(self.dir .. "/pid") or "") end
  function h:rc() return tonumber(slurp(self.dir .. "/rc") or "") end
  function h:wait(timeout) return U.wait_until(function() return self:rc() end, timeout) end
  function h:cleanup() cleanup(self.dir) end
  return h
end

-- Polls fn every 50 ms (sleeping) until it returns a true value or timeout s pass.
function U.wait_until(fn, timeout)
  local deadline = U.now() + timeout
  while true do
    local v = fn()
    if v then return v end
    if U.now() > deadline then return nil end
    U.sleep(0.05)
  end
end

function U.count(s, pat)
  local n = 0
  for _ in s:gmatch(pat) do n = n + 1 end
  return n
end

-- Rank processes of this test run still alive (the bracket keeps pgrep's own
-- shell, whose command line holds the pattern, from matching).
function U.strays() return P.pgrep("helpers/launcher_[a-z]+[.]lua.*" .. U.TOKEN) end

-- SIGKILL the processes listed by U.strays() (their pids only)
U.kill_strays = P.kill_listed

return U
