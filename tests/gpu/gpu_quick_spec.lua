-- #gpu: the quick all-reduce's kernel (kernels/quick_allreduce.cu) at worlds
-- 2, 4, 6 and 8 with ranks sharing the GPUs of this machine under MPS
-- (scripts/weft-mps), one run of tests/helpers/gpu_quick_worker.lua per
-- world, each in its own MPS daemon: every codec equals the CPU reference bit
-- for bit, lies within the stated bound element by element on the five data
-- classes, is the same on every rank; NaN/Inf confined to their block;
-- graphs, weft.async, deterministic mode, a large call. Then a rank that
-- leaves during quick calls: every survivor fails naming it, nothing hangs.
-- Needs one GPU and nvidia-cuda-mps-control; skipped otherwise (pending).
-- With $OUT set, each run's output is kept there (quick-w<W>.log).
-- run-tests: long (five MPS worlds: ~45 s on one H200; started first in the GPU lanes)
local G = require "helpers.gpu_ranks"
local spec = require "helpers.spec_util"

local CHECKS = { "bounds", "nan_inf", "graph", "async", "determinism", "large", "fused" }

local runs = {}
local function run(w, env, log)
  local key = w .. (env or "")
  if runs[key] then return runs[key][1], runs[key][2] end
  local out, rc = spec.shell(("%s timeout 900 scripts/weft-mps -n %d -- scripts/weft-run -n %d --timeout 800 "
                              .. "tests/helpers/gpu_quick_worker.lua"):format(env or "WEFT_TIMEOUT_MS=60000", w, w))
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
  local out, rc = run(w, nil, "quick-w" .. w .. ".log")
  if rc == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return false end
  return true, out, rc
end

-- WEFT_QUICK_WORLDS="2 4" runs a subset (a short device session)
local WORLDS = {}
for w in (os.getenv("WEFT_QUICK_WORLDS") or "2 4 6 8"):gmatch("%d+") do WORLDS[#WORLDS + 1] = tonumber(w) end

describe("#gpu quick all-reduce (MPS)", function()
  for _, w in ipairs(WORLDS) do
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

  it("world 4: a rank that leaves is named by every survivor, nothing hangs", function()
    if not G.need_gpus(1, function(why) pending(why) end) then return end
    if os.getenv("WEFT_QUICK_NO_KILL") == "1" then pending("WEFT_QUICK_NO_KILL=1"); return end
    local t0 = os.time()
    local out, rc = run(4, "WEFT_TIMEOUT_MS=6000 WEFT_QUICK_KILL=2", "quick-w4-kill.log")
    if rc == 77 then pending("MPS cannot start here"); return end
    assert.is_truthy(out:find("[rank2] LEAVING", 1, true), out:sub(-4000))
    for r = 0, 3 do
      if r ~= 2 then
        assert.is_truthy(out:find("[rank" .. r .. "] PASS killed", 1, true),
                         ("rank %d did not report the leaver:\n%s"):format(r, out:sub(-4000)))
      end
    end
    assert.is_true(os.time() - t0 < 120, "took " .. (os.time() - t0) .. " s")
  end)
end)
