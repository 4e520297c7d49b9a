-- A retry loop that recovers sees no wrong result (issue 36): every rank
-- runs calls whose results are checked exactly, retries a failed call after
-- weft.recover(), and one rank (the store's host, rank 0, or another) is
-- stopped past the timeout. Either every call completes right on every
-- rank, or recover() raises on every rank that the results from some call
-- on cannot be trusted (a call completed on some ranks only); never a wrong
-- result. tests/helpers/retry_ranks.lua; docs/faults.md "Every call agreed".
local N = require "helpers.nodes_util"
local P = require "helpers.procs"
local S = require "helpers.spec_util"

local HELPER = "tests/helpers/retry_ranks.lua"

local function run(op, group, victim, stop_ms, calls)
  return S.shell(("cd %s && env WEFT_TIMEOUT_MS=1500 timeout -s KILL 120 scripts/weft-run -n 4 --timeout 100 %s %s %s %d %d %d")
                 :format(P.q(P.ROOT), HELPER, op, group, victim, stop_ms, calls))
end

local function check(out, members)
  local res, div = {}, 0
  for _, l in ipairs(N.rank_lines(out:gsub("%[rank(%d+)%]", "[node0 rank%1]"))) do
    local ok, wrong, errs, d = l.text:match("^RESULT ok=(%d+) wrong=(%d+) errors=(%d+) diverged=(%d)")
    if ok then res[l.rank] = { ok = tonumber(ok), wrong = tonumber(wrong), diverged = tonumber(d) } end
    assert.is_nil(l.text:match("^RECOVERFAIL"), out)
  end
  for _, r in ipairs(members) do
    local x = res[r]
    assert.is_truthy(x, ("rank %d printed no result:\n%s"):format(r, out))
    assert.are.equal(0, x.wrong, ("rank %d had %d wrong results:\n%s"):format(r, x.wrong, out))
    div = div + x.diverged
  end
  -- a divergence is told to every member, or to none
  assert.is_true(div == 0 or div == #members, out)
end

describe("a retry loop that recovers sees no wrong result #fault", function()
  it("tp group of tp = 2 x pp = 2, all_gather_object, rank 0 (the store's host) stopped 2.5 s", function()
    check(run("all_gather_object", "tp", 0, 2500, 40), { 0, 1, 2, 3 })
  end)
  it("world group, all_reduce on the store path, rank 2 stopped 2.5 s", function()
    check(S.shell(("cd %s && env WEFT_TIMEOUT_MS=1500 WEFT_HOST_BACKEND=store timeout -s KILL 120 scripts/weft-run -n 4 --timeout 100 %s all_reduce world 2 2500 40")
                  :format(P.q(P.ROOT), HELPER)), { 0, 1, 2, 3 })
  end)
  it("custom group {0, 1}, broadcast, rank 1 stopped just under the timeout (1.3 s)", function()
    check(run("broadcast", "custom", 1, 1300, 40), { 0, 1 })
  end)
end)
