-- Test driver for tests/unit/repl_spec.lua: REPL sessions in a pseudo-terminal
-- (tmux on a private socket, no user config), output read with capture-pane,
-- every wait bounded; plus piped (non-tty) runs and stray-process checks.
local ffi = require("ffi")
local P = require("helpers.procs")

local U = {}

if not pcall(function() return ffi.C.weft_rt_getpid end) then
  ffi.cdef [[
  int weft_rt_getpid(void) __asm__("getpid");
  unsigned int weft_rt_getuid(void) __asm__("getuid");
  ]]
end
local C = ffi.C

U.ROOT = P.ROOT
U.TOKEN = "rtok" .. C.weft_rt_getpid()
U.SOCKET = "weft-repl-test-" .. C.weft_rt_getpid()
U.INIT = "tests/helpers/repl_init.lua"

U.now, U.sleep, U.q = P.now, P.sleep, P.q
local slurp, spit = P.slurp, P.spit
U.slurp, U.spit = slurp, spit

function U.tmpdir() return P.tmpdir("weft-repl-test") end
function U.rmdir(d) if d and d:match("^/tmp/weft%-repl%-test%.") then os.execute("rm -rf " .. U.q(d)) end end

-- environment given to a session, in shell syntax
local function env_prefix(extra)
  local t = { "env" }
  local lib = os.getenv("WEFT_LIB")
  if lib then t[#t + 1] = "WEFT_LIB=" .. U.q(lib) end
  for k, v in pairs(extra or {}) do t[#t + 1] = k .. "=" .. U.q(v) end
  return table.concat(t, " ")
end

local CONF = "/tmp/weft-repl-tmux-" .. C.weft_rt_getpid() .. ".conf"
local function tmux(args)
  local p = io.popen("tmux -L " .. U.SOCKET .. " -f " .. CONF .. " " .. args .. " 2>&1")
  local s = p:read("*a"); p:close()
  return s
end
U.tmux = tmux

local S = {}
S.__index = S

-- Starts `cmd` (run in the repository root, with env) in a new tmux session.
-- The pane prints REPL-EXIT:<code> when the command ends and stays readable.
function U.start(cmd, env)
  spit(CONF, "set -g history-limit 20000\nset -g remain-on-exit off\n")
  U.nsess = (U.nsess or 0) + 1
  local name = "s" .. U.nsess
  local line = ("cd %s && %s %s; echo REPL-EXIT:$?; sleep 120"):format(U.q(U.ROOT), env_prefix(env), cmd)
  local out = tmux(("new-session -d -s %s -x 200 -y 50 %s"):format(name, U.q(line)))
  assert(out == "", "tmux new-session: " .. out)
  return setmetatable({ name = name }, S)
end

-- everything the pane showed (scroll-back too), trailing white space dropped
-- (so an empty prompt line ends the text as "\n>")
function S:screen()
  local s = tmux("capture-pane -p -J -S - -t " .. self.name)
  return (s:gsub("%s+$", ""))
end

-- Text typed literally, then Enter (unless enter == false).
function S:type(text, enter)
  tmux("send-keys -t " .. self.name .. " -l " .. U.q(text))
  if enter ~= false then tmux("send-keys -t " .. self.name .. " Enter") end
end
function S:key(k) tmux("send-keys -t " .. self.name .. " " .. k) end

-- Waits (bounded) until the screen matches every Lua pattern given; returns
-- the screen, or nil and the last screen.
function S:wait(patterns, timeout)
  if type(patterns) == "string" then patterns = { patterns } end
  local deadline = U.now() + (timeout or 30)
  local scr
  while true do
    scr = self:screen()
    local all = true
    for _, p in ipairs(patterns) do if not scr:find(p) then all = false; break end end
    if all then return scr end
    if U.now() > deadline then return nil, scr end
    U.sleep(0.1)
  end
end

-- Waits (bounded) until pattern p matches at least n times; true or nil, screen.
function S:wait_count(p, n, timeout)
  local deadline = U.now() + (timeout or 30)
  while true do
    if self:count(p) >= n then return true end
    if U.now() > deadline then return nil, self:screen() end
    U.sleep(0.1)
  end
end

-- count of matches of pattern p on the screen
function S:count(p)
  local n = 0
  for _ in self:screen():gmatch(p) do n = n + 1 end
  return n
end

function S:exit_code(timeout)
  local scr = self:wait("REPL%-EXIT:%d+", timeout)
  return scr and tonumber(scr:match("REPL%-EXIT:(%d+)")), scr
end

function S:kill() tmux("kill-session -t " .. self.name) end

function U.kill_server()
  tmux("kill-server")
  os.remove(CONF)
  os.remove(("%s/tmux-%d/%s"):format(os.getenv("TMUX_TMPDIR") or "/tmp", C.weft_rt_getuid(), U.SOCKET))
end

-- Piped (non-tty) run of weft-run with `input` on stdin; bounded by `timeout`.
function U.pipe(args, input, env, timeout)
  local d = U.tmpdir()
  spit(d .. "/in", input)
  os.execute(("cd %s && %s timeout -k 5 %d scripts/weft-run %s <%s/in >%s/out 2>%s/err; echo $? >%s/rc")
             :format(U.q(U.ROOT), env_prefix(env), timeout or 60, args, d, d, d, d))
  local r = { out = slurp(d .. "/out") or "", err = slurp(d .. "/err") or "",
              rc = tonumber(slurp(d .. "/rc") or "") }
  U.rmdir(d)
  return r
end

-- Rank processes of this run still alive (their command line holds TOKEN;
-- the bracket keeps pgrep's own shell from matching).
function U.strays() return P.pgrep("repl_init[.]lua.*" .. U.TOKEN) end

-- Waits (bounded) for the rank processes to go; kills any left, returns them.
function U.reap(timeout)
  local deadline = U.now() + (timeout or 10)
  local s = U.strays()
  while s ~= "" and U.now() < deadline do
    U.sleep(0.1)
    s = U.strays()
  end
  P.kill_listed(s)
  return s
end

return U
