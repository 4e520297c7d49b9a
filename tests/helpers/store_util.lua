-- Test helpers for the store and cpu-group specs: raw sockets (to send bad
-- frames), clocks, env, and bounded process spawning. POSIX calls are bound
-- under private names (asm labels), so no other module's cdefs can clash.
local ffi = require("ffi")
local bit = require("bit")

local M = {}

if not pcall(ffi.typeof, "wst_sockaddr_in") then
  ffi.cdef [[
  typedef struct { uint16_t family; uint16_t port; uint32_t addr; uint8_t zero[8]; } wst_sockaddr_in;
  typedef struct { int fd; short events; short revents; } wst_pollfd;
  int wst_socket(int domain, int type, int protocol) __asm__("socket");
  int wst_connect(int fd, const void *addr, uint32_t len) __asm__("connect");
  int wst_bind(int fd, const void *addr, uint32_t len) __asm__("bind");
  int wst_listen(int fd, int backlog) __asm__("listen");
  int wst_accept(int fd, void *addr, void *len) __asm__("accept");
  int wst_getsockname(int fd, void *addr, uint32_t *len) __asm__("getsockname");
  int wst_setsockopt(int fd, int level, int name, const void *val, uint32_t len) __asm__("setsockopt");
  long wst_send(int fd, const void *buf, unsigned long n, int flags) __asm__("send");
  long wst_recv(int fd, void *buf, unsigned long n, int flags) __asm__("recv");
  int wst_close(int fd) __asm__("close");
  int wst_poll(wst_pollfd *fds, unsigned long n, int timeout) __asm__("poll");
  int wst_setenv(const char *k, const char *v, int overwrite) __asm__("setenv");
  int wst_unsetenv(const char *k) __asm__("unsetenv");
  int wst_kill(int pid, int sig) __asm__("kill");
  ]]
end
local C = ffi.C

local AF_INET, SOCK_STREAM, MSG_NOSIGNAL = 2, 1, 0x4000
local POLLIN, POLLOUT = 1, 4
local LOOPBACK = 0x0100007f  -- 127.0.0.1 in network order (little-endian host)

local function htons(p) return bit.bor(bit.lshift(bit.band(p, 0xff), 8), bit.rshift(p, 8)) end

local now_ns = require("weft.internal.clock").now_ns
function M.now_ms() return math.floor(now_ns() / 1e6) end   -- whole ms

function M.sleep_ms(ms) C.wst_poll(nil, 0, ms) end

function M.setenv(k, v)
  if v == nil then C.wst_unsetenv(k) else C.wst_setenv(k, tostring(v), 1) end
end

-- Runs f with environment variables set, restoring them afterwards.
function M.with_env(vars, f)
  local old = {}
  for k, v in pairs(vars) do old[k] = os.getenv(k) or false; M.setenv(k, v) end
  local ok, err = pcall(f)
  for k, v in pairs(old) do M.setenv(k, v or nil) end
  if not ok then error(err, 0) end
end

local function addr(port)
  local a = ffi.new("wst_sockaddr_in")
  a.family, a.port, a.addr = AF_INET, htons(port), LOOPBACK
  return a
end

-- A blocking TCP connection to 127.0.0.1:port (nil, errno on failure).
function M.connect(port)
  local fd = C.wst_socket(AF_INET, SOCK_STREAM, 0)
  assert(fd >= 0, "socket failed")
  if C.wst_connect(fd, addr(port), ffi.sizeof("wst_sockaddr_in")) ~= 0 then
    local e = ffi.errno()
    C.wst_close(fd)
    return nil, e
  end
  return fd
end

function M.close(fd) C.wst_close(fd) end

