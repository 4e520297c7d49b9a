-- Helper process for tests/unit/store_spec.lua (always started under `timeout`).
--   store_proc.lua serve PORT DELAY_MS HOLD_MS   start a server after DELAY_MS; exit when
--                                               key "done" is set or after HOLD_MS
--   store_proc.lua vanish PORT AFTER_MS          serve, then exit without closing after AFTER_MS
--   store_proc.lua get PORT KEY TIMEOUT_MS       print "VALUE <v>" or "ERR <message>"
--   store_proc.lua set PORT KEY VALUE DELAY_MS   set a key after DELAY_MS
--   store_proc.lua open PORT SECRET              print "OPENED" or "ERR <message>"
--   store_proc.lua relay TARGET PORTFILE CAPFILE TCP relay to TARGET recording both directions
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")

local ffi = require("ffi")
local util = require("helpers.store_util")
local mode = arg[1]

local function say(s) io.stdout:write(s, "\n"); io.stdout:flush() end

if mode == "serve" or mode == "vanish" then
  local store = require("weft.store")
  local port = tonumber(arg[2])
  if mode == "serve" then util.sleep_ms(tonumber(arg[3])) end
  local s = store.open { port = port, server = true, timeout_ms = 5000 }
  say("SERVING " .. s.port)
  if mode == "vanish" then
    util.sleep_ms(tonumber(arg[3]))
    os.exit(0)  -- no close: the process (and its server thread) just disappears
  end
  pcall(s.get, s, "done", tonumber(arg[4]))
  s:close()
elseif mode == "get" then
  local store = require("weft.store")
  local s = store.open { port = tonumber(arg[2]), timeout_ms = 10000 }
  local ok, v = pcall(s.get, s, arg[3], tonumber(arg[4]))
  say(ok and ("VALUE " .. v) or ("ERR " .. tostring(v)))
  s:close()
elseif mode == "open" then
  local store = require("weft.store")
  local ok, e = pcall(store.open, { port = tonumber(arg[2]), timeout_ms = 5000, secret = arg[3] })
  say(ok and "OPENED" or ("ERR " .. tostring(e)))
  if ok then e:close() end
elseif mode == "set" then
  local store = require("weft.store")
  local s = store.open { port = tonumber(arg[2]), timeout_ms = 10000 }
  util.sleep_ms(tonumber(arg[5]))
  s:set(arg[3], arg[4])
  s:close()
elseif mode == "relay" then
  local target, portfile, capfile = tonumber(arg[2]), arg[3], arg[4]
  local lfd, port = util.listen()
  local f = io.open(portfile .. ".tmp", "w"); f:write(port); f:close()
  os.rename(portfile .. ".tmp", portfile)
  local cap = io.open(capfile, "wb")
  local deadline = util.now_ms() + 20000
  -- Relay every client that connects (the client may reconnect) until idle.
  local first = true
  while util.now_ms() < deadline do
    local cfd = util.accept(lfd, first and 10000 or 500)
    first = false
    if not cfd or cfd < 0 then break end
    local sfd = assert(util.connect(target))
    local fds = ffi.new("wst_pollfd[2]")
    fds[0].fd, fds[0].events = cfd, util.POLLIN
    fds[1].fd, fds[1].events = sfd, util.POLLIN
    local buf = ffi.new("char[65536]")
    local open = true
    while open and util.now_ms() < deadline do
      if util.poll(fds, 2, 1000) > 0 then
        for i = 0, 1 do
          if open and fds[i].revents ~= 0 then
            local n = util.raw_recv(fds[i].fd, buf, 65536)
            if n <= 0 then open = false
            else
              local data = ffi.string(buf, n)
              cap:write(data)
              util.send(i == 0 and sfd or cfd, data)
            end
          end
        end
      end
    end
    util.close(cfd); util.close(sfd)
  end
  cap:close()
  util.close(lfd)
  local d = io.open(capfile .. ".done", "w"); d:write("1"); d:close()
else
  io.stderr:write("store_proc.lua: unknown mode ", tostring(mode), "\n")
  os.exit(2)
end
