-- weft.async (src/async.c, lua/weft/async.lua): the progress worker, handles
-- that test without blocking and wait with a bound, errors carried from the
-- worker thread to the caller's, fork and Lua-VM safety, and every async
-- collective with real processes (shared memory and the store path).
local ROOT = os.getenv("PWD") or "."
local U = require("helpers.spec_util")
local ffi = require("ffi")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")

local sh = U.shell

local function luajit(script, env)
  return sh(("%s LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' timeout -s KILL 60 luajit %s/tests/helpers/%s")
            :format(env or "", ROOT, ROOT, ROOT, script))
end

local function ranks(n, env)
  return sh(("WEFT_TIMEOUT_MS=20000 %s timeout -s KILL 150 %s/scripts/weft-run -n %d --timeout 140 %s/tests/helpers/serve_async_ranks.lua")
            :format(env or "", ROOT, n, ROOT))
end

local count_ok = U.count_ok

describe("weft.async", function()
  local async, wffi, C, store_mod

  setup(function()
    async = require("weft.async")
    wffi = require("weft.internal.ffi")
    C = wffi.C
    store_mod = require("weft.store")
  end)

  describe("loading", function()
    it("require('weft') starts no thread, opens no socket, loads no CUDA", function()
      local out, rc = luajit("serve_require.lua")
      assert.are.equal(0, rc, out)
      local tb, ta, sb, sa = out:match("tasks_before=(%d+) tasks_after=(%d+) sockets_before=(%d+) sockets_after=(%d+)")
      assert.are.equal("1", tb, out)
      assert.are.equal("1", ta, out)
      assert.are.equal(sb, sa, out)
      assert.are.equal("0", sa, out)
      assert.truthy(out:find("cuda_module=false", 1, true), out)
      assert.truthy(out:find("initialized=false", 1, true), out)
    end)

    it("a queue makes no thread until its first operation", function()
      local g = { unique_name = "lazy", timeout_ms = 5000 }
      async.queue(g)
      assert.is_false(async.stats(g).started)
      assert.is_true(async.nop(g):wait())
      assert.is_true(async.stats(g).started)
      async.close(g)
    end)

    it("two Lua VMs in one process, and a second copy of weft in one VM, stay independent", function()
      local out, rc = luajit("serve_vms.lua")
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("OK two VMs", 1, true), out)
      assert.truthy(out:find("OK second copy", 1, true), out)
    end)

    it("a queue started before fork() refuses work in the child, clearly", function()
      local out, rc = luajit("serve_fork.lua")
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("child refused: .*before fork%(%)"), out)
      assert.truthy(out:find("child_status=0", 1, true), out)
    end)
  end)

  describe("handles (one process)", function()
    local s, c, g

    before_each(function()
      s = store_mod.open { server = true, port = 0, timeout_ms = 5000 }
      c = store_mod.open { host = "127.0.0.1", port = s.port, timeout_ms = 5000 }
      g = { unique_name = "h", timeout_ms = 5000 }
    end)
    after_each(function()
      async.close(g)
      c:close(); s:close()
    end)

    local function get_async(key, timeout_ms)
      local d = async._desc(g, "store_get")
      d.kind, d.comm, d.key, d.timeout_ms = async.KINDS.STORE_GET, s.handle, key, timeout_ms or 5000
      return async._submit(g, "store_get", nil, function(h)
        local p, _, _, n = async.result_bytes(h)
        return ffi.string(p, n)
      end)
    end

    it("test() never blocks; wait() returns the result once the key is set", function()
      local h = get_async("k")
      assert.is_false(h:test())          -- nobody has set k: cannot be done
      assert.is_false(h:test())
      c:set("k", "v1")                    -- a second handle: the worker holds s's mutex
      assert.are.equal("v1", h:wait())
      assert.is_true(h:test())
      assert.are.equal("v1", h.result)
    end)

    it("wait(timeout) on a running operation raises 'not done' and leaves it running", function()
      local h = get_async("k2")
      local ok, err = pcall(h.wait, h, 30)
      assert.is_false(ok)
      assert.truthy(err:find("weft: store_get: group h: async store get on queue 'h': not done after 30 ms", 1, true), err)
      assert.are.equal("pending", h.state)
      c:set("k2", "later")
      assert.are.equal("later", h:wait())
    end)

    it("an error on the worker thread is raised on the caller's, with its message", function()
      local h = get_async("never", 50)
      local ok, err = pcall(h.wait, h)
      assert.is_false(ok)
      assert.truthy(err:find("timed out after 50 ms", 1, true), err)
      assert.truthy(err:find("'never'", 1, true), err)
      -- the thread-local last error of this thread now carries it
      assert.truthy(wffi.last_error():find("timed out after 50 ms", 1, true), wffi.last_error())
      local ok2, err2 = pcall(h.test, h)
      assert.is_false(ok2)
      assert.are.equal(err, err2)
      assert.are.equal(1, async.stats(g).failed)
    end)

    it("operations run in submission order, one at a time", function()
      local h1 = get_async("a")
      local h2 = get_async("b")
      c:set("b", "B")                      -- b is there, but h2 waits behind h1
      assert.is_false(h2:test())
      c:set("a", "A")
      assert.are.equal("B", h2:wait())
      assert.is_true(h1:test())
      local t1, t2 = h1:times(), h2:times()
      assert.is_true(t2.start >= t1.finish)
    end)

    it("poll_wait yields to the caller between tests", function()
      local h = get_async("p")
      local yields = 0
      local v = async.poll_wait(h, function(i)
        yields = i
        if i == 3 then c:set("p", "polled") end
      end)
      assert.are.equal("polled", v)
      assert.is_true(yields >= 3)
    end)

    it("poll_wait gives up after its bound with a clear message", function()
      local h = get_async("q", 5000)
      local ok, err = pcall(async.poll_wait, h, function() C.weft_async_wait(h._c, 5) end, 40)
      assert.is_false(ok)
      assert.truthy(err:find("not done within 40 ms of polling", 1, true), err)
      c:set("q", "x")
      assert.are.equal("x", h:wait())
    end)

    it("destroying a queue fails what has not started and waits for the running one", function()
      local q = async.queue(g)
      local h1 = get_async("slow", 200)   -- runs (and times out) on the worker
      for _ = 1, 2000 do                   -- until the worker has taken it (bounded)
        if h1:times().start > 0 then break end
        ffi.C.poll(nil, 0, 1)
      end
      assert.is_true(h1:times().start > 0)
      local d = async._desc(g, "nop")
      d.kind = async.KINDS.NOP
      local h2 = async._submit(g, "nop", nil, nil, true)
      -- the C queue directly (the Lua close would drain first)
      local raw = q.handle
      q.handle = nil
      ffi.gc(raw, nil)
      assert.are.equal(0, C.weft_async_queue_destroy(raw))
      local ok, err = pcall(h2.wait, h2)
      assert.is_false(ok)
      assert.truthy(err:find("destroyed before it ran", 1, true), err)
      local ok1, err1 = pcall(h1.wait, h1)
      assert.is_false(ok1)
      assert.truthy(err1:find("timed out after 200 ms", 1, true), err1)
      g._async = nil
    end)

    it("keeps no settled handles around (a long-running server's queue stays small)", function()
      for _ = 1, 500 do async.poll_wait(async.nop(g), function() end) end
      local q = async.queue(g)
      assert.is_true(q.tail - q.head + 1 <= 1, ("%d handles remembered"):format(q.tail - q.head + 1))
      assert.are.equal(0, async.pending(g))
      assert.is_nil(next(q.live))
    end)

    it("refuses bad descriptors", function()
      local d = async._desc(g, "x")
      d.kind = 9999
      local ok, err = pcall(async._submit, g, "x")
      assert.is_false(ok)
      assert.truthy(err:find("unknown operation kind 9999", 1, true), err)
      d = async._desc(g, "x")
      d.kind = async.KINDS.SHM_ALL_REDUCE
      ok, err = pcall(async._submit, g, "x")
      assert.is_false(ok)
      assert.truthy(err:find("NULL communicator", 1, true), err)
    end)

    it("store_get / store_wait step through polls", function()
      local n = 0
      local v = async.store_get(c, "sg", function(i) n = i; if i == 2 then s:set("sg", "ok") end end, 5000)
      assert.are.equal("ok", v)
      assert.are.equal(2, n)
      async.store_wait(c, { "sg" }, function() error("must not poll") end, 5000)
      local ok, err = pcall(async.store_get, c, "missing", function() end, 20)
      assert.is_false(ok)
      assert.truthy(err:find("key \"missing\" not set within 20 ms", 1, true), err)
    end)
  end)

  describe("process exit", function()
    -- exit() while a worker is inside an operation: the library's exit
    -- handler stops the worker (queued work failed, the running one awaited
    -- with a bound) before the runtime's static destructors run.
    local prog = [[
local ffi = require("ffi"); local C = require("weft.internal.ffi").C
local q = ffi.new("weft_async_queue *[1]"); assert(C.weft_async_queue_create("exitq", q) == 0)
local d = ffi.new("weft_async_desc"); d.kind = C.WEFT_ASYNC_SLEEP; d.count = %d
local h = ffi.new("weft_async *[1]"); assert(C.weft_async_submit(q[0], d, h) == 0)
d.kind = C.WEFT_ASYNC_NOP; assert(C.weft_async_submit(q[0], d, h) == 0)
ffi.cdef "int poll(void *, unsigned long, int);"; C.poll(nil, 0, 50)
io.stdout:write("SUBMITTED\n"); io.stdout:flush()
%s
]]
    local function run(ms, tail, env)
      local f = os.tmpname()
      local fh = io.open(f, "w"); fh:write(prog:format(ms, tail)); fh:close()
      local out, rc = sh(("%s LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' timeout -s KILL 60 luajit %s")
                         :format(env or "", ROOT, ROOT, f))
      os.remove(f)
      return out, rc
    end

    it("waits for the running operation at exit (os.exit without closing the state)", function()
      local out, rc = run(300, "os.exit(0)")
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("SUBMITTED", 1, true), out)
      assert.falsy(out:find("abandoned", 1, true), out)
    end)

    it("abandons a worker still busy after WEFT_ASYNC_EXIT_MS, and exits", function()
      local out, rc = run(20000, "os.exit(0)", "WEFT_ASYNC_EXIT_MS=100")
      assert.are.equal(0, rc, out)
      assert.truthy(out:find("async queue 'exitq': the progress worker is still inside an operation at exit", 1, true), out)
    end)

    it("an error with host all-reduces in flight: the state closes without freeing under the worker (8 runs)", function()
      for i = 1, 8 do
        local out, rc = sh(("WEFT_TIMEOUT_MS=20000 timeout -s KILL 60 %s/scripts/weft-run -n 2 --timeout 50 "
                            .. "%s/tests/helpers/async_exit_error_ranks.lua"):format(ROOT, ROOT))
        assert.is_nil(out:find("killed by signal", 1, true), ("run %d: %s"):format(i, out))
        assert.is_truthy(out:find("boom: an error with operations in flight", 1, true), out)
        assert.are_not.equal(0, rc, out)
      end
    end)

    it("end of script (lua_close runs the queue's finalizer, then exit)", function()
      local out, rc = run(200, "q = nil; h = nil")
      assert.are.equal(0, rc, out)
      assert.falsy(out:find("abandoned", 1, true), out)
    end)
  end)

  describe("install", function()
    it("adds _async methods, keeps error levels at the caller, and is idempotent", function()
      local group = require("weft.group")
      local G = group.GroupCoordinator
      async.install(G, group)
      async.install(G, group)
      assert.are.equal(async.all_reduce, G.all_reduce_async)
      local n = 0
      for _, f in ipairs(group.destroy_hooks) do if f == async.close then n = n + 1 end end
      assert.are.equal(1, n)
      local g = group.new { name = "solo", ranks = { 0 }, rank = 0, timeout_ms = 1000 }
      local t = require("weft.tensor").from_table({ 1, 2 }, "f32", { 2 })
      assert.are.equal(t, g:all_reduce_async(t):wait())
      local ok, err = pcall(function() g:all_reduce(t, "bogus") end)
      assert.is_false(ok)
      assert.truthy(err:find("async_spec.lua", 1, true), "error level points at the caller: " .. err)
      g:destroy()
    end)
  end)

  describe("device collectives", function()
    it("NCCL all-reduce on the worker and the served engine on device tensors #gpu", function()
      local cuda = require("weft.cuda")
      if cuda.device_count() < 2 then
        pending(cuda.available() and "needs 2 CUDA devices" or "no CUDA device")
        return
      end
      local out, rc = sh(("WEFT_ROOT=%s WEFT_TIMEOUT_MS=60000 timeout -s KILL 400 %s/scripts/weft-run -n 2 --timeout 360 %s/tests/helpers/serve_gpu_ranks.lua")
                         :format(ROOT, ROOT, ROOT))
      assert.are.equal(0, rc, out)
      assert.are.equal(8, count_ok(out), out)
    end)
  end)

  describe("collectives with real processes", function()
    it("a tensor in use by a pending operation is never read or written: its methods and other groups refuse it", function()
      local out, rc = sh(("WEFT_TIMEOUT_MS=20000 timeout -s KILL 100 %s/scripts/weft-run -n 2 --timeout 90 "
                          .. "%s/tests/helpers/async_pin_ranks.lua"):format(ROOT, ROOT))
      assert.are.equal(0, rc, out)
      local n = 0
      for _ in out:gmatch("OK pinned ") do n = n + 1 end
      assert.are.equal(2 * 13, n, out)
    end)
    for _, case in ipairs({ { n = 2 }, { n = 3 }, { n = 3, env = "WEFT_HOST_BACKEND=store" } }) do
      it(("every async collective on %d ranks%s"):format(case.n, case.env and " (store path)" or ""), function()
        local out, rc = ranks(case.n, case.env)
        assert.are.equal(0, rc, out)
        assert.are.equal(14 * case.n, count_ok(out), out)
      end)
    end
  end)
end)
