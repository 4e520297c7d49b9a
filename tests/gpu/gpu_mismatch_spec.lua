-- #gpu: device calls that differ between the ranks of a group fail on every
-- rank at once, naming both calls (the agreement announcements of
-- src/coll/agree.h), not at the timeout: the custom all-reduce (algorithm,
-- count, dtype), the quick all-reduce, the fused all-reduce + RMSNorm and
-- graph replays, at worlds 2, 4 and 8 with ranks sharing this machine's GPU
-- under MPS (tests/helpers/gpu_mismatch_worker.lua). The timeout is 20 s; an
-- error later than 2 s fails. With WEFT_DEVICE_AGREE=0 (no announcements)
-- these cases wait for the timeout or pass silently: the check is what finds
-- them. Needs one GPU and nvidia-cuda-mps-control; skipped otherwise.
-- With $OUT set, each run's output is kept there (mismatch-w<W>.log).
-- run-tests: long (three MPS worlds, each case followed by weft.recover())
local G = require("helpers.gpu_ranks")

local CASES = { "ar_algo", "ar_count", "ar_dtype", "quick", "fused", "fused_gemma", "graph_replay" }

local run = G.once_per_world(function(w)
  return G.shell_kept(("WEFT_TIMEOUT_MS=20000 timeout 900 scripts/weft-mps -n %d -- scripts/weft-run -n %d "
                       .. "--timeout 800 tests/helpers/gpu_mismatch_worker.lua"):format(w, w), "mismatch-w" .. w .. ".log")
end)

describe("#gpu device calls that differ (MPS)", function()
  for _, w in ipairs { 2, 4, 8 } do
    for _, case in ipairs(CASES) do
      it(("world %d: %s fails on every rank, naming the calls"):format(w, case), function()
        if not G.need_gpus(1, function(why) pending(why) end) then return end
        local out, rc = run(w)
        if rc == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return end
        for r = 0, w - 1 do
          assert.is_truthy(out:find(("[rank%d] PASS %s "):format(r, case), 1, true),
                           ("rank %d, %s:\n%s"):format(r, case, out:sub(-6000)))
        end
      end)
    end
    it(("world %d: every rank exits cleanly"):format(w), function()
      if not G.need_gpus(1, function(why) pending(why) end) then return end
      local out, rc = run(w)
      if rc == 77 then pending("MPS cannot start here"); return end
      assert.are.equal(0, rc, out:sub(-6000))
    end)
  end
end)
