-- Helper processes for tests/faults/fault_store_spec.lua (always started under `timeout`;
-- loopback only).
--   store_fault.lua serve PORT HOLD_MS        a server (secret from WEFT_STORE_SECRET); prints
--                                            "SERVING <port> nofile <soft> <hard>"; exits when
--                                            key "done" is set or after HOLD_MS
--   store_fault.lua flood PORT N SECONDS      holds N idle connections that never authenticate,
--                                            reopening the ones the server closes, for SECONDS;
--                                            prints "FULL" once N were opened, then
--                                            "FLOOD opened <n> greeted <n> shed <n>"; closes all
--   store_fault.lua fill PORT COUNT BYTES     sets COUNT keys of BYTES bytes each; prints
--                                            "SET <i> ok" or "SET <i> refused <message>", then
--                                            "FILLED"
--   store_fault.lua keys PORT KEYLEN VALLEN MAX sets up to MAX new keys of KEYLEN bytes with values
--                                            of VALLEN bytes until one is refused; prints
--                                            "KEYS <stored> refused <message>" or "KEYS <stored> all"
--   store_fault.lua park PORT N KIB VALLEN    N raw connections each park a GET of ~KIB KiB of keys,
--                                            one by one; prints "REFUSED <i> <answer>" for each
--                                            refused, "PARKED <n>", then one honest SET of VALLEN
--                                            bytes: "HONEST ok" or "HONEST refused <message>"
--   store_fault.lua partial PORT PLEN VALLEN  a raw connection sends a SET header of PLEN bytes and
--                                            16 bytes of body; then one honest SET of VALLEN bytes:
--                                            "HONEST ok" or "HONEST refused <message>"
--   store_fault.lua rank                      a rank of a 2-rank run: rank 1 has a wrong secret;
--                                            prints "INIT OK" or "ERR <ms> <message>"
--   store_fault.lua idle N                    a rank: N object broadcasts, each after a sleep of
--                                            WEFT_STORE_IDLE_MS +- 3 ms (requests going out as the
--                                            server closes the connection as idle); prints
--                                            "IDLE OK" or "IDLE ERR <i> <message>"
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")

local ffi = require("ffi")
local bit = require("bit")
local util = require("helpers.store_util")
local C = ffi.C
local mode = arg[1]

local function say(s) io.stdout:write(s, "\n"); io.stdout:flush() end

if not pcall(ffi.typeof, "wsf_rlimit") then
  ffi.cdef [[
  typedef struct { uint64_t cur, max; } wsf_rlimit;
  int wsf_getrlimit(int res, wsf_rlimit *r) __asm__("getrlimit");
  int wsf_setrlimit(int res, const wsf_rlimit *r) __asm__("setrlimit");
  ]]
end
local RLIMIT_NOFILE = 7
pcall(ffi.cdef, "int getpid(void);")

local function nofile()
  local r = ffi.new("wsf_rlimit")
  C.wsf_getrlimit(RLIMIT_NOFILE, r)
  return tonumber(r.cur), tonumber(r.max)
end

if mode == "serve" then
  local store = require("weft.store")
  local s = store.open { port = tonumber(arg[2]), server = true, timeout_ms = 5000 }
  local soft, hard = nofile()
  say(("SERVING %d nofile %d %d pid %d"):format(s.port, soft, hard, C.getpid()))
  pcall(s.get, s, "done", tonumber(arg[3]))
  s:close()
