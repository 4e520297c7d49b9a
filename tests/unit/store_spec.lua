-- weft.store: TCP key-value rendezvous (src/store/store.c, lua/weft/store.lua).
local ffi = require("ffi")
local store = require("weft.store")
local wffi = require("weft.internal.ffi")
local util = require("helpers.store_util")

local C = wffi.C
local OP, frame, u32, u64 = util.OP, util.frame, util.u32, util.u64

local function server(opts)
  opts = opts or {}
  opts.server, opts.port = true, opts.port or 0
  opts.timeout_ms = opts.timeout_ms or 5000
  return store.open(opts)
end

local function client(port, opts)
  opts = opts or {}
  opts.port, opts.timeout_ms = port, opts.timeout_ms or 5000
  return store.open(opts)
end

local err_of = require("helpers.spec_util").err_of

-- Reads a raw connection until n bytes came, ms passed or it closed.
local function recv_upto(fd, n, ms)
  local got = ""
  local deadline = util.now_ms() + ms
  while #got < n and util.now_ms() < deadline do
    local r = util.recv_some(fd, 500)
    if r == nil then break end
    got = got .. r
  end
  return got
end

-- Reads the server greeting of a raw connection.
local function hello(fd) return recv_upto(fd, 16 + 33, 3000) end

describe("weft.store", function()
  local s

  before_each(function() s = server() end)
  after_each(function() if s then s:close() end end)

  it("reports the ephemeral port it picked", function()
    assert.is_true(s.port > 0 and s.port < 65536)
    local port = ffi.new("int[1]")
    assert.are.equal(0, C.weft_store_port(s.handle, port))
    assert.are.equal(s.port, port[0])
  end)

  it("sets and gets bytes: text, binary with NULs, empty values, overwrite", function()
    s:set("a", "hello")
    assert.are.equal("hello", s:get("a"))
    local bin = "\0\1\2\255binary\0"
    s:set("bin", bin)
    assert.are.equal(bin, s:get("bin"))
    s:set("empty", "")
    assert.are.equal("", s:get("empty"))
    s:set("a", "again")
    assert.are.equal("again", s:get("a"))
    local c = client(s.port)
    assert.are.equal("again", c:get("a"))
    c:close()
  end)

  it("try_get never blocks; get and wait time out naming the missing keys and the address", function()
    assert.is_nil(s:try_get("nope"))
    s:set("present", "1")
    assert.are.equal("1", s:try_get("present"))
    local e = err_of(s.get, s, "absent-key", 200)
    assert.are.equal(("weft: store get: timed out after 200 ms waiting for key(s) 'absent-key' at 127.0.0.1:%d")
                     :format(s.port), e)
    e = err_of(s.wait, s, { "present", "a", "b" }, 150)
    assert.is_truthy(e:find("store wait: timed out after 150 ms waiting for key(s) 'a', 'b' at 127.0.0.1:"
                            .. s.port, 1, true), e)
    assert.is_falsy(e:find("'present'", 1, true), e)
    e = err_of(s.multi_get, s, { "present", "zz" }, 100)
    assert.is_truthy(e:find("waiting for key(s) 'zz'", 1, true), e)
    -- EAGAIN straight from C with timeout 0
    local v, n = ffi.new("const void *[1]"), ffi.new("size_t[1]")
    assert.are.equal(C.WEFT_EAGAIN, C.weft_store_get(s.handle, "nope", 0, v, n))
    assert.are.equal(C.WEFT_ETIMEOUT, C.weft_store_get(s.handle, "nope", 50, v, n))
  end)

  it("get and wait return as soon as another process sets the key (server-side wait)", function()
    local pid = util.spawn(("luajit tests/helpers/store_proc.lua set %d late value-from-child 300"):format(s.port), 20)
    local t0 = util.now_ms()
    assert.are.equal("value-from-child", s:get("late", 10000))
    s:wait({ "late" }, 1000)
    assert.is_true(util.now_ms() - t0 < 9000)
    assert.is_true(util.reap(pid, 10000))
  end)

  it("multi_get returns values in key order in one call", function()
    s:set("k1", "v1"); s:set("k2", ""); s:set("k3", "v3")
    assert.are.same({ "v3", "v1", "", "v1" }, s:multi_get({ "k3", "k1", "k2", "k1" }, 100))
  end)

  it("add counts (creating at 0), check, compare_set, delete, num_keys", function()
    assert.are.equal(5, s:add("cnt", 5))
    assert.are.equal(2, s:add("cnt", -3))
    assert.are.equal("2", s:get("cnt"))
    assert.are.equal(-2 ^ 40, s:add("big", -2 ^ 40))
    assert.is_true(s:check { "cnt", "big" })
    assert.is_false(s:check { "cnt", "missing" })
    -- compare_set: create when absent and expected empty
    assert.are.equal("v1", s:compare_set("cas", nil, "v1"))
    assert.are.equal("v1", s:compare_set("cas", "wrong", "v2"))   -- no swap: current
    assert.are.equal("v2", s:compare_set("cas", "v1", "v2"))      -- swap
    assert.are.equal("", s:compare_set("absent", "x", "y"))       -- absent, expected set: nothing
    assert.is_false(s:check { "absent" })
    assert.are.equal(3, s:num_keys())
    assert.is_true(s:delete("cas"))
    assert.is_false(s:delete("cas"))
    assert.are.equal(2, s:num_keys())
    s:set("text", "abc")
    local e = err_of(s.add, s, "text", 1)
    assert.is_truthy(e:find("store add: the key holds a value that is not an integer", 1, true), e)
    assert.are.equal("abc", s:get("text"))  -- connection still fine
  end)

  it("rejects bad keys before sending", function()
    assert.is_truthy(err_of(s.set, s, "", "x"):find("empty key", 1, true))
    assert.is_truthy(err_of(s.set, s, ("k"):rep(4097), "x"):find("longer than 4096", 1, true))
    s:set(("k"):rep(4096), "max-key")
    assert.are.equal("max-key", s:get(("k"):rep(4096)))
    assert.is_truthy(err_of(s.check, s, {}):find("non%-empty array"))
  end)

  it("holds many keys", function()
    local keys = {}
    for i = 1, 3000 do
      keys[i] = "many/" .. i
      s:set(keys[i], ("v%d"):format(i * 7))
    end
    assert.are.equal(3000, s:num_keys())
    local vals = s:multi_get(keys, 1000)
    for i = 1, 3000 do assert.are.equal(("v%d"):format(i * 7), vals[i]) end
    assert.is_true(s:check(keys))
    for i = 1, 3000, 2 do assert.is_true(s:delete(keys[i])) end
    assert.are.equal(1500, s:num_keys())
  end)

  it("moves a 32 MiB value under the default limit", function()
    local big = ("0123456789abcdef"):rep(2 * 1024 * 1024)
    s:set("big", big)
    local got = s:get("big")
    assert.are.equal(#big, #got)
    assert.is_true(got == big)
  end)

  it("stays usable after a timed-out get", function()
    local e = err_of(s.get, s, "x", 10)
    assert.is_truthy(e:find("timed out"))
    s:set("after", "ok")
    assert.are.equal("ok", s:get("after"))
  end)

  it("close is idempotent; use after close raises 'destroyed'", function()
    local c = client(s.port)
    c:close(); c:close()
    assert.is_truthy(err_of(c.get, c, "a"):find("weft: store get: destroyed", 1, true))
    assert.is_truthy(err_of(c.set, c, "a", "b"):find("weft: store set: destroyed", 1, true))
  end)
end)

describe("weft.store limits and bad peers", function()
  it("values up to WEFT_STORE_MAX_VALUE pass; one byte more is refused with the limit named", function()
    util.with_env({ WEFT_STORE_MAX_VALUE = 4 * 1024 * 1024 }, function()
      local s = server()
      local ok, err = pcall(function()
        local v = ("x"):rep(4 * 1024 * 1024)
        s:set("limit", v)
        assert.is_true(s:get("limit") == v)
        local e = err_of(s.set, s, "over", v .. "y")
        assert.is_truthy(e:find("value of 4194305 bytes for key 'over' exceeds the limit of 4194304 bytes "
                                .. "(WEFT_STORE_MAX_VALUE)", 1, true), e)
        e = err_of(s.compare_set, s, "over", "", v .. "y")
        assert.is_truthy(e:find("exceeds the limit", 1, true), e)
        -- a raw client declaring a frame over any possible SET is cut off at the header
        local fd = assert(util.connect(s.port))
        hello(fd)
        util.send(fd, frame(OP.SET, 0, 4 * 1024 * 1024 + 8192))
        assert.is_true(util.wait_closed(fd, 3000))
        util.close(fd)
        -- a complete SET whose value is one byte over the limit is dropped after parsing
        fd = assert(util.connect(s.port))
        hello(fd)
        local body = u32(0) .. u32(4) .. "over" .. u64(#v + 1) .. v .. "y"
        util.send(fd, frame(OP.SET, 0, #body) .. body)
        assert.is_true(util.wait_closed(fd, 3000))
        util.close(fd)
        assert.is_false(s:check { "over" })
        assert.is_true(s:get("limit") == v)
      end)
      s:close()
      if not ok then error(err, 0) end
    end)
  end)

  it("garbage, unknown ops, malformed and oversized frames close only that connection", function()
    local s = server()
    local ok, err = pcall(function()
      s:set("keep", "serving")
      -- a second client parked in a wait while the bad connections come and go
      local log = os.tmpname()
      local pid = util.spawn(("luajit tests/helpers/store_proc.lua get %d parked 15000"):format(s.port), 30, log)
      local bad = {
        "GET / HTTP/1.1\r\nHost: x\r\n\r\n",                       -- not a weft frame
        frame(OP.SET, 0, 10, 9),                                   -- wrong version
        frame(77, 0, 0),                                           -- unknown op
        frame(OP.RESP, 0, 4) .. u32(0),                            -- a reply sent as a request
        frame(OP.SET, 0, 2 ^ 40),                                  -- oversized
        frame(OP.GET, 0, 2 ^ 62),                                  -- oversized
        frame(OP.SET, 0, 16) .. u32(0) .. u32(0) .. u64(0),        -- empty key: malformed
        frame(OP.DELETE, 0, 8) .. u32(100) .. "abcd",              -- key longer than payload
        frame(OP.NUM_KEYS, 0, 1) .. "x",                           -- trailing bytes
      }
      for i, bytes in ipairs(bad) do
        local fd = assert(util.connect(s.port))
        local greet = hello(fd)
        assert.are.equal("WFST", greet:sub(1, 4))
        util.send(fd, bytes)
        assert.is_true(util.wait_closed(fd, 3000), "bad frame #" .. i .. " did not close its connection")
        util.close(fd)
        assert.are.equal("serving", s:get("keep"))
      end
      -- a well-formed raw request still works on a fresh connection
      local fd = assert(util.connect(s.port))
      hello(fd)
      util.send(fd, frame(OP.NUM_KEYS, 0, 0))
      local reply = util.recv_some(fd, 3000)
      assert.are.equal(frame(OP.RESP, 0, 12) .. u32(0) .. u64(1), reply)
      util.close(fd)
      -- the parked client is still served
      s:set("parked", "still-here")
      assert.is_true(util.reap(pid, 15000))
      assert.are.equal("VALUE still-here\n", util.read_file(log))
      os.remove(log)
    end)
    s:close()
    if not ok then error(err, 0) end
  end)

  it("drops an incomplete frame after WEFT_STORE_READ_TIMEOUT_MS", function()
    util.with_env({ WEFT_STORE_READ_TIMEOUT_MS = 300 }, function()
      local s = server()
      local ok, err = pcall(function()
        local fd = assert(util.connect(s.port))
        hello(fd)
        util.send(fd, "WFST\1")    -- 5 of 16 header bytes, then silence
        assert.is_true(util.wait_closed(fd, 5000))
        util.close(fd)
        fd = assert(util.connect(s.port))
        hello(fd)
        util.send(fd, frame(OP.SET, 0, 100) .. "partial")
        assert.is_true(util.wait_closed(fd, 5000))
        util.close(fd)
        s:set("x", "fine")
        assert.are.equal("fine", s:get("x"))
      end)
      s:close()
      if not ok then error(err, 0) end
    end)
  end)
end)

describe("weft.store secret", function()
  local SECRET = "correct-horse-battery-staple-7f3a"

  it("right secret works, wrong or missing secret fails with EAUTH and a clear message", function()
    local s = server { secret = SECRET }
    local ok, err = pcall(function()
      s:set("a", "1")
      local c = client(s.port, { secret = SECRET })
      assert.are.equal("1", c:get("a"))
      c:close()
      local e = err_of(client, s.port, { secret = "wrong-secret" })
      assert.is_truthy(e:find("rejected this client: the secrets differ", 1, true), e)
      assert.is_truthy(e:find("127.0.0.1:" .. s.port, 1, true), e)
      e = err_of(client, s.port)
      assert.is_truthy(e:find("requires a secret and none was given", 1, true), e)
      -- the C code is EAUTH
      local o = ffi.new("weft_store_opts")
      o.port, o.timeout_ms, o.secret = s.port, 2000, "nope"
      local out = ffi.new("weft_store *[1]")
      assert.are.equal(C.WEFT_EAUTH, C.weft_store_open(o, out))
      -- a raw client answering the challenge with garbage is dropped
      local fd = assert(util.connect(s.port))
      local greet = hello(fd)
      assert.are.equal(1, greet:byte(17))            -- auth required
      util.send(fd, frame(OP.AUTH, 0, 64) .. ("\0"):rep(64))
      assert.is_true(util.wait_closed(fd, 3000))
      util.close(fd)
      assert.are.equal("1", s:get("a"))
    end)
    s:close()
    if not ok then error(err, 0) end
  end)

  it("a client refuses a server that cannot prove it knows the secret (mutual)", function()
    local lfd, port = util.listen()
    local log = os.tmpname()
    local pid = util.spawn(("luajit tests/helpers/store_proc.lua open %d %s"):format(port, SECRET), 30, log)
    local fd = util.accept(lfd, 10000)
    assert.is_truthy(fd and fd >= 0, "client did not connect")
    util.send(fd, frame(OP.HELLO, 0, 33) .. "\1" .. ("n"):rep(32))  -- demands a secret
    local auth = recv_upto(fd, 16 + 64, 5000)
    -- AUTH: nonce and proof (64 bytes), then the claim (who the client says it is)
    assert.are.equal(frame(OP.AUTH, 0, 64):sub(1, 8), auth:sub(1, 8))
    assert.is_true(auth:byte(16) > 64)
    assert.is_falsy(auth:find(SECRET, 1, true))
    util.send(fd, frame(OP.AUTH_OK, 0, 32) .. ("\0"):rep(32))     -- a proof made up without it
    assert.is_true(util.reap(pid, 10000))
    util.close(fd); util.close(lfd)
    local out = util.read_file(log)
    os.remove(log)
    assert.is_truthy(out:find("could not prove it knows the secret", 1, true), out)
  end)

  it("a client with a secret refuses a server without one", function()
    local s = server()
    local e = err_of(client, s.port, { secret = SECRET })
    s:close()
    assert.is_truthy(e:find("uses no secret but this client has one", 1, true), e)
  end)

  it("takes the secret from WEFT_STORE_SECRET", function()
    util.with_env({ WEFT_STORE_SECRET = SECRET }, function()
      local s = server()
      local c = client(s.port)
      c:set("k", "v")
      assert.are.equal("v", s:get("k"))
      c:close(); s:close()
    end)
    local s = server { secret = SECRET }
    local e = err_of(client, s.port)
    s:close()
    assert.is_truthy(e:find("requires a secret", 1, true))
  end)

  it("never sends the secret: traffic through a relay does not contain it", function()
    local s = server { secret = SECRET }
    local ok, err = pcall(function()
      local dir = util.tmpdir()
      local portfile, capfile = dir .. "/port", dir .. "/cap"
      local pid = util.spawn(("luajit tests/helpers/store_proc.lua relay %d %s %s"):format(s.port, portfile, capfile), 30)
      local rport
      local deadline = util.now_ms() + 10000
      while not rport and util.now_ms() < deadline do
        rport = tonumber(util.read_file(portfile) or "")
        if not rport then util.sleep_ms(20) end
      end
      assert.is_not_nil(rport, "relay did not start")
      local c = client(rport, { secret = SECRET })
      c:set("through-relay", "payload-bytes")
      assert.are.equal("payload-bytes", c:get("through-relay"))
      c:close()
      deadline = util.now_ms() + 10000
      while not util.read_file(capfile .. ".done") and util.now_ms() < deadline do util.sleep_ms(50) end
      assert.is_true(util.reap(pid, 5000))
      local cap = util.read_file(capfile)
      util.rmdir(dir)
      assert.is_truthy(cap:find("through-relay", 1, true), "the capture saw the traffic")
      assert.is_truthy(cap:find("WFST", 1, true))
      assert.is_falsy(cap:find(SECRET, 1, true), "the secret went over the wire")
      assert.is_falsy(cap:find(SECRET:sub(1, 12), 1, true))
    end)
    s:close()
    if not ok then error(err, 0) end
  end)
end)

describe("weft.store connection lifetime", function()
  it("a client retries until a server that starts late", function()
    local port = util.free_port()
    local pid = util.spawn(("luajit tests/helpers/store_proc.lua serve %d 700 15000"):format(port), 30)
    local t0 = util.now_ms()
    local c = client(port, { timeout_ms = 15000 })
    c:set("done", "1")
    c:close()
    assert.is_true(util.now_ms() - t0 < 15000)
    assert.is_true(util.reap(pid, 10000))
  end)

  it("connect gives up after timeout_ms naming host:port", function()
    local port = util.free_port()
    local e = err_of(client, port, { timeout_ms = 300 })
    assert.is_truthy(e:find(("could not connect to the store at 127.0.0.1:%d within 300 ms"):format(port), 1, true), e)
  end)

  it("a server that closes gives ECLOSED to its clients", function()
    local s = server()
    local c = client(s.port)
    c:set("x", "1")
    s:close()
    local v, n = ffi.new("const void *[1]"), ffi.new("size_t[1]")
    assert.are.equal(C.WEFT_ECLOSED, C.weft_store_get(c.handle, "x", 1000, v, n))
    local msg = wffi.last_error()
    assert.is_truthy(msg:find("127.0.0.1:" .. s.port, 1, true), msg)
    -- later calls stay ECLOSED (the server is gone), without waiting out a timeout
    local t0 = util.now_ms()
    assert.are.equal(C.WEFT_ECLOSED, C.weft_store_get(c.handle, "x", 1000, v, n))
    assert.is_true(util.now_ms() - t0 < 1000)
    c:close()
  end)

  it("a client waiting in get sees ECLOSED when the server process dies", function()
    local port = util.free_port()
    local log = os.tmpname()
    local pid = util.spawn(("luajit tests/helpers/store_proc.lua vanish %d 800"):format(port), 30, log)
    local c = client(port, { timeout_ms = 10000 })
    local v, n = ffi.new("const void *[1]"), ffi.new("size_t[1]")
    local t0 = util.now_ms()
    local rc = C.weft_store_get(c.handle, "never-set", 20000, v, n)
    local msg = wffi.last_error()
    assert.are.equal(C.WEFT_ECLOSED, rc, msg)
    assert.is_true(util.now_ms() - t0 < 15000)
    assert.is_truthy(msg:find("closed the connection", 1, true), msg)
    c:close()
    assert.is_true(util.reap(pid, 5000))
    os.remove(log)
  end)

  it("wait_closed: ETIMEOUT while the server answers, 0 once it closed, and never reconnects", function()
    local s = server()
    local c = client(s.port)
    c:set("x", "1")
    local t0 = util.now_ms()
    assert.are.equal(C.WEFT_ETIMEOUT, C.weft_store_wait_closed(c.handle, 300))
    assert.is_true(util.now_ms() - t0 >= 250)
    local port = s.port
    s:close()
    -- something else takes the port and never speaks: a reconnect would
    -- wait there until the timeout; the closed connection is the answer
    local lfd = util.listen(port)
    t0 = util.now_ms()
    assert.are.equal(0, C.weft_store_wait_closed(c.handle, 4000), wffi.last_error())
    assert.is_true(util.now_ms() - t0 < 2000)
    -- and later calls on the handle fail at once instead of connecting there
    local v, n = ffi.new("const void *[1]"), ffi.new("size_t[1]")
    assert.are.equal(C.WEFT_ECLOSED, C.weft_store_get(c.handle, "x", 1000, v, n))
    util.close(lfd)
    c:close()
  end)

  it("refuses a second server on a port in use", function()
    local s = server()
    local e = err_of(store.open, { server = true, port = s.port, timeout_ms = 1000 })
    s:close()
    assert.is_truthy(e:find("address already in use", 1, true), e)
  end)
end)

describe("weft.store from C", function()
  it("passes the HMAC-SHA256 known-answer test through libcrypto (tests/c/store_hmac_test.c)", function()
    local dir = util.tmpdir()
    local exe = dir .. "/store_hmac_test"
    -- where OpenSSL's headers and library are, as the Makefile takes them
    local cflags, libs = os.getenv("CRYPTO_CFLAGS") or "", os.getenv("CRYPTO_LIBS") or "-lcrypto"
    local cmd = ("cd '%s' && cc -O2 -Wall -Wextra -Werror -Isrc %s tests/c/store_hmac_test.c src/store/hmac.c %s -o '%s' 2>&1 && '%s' 2>&1; echo rc=$?")
                :format(util.root(), cflags, libs, exe, exe)
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    util.rmdir(dir)
    assert.is_truthy(out:find("0 failed", 1, true), out)
    assert.is_truthy(out:find("rc=0", 1, true), out)
  end)

  it("serializes threads sharing a handle and releases many parked waiters (tests/c/store_threads_test.c)", function()
    local dir = util.tmpdir()
    local exe = dir .. "/store_threads_test"
    local lib = wffi.path
    local libdir = lib:match("^(.*)/[^/]*$") or "."
    local cmd = ("cd '%s' && cc -O2 -Wall -Wextra -Werror -Isrc tests/c/store_threads_test.c '%s' -pthread "
                 .. "-Wl,-rpath,'%s' -o '%s' 2>&1 && timeout 60 '%s' 2>&1; echo rc=$?")
                :format(util.root(), lib, libdir, exe, exe)
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    util.rmdir(dir)
    assert.is_truthy(out:find("store_threads: %d+ passed, 0 failed"), out)
    assert.is_truthy(out:find("rc=0", 1, true), out)
  end)
end)
