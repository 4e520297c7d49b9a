-- The served demo as the serve specs run it (tests/unit/serve_spec.lua,
-- tests/faults/fault_serve_spec.lua): whether nginx with its Lua module is here
-- (scripts/serve/ensure-nginx installs it from Debian when running as root),
-- and scripts/serve/start in its own session on a free loopback port, up
-- once /health says ok, stopped with the whole session. Loading it puts the
-- demo's modules (scripts/serve/: serve_json, serve_model, ...) on
-- package.path; M.json is serve_json, or why it did not load.
local ROOT = os.getenv("PWD") or "."
package.path = ROOT .. "/scripts/serve/?.lua;" .. package.path

local ffi = require("ffi")
local http = require("helpers.serve_http")
local S = require("helpers.spec_util")
local util = require("helpers.store_util")

pcall(ffi.cdef, "int kill(int pid, int sig);")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")

local M = {}

-- lua-cjson may be missing: then have_nginx() says so (scripts/serve/ensure-nginx)
M.json = select(2, pcall(require, "serve_json"))

function M.alive(pid) return ffi.C.kill(pid, 0) == 0 end
function M.sleep_ms(ms) ffi.C.poll(nil, 0, ms) end

-- The file's contents, "" when it cannot be read.
function M.read_file(path) return util.read_file(path) or "" end

local nginx_ok, nginx_why
function M.have_nginx()
  if nginx_ok == nil then
    local out, rc = S.shell(ROOT .. "/scripts/serve/ensure-nginx")
    nginx_ok = rc == 0
    nginx_why = out:gsub("rc=%d+%s*$", ""):gsub("%s+$", "")
  end
  return nginx_ok
end

-- Why have_nginx() said no, as a pending() message.
function M.no_nginx() return "nginx with the Lua module is not installed: " .. tostring(nginx_why) end

-- Starts scripts/serve/start -n n in its own session; returns the server
-- { pid, port, prefix, log, n } or raises (after killing the session).
-- opts: tag (of the temporary prefix), hidden, args (more start options).
function M.start(n, opts)
  local port = assert(require("weft.tools.launcher").free_port("127.0.0.1"))
  local prefix = S.shell(("mktemp -d /tmp/weft-%s.XXXXXX"):format(opts.tag)):match("^(%S+)")
  local log = prefix .. ".log"
  local cmd = ("WEFT_TIMEOUT_MS=4000 setsid %s/scripts/serve/start -n %d --port %d --prefix %s --hidden %d %s > %s 2>&1 < /dev/null & echo $!")
    :format(ROOT, n, port, prefix, opts.hidden, opts.args or "", log)
  local pid = tonumber(S.shell(cmd):match("^(%d+)"))
  local srv = { pid = pid, port = port, prefix = prefix, log = log, n = n }
  local up = http.wait_up(port, "/health", 60000, function(st, body) return st == 200 and body:find('"status":"ok"', 1, true) end)
  if not up then
    local l = M.read_file(log)
    ffi.C.kill(-pid, 9)
    S.shell(("rm -rf %s %s"):format(prefix, log))
    error(("server did not come up on port %d:\n%s"):format(port, l))
  end
  return srv
end

-- Stops the session (start, weft-run, nginx, workers): TERM, up to 15 s, KILL.
function M.stop(srv)
  if not srv or not srv.pid then return end
  ffi.C.kill(-srv.pid, 15)
  local deadline = http.now_ms() + 15000
  while M.alive(srv.pid) and http.now_ms() < deadline do M.sleep_ms(50) end
  if M.alive(srv.pid) then ffi.C.kill(-srv.pid, 9) end
  S.shell(("rm -rf %s %s"):format(srv.prefix, srv.log))
  srv.pid = nil
end

return M