elseif mode == "keys" then
  local store = require("weft.store")
  local s = store.open { port = tonumber(arg[2]), timeout_ms = 20000 }
  local klen, vlen, max = tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5])
  local val = ("v"):rep(vlen)
  local n, why = 0, nil
  for i = 1, max do
    local key = ("k"):rep(klen - #tostring(i)) .. i
    local ok, e = pcall(s.set, s, key, val)
    if not ok then why = tostring(e); break end
    n = i
  end
  say(why and ("KEYS %d refused %s"):format(n, why) or ("KEYS %d all"):format(n))
  s:close()
elseif mode == "fill" then
  local store = require("weft.store")
  local s = store.open { port = tonumber(arg[2]), timeout_ms = 20000 }
  local n, bytes = tonumber(arg[3]), tonumber(arg[4])
  local val = ("v"):rep(bytes)
  local tag = tostring(C.getpid())
  for i = 1, n do
    local ok, e = pcall(s.set, s, ("fill/%s/%d"):format(tag, i), val)
    say(ok and ("SET %d ok"):format(i) or ("SET %d refused %s"):format(i, tostring(e)))
  end
  say("FILLED")
  s:close()
elseif mode == "park" then
  -- issue 37 item 4: <n> raw connections each send one GET of about <kb>
  -- KiB of absent keys (60 s wait) that also sets "park/<i>" (WF_GET_PUT),
  -- one after another; each is seen either parked (its key "park/<i>" is
  -- there and no answer came) or answered (refused). Then an honest client
  -- tries one SET of <val> bytes. Prints PARKED <n>, REFUSED <i> <message>,
  -- and HONEST ok|refused <message>.
  local store = require("weft.store")
  local port, n, kb, val = tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5])
  local s = store.open { port = port, timeout_ms = 20000 }
  local WF_GET_PUT = 4
  local function key(k) return util.u32(#k) .. k end
  local fds, parked = {}, 0
  for i = 1, n do
    local fd = assert(util.connect(port))
    fds[#fds + 1] = fd
    local keys, nk, bytes = {}, 0, 0
    while bytes < kb * 1024 do
      local k = ("absent/%d/%d/"):format(i, nk) .. ("x"):rep(3900)
      keys[#keys + 1] = key(k)
      nk, bytes = nk + 1, bytes + 4 + #k
    end
    local pk = "park/" .. i
    local body = util.u32(60000) .. util.u32(1) .. key(pk) .. util.u64(1) .. "p"
                 .. util.u32(nk) .. table.concat(keys)
    util.send(fd, util.frame(util.OP.GET, WF_GET_PUT, #body) .. body)
    local answered
    while true do   -- whichever comes: the server ran it (parked) or answered it
      local got = util.recv_some(fd, 20)
      if got == nil or (got ~= "" and got:find("full", 1, true)) then answered = got or "closed"; break end
      if s:check({ pk }) then break end
    end
    if answered then say(("REFUSED %d %s"):format(i, answered:match("the store is full[^%z]*") or answered))
    else parked = parked + 1 end
  end
  say(("PARKED %d"):format(parked))
  local ok, e = pcall(s.set, s, "honest", ("v"):rep(val))
  say(ok and "HONEST ok" or ("HONEST refused " .. tostring(e)))
  for _, fd in ipairs(fds) do util.close(fd) end
  s:close()
elseif mode == "partial" then
  -- a raw connection sends the header of a SET of <plen> bytes and 16 bytes
  -- of its body, then nothing; an honest client then sets <val> bytes
  local store = require("weft.store")
  local port, plen, val = tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4])
  local fd = assert(util.connect(port))
  util.send(fd, util.frame(util.OP.SET, 0, plen) .. ("\0"):rep(16))
  local s = store.open { port = port, timeout_ms = 20000 }
  local ok, e = pcall(s.set, s, "honest", ("v"):rep(val))
  say(ok and "HONEST ok" or ("HONEST refused " .. tostring(e)))
  util.close(fd)
  s:close()
elseif mode == "flood" then
  local port, n, secs = tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4])
  local soft, hard = nofile()
  if hard < n + 64 then say("FLOOD cannot: hard fd limit " .. hard); os.exit(3) end
  if soft < n + 64 then
    local r = ffi.new("wsf_rlimit")
    r.cur, r.max = n + 64, hard
    C.wsf_setrlimit(RLIMIT_NOFILE, r)
  end
  local AF_INET, SOCK_STREAM, SOCK_NONBLOCK = 2, 1, 2048
  local a = ffi.new("wst_sockaddr_in")
  a.family = AF_INET
  a.port = bit.bor(bit.lshift(bit.band(port, 0xff), 8), bit.rshift(port, 8))
  a.addr = 0x0100007f
  local fds = ffi.new("wst_pollfd[?]", n)
  for i = 0, n - 1 do fds[i].fd = -1 end
  local buf = ffi.new("char[4096]")
  local opened, greeted, shed, full = 0, 0, 0, false
  local deadline = util.now_ms() + secs * 1000
  while util.now_ms() < deadline do
    local started = 0
    for i = 0, n - 1 do
      if fds[i].fd < 0 and started < 128 then   -- bounded bursts: the server's thread gets turns
        local fd = C.wst_socket(AF_INET, bit.bor(SOCK_STREAM, SOCK_NONBLOCK), 0)
        if fd >= 0 then
          C.wst_connect(fd, a, ffi.sizeof(a))    -- EINPROGRESS; the poll below tells the rest
          fds[i].fd, fds[i].events, fds[i].revents = fd, util.POLLIN, 0
          opened, started = opened + 1, started + 1
        end
      end
    end
    if not full and opened >= n then full = true; say("FULL") end
    if util.poll(fds, n, 5) > 0 then
      for i = 0, n - 1 do
        local re = fds[i].revents
        if fds[i].fd >= 0 and re ~= 0 then
          local got = util.raw_recv(fds[i].fd, buf, 4096)
          if got > 0 then greeted = greeted + 1     -- the HELLO; say nothing back
          else C.wst_close(fds[i].fd); fds[i].fd = -1; shed = shed + 1 end
          fds[i].revents = 0
        end
      end
    end
  end
  for i = 0, n - 1 do if fds[i].fd >= 0 then C.wst_close(fds[i].fd) end end
  say(("FLOOD opened %d greeted %d shed %d"):format(opened, greeted, shed))
elseif mode == "rank" then
  if os.getenv("RANK") == "1" then util.setenv("WEFT_STORE_SECRET", "a-wrong-secret-on-rank-1") end
  local weft = require("weft")
  local t0 = util.now_ms()
  local ok, err = pcall(weft.init)
  if ok then say("INIT OK"); weft.shutdown()
  else say(("ERR %d %s"):format(util.now_ms() - t0, tostring(err))) end
elseif mode == "idle" then
  pcall(ffi.cdef, "int usleep(unsigned int usec);")
  local weft = require("weft")
  local w = weft.init()
  local idle = tonumber(os.getenv("WEFT_STORE_IDLE_MS"))
  math.randomseed(w.rank + 7)
  for i = 1, tonumber(arg[2]) do
    ffi.C.usleep(math.floor((idle - 3 + math.random() * 6) * 1000))
    local ok, err = pcall(w.broadcast_object, w, { i = i }, 0)
    if not ok then say(("IDLE ERR %d %s"):format(i, tostring(err))); os.exit(1) end
  end
  say("IDLE OK")
  weft.shutdown()
else
  io.stderr:write("store_fault.lua: unknown mode ", tostring(mode), "\n")
  os.exit(2)
end
