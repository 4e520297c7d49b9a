-- An async collective on one group while the caller runs a blocking one on
-- another (issue 24 item 4): with 4 ranks (tp=2 x pp=2), every async op (9)
-- x blocking op (8) x ordered group pair (world/tp, tp/world, tp/pp, pp/tp,
-- world/pp, pp/world), twice each, results checked exactly
-- (tests/helpers/async_cross_ranks.lua); once with the policy's routes (shm
-- for host tensors) and once with every host tensor on the store. Before
-- the fix, the progress worker's wait and the caller's wait queued on the
-- rank's one store connection and the ranks timed out naming live ranks.
local ROOT = os.getenv("PWD") or "."
local U = require("helpers.spec_util")
local P = require("helpers.rank_passes")

local function run(env)
  return P.run(ROOT, "tests/helpers/async_cross_ranks.lua", 4, env .. " WEFT_TIMEOUT_MS=5000", 200)
end

local function check(out, rc)
  assert.are.equal(0, rc, out)
  assert.are.equal(4, U.count_ok(out), out)
  local n = 0
  for _ in out:gmatch("ASYNC_CROSS rank %d triples=432 iters=2") do n = n + 1 end
  assert.are.equal(4, n, out)
end

describe("async on one group x blocking on another #fault", function()
  it("4 ranks, tp=2 x pp=2: 9 async ops x 8 blocking ops x 6 group pairs, policy routes", function()
    check(run(""))
  end)

  it("the same with every host tensor on the store route (WEFT_HOST_BACKEND=store)", function()
    check(run("WEFT_HOST_BACKEND=store"))
  end)

  it("a rank that dies while the others wait in an async op is named within 5 s (timeout 60 s)", function()
    -- the worker's own store connection sees deaths like the rank's own
    local L = require("weft.tools.launcher")
    local port = assert(L.free_port("127.0.0.1"))
    local cmds = {}
    for r = 0, 2 do
      cmds[#cmds + 1] = ("RANK=%d LOCAL_RANK=%d WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 "
        .. "MASTER_PORT=%d WEFT_TIMEOUT_MS=60000 LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;%s/tests/?.lua;;' "
        .. "timeout -s KILL 80 luajit %s/tests/helpers/async_death_ranks.lua 2 2>&1 | sed 's/^/[r%d] /' &")
        :format(r, r, port, ROOT, ROOT, ROOT, ROOT, r)
    end
    local out = U.shell("(" .. table.concat(cmds, "\n") .. "\nwait) 2>/dev/null")
    local vpid = out:match("%[r2%] PID (%d+)")
    assert.is_truthy(vpid, out)
    for r = 0, 1 do
      local ms, msg = out:match("%[r" .. r .. "%] ASYNC_DEATH (%d+) ([^\n]*)")
      assert.is_truthy(ms, out)
      assert.is_true(tonumber(ms) < 5000, ("rank %d: %s ms: %s"):format(r, ms, msg))
      assert.is_truthy(msg:find("rank 2 (pid " .. vpid, 1, true) and msg:find("died", 1, true), msg)
      assert.is_truthy(msg:find("all_gather_object", 1, true), msg)
    end
  end)

  -- An async operation and a blocking call on the SAME group, without
  -- weft.async.install: the blocking call waits for the group's queue first.
  -- Before, the progress worker and the caller ran in the group's cpu group
  -- at once: on the store route 97 of 200 all-reduces were wrong on every
  -- rank with no error, object all-gathers paired each other's keys, and
  -- initialize_model_parallel's agreement met the pending all_gather_object.
  local function same(env)
    return P.run(ROOT, "tests/helpers/async_same_ranks.lua loop", 4, env .. " WEFT_TIMEOUT_MS=5000", 100)
  end
  for _, env in ipairs { "WEFT_HOST_BACKEND=store", "" } do
    it("async and blocking on the same group, program order, 0 wrong" .. (env ~= "" and " (" .. env .. ")" or " (policy routes)"), function()
      local out, rc = same(env)
      assert.are.equal(0, rc, out)
      assert.are.equal(4, U.count_ok(out), out)
      local k = 0
      for _ in out:gmatch("SAME rank %d wrong=0") do k = k + 1 end
      assert.are.equal(4, k, out)
    end)
  end

  it("the cpu group refuses a second thread: a raw call while the worker waits in it fails at once", function()
    local out, rc = P.run(ROOT, "tests/helpers/async_same_ranks.lua raw", 4, "WEFT_TIMEOUT_MS=5000", 60)
    assert.are.equal(0, rc, out)
    assert.are.equal(4, U.count_ok(out), out)
    local ms, msg = out:match("RAW (%d+) ([^\n]*)")
    assert.is_truthy(ms, out)
    assert.is_truthy(msg:find("another operation is in flight on this group", 1, true), msg)
    assert.is_true(tonumber(ms) < 500, ms .. " ms: " .. msg)
  end)
end)
