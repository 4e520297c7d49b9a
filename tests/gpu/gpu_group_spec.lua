-- Device collectives through the GroupCoordinator with 2 real ranks: runs
-- tests/helpers/gpu_group_worker.lua under scripts/weft-run once and checks
-- that both ranks passed every check (policy -> NCCL / custom all-reduce /
-- fused kernel / host staging, against the host path or an f64 reference;
-- graphs replayed on refilled inputs; fallbacks; bad input).
-- Needs 2 CUDA devices; pending otherwise.
local G = require("helpers.gpu_ranks")

local CHECKS = {
  "setup_lazy", "all_reduce_nccl_forced", "all_reduce_custom_eager", "all_reduce_out_of_place",
  "all_reduce_fallbacks", "all_gather_dims", "all_gatherv", "reduce_scatter_dims", "reduce_scatterv",
  "nan_max_min", "broadcast_gather", "send_recv", "all_to_all_single", "tensor_dicts", "graph_capture_replay",
  "fused_kernel", "fused_fallbacks", "fused_graph_replay", "bad_inputs", "host_staging",
  "eager_latency", "destroy",
}

describe("device collectives through the group with 2 ranks #gpu", function()
  G.rank_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = 2, worker = "tests/helpers/gpu_group_worker.lua", env = "WEFT_TIMEOUT_MS=30000",
    timeout = 400, log = "gpu_group_worker.log", checks = CHECKS,
    pass_end = " (",  -- "PASS <name> (<seconds> s)"
  })
end)
