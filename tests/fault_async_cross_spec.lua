-- An async collective on one group while the caller runs a blocking one on
-- another (issue 24 item 4): with 4 ranks (tp=2 x pp=2), every async op (9)
-- x blocking op (8) x ordered group pair (world/tp, tp/world, tp/pp, pp/tp,
-- world/pp, pp/world), twice each, results checked exactly
-- (tests/helpers/async_cross_ranks.lua); once with the policy's routes (shm
-- for host tensors) and once with every host tensor on the store. Before
-- the fix, the progress worker's wait and the caller's wait queued on the
-- rank's one store connection and the ranks timed out naming live ranks.
local ROOT = os.getenv("PWD") or "."
local U = require "helpers.spec_util"

local function run(env)
  return U.shell(("%s WEFT_TIMEOUT_MS=5000 LUA_PATH='%s/tests/?.lua;;' timeout -s KILL 200 %s/scripts/weft-run -n 4 --timeout 180 %s/tests/helpers/async_cross_ranks.lua")
                 :format(env, ROOT, ROOT, ROOT))
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
end)
