-- The eager device all_reduce's memo of its size-dependent choice
-- (lua/weft/backends/device_backends/sized_memo.lua) on 2 ranks over a pretend GPU
-- (tests/helpers/sized_memo_ranks.lua): the rules are walked once per size,
-- and every input the choice reads (policy.set, g.use_custom_allreduce, the
-- per-kind table, alignment of input and output, the workspace's size, a
-- broken workspace) still steers the next call; the kernel that runs is the
-- one the rule chose, never "auto" (the algorithm chosen once)
local spec = require("helpers.spec_util")
local ROOT = os.getenv("PWD") or "."

describe("eager device all_reduce: the memoised choice", function()
  local out, rc
  setup(function()
    out, rc = spec.shell(("cd %s && WEFT_FAKE_DEVICE=1 timeout -s KILL 120 scripts/weft-run -n 2 --timeout 110 "
                          .. "tests/helpers/sized_memo_ranks.lua"):format(ROOT))
  end)
  for _, name in ipairs({
    "memoised: 50 calls, 0 policy walks, 50 kernel launches",
    "policy.set re-decides (twoshot: algorithm 2)",
    "g.use_custom_allreduce = false sends the next calls to NCCL",
    "g.use_custom_allreduce = nil brings the kernels back",
    "the per-kind table edited in place is seen",
    "and restored",
    "an unaligned input of a memoised size goes to NCCL",
    "the aligned one still takes the kernels",
    "a size over the workspace goes to NCCL (twice)",
    "an unaligned output goes to NCCL, asked of the rules each call",
    "an aligned output takes the kernels, memoised",
    "the algorithm is chosen once: weft_ar_run never gets auto, and runs the kernel explain names",
    "after a failed kernel the next call raises (no stale choice)",
  }) do
    it(name, function()
      for r = 0, 1 do
        assert.is_truthy(out:find("[rank" .. r .. "] PASS " .. name, 1, true), out:sub(-3000))
      end
    end)
  end
  it("every rank exits cleanly", function() assert.are.equal(0, rc, out:sub(-3000)) end)
end)
