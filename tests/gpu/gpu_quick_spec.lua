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
local G = require("helpers.gpu_ranks")

local CHECKS = { "bounds", "nan_inf", "graph", "async", "determinism", "large", "fused" }

-- WEFT_QUICK_WORLDS="2 4" runs a subset (a short device session)
local WORLDS = {}
for w in (os.getenv("WEFT_QUICK_WORLDS") or "2 4 6 8"):gmatch("%d+") do WORLDS[#WORLDS + 1] = tonumber(w) end

describe("#gpu quick all-reduce (MPS)", function()
  G.mps_worlds({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    worker = "tests/helpers/gpu_quick_worker.lua", log = "quick", timeout = 800, worlds = WORLDS,
    checks = CHECKS, kill = { world = 4, rank = 2, env = "WEFT_TIMEOUT_MS=6000 WEFT_QUICK_KILL=2" },
    skip_kill = "WEFT_QUICK_NO_KILL",
  })
end)
