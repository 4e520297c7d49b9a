-- Ranks that disagree fail at once, on every rank, naming each rank's part,
-- with the default 60 s timeout in force: mismatched object collectives
-- (blocking, async, point to point), initialize_model_parallel arguments,
-- custom-group rank lists. Afterwards the groups work and shutdown() ends.
-- Real processes through weft-run (tests/helpers/agreement_ranks.lua).
local P = require("helpers.procs")
local ROOT = P.ROOT

local function run(n, case)
  local cmd = ("cd %s && WEFT_TIMEOUT_MS=60000 AGREE_CASE=%s LUA_PATH='%s/tests/?.lua;;' "
               .. "timeout -s KILL 100 scripts/weft-run -n %d --timeout 90 tests/helpers/agreement_ranks.lua 2>&1; echo \"rc=$?\"")
              :format(P.q(ROOT), case, ROOT, n)
  local t0 = P.now()
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return out, tonumber(out:match("rc=(%d+)%s*$")), P.now() - t0
end

local function count(s, pat)
  local k = 0
  for _ in s:gmatch(pat) do k = k + 1 end
  return k
end

describe("disagreeing ranks #fault", function()
  it("mismatched object collectives fail within seconds on both ranks, then shutdown ends", function()
    local out, rc, secs = run(2, "objects")
    assert.are.equal(0, rc, out)
    assert.are.equal(2, count(out, "%] OK shutdown"), out)
    assert.are.equal(2 * 6, count(out, "%] OK "), out)   -- 5 checks + shutdown, per rank
    -- with a 60 s timeout: every error and the whole run well inside it
    assert.is_true(secs < 30, ("took %.1f s:\n%s"):format(secs, out))
    for ms in out:gmatch("ELAPSED shutdown (%d+)") do
      assert.is_true(tonumber(ms) < 5000, "shutdown took " .. ms .. " ms:\n" .. out)
    end
  end)

  it("disagreeing initialize_model_parallel arguments and custom-group lists fail at once on 4 ranks", function()
    local out, rc, secs = run(4, "setup")
    assert.are.equal(0, rc, out)
    assert.are.equal(4 * 3, count(out, "%] OK "), out)   -- 2 checks + shutdown, per rank
    assert.is_true(secs < 30, ("took %.1f s:\n%s"):format(secs, out))
  end)
end)
