-- weft.init / weft.dist in one process: environment parsing and its errors,
-- the world of one rank and the bypass of every collective, model-parallel
-- getters on one rank, options validation, the policy table, shutdown.
local ROOT = os.getenv("PWD") or "."

-- runs a snippet in a fresh luajit with the given environment (RANK & co
-- cleared first); returns ok, output
local function sub(env, code)
  local vars = {}
  for k, v in pairs(env) do vars[#vars + 1] = ("%s='%s'"):format(k, v) end
  local cmd = ("env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT "
               .. "-u WEFT_TIMEOUT_MS %s LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' timeout -s KILL 30 luajit -e \"%s\" 2>&1; echo rc=$?")
              :format(table.concat(vars, " "), ROOT, ROOT, code)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return out:match("rc=0%s*$") ~= nil, out
end

describe("weft.dist", function()
  describe("environment", function()
    local cases = {
      { { RANK = "5", WORLD_SIZE = "4", MASTER_PORT = "1" }, "RANK=5 is not below WORLD_SIZE=4" },
      { { RANK = "x", WORLD_SIZE = "2" }, "RANK=\\\"x\\\" is not an integer" },
      { { RANK = "1" }, "RANK=1 is set but WORLD_SIZE is not" },
      { { RANK = "0", WORLD_SIZE = "2" }, "WORLD_SIZE=2 needs MASTER_PORT" },
      { { RANK = "0", WORLD_SIZE = "0" }, "WORLD_SIZE=0 is out of range" },
      { { WORLD_SIZE = "2", MASTER_PORT = "29640" }, "WORLD_SIZE=2 is set but RANK is not" },
      { { RANK = "1", WORLD_SIZE = "2", MASTER_PORT = "0" }, "WORLD_SIZE=2 needs MASTER_PORT (1..65535; and MASTER_ADDR) to find rank 0's store, not 0" },
      { { RANK = "0", WORLD_SIZE = "2", MASTER_PORT = "70000" }, "MASTER_PORT=70000 is out of range" },
      { { RANK = "0", WORLD_SIZE = "4", MASTER_PORT = "1", WEFT_STORE_MAX_CONNS = "3" },
        "WEFT_STORE_MAX_CONNS=3 is below WORLD_SIZE=4: every rank holds a connection to the store; set at least 4" },
      { { RANK = "1", WORLD_SIZE = "4", LOCAL_RANK = "3", LOCAL_WORLD_SIZE = "2", MASTER_PORT = "1" },
        "LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2" },
      { { WEFT_TIMEOUT_MS = "0" }, "WEFT_TIMEOUT_MS=\\\"0\\\" is not allowed: it takes an integer from 1 to 2147483647" },
      { { WEFT_TIMEOUT_MS = "-5" }, "WEFT_TIMEOUT_MS=\\\"-5\\\" is not allowed: it takes an integer from 1 to 2147483647" },
    }
    it("refuses a rank whose WORLD_SIZE is not rank 0's, at once, on both ranks", function()
      local port = 20000 + (os.time() * 7919) % 20000
      local r0 = io.popen(("env RANK=0 WORLD_SIZE=2 MASTER_PORT=%d WEFT_TIMEOUT_MS=20000 LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' "
                           .. "timeout -s KILL 30 luajit -e \"print(pcall(require('weft').init))\" 2>&1"):format(port, ROOT, ROOT))
      local t0 = os.time()
      local ok, out = sub({ RANK = "1", WORLD_SIZE = "3", MASTER_PORT = tostring(port), WEFT_TIMEOUT_MS = "20000" },
                          "require('weft').init()")
      local out0 = r0:read("*a"); r0:close()
      assert.is_false(ok, out)
      assert.is_truthy(out:find("started with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2", 1, true), out)
      assert.is_truthy(out0:find("false", 1, true) and out0:find("rank 1", 1, true), out0)
      assert.is_true(os.time() - t0 < 15, "both ended well before the 20 s timeout")
    end)

    for _, c in ipairs(cases) do
      it("refuses " .. c[2]:gsub("\\", ""), function()
        local ok, out = sub(c[1], "require('weft').init()")
        assert.is_false(ok, out)
        assert.is_truthy(out:find("weft: init: " .. c[2]:gsub("\\", ""), 1, true), out)
      end)
    end

    it("names the range parse_env wants when it has no upper end", function()
      local ok, out = sub({ WEFT_TIMEOUT_MS = "-5" }, "require('weft.dist').parse_env()")
      assert.is_false(ok, out)
      assert.is_truthy(out:find("weft: init: WEFT_TIMEOUT_MS=-5 is out of range (>= 1)", 1, true), out)
    end)

    it("reads the torchrun names, with defaults", function()
      local d = require("weft.dist")
      local ok, out = sub({ RANK = "3", WORLD_SIZE = "8", LOCAL_WORLD_SIZE = "4", MASTER_PORT = "1234",
                            WEFT_TIMEOUT_MS = "777", WEFT_HOST_BACKEND = "store" },
        "local e = require('weft.dist').parse_env(); print(e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr, e.master_port, e.timeout_ms, e.host_backend)")
      assert.is_true(ok, out)
      assert.matches("3\t8\t3\t4\t127.0.0.1\t1234\t777\tstore", out)
      ok, out = sub({}, "local e = require('weft.dist').parse_env(); print(e.rank, e.world_size, e.local_rank, e.timeout_ms)")
      assert.is_true(ok, out)
      assert.matches("0\t1\t0\t" .. d.DEFAULT_TIMEOUT_MS, out)
    end)

    it("runs a world of one from a bare environment, and a world of two through weft-run", function()
      local ok, out = sub({}, "local w = require('weft').init(); print(w.world_size, w.rank, w.unique_name)")
      assert.is_true(ok, out)
      assert.matches("1\t0\tworld", out)
      local p = io.popen(("timeout -s KILL 60 %s/scripts/weft-run -n 2 -- luajit -e \"local weft = require('weft'); "
        .. "local w = weft.init(); local x = weft.tensor.full({2}, w.rank + 1, 'f32'); w:all_reduce(x); "
        .. "print('sum', x:to_table()[1]); weft.shutdown()\" 2>&1; echo rc=$?"):format(ROOT))
      out = p:read("*a"); p:close()
      assert.matches("rc=0", out)
      assert.matches("%[rank0%] sum\t3", out)
      assert.matches("%[rank1%] sum\t3", out)
    end)
  end)

  describe("a world that is not tp x pp", function()
    -- the commonest mistake: the message points at the script's line and says
    -- which -n, or which tp / pp, would fit
    local script = os.tmpname() .. ".lua"
    setup(function()
      local f = assert(io.open(script, "w"))
      f:write('local weft = require("weft")\nweft.init()\nweft.initialize_model_parallel{tp = 2, pp = 2}\nweft.shutdown()\n')
      f:close()
    end)
    teardown(function() os.remove(script) end)
    local function run(cmd)
      local p = io.popen(("cd %s && %s 2>&1; echo rc=$?"):format(ROOT, cmd))
      local out = p:read("*a"); p:close()
      return out
    end

    it("under weft-run: the -n that fits, or the tp / pp that fit the ranks started", function()
      local out = run(("timeout -s KILL 60 scripts/weft-run -n 3 %s"):format(script))
      assert.matches(script .. ":3: weft: initialize_model_parallel: world_size (3) is not equal to tp (2) x pp (2) = 4: "
                     .. "use scripts/weft-run -n 4 " .. script .. ", or for 3 ranks tp = 3 pp = 1\n", out, 1, true)
      assert.is_nil(out:find("rc=0", 1, true), out)
      out = run(("timeout -s KILL 60 scripts/weft-run -n 8 %s"):format(script))
      assert.matches(script .. ":3: weft: initialize_model_parallel: world_size (8) is not equal to tp (2) x pp (2) = 4: "
                     .. "use scripts/weft-run -n 4 " .. script .. ", or for 8 ranks pp = 4 or tp = 4\n", out, 1, true)
      -- in the REPL: its own command line
      out = run("printf 'weft.initialize_model_parallel{tp = 2, pp = 2}\\n' | timeout -s KILL 60 scripts/weft-run -n 3 --repl")
      assert.matches("error: stdin:1: weft: initialize_model_parallel: world_size (3) is not equal to tp (2) x pp (2) = 4: "
                     .. "use scripts/weft-run -n 4 --repl, or for 3 ranks tp = 3 pp = 1\n", out, 1, true)
    end)

    it("without the launcher: initialize_model_parallel initializes a world of one on purpose, and says to launch", function()
      local out = run(("env -u WORLD_SIZE -u RANK LUA_PATH='lua/?.lua;lua/?/init.lua;;' luajit %s"):format(script))
      assert.matches(script .. ":3: weft: initialize_model_parallel: world_size (1) is not equal to tp (2) x pp (2): "
                     .. "this process runs alone (no launcher environment); start 4 ranks with scripts/weft-run -n 4 "
                     .. script .. "\n", out, 1, true)
    end)
  end)

  describe("one process", function()
    local weft = require("weft")
    local T = weft.tensor

    teardown(function() weft.shutdown() end)

    it("validates init options", function()
      assert.has_error(function() weft.init { foo = 1 } end, "weft: init: unknown option \"foo\" (timeout_ms, backend)")
      assert.has_error(function() weft.init { backend = "carrier-pigeon" } end,
                       "weft: init: unknown backend \"carrier-pigeon\" (auto, shm, store, gloo, hier)")
      for _, v in ipairs { -5, 0 / 0, 1 / 0, 2 ^ 40, 1.5, "100" } do
        local ok, err = pcall(weft.init, { timeout_ms = v })
        assert.is_false(ok); assert.matches("timeout_ms must be a whole number of milliseconds in 1..2147483647", err)
      end
      assert.is_false(weft.is_initialized())
    end)

    it("gives a world group of one with the seed's properties", function()
      local w = weft.init()
      assert.are.equal(w, weft.init())
      assert.are.equal(w, weft.world())
      assert.are.equal(0, w.rank); assert.are.same({ 0 }, w.ranks)
      assert.are.equal(1, w.world_size); assert.are.equal(0, w.rank_in_group); assert.are.equal(0, w.local_rank)
      assert.are.equal(0, w.first_rank); assert.are.equal(0, w.last_rank)
      assert.is_true(w.is_first_rank); assert.is_true(w.is_last_rank)
      assert.are.equal(0, w.next_rank); assert.are.equal(0, w.prev_rank)
      assert.are.equal("world", w.unique_name)
      assert.is_nil(w.cpu_group); assert.is_nil(w.device_group)
      assert.are.equal(1, weft.world_size()); assert.are.equal(0, weft.world_rank())
      assert.matches("GroupCoordinator%(world: ranks={0}", tostring(w))
    end)

    it("bypasses every collective on a world of one", function()
      local w = weft.world()
      local x = T.from_table({ 1, 2, 3, 4 }, "f32", { 2, 2 })
      assert.are.equal(x, w:all_reduce(x))
      assert.are.same({ 1, 2, 3, 4 }, x:to_table())
      assert.are.same({ 1, 2, 3, 4 }, w:all_gather(x, 1):to_table())
      assert.are.same({ 1, 2, 3, 4 }, w:reduce_scatter(x, 0):to_table())
      assert.are.equal(x, w:broadcast(x, 0))
      assert.are.equal(x, w:gather(x, 0))
      local out = T.empty({ 2, 2 }, "f32")
      w:all_to_all_single(out, x)
      assert.are.same({ 1, 2, 3, 4 }, out:to_table())
      w:barrier()
      local obj = { a = 1 }
      assert.are.equal(obj, w:broadcast_object(obj))
      assert.are.same({ obj }, w:all_gather_object(obj))
      local d = { t = x }
      assert.are.equal(d, w:broadcast_tensor_dict(d))
      assert.is_nil(w:recv_tensor_dict())
      local y, r = w:fused_allreduce_rmsnorm(x, T.zeros({ 2, 2 }, "f32"), T.ones({ 2 }, "f32"), 0)
      local v = y:to_table()
      assert.is_true(math.abs(v[1] - 1 / math.sqrt(2.5)) < 1e-6)
      assert.are.same({ 1, 2, 3, 4 }, r:to_table())
      -- validation still applies on a group of one
      assert.has_error(function() w:broadcast(x, 1) end)
      -- a rank given as a string is named as one, not as "rank 0 is out of range" (issue 37)
      local ok, err = pcall(w.broadcast, w, x, "0")
      assert.is_false(ok)
      assert.matches('weft: broadcast: src must be an integer rank of group world (0..0), got the string "0"', err, 1, true)
      ok, err = pcall(weft.create_custom_group, { "0" })
      assert.is_false(ok)
      assert.matches('weft: create_custom_group: ranks must be integers, got the string "0" at index 1', err, 1, true)
      ok, err = pcall(w.all_gather, w, x, "1")
      assert.is_false(ok)
      assert.matches('dim the string "1" is invalid', err, 1, true)
      assert.has_error(function() w:all_reduce(x:transpose(0, 1)) end)
    end)

    it("refuses an output that overlaps its input in part, on every collective, before anything runs (issue 37)", function()
      local w = weft.world()
      local base = T.from_table({ 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3 }, "f32", { 12 })
      local function snapshot() return base:to_table() end
      local before = snapshot()
      local x, out = base:narrow(0, 0, 8), base:narrow(0, 4, 8)
      local function refused(what, f, ...)
        local args = { ... }
        local ok, err = pcall(function() f(unpack(args)) end) -- not a tail call: the line is kept
        assert.is_false(ok, what)
        assert.matches("overlap in part", err, 1, true)
        assert.matches("results would be silently wrong (group world)", err, 1, true)
        assert.matches("dist_spec.lua", err, 1, true) -- raised at the caller's line
        assert.are.same(before, snapshot(), what) -- nothing written
        return err
      end
      local err = refused("all_reduce", w.all_reduce, w, x, "sum", out)
      assert.matches("weft: all_reduce: input and output overlap in part (output {8} of 32 bytes starts at "
                     .. "byte 16 of input {8} of 32 bytes): they must be the same memory (in place) or not "
                     .. "share memory at all", err, 1, true)
      -- in place (the same memory, another view of it) and apart still work
      assert.are.equal(x, w:all_reduce(x, "sum", base:narrow(0, 0, 8)) and x)
      assert.are.same({ 1, 1, 1, 1 }, w:all_reduce(base:narrow(0, 0, 4), "sum", base:narrow(0, 8, 4)):to_table())
      base:copy_(T.from_table(before, "f32", { 12 }))
      -- gathers and scatters: the one allowed place is this rank's block
      local g2 = base:narrow(0, 2, 4)
      refused("all_gather", w.all_gather, w, g2, 0, base:narrow(0, 0, 4))
      refused("all_gather_into_tensor", w.all_gather_into_tensor, w, base:narrow(0, 0, 4), base:narrow(0, 2, 4))
      assert.are.same({ 1, 1, 1, 1 }, w:all_gather(base:narrow(0, 0, 4), 0, base:narrow(0, 0, 4)):to_table())
      refused("reduce_scatter", w.reduce_scatter, w, base:narrow(0, 0, 4), 0, base:narrow(0, 2, 4))
      refused("all_gatherv", w.all_gatherv, w, g2, { 4 }, base:narrow(0, 0, 4))
      refused("reduce_scatterv", w.reduce_scatterv, w, g2, base:narrow(0, 0, 4), { 4 })
      refused("all_to_all_single", w.all_to_all_single, w, base:narrow(0, 0, 4), base:narrow(0, 2, 4))
      local async = require("weft.async")
      refused("all_gather_async", async.all_gather, w, g2, 0, base:narrow(0, 0, 4))
      refused("reduce_scatter_async", async.reduce_scatter, w, base:narrow(0, 0, 4), 0, base:narrow(0, 2, 4))
      -- fused: outputs in place over the input or apart, never across the weight
      local m = T.from_table({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 }, "f32", { 12 })
      before = m:to_table()
      local mx, mres, mw = m:narrow(0, 0, 2):view({ 1, 2 }), m:narrow(0, 2, 2):view({ 1, 2 }), m:narrow(0, 4, 2)
      for _, o in ipairs({ { norm_out = m:narrow(0, 1, 2):view({ 1, 2 }) },
                           { residual_out = m:narrow(0, 3, 2):view({ 1, 2 }) },
                           { norm_out = m:narrow(0, 4, 2):view({ 1, 2 }) },
                           { norm_out = m:narrow(0, 8, 2):view({ 1, 2 }), residual_out = m:narrow(0, 9, 2):view({ 1, 2 }) } }) do
        local ok, e = pcall(w.fused_allreduce_rmsnorm, w, mx, mres, mw, 1e-6, o)
        assert.is_false(ok)
        assert.matches("weft: fused_allreduce_rmsnorm: .* overlap in part", e)
        assert.are.same(before, m:to_table())
      end
      -- the other fusion patterns (weft.fusion_ext) go through the same check
      local ok, e = pcall(w.fused_allreduce_prepost_rmsnorm, w, mx, mres, mw, mw, 1e-6,
                          { norm_out = m:narrow(0, 1, 2):view({ 1, 2 }) })
      assert.is_false(ok)
      assert.matches("weft: fused_allreduce_prepost_rmsnorm: input and norm_out overlap in part", e, 1, true)
      assert.are.same(before, m:to_table())
      w:fused_allreduce_rmsnorm(mx, mres, mw, 1e-6, { norm_out = mx, residual_out = mres }) -- in place
    end)

    it("builds every model-parallel group on one rank, aliased as the seed does", function()
      assert.is_false(weft.model_parallel_is_initialized())
      assert.is_nil(weft.initialize_model_parallel {})   -- returns (and so prints) nothing
      local plan = weft.plan()
      assert.are.equal(1, plan.world_size)
      assert.truthy(tostring(plan):find("^world_size 1: tp=1"), tostring(plan))
      assert.is_true(weft.model_parallel_is_initialized())
      for _, k in ipairs({ "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp" }) do
        assert.are.equal(1, weft[k]().world_size)
        assert.are.equal(1, weft[k .. "_size"]())
        assert.are.equal(0, weft[k .. "_rank"]())
      end
      assert.are.equal(weft.tp(), weft.attn_tp())
      assert.are.equal(weft.tp(), weft.moe_tp())
      assert.are_not.equal(weft.tp(), weft.pp())
      assert.are.equal("tp.0", weft.tp().unique_name)
      assert.are.equal(weft.tp(), weft.get_tp_group())
      assert.are.equal(1, weft.get_tensor_model_parallel_world_size())
      assert.are.equal(plan, weft.plan())
      local tp = weft.tp()
      weft.destroy_model_parallel()
      assert.is_true(tp.destroyed)
      assert.is_false(weft.model_parallel_is_initialized())
      assert.has_error(function() weft.pp() end)
    end)

    it("re-exports the submodules and reports CUDA availability as a boolean", function()
      assert.are.equal(require("weft.tensor"), weft.tensor)
      assert.are.equal(require("weft.topology"), weft.topology)
      assert.are.equal(require("weft.policy"), weft.policy)
      assert.are.equal(require("weft.serialize"), weft.serialize)
      assert.are.equal("boolean", type(weft.cuda_available()))
      assert.is_true(weft.now_us() > 0)
    end)

    it("explains and extends the dispatch table", function()
      local policy = weft.policy
      local w = weft.world()
      local x = T.zeros({ 8, 16 }, "bf16")
      assert.are.equal("bypass", (policy.select(w, "all_reduce", x)))
      assert.matches("all_reduce bf16 {8,16} %(256 B, cpu%) on world %(1 ranks%): bypass", policy.explain(w, x))
      -- a two-rank stand-in: the host rules
      local g = { world_size = 2, same_node = true, unique_name = "fake" }
      assert.are.equal("shm", (policy.select(g, "all_reduce", x)))
      assert.are.equal("shm_gather", (policy.select(g, "all_reduce", T.zeros({ 2 }, "u8"))))
      assert.are.equal("shm_gather", (policy.select(g, "all_reduce", x, "prod")))
      assert.are.equal("shm", (policy.select(g, "all_gather", T.zeros({ 2 }, "u8"))))
      g.same_node = false
      -- across nodes: Gloo where weft was built with it (hierarchical where a
      -- node has several ranks; the store for small all-reduces with one
      -- rank per node), else the store path
      if require("weft.backends.host_nodes").built then
        local big = T.zeros({ 1024, 1024 }, "bf16")
        assert.are.equal("gloo", (policy.select(g, "all_reduce", x)))           -- small: Gloo's small path
        g.world_size = 3                                                          -- no small path there:
        assert.are.equal("store", (policy.select(g, "all_reduce", x)))          -- small, one rank per node
        g.world_size = 2
        assert.are.equal("gloo", (policy.select(g, "all_reduce", big)))
        assert.are.equal("gloo", (policy.select(g, "broadcast", x)))
        g.node_count = 1   -- the stand-in's layout: fewer nodes than ranks
        assert.are.equal("gloo_hier", (policy.select(g, "all_reduce", big)))
        -- small and a power-of-two group: flat Gloo's small path beats the hierarchy
        assert.are.equal("gloo", (policy.select(g, "all_reduce", x)))
        assert.matches("flat Gloo takes its small path", policy.explain(g, x), 1, true)
        g.world_size = 3   -- no small path: the ring would run, the hierarchy wins
        assert.are.equal("gloo_hier", (policy.select(g, "all_reduce", x)))
        g.world_size = 2
        assert.are.equal("gloo", (policy.select(g, "all_reduce", big, "prod")))   -- shm does not reduce prod
        assert.are.equal("gloo", (policy.select(g, "reduce_scatter", big)))
        g.host_backend = "gloo"
        assert.are.equal("gloo", (policy.select(g, "all_reduce", big)))
        g.host_backend = "hier"
        assert.are.equal("gloo_hier", (policy.select(g, "all_reduce", x)))
        g.host_backend, g.node_count = nil, nil
        big:free()
      else
        assert.are.equal("store", (policy.select(g, "all_reduce", x)))
      end
      g.same_node, g.host_backend = true, "store"
      assert.are.equal("store", (policy.select(g, "broadcast", x)))
      g.host_backend = nil
      -- a device tensor: a device rule (weft.backends.device_backends; no_device_backend
      -- without CUDA), then a rule added ahead of it, then removed again
      local dev = { dtype = "bf16", shape = { 4 }, nbytes = 8, device = "cuda:0" }
      local before = policy.select(g, "all_reduce", dev)
      assert.is_truthy(({ no_device_backend = true, nccl = true, custom_ar = true })[before], tostring(before))
      policy.add_rule { name = "test device", backend = "test_dev", why = "a test",
                        when = function(_, _, t) return t.device ~= "cpu" end }
      assert.are.equal("test_dev", (policy.select(g, "all_reduce", dev)))
      assert.matches("test_dev — a test", policy.explain(g, dev))
      assert.is_true(policy.remove_rule("test device"))
      assert.are.equal(before, (policy.select(g, "all_reduce", dev)))
    end)

    it("shuts down and starts again", function()
      weft.shutdown()
      assert.is_false(weft.is_initialized())
      local w = weft.init()
      assert.are.equal(1, w.world_size)
      weft.shutdown()
      weft.shutdown()
    end)
  end)
end)
