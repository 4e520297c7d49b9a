-- Freed, in-use and failed device buffers with 2 ranks (one GPU each): views
-- of freed device storage and tensors pinned by a pending async NCCL
-- all-reduce (issue 13 items 1-2, device side), and a custom all-reduce
-- kernel that timed out reported at the next host wait, not read quietly
-- (item 3): tests/helpers/gpu_buffers_worker.lua. Needs 2 CUDA devices;
-- pending otherwise.
local G = require "helpers.gpu_ranks"

describe("freed, in-use and failed device buffers with 2 ranks #gpu #fault", function()
  G.rank_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = 2, worker = "tests/helpers/gpu_buffers_worker.lua", env = "WEFT_TIMEOUT_MS=30000",
    timeout = 300, log = "gpu_buffers_worker.log",
    checks = { "device_freed_views", "device_pinned_async", "custom_ar_failure_raises_at_host_waits" },
    pass_end = " (",
  })
end)