function M.send(fd, s)
  local off = 0
  while off < #s do
    local n = tonumber(C.wst_send(fd, ffi.cast("const char *", s) + off, #s - off, MSG_NOSIGNAL))
    if n <= 0 then return off end
    off = off + n
  end
  return off
end

local function wait_fd(fd, ev, ms)
  local p = ffi.new("wst_pollfd[1]")
  p[0].fd, p[0].events = fd, ev
  return C.wst_poll(p, 1, ms) > 0
end

-- Reads what arrives within ms; "" when nothing, nil when the peer closed.
function M.recv_some(fd, ms)
  if not wait_fd(fd, POLLIN, ms) then return "" end
  local buf = ffi.new("char[65536]")
  local n = tonumber(C.wst_recv(fd, buf, 65536, 0))
  if n <= 0 then return nil end
  return ffi.string(buf, n)
end

-- True when the peer closes the connection within ms (data is discarded).
function M.wait_closed(fd, ms)
  local deadline = M.now_ms() + ms
  while true do
    local left = deadline - M.now_ms()
    if left <= 0 then return false end
    local r = M.recv_some(fd, left)
    if r == nil then return true end
  end
end

-- A raw listening socket on loopback (port: a given one, else any), and its port.
function M.listen(port)
  local fd = C.wst_socket(AF_INET, SOCK_STREAM, 0)
  local one = ffi.new("int[1]", 1)
  C.wst_setsockopt(fd, 1, 2, one, 4)  -- SOL_SOCKET, SO_REUSEADDR
  assert(C.wst_bind(fd, addr(port or 0), ffi.sizeof("wst_sockaddr_in")) == 0, "bind failed")
  assert(C.wst_listen(fd, 16) == 0, "listen failed")
  local a, len = ffi.new("wst_sockaddr_in"), ffi.new("uint32_t[1]", ffi.sizeof("wst_sockaddr_in"))
  C.wst_getsockname(fd, a, len)
  return fd, htons(a.port)
end

function M.accept(fd, ms)
  if not wait_fd(fd, POLLIN, ms) then return nil end
  return C.wst_accept(fd, nil, nil)
end

-- A free TCP port on loopback (bound once, then released).
function M.free_port()
  local fd, port = M.listen()
  C.wst_close(fd)
  return port
end

M.poll = function(fds, n, ms) return C.wst_poll(fds, n, ms) end
M.POLLIN, M.POLLOUT = POLLIN, POLLOUT
M.raw_recv = function(fd, buf, n) return tonumber(C.wst_recv(fd, buf, n, 0)) end

-- Frame header of the store protocol (src/store/store_proto.h).
function M.u32(v)
  return string.char(bit.band(bit.rshift(v, 24), 255), bit.band(bit.rshift(v, 16), 255),
                     bit.band(bit.rshift(v, 8), 255), bit.band(v, 255))
end
function M.u64(v) return M.u32(math.floor(v / 2 ^ 32)) .. M.u32(v % 2 ^ 32) end
function M.frame(op, flags, len, version)
  return "WFST" .. string.char(version or 2, op) .. string.char(bit.rshift(flags, 8), bit.band(flags, 255))
         .. M.u64(len)
end
M.OP = { HELLO = 1, AUTH = 2, AUTH_OK = 3, SET = 4, GET = 5, ADD = 6, CHECK = 7, CAS = 8,
         DELETE = 9, NUM_KEYS = 10, RESP = 11 }

-- A store server on a free loopback port and a cpu group of one on it
-- (global rank `rank`, default 0; timeout_ms default 5000): s, g. The specs'
-- one-process checks; close with g:destroy(); s:close().
function M.one_rank_group(name, rank, timeout_ms)
  local s = require("weft.store").open { host = "127.0.0.1", port = 0, server = true, timeout_ms = 5000 }
  return s, require("weft.cpugroup").new(s, name, { rank or 0 }, 0, timeout_ms or 5000)
end

---------------------------------------------------------------- processes

function M.root()
  local src = debug.getinfo(1, "S").source:sub(2)
  local dir = src:match("^(.*)/tests/helpers/[^/]*$")
  return dir or "."
end

function M.tmpdir()
  local p = os.tmpname()
  os.remove(p)
  assert(os.execute("mkdir -p '" .. p .. "'"))
  return p
end

function M.read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

function M.rmdir(p) os.execute("rm -rf '" .. p .. "'") end

-- Starts `cmd` in the background (bounded by `timeout`); returns its pid.
function M.spawn(cmd, limit_s, log)
  local pidfile = os.tmpname()
  os.execute(("cd '%s' && (timeout %d %s > '%s' 2>&1 &\n echo $! > '%s')")
             :format(M.root(), limit_s or 30, cmd, log or "/dev/null", pidfile))
  local pid = tonumber(M.read_file(pidfile))
  os.remove(pidfile)
  return pid
end

-- Alive = exists and is not a zombie waiting for its (adoptive) parent to reap it.
function M.alive(pid)
  if not pid or C.wst_kill(pid, 0) ~= 0 then return false end
  local stat = M.read_file("/proc/" .. pid .. "/stat")
  return not (stat and stat:match("^%d+ %b() Z"))
end

-- Waits (bounded) for a spawned process to end; kills it (by pid) if it does not.
function M.reap(pid, ms)
  local deadline = M.now_ms() + (ms or 10000)
  while M.alive(pid) and M.now_ms() < deadline do M.sleep_ms(20) end
  if M.alive(pid) then C.wst_kill(pid, 15); return false end
  return true
end

-- Runs n ranks of a Lua script in parallel (each bounded by limit_s) with
-- RANK/WORLD_SIZE/MASTER_PORT and extra env; waits for all. Returns
-- { [rank] = { rc = number, out = string } }.
function M.run_ranks(n, script, env, limit_s)
  local dir = M.tmpdir()
  local port = M.free_port()
  local extra = {}
  for k, v in pairs(env or {}) do extra[#extra + 1] = ("%s='%s'"):format(k, v) end
  extra = table.concat(extra, " ")
  local parts = {}
  for r = 0, n - 1 do
    parts[#parts + 1] = ("(RANK=%d WORLD_SIZE=%d LOCAL_RANK=%d LOCAL_WORLD_SIZE=%d MASTER_ADDR=127.0.0.1 "
                         .. "MASTER_PORT=%d %s timeout %d luajit %s > '%s/out.%d' 2>&1; echo $? > '%s/rc.%d') &")
                        :format(r, n, r, n, port, extra, limit_s or 60, script, dir, r, dir, r)
  end
  os.execute(("cd '%s' && %s wait"):format(M.root(), table.concat(parts, " ")))
  local res = {}
  for r = 0, n - 1 do
    res[r] = { rc = tonumber(M.read_file(("%s/rc.%d"):format(dir, r)) or ""),
               out = M.read_file(("%s/out.%d"):format(dir, r)) or "" }
  end
  M.rmdir(dir)
  return res
end

return M
