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
local G = require("helpers.gpu_ranks")

local CHECKS = { "setup", "policy_crossover", "all_reduce_eager", "all_reduce_large", "all_reduce_graph",
                 "fusion_workspace_grows", "fused", "destroy" }

describe("#gpu shared GPU (MPS)", function()
  G.mps_worlds({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    worker = "tests/helpers/gpu_shared_worker.lua", log = "shared", timeout = 1200, worlds = { 2, 3, 4, 6, 8 },
    checks = CHECKS, kill = { world = 8, rank = 5, env = "WEFT_TIMEOUT_MS=8000 WEFT_SHARED_KILL=5" },
  })
end)
