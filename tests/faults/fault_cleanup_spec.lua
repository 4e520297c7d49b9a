-- Failed runs leave nothing in /dev/shm (issue 13 item 13). A segment's name
-- exists from its creation until every rank attached; a creator stopped in
-- that window (the launcher's SIGTERM after another rank failed, or SIGKILL)
-- used to leave it behind (8 MiB for a weft-shm-*) until another run swept
-- it minutes later. The error and SIGKILL runs fail while rank 0 holds such
-- a name (the helper's rank 1 waits until it sees one); the bad-tp and init
-- runs fail before any segment exists. After each, the spec checks that no
-- name created by that run's pids is left. Other runs on this machine may
-- hold weft names at the same time: only this run's pids are looked at.
local ROOT = os.getenv("PWD") or "."
local S = require("helpers.spec_util")
local shm_names = require("weft.internal.shm_names")
local clock = require("weft.internal.clock")

local read = require("helpers.store_util").read_file

-- Runs the helper in mode; returns the launcher's output, status, the
-- run's pids, what rank 1 saw (the pending name) and the time it took.
local function failing_run(mode, env)
  local dir = S.shell("mktemp -d /tmp/weft-cleanup.XXXXXX"):match("^(%S+)")
  local t0 = clock.now_ms()
  local out, rc = S.shell(("cd %s && %s WEFT_TIMEOUT_MS=5000 timeout 60 scripts/weft-run -n 2 "
                           .. "tests/helpers/cleanup_ranks.lua %s %s"):format(ROOT, env or "", mode, dir))
  local ms = clock.now_ms() - t0
  local pids = {}
  for r = 0, 1 do pids[#pids + 1] = tonumber(read(("%s/pid.%d"):format(dir, r)) or "") end
  local saw = read(dir .. "/saw.1")
  S.shell("rm -rf " .. dir)
  return out, rc, pids, saw, ms
end

local function check_clean(mode, env, expect_pending)
  local out, rc, pids, saw, ms = failing_run(mode, env)
  assert.are_not.equal(0, rc, out)
  assert.are.equal(2, #pids, "both ranks wrote their pid:\n" .. out)
  if expect_pending then
    assert.truthy(saw and saw:find("^weft%-"), "rank 0 never held a pending name: the run did not test the window\n" .. out)
  end
  local left = shm_names.of(pids)
  for _, name in ipairs(left) do os.remove(shm_names.DIR .. "/" .. name) end   -- do not leak on failure
  assert.are.same({}, left, "left behind by the failed run (" .. mode .. ")")
  assert.is_true(ms < 30000, ("the failed run took %d ms"):format(ms))
end

describe("failed runs leave nothing in /dev/shm #fault", function()
  it("a rank raising an error while rank 0 creates the segment", function()
    check_clean("error", nil, true)
  end)

  it("a bad tp argument on one rank", function()
    check_clean("bad_tp", nil, false)
  end)

  it("the creating rank killed with SIGKILL", function()
    check_clean("kill9", nil, true)
  end)

  it("init failing on one rank (the store rejects its secret)", function()
    -- rank 0 and rank 1 get different secrets: the ranks' env is the launcher's
    check_clean("init", "WEFT_STORE_SECRET=cleanup-test-secret", false)
  end)

  it("names weft's segments by creator pid (what the launcher removes)", function()
    assert.are.equal(123, shm_names.creator("weft-shm-123-" .. ("ab"):rep(16)))
    assert.are.equal(7, shm_names.creator("weft-node-7-" .. ("0f"):rep(16)))
    assert.is_nil(shm_names.creator("weft-shm-123-" .. ("AB"):rep(16)))
    assert.is_nil(shm_names.creator("weft-shm-123-abc"))
    assert.is_nil(shm_names.creator("other-shm-123-" .. ("ab"):rep(16)))
  end)
end)
