-- scripts/weft-run, run for real: environment, output relay, failure and
-- signal handling, port choice, usage errors; no rank process may outlive a test.
local U = require("helpers.launcher_util")
local q, TOKEN = U.q, U.TOKEN

local ENV = "tests/helpers/launcher_env.lua"
local LINES = "tests/helpers/launcher_lines.lua"
local RANKS = "tests/helpers/launcher_rank.lua"

-- parse "[rankN] ENV K=V ..." lines into { [N] = {K = V, ...} }
local function env_lines(out)
  local seen, count = {}, 0
  for line in out:gmatch("[^\n]+") do
    local prefix_rank, rest = line:match("^%[rank(%d+)%] ENV (.*)$")
    if prefix_rank then
      local t = {}
      for k, v in rest:gmatch("(%S+)=(%S*)") do t[k] = v end
      seen[tonumber(prefix_rank)] = t
      count = count + 1
    end
  end
  return seen, count
end

describe("weft-run", function()
  after_each(function()
    local strays = U.strays()
    U.kill_strays(strays)   -- so one failure does not leak into the next test
    assert.are.equal("", strays, "rank processes left running")
  end)

  for _, n in ipairs { 1, 2, 3, 4, 8 } do
    it(("gives each of %d ranks its environment"):format(n), function()
      local r = U.run(("-n %d %s a1 'b 2' %s"):format(n, ENV, TOKEN))
      assert.are.equal(0, r.rc, r.err)
      local seen, count = env_lines(r.out)
      assert.are.equal(n, count, r.out)
      local port
      for rank = 0, n - 1 do
        local e = seen[rank]
        assert.is_table(e, "no output from rank " .. rank)
        assert.are.equal(tostring(rank), e.RANK)
        assert.are.equal(tostring(n), e.WORLD_SIZE)
        assert.are.equal(tostring(rank), e.LOCAL_RANK)
        assert.are.equal(tostring(n), e.LOCAL_WORLD_SIZE)
        assert.are.equal("127.0.0.1", e.MASTER_ADDR)
        assert.are.equal("1", e.WEFT_NNODES)
        assert.are.equal("0", e.WEFT_NODE_RANK)
        assert.are.equal("true", e.WEFT_MODULE)
        assert.are.equal("a1,b", e.ARGS:sub(1, 4))
        assert.truthy(tonumber(e.MASTER_PORT), e.MASTER_PORT)
        port = port or e.MASTER_PORT
        assert.are.equal(port, e.MASTER_PORT)   -- one port for the whole world
      end
      assert.truthy(r.out:find("ARGS=a1,b 2," .. TOKEN, 1, true), "arguments with spaces intact")
    end)
  end

  it("numbers ranks across nodes with --nnodes/--node-rank", function()
    local r = U.run(("--nnodes 3 --node-rank 1 -n 2 --master-addr 10.1.2.3 --master-port 29555 %s %s")
                    :format(ENV, TOKEN))
    assert.are.equal(0, r.rc, r.err)
    local seen, count = env_lines(r.out)
    assert.are.equal(2, count)
    for lr = 0, 1 do
      local e = seen[2 + lr]
      assert.is_table(e, r.out)
      assert.are.equal(tostring(2 + lr), e.RANK)
      assert.are.equal("6", e.WORLD_SIZE)
      assert.are.equal(tostring(lr), e.LOCAL_RANK)
      assert.are.equal("2", e.LOCAL_WORLD_SIZE)
      assert.are.equal("10.1.2.3", e.MASTER_ADDR)
      assert.are.equal("29555", e.MASTER_PORT)
      assert.are.equal("3", e.WEFT_NNODES)
      assert.are.equal("1", e.WEFT_NODE_RANK)
    end
  end)

  it("chooses a free port when none is given, not the torchrun default", function()
    local r = U.run(("-n 2 %s %s"):format(ENV, TOKEN))
    assert.are.equal(0, r.rc, r.err)
    local seen = env_lines(r.out)
    local port = tonumber(seen[0].MASTER_PORT)
    assert.truthy(port and port > 0 and port < 65536, tostring(port))
    assert.are_not.equal(29500, port)
    -- the port was free: a listener can take it now (rank 0's store will)
    local p = io.popen(("cd %s && luajit -e %s 2>&1"):format(q(U.ROOT), q(([[
      package.path = "lua/?.lua;" .. package.path
      local ffi = require("ffi"); require("weft.tools.launcher")
      ffi.cdef "int socket(int, int, int); int bind(int, const void *, uint32_t); int close(int);"
      local sa = ffi.new("weft_run_sockaddr_in"); sa.family = 2
      sa.port = bit.bor(bit.rshift(%d, 8), bit.lshift(bit.band(%d, 255), 8))
      sa.addr = 0x0100007f
      local fd = ffi.C.socket(2, 1, 0)
      io.write(ffi.C.bind(fd, ffi.cast("void *", sa), 16) == 0 and "bound" or "busy")
      ffi.C.close(fd)]]):format(port, port))))
    local bound = p:read("*a"); p:close()
    assert.are.equal("bound", bound)
  end)

  it("runs an arbitrary command after --", function()
    local r = U.run("-n 3 -- sh -c 'echo \"r=$RANK w=$WORLD_SIZE\"; echo e$RANK >&2'")
    assert.are.equal(0, r.rc, r.err)
    for rank = 0, 2 do
      assert.truthy(r.out:find(("[rank%d] r=%d w=3\n"):format(rank, rank), 1, true), r.out)
      assert.truthy(r.err:find(("[rank%d] e%d\n"):format(rank, rank), 1, true), r.err)
    end
  end)

  it("prefixes every line and never splits one, under heavy output", function()
    local n, lines = 4, 1500
    local r = U.run(("-n %d %s %d %s"):format(n, LINES, lines, TOKEN))
    assert.are.equal(0, r.rc, r.err)
    local next_out, next_err, tails, etails = {}, {}, {}, {}
    for rank = 0, n - 1 do next_out[rank], next_err[rank] = 1, 4 end
    local bad
    for line in r.out:gmatch("([^\n]*)\n") do
      local pr, rk, i, len, xs = line:match("^%[rank(%d+)%] out (%d+) (%d+) (%d+) (x*)$")
      if pr then
        pr, rk, i = tonumber(pr), tonumber(rk), tonumber(i)
        if pr ~= rk or i ~= next_out[pr] or #xs ~= tonumber(len) then bad = bad or line:sub(1, 120) end
        next_out[pr] = i + 1
      else
        local tr, tk = line:match("^%[rank(%d+)%] tail (%d+) no newline$")
        if tr and tr == tk then tails[tonumber(tr)] = true else bad = bad or line:sub(1, 120) end
      end
    end
    for line in r.err:gmatch("([^\n]*)\n") do
      local pr, rk, i = line:match("^%[rank(%d+)%] err (%d+) (%d+) y*$")
      if pr then
        pr, rk, i = tonumber(pr), tonumber(rk), tonumber(i)
        if pr ~= rk or i ~= next_err[pr] then bad = bad or line:sub(1, 120) end
        next_err[pr] = i + 4
      else
        local tr, tk = line:match("^%[rank(%d+)%] etail (%d+)$")
        if tr and tr == tk then etails[tonumber(tr)] = true else bad = bad or line:sub(1, 120) end
      end
    end
    assert.is_nil(bad, "malformed or out-of-order line")
    assert.are.equal("\n", r.out:sub(-1))
    for rank = 0, n - 1 do
      assert.are.equal(lines + 1, next_out[rank], "stdout lines of rank " .. rank)
      assert.are.equal(lines + 4, next_err[rank], "stderr lines of rank " .. rank)
      assert.is_true(tails[rank], "partial last stdout line of rank " .. rank)
      assert.is_true(etails[rank], "partial last stderr line of rank " .. rank)
    end
  end)

  it("relays raw output with --no-prefix", function()
    local r = U.run("--no-prefix -n 2 -- sh -c 'echo plain'")
    assert.are.equal(0, r.rc, r.err)
    assert.are.equal("plain\nplain\n", r.out)
  end)

  it("stops the others and names the rank when one exits non-zero", function()
    local r = U.run(("-n 4 %s fail=2 code=3 %s"):format(RANKS, TOKEN))
    assert.are.equal(3, r.rc, r.err)
    assert.truthy(r.err:find("weft-run: rank 2 exited with code 3", 1, true), r.err)
    assert.are.equal(4, U.count(r.out, "ready %d"), r.out)   -- all had started
    assert.is_true(r.elapsed < 8, "took " .. r.elapsed .. " s")
  end)

  it("prints an error every rank raised once, with the list of ranks and one traceback", function()
    local r = U.run(("-n 3 tests/helpers/launcher_fold.lua same %s"):format(TOKEN))
    assert.are.equal(1, r.rc, r.err)
    assert.are.equal(1, U.count(r.err, "boom: every rank"), r.err)
    assert.truthy(r.err:find("[ranks 0-2] luajit: tests/helpers/launcher_fold.lua:", 1, true), r.err)
    assert.are.equal(1, U.count(r.err, "stack traceback:"), r.err)
    assert.truthy(r.err:find("weft-run: ranks 0-2 failed with this same error", 1, true), r.err)
    -- different errors are each shown, with their rank
    r = U.run(("-n 2 tests/helpers/launcher_fold.lua differ %s"):format(TOKEN))
    assert.truthy(r.err:find("%[rank0%] luajit: tests/helpers/launcher_fold%.lua:%d+: boom 0"), r.err)
    assert.truthy(r.err:find("%[rank1%] luajit: tests/helpers/launcher_fold%.lua:%d+: boom 1"), r.err)
    assert.are.equal(2, U.count(r.err, "stack traceback:"), r.err)
  end)

  it("shows once a weft warning every rank printed, and each rank's own", function()
    local r = U.run(("-n 4 tests/helpers/launcher_fold.lua warn %s"):format(TOKEN))
    assert.are.equal(0, r.rc, r.err)
    assert.are.equal(1, U.count(r.err, "weft: warning: shared by all"), r.err)
    for k = 0, 3 do
      assert.truthy(r.err:find(("[rank%d] weft: warning: rank %d only"):format(k, k), 1, true), r.err)
    end
    assert.are.equal(4, U.count(r.err, "not a warning"), r.err)   -- other lines as they come
  end)

  it("drops the unfinished line of a rank it stopped", function()
    local r = U.run(("-n 2 tests/helpers/launcher_fold.lua half %s"):format(TOKEN))
    assert.are.equal(3, r.rc, r.err)
    assert.truthy(r.err:find("weft-run: rank 0 exited with code 3", 1, true), r.err)
    assert.is_nil(r.err:find("[rank1] luajit", 1, true), r.err)
  end)

  it("escalates to SIGKILL for a rank that ignores SIGTERM", function()
    local r = U.run(("-n 3 %s fail=0 code=5 stubborn=1 %s"):format(RANKS, TOKEN))
    assert.are.equal(5, r.rc, r.err)
    assert.truthy(r.err:find("weft-run: rank 0 exited with code 5", 1, true), r.err)
    assert.truthy(r.err:find("rank 1 did not stop", 1, true), r.err)
    assert.is_true(r.elapsed < 8, "took " .. r.elapsed .. " s")
  end)

  it("stops the others when a rank is killed by SIGKILL", function()
    local r = U.run(("-n 3 %s kill=1 %s"):format(RANKS, TOKEN))
    assert.are_not.equal(0, r.rc)
    assert.are.equal(128 + 9, r.rc)
    assert.truthy(r.err:find("weft-run: rank 1 killed by signal 9", 1, true), r.err)
    assert.is_true(r.elapsed < 8, "took " .. r.elapsed .. " s")
  end)

  it("forwards SIGTERM to every rank and stops", function()
    local h = U.start(("-n 3 %s catch %s"):format(RANKS, TOKEN))
    local ready = U.wait_until(function() return U.count(h:out(), "ready %d") == 3 end, 20)
    assert.is_true(ready, h:out() .. h:err())
    os.execute("kill -TERM " .. h:pid())
    local rc = h:wait(20)
    local out, err = h:out(), h:err()
    h:cleanup()
    assert.are.equal(128 + 15, rc, err)
    for rank = 0, 2 do
      assert.truthy(out:find(("[rank%d] rank %d got signal 15"):format(rank, rank), 1, true), out)
    end
    assert.truthy(err:find("received SIGTERM", 1, true), err)
  end)

  it("forwards SIGINT to the whole process tree of each rank", function()
    local h = U.start(("-n 2 %s tree %s"):format(RANKS, TOKEN))
    local ready = U.wait_until(function() return U.count(h:out(), "child ready %d") == 2 end, 20)
    assert.is_true(ready, h:out() .. h:err())
    local t0 = U.now()
    os.execute("kill -INT " .. h:pid())
    local rc = h:wait(20)
    local err = h:err()
    h:cleanup()
    assert.are.equal(128 + 2, rc, err)
    assert.is_true(U.now() - t0 < 8)
  end)

  it("stops everything at --timeout and says so", function()
    local r = U.run(("-n 2 --timeout 1 %s %s"):format(RANKS, TOKEN))
    assert.are.equal(124, r.rc, r.err)
    assert.truthy(r.err:find("weft-run: timeout", 1, true), r.err)
    assert.is_true(r.elapsed < 8, "took " .. r.elapsed .. " s")
  end)

  it("reports a command that cannot be executed", function()
    local r = U.run("-n 2 -- /nonexistent/weft-cmd")
    assert.are.equal(127, r.rc)
    assert.truthy(r.err:find("cannot execute '/nonexistent/weft-cmd'", 1, true), r.err)
  end)

  describe("bad usage exits 2 with a clear message", function()
    local cases = {
      { "-n 0 " .. ENV, "-n/--nproc-per-node must be >= 1" },
      { "-n 2", "missing script" },
      { "", "missing script" },
      { "-n x " .. ENV, "-n/--nproc-per-node must be an integer" },
      { "--bogus " .. ENV, "unknown option --bogus" },
      { "-n 2 tests/helpers/no_such_script.lua", "cannot open script" },
      { "--nnodes 2 " .. ENV, "--master-port is required" },
      { "--nnodes 2 --node-rank 2 --master-port 1234 " .. ENV, "--node-rank must be < --nnodes" },
      { "-n 2 --", "missing command" },
    }
    for _, c in ipairs(cases) do
      it(("'%s'"):format(c[1]), function()
        local r = U.run(c[1])
        assert.are.equal(2, r.rc, r.err)
        assert.truthy(r.err:find("weft-run: " .. c[2], 1, true), r.err)
        assert.are.equal("", r.out)
      end)
    end
  end)

  it("prints help with -h", function()
    local r = U.run("-h")
    assert.are.equal(0, r.rc)
    assert.truthy(r.out:find("usage: weft-run", 1, true))
    assert.truthy(r.out:find("WEFT_NODE_RANK", 1, true))
  end)
end)

describe("weft-run's port reservation (launcher.free_port with keep)", function()
  it("holds the port against other binds while rank 0's store binds it", function()
    local ffi = require("ffi")
    local L = require("weft.tools.launcher")
    local store = require("weft.store")
    require("helpers.store_util")   -- its raw socket declarations (wst_*)
    local C = ffi.C
    local port, fd = L.free_port("127.0.0.1", true)
    assert.truthy(port and fd, tostring(fd))
    local function plain_bind(p)   -- a socket without SO_REUSEADDR on 127.0.0.1:p
      local s = C.wst_socket(2, 1, 0)
      local a = ffi.new("wst_sockaddr_in")
      a.family, a.port, a.addr = 2, bit.bor(bit.rshift(p, 8), bit.lshift(bit.band(p, 0xff), 8)), 0x0100007f
      local rc = C.wst_bind(s, a, ffi.sizeof(a))
      C.wst_close(s)
      return rc == 0
    end
    assert.is_false(plain_bind(port))   -- reserved: another job's bind fails
    local s = store.open({ server = true, port = port, timeout_ms = 2000 })
    assert.are.equal(port, s.port)
    local c = store.open({ port = port, timeout_ms = 2000 })
    c:set("k", "v")
    assert.are.equal("v", s:get("k", 1000))
    c:close()
    s:close()
    assert.is_false(plain_bind(port))   -- still held after the store closed
    C.close(fd)
    -- free once the reservation ends (the closed connections' TIME_WAIT
    -- still refuses a plain bind; a server, SO_REUSEADDR, takes it)
    store.open({ server = true, port = port, timeout_ms = 2000 }):close()
  end)
end)
