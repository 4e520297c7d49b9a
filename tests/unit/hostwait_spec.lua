-- The adaptive host wait (src/core/wait.c) and the Lua call path of a host
-- all-reduce, across real processes (tests/helpers/hostwait_ranks.lua):
-- a rank waiting for a late peer sleeps instead of burning its core (the
-- CPU time it used while waiting, 2 ranks and 8 ranks on this machine's
-- CPUs, shm barrier and mq reader); a rank that never comes fails the other
-- at the timeout, named; an armed interrupt (Ctrl-C's fd) ends a wait for a
-- rank that never comes; a dead peer is named within a second;
-- 10^5 group:all_reduce calls on a host tensor allocate nothing per call,
-- never consult the policy table, and every argument check still refuses.
-- (A spinning waiter would use most of the 1.5 s, and still far over 100 ms
-- at an eighth of a CPU on a crowded machine.) No speed is asserted here:
-- bench-host measures it (--load busy included).
local util = require("helpers.store_util")
local spec = require("helpers.spec_util")

local WORKER = "tests/helpers/hostwait_ranks.lua"

local function run(n, mode, env, limit)
  env = env or {}
  env.HW_MODE = mode
  return util.run_ranks(n, WORKER, env, limit or 120)
end

local function report(res, r, tag)
  return spec.report_of(spec.lines_of(res[r].out), tag)
end

local function all_ok(n, res)
  for r = 0, n - 1 do
    assert.are.equal(0, res[r].rc, ("rank %d failed:\n%s"):format(r, res[r].out))
    assert.is_truthy(res[r].out:find("OK rank " .. r, 1, true), res[r].out)
  end
end

describe("host waits", function()
  it("group:all_reduce on a host tensor: no allocation per call, the memoized dispatch, every check (2 ranks)", function()
    all_ok(2, run(2, "callpath"))
  end)

  for _, n in ipairs { 2, 8 } do
    it(("ranks waiting 1.5 s for a late rank sleep: under 100 ms of CPU each (%d ranks, shm and mq)"):format(n), function()
      local res = run(n, "idle", { HW_LATE_MS = 1500 })
      all_ok(n, res)
      for r = 0, n - 2 do
        local g = report(res, r, "IDLE_SHM")
        assert.is_truthy(g, res[r].out)
        local cpu = tonumber(g.msg:match("cpu_ms=(%d+)"))
        assert.is_true(g.ms >= 1000, ("rank %d did not wait (%d ms)"):format(r, g.ms))
        assert.is_true(cpu < 100, ("rank %d used %d ms of CPU waiting %d ms (shm)"):format(r, cpu, g.ms))
      end
      for r = 1, n - 1 do
        local g = report(res, r, "IDLE_MQ")
        assert.is_truthy(g, res[r].out)
        local cpu = tonumber(g.msg:match("cpu_ms=(%d+)"))
        assert.is_true(cpu < 100, ("rank %d used %d ms of CPU waiting %d ms (mq)"):format(r, cpu, g.ms))
      end
    end)
  end

  it("an armed interrupt (a byte on the fd, as Ctrl-C on the REPL's signalfd) ends a wait for a rank that never comes", function()
    local res = run(2, "interrupt", { HW_LATE_MS = 3000, HW_TIMEOUT_MS = 20000 })
    local g = report(res, 0, "INTERRUPT")
    assert.is_truthy(g, res[0].out)
    assert.are.equal("false", g.ok)
    assert.is_true(g.ms < 1000, ("interrupted after %d ms"):format(g.ms))
    assert.is_truthy(g.msg:find("interrupted (Ctrl-C)", 1, true), g.msg)
    assert.is_truthy(g.msg:find("all_reduce", 1, true), g.msg)
    local p = report(res, 1, "INTERRUPT_PEER")
    assert.is_truthy(p, res[1].out)
    assert.are.equal("false", p.ok)
    assert.is_truthy(p.msg:find("aborted", 1, true), p.msg)
  end)

  it("a rank that never comes: the other fails at the timeout naming it (2 ranks: the spinning path)", function()
    local tmo = 2000
    local res = run(2, "late", { HW_LATE_MS = 4000, HW_TIMEOUT_MS = tmo })
    local g = report(res, 0, "LATE")
    assert.is_truthy(g, res[0].out)
    assert.are.equal("false", g.ok)
    assert.is_true(g.ms >= tmo - 100 and g.ms < tmo + 1000, ("failed after %d ms"):format(g.ms))
    assert.is_truthy(g.msg:find("timed out after 2000 ms", 1, true), g.msg)
    assert.is_truthy(g.msg:find("rank 1 (global 1, pid", 1, true), g.msg)
    assert.is_truthy(g.msg:find("all_reduce", 1, true), g.msg)
  end)

  it("a peer that dies while the others wait is named within a second (3 ranks)", function()
    local n = 3
    local res = run(n, "dead", { HW_LATE_MS = 300, HW_TIMEOUT_MS = 20000 })
    for r = 0, n - 2 do
      local g = report(res, r, "DEAD")
      assert.is_truthy(g, res[r].out)
      assert.are.equal("false", g.ok)
      assert.is_true(g.ms < 300 + 1000, ("rank %d named the dead peer after %d ms"):format(r, g.ms))
      assert.is_truthy(g.msg:find("rank 2 (global 2, pid", 1, true), g.msg)
      assert.is_truthy(g.msg:find("died", 1, true), g.msg)
    end
  end)
end)

-- The spin the Gloo shim's small path runs on its partner's socket before
-- blocking in the read (wf_wait_spin_on): never a yield, stops once the
-- thread lost its CPU, adapts within its bounds (tests/c/wait_spin_test.c).
-- Its bounds across nodes (a stalled rank fails the others at the timeout,
-- a killed one is named) are in tests/faults/fault_nodes_spec.lua.
describe("the Gloo small path's socket spin (tests/c/wait_spin_test.c)", function()
  local run_c = spec.c_test("wait_spin_test", 60)
  it("passes every check", function()
    local o = run_c()
    spec.assert_c_passed(assert, o, "wait_spin", 20)
    assert.is_truthy(o:match("rc=0%s*$"), o)
  end)
end)
