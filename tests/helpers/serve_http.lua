-- A small HTTP/1.1 client over LuaJIT FFI sockets for the serve tests and
-- the benchmark's checks: keep-alive connections, many in flight at once
-- through one poll() loop, bounded by deadlines. Responses must carry
-- Content-Length (the demo's all do). Loopback only.
local ffi = require("ffi")
local bit = require("bit")

if not pcall(ffi.typeof, "weft_http_pollfd") then
  ffi.cdef [[
    typedef struct { int fd; short events; short revents; } weft_http_pollfd;
    typedef struct { uint16_t family; uint16_t port; uint32_t addr; uint8_t zero[8]; } weft_http_sockaddr;
  ]]
end
pcall(ffi.cdef, [[
  int socket(int domain, int type, int protocol);
  int connect(int fd, const void *addr, uint32_t len);
  long send(int fd, const void *buf, unsigned long n, int flags);
  long recv(int fd, void *buf, unsigned long n, int flags);
  int close(int fd);
  int poll(void *fds, unsigned long n, int timeout);
  int inet_pton(int af, const char *src, void *dst);
]])
local C = ffi.C
local AF_INET, SOCK_STREAM, SOCK_NONBLOCK, SOCK_CLOEXEC = 2, 1, 0x800, 0x80000
local POLLIN, POLLOUT = 1, 4
local EINPROGRESS, EAGAIN, EINTR = 115, 11, 4
local MSG_NOSIGNAL = 0x4000

local M = {}

M.now_ms = require("weft.internal.clock").now_ms

local function connect(host, port)
  local fd = C.socket(AF_INET, bit.bor(SOCK_STREAM, SOCK_NONBLOCK, SOCK_CLOEXEC), 0)
  assert(fd >= 0, "socket failed")
  local sa = ffi.new("weft_http_sockaddr")
  sa.family = AF_INET
  sa.port = bit.bor(bit.lshift(bit.band(port, 0xff), 8), bit.rshift(port, 8))
  assert(C.inet_pton(AF_INET, host or "127.0.0.1", ffi.cast("char *", sa) + 4) == 1, "bad address")
  local rc = C.connect(fd, sa, ffi.sizeof(sa))
  if rc ~= 0 and ffi.errno() ~= EINPROGRESS then
    C.close(fd)
    return nil, "connect failed (errno " .. ffi.errno() .. ")"
  end
  return fd
end

local Conn = {}
Conn.__index = Conn

function M.open(port, host)
  local fd, err = connect(host, port)
  if not fd then return nil, err end
  return setmetatable({ fd = fd, port = port, host = host, out = "", inbuf = "", busy = false }, Conn)
end

function Conn:close()
  if self.fd then C.close(self.fd); self.fd = nil end
end

-- Queues a request; the response arrives through step()/M.run.
function Conn:request(method, path, body)
  body = body or ""
  local req = ("%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s")
    :format(method, path, self.host or "127.0.0.1", #body, body)
  self.out = self.out .. req
  self.busy = true
  self.t0 = M.now_ms()
end

-- Writes everything queued now (waits for the connection to be writable,
-- bounded by timeout_ms), so a request is on its way before anything else.
function Conn:flush(timeout_ms)
  local pfd = ffi.new("weft_http_pollfd[1]")
  local deadline = M.now_ms() + (timeout_ms or 10000)
  while #self.out > 0 do
    if M.now_ms() > deadline then error("http: could not send the request in time") end
    pfd[0].fd, pfd[0].events, pfd[0].revents = self.fd, POLLOUT, 0
    if C.poll(pfd, 1, 100) > 0 then
      if bit.band(pfd[0].revents, 0x18) ~= 0 then error("http: connection failed") end
      local n = C.send(self.fd, self.out, #self.out, MSG_NOSIGNAL)
      if n > 0 then self.out = self.out:sub(tonumber(n) + 1)
      elseif ffi.errno() ~= EAGAIN and ffi.errno() ~= EINTR then error("send failed (errno " .. ffi.errno() .. ")") end
    end
  end
end

local rbuf = ffi.new("uint8_t[65536]")

-- Parses a complete response from inbuf: status, headers, body or nil.
local function parse(self)
  local s = self.inbuf
  local he = s:find("\r\n\r\n", 1, true)
  if not he then return nil end
  local head = s:sub(1, he - 1)
  local status = tonumber(head:match("^HTTP/1%.%d (%d%d%d)"))
  local len = tonumber(head:lower():match("\ncontent%-length:%s*(%d+)"))
  if not status then error("bad response: " .. head:sub(1, 80)) end
  if not len then error("response without Content-Length: " .. head) end
  if #s < he + 3 + len then return nil end
  local body = s:sub(he + 4, he + 3 + len)
  self.inbuf = s:sub(he + 4 + len)
  return status, body, head
end

-- Does what I/O it can; returns status, body when a response completed,
-- or nil; raises on a closed connection.
function Conn:io(revents)
  if #self.out > 0 and bit.band(revents, POLLOUT) ~= 0 then
    local n = C.send(self.fd, self.out, #self.out, MSG_NOSIGNAL)
    if n > 0 then self.out = self.out:sub(tonumber(n) + 1)
    elseif n < 0 and ffi.errno() ~= EAGAIN and ffi.errno() ~= EINTR then
      error("send failed (errno " .. ffi.errno() .. ")")
    end
  end
  if bit.band(revents, POLLIN) ~= 0 or bit.band(revents, 0x18) ~= 0 then
    local n = C.recv(self.fd, rbuf, 65536, 0)
    if n > 0 then self.inbuf = self.inbuf .. ffi.string(rbuf, n)
    elseif n == 0 then error("connection closed by the server")
    elseif ffi.errno() ~= EAGAIN and ffi.errno() ~= EINTR then error("recv failed (errno " .. ffi.errno() .. ")") end
  end
  local status, body = parse(self)
  if status then self.busy = false; return status, body end
  return nil
end

-- Runs conns (array) until done(conn, status, body) has been called for
-- every outstanding request and no conn is busy, or deadline_ms passes
-- (then raises). on_idle(): called when a conn is free, may queue more.
function M.run(conns, on_response, deadline_ms)
  local n = #conns
  local pfds = ffi.new("weft_http_pollfd[?]", n)
  local deadline = M.now_ms() + (deadline_ms or 60000)
  while true do
    local active = 0
    for i = 1, n do
      local c = conns[i]
      pfds[i - 1].fd = c.busy and c.fd or -1
      pfds[i - 1].events = (#c.out > 0) and bit.bor(POLLIN, POLLOUT) or POLLIN
      pfds[i - 1].revents = 0
      if c.busy then active = active + 1 end
    end
    if active == 0 then return end
    local left = deadline - M.now_ms()
    if left <= 0 then error(("http: %d request(s) unanswered at the deadline"):format(active)) end
    C.poll(pfds, n, math.min(100, math.ceil(left)))
    for i = 1, n do
      local c = conns[i]
      local re = pfds[i - 1].revents
      if c.busy and re ~= 0 then
        local status, body = c:io(re)
        if status then on_response(c, status, body, M.now_ms() - c.t0) end
      end
    end
  end
end

-- One request on a fresh connection: status, body (raises after timeout_ms).
function M.request(port, method, path, body, timeout_ms)
  local c = assert(M.open(port))
  c:request(method, path, body)
  local st, bd
  local ok, err = pcall(M.run, { c }, function(_, s, b) st, bd = s, b end, timeout_ms or 30000)
  c:close()
  if not ok then error(err, 2) end
  return st, bd
end

-- true once GET path answers (any status) within timeout_ms (polling).
function M.wait_up(port, path, timeout_ms, want)
  local deadline = M.now_ms() + (timeout_ms or 30000)
  while M.now_ms() < deadline do
    local ok, st, body = pcall(M.request, port, "GET", path, nil, 2000)
    if ok and (not want or want(st, body)) then return true, st, body end
    C.poll(nil, 0, 50)
  end
  return false
end

return M
