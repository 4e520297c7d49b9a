-- #gpu: weft's kernels at worlds 2, 3, 4, 6 and 8 with ranks sharing the GPUs
-- of this machine under MPS (scripts/weft-mps: one SM slice per rank,
-- WEFT_ALLOW_SHARED_GPU=1). One run of tests/helpers/gpu_shared_worker.lua
-- per world, each in its own MPS daemon (a client that faulted can leave the
-- daemon refusing new clients); world 3 has no kernels and must say so and
-- still be right. Then a rank that leaves in the middle of one-shot calls at
-- world 8: every survivor fails, naming it, well within the launcher's bound.
-- Needs one GPU and nvidia-cuda-mps-control; skipped otherwise (pending).
-- With $OUT set, each run's output is kept there (shared-w<W>.log).
-- run-tests: long (six MPS worlds one after another: ~100 s on one H200; started first in the GPU lanes)
local G = require "helpers.gpu_ranks"
local spec = require "helpers.spec_util"

local CHECKS = { "setup", "policy_crossover", "all_reduce_eager", "all_reduce_large", "all_reduce_graph",
                 "fusion_workspace_grows", "fused", "destroy" }

local runs = {}
local function run(w, env, log)
  local key = w .. (env or "")
  if runs[key] then return runs[key][1], runs[key][2] end
  local out, rc = spec.shell(("%s timeout 1500 scripts/weft-mps -n %d -- scripts/weft-run -n %d --timeout 1200 "
                              .. "tests/helpers/gpu_shared_worker.lua"):format(env or "WEFT_TIMEOUT_MS=60000", w, w))
  local dir = os.getenv("OUT")
  if dir and dir ~= "" then
    local f = io.open(dir .. "/" .. log, "w")
    if f then f:write(out); f:close() end
  end
  runs[key] = { out, rc }
  return out, rc
end

local function usable(w)
  if not G.need_gpus(1, function(why) pending(why) end) then return false end
  local out, rc = run(w, nil, "shared-w" .. w .. ".log")
  if rc == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return false end
  return true, out, rc
end

describe("#gpu shared GPU (MPS)", function()
  for _, w in ipairs { 2, 3, 4, 6, 8 } do
    for _, name in ipairs(CHECKS) do
      it(("world %d: %s"):format(w, name), function()
        local ok, out = usable(w)
        if not ok then return end
        G.assert_ranks_passed(assert, out, name, w)
      end)
    end
    it(("world %d: every rank exits cleanly"):format(w), function()
      local ok, out, rc = usable(w)
      if not ok then return end
      assert.are.equal(0, rc, out:sub(-4000))
    end)
  end

  it("world 8: a rank that leaves is named by every survivor, nothing hangs", function()
    if not G.need_gpus(1, function(why) pending(why) end) then return end
    local t0 = os.time()
    local out, rc = run(8, "WEFT_TIMEOUT_MS=8000 WEFT_SHARED_KILL=5", "shared-w8-kill.log")
    if rc == 77 then pending("MPS cannot start here"); return end
    assert.is_truthy(out:find("[rank5] LEAVING", 1, true), out:sub(-4000))
    for r = 0, 7 do
      if r ~= 5 then
        assert.is_truthy(out:find("[rank" .. r .. "] PASS killed", 1, true),
                         ("rank %d did not report the leaver:\n%s"):format(r, out:sub(-4000)))
      end
    end
    assert.is_true(os.time() - t0 < 120, "took " .. (os.time() - t0) .. " s")
  end)
end)
