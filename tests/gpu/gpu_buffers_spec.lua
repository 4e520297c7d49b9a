-- Freed, in-use and failed device buffers with 2 ranks (one GPU each): views
-- of freed device storage and tensors pinned by a pending async NCCL
-- all-reduce (issue 13 items 1-2, device side), and a custom all-reduce
-- kernel that timed out reported at the next host wait, not read quietly
-- (item 3): tests/helpers/gpu_buffers_worker.lua. With 2 CUDA devices one
-- rank each; with one, the two ranks share it under MPS (scripts/weft-mps:
-- shared-GPU test mode, no NCCL, so the pinned tensor's pending all-reduce is
-- weft's own). Pending without a GPU (or without MPS on a single GPU).
local G = require("helpers.gpu_ranks")

describe("freed, in-use and failed device buffers with 2 ranks #gpu #fault", function()
  local shared = require("weft.cuda").device_count() == 1
  G.rank_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = 2, gpus = shared and 1 or 2, wrap = shared and "scripts/weft-mps -n 2 --" or nil,
    worker = "tests/helpers/gpu_buffers_worker.lua", env = "WEFT_TIMEOUT_MS=30000",
    timeout = 300, log = "gpu_buffers_worker.log",
    checks = { "device_freed_views", "device_pinned_async", "custom_ar_failure_raises_at_host_waits" },
    pass_end = " (",
  })
end)
