-- A resumed rank writes into closed sockets (issue 24 item 5): the last rank
-- is stopped (SIGSTOP) past the timeout in a loop of Gloo all-reduces, the
-- others fail and exit at once, then it is continued. It must end with an
-- error, never be killed by SIGPIPE, and keep its own SIGPIPE disposition
-- and mask; a SIGPIPE the application had pending before a Gloo call is
-- still pending after it (tests/helpers/sigpipe_ranks.lua). On one node
-- through a weft.gloo communicator on the world's cpu group (Gloo's own
-- all-reduce with 3 ranks; the small path's doubling and chunked halving
-- with 4), and across simulated nodes through world:all_reduce on the Gloo
-- route (needs root, else pending). Before the fix the resumed rank was
-- killed by SIGPIPE in each one-node case.
local ROOT = os.getenv("PWD") or "."
local U = require("helpers.spec_util")
local N = require("helpers.nodes_util")

local function gloo_or_pending()
  local ok, g = pcall(require, "weft.gloo")
  if ok and g.available() then return true end
  pending("weft was built without Gloo")
  return false
end

local function check(out, victim, launcher_tag)
  assert.is_falsy(out:find("signal 13", 1, true), out)
  assert.is_truthy(out:find(("weft-run%s: rank %d exited with code 3"):format(launcher_tag, victim), 1, true), out)
  local resumed = out:match("rank" .. victim .. "%] ENDED ([^\n]*)")
  assert.is_truthy(resumed and resumed:find("weft_gloo_all_reduce: group 'world'", 1, true), out)
  assert.is_truthy(out:find("rank" .. victim .. "%] RESUMED disposition_default=true pipe_blocked=false"), out)
  local _, kept = out:gsub("OWN_PENDING_KEPT true", "")
  assert.is_true(kept >= victim + 1, out)
  assert.is_falsy(out:find("OWN_PENDING_KEPT false", 1, true), out)
end

describe("a resumed rank writing into closed sockets #fault", function()
  for _, case in ipairs { { 3, 256, "Gloo's all-reduce" }, { 4, 256, "small path, recursive doubling" },
                          { 4, 1048576, "small path, chunked halving" } } do
    it(("%d ranks, %d f32 (%s): an error, never SIGPIPE"):format(case[1], case[2], case[3]), function()
      if not gloo_or_pending() then return end
      local out = U.shell(("SIGPIPE_NUMEL=%d WEFT_TIMEOUT_MS=1000 LUA_PATH='%s/tests/?.lua;;' timeout -s KILL 60 %s/scripts/weft-run -n %d --timeout 50 %s/tests/helpers/sigpipe_ranks.lua direct")
                          :format(case[2], ROOT, ROOT, case[1], ROOT))
      check(out, case[1] - 1, "")
    end)
  end

  it("3 simulated nodes, world:all_reduce on the Gloo route: an error, never SIGPIPE", function()
    if not gloo_or_pending() then return end
    local out, rc = N.run { nodes = 3, per_node = 1, timeout = 60,
      env = { SIGPIPE_NUMEL = "256", WEFT_HOST_BACKEND = "gloo", WEFT_TIMEOUT_MS = "2000" },
      args = { "tests/helpers/sigpipe_ranks.lua", "group" } }
    if rc == N.SKIP then pending("simulated nodes unavailable: " .. N.skipped(out)); return end
    check(out, 2, "[node2]")
    assert.are.equal("", N.leftover_namespaces())
  end)
end)
