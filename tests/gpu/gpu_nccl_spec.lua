-- NCCL collectives with 2 real ranks: runs tests/helpers/gpu_nccl_worker.lua under
-- scripts/weft-run once and checks that both ranks passed every check: each
-- per-mode check on the default (blocking calls, split) communicator and,
-- suffixed "_nb", on a non-blocking one; then the checks that run once.
-- Needs 2 CUDA devices; pending otherwise.
local G = require("helpers.gpu_ranks")

local PER_MODE = {
  "all_reduce", "all_reduce_inplace_ops", "all_gather", "all_gatherv", "reduce_scatter",
  "reduce_scatterv", "broadcast", "gather", "send_recv", "all_to_all_equal",
  "all_to_all_splits", "graph_replay", "bad_input", "destroyed_communicator",
  "timeout_aborts", "lone_send_bounded", "destroy_bounded",
}
local CHECKS = { "default_is_blocking" }
for _, sfx in ipairs { "", "_nb" } do
  for _, name in ipairs(PER_MODE) do CHECKS[#CHECKS + 1] = name .. sfx end
end
for _, name in ipairs { "store_collective_refused_in_capture", "init_timeout", "split_timeout",
                         "eager_timing" } do
  CHECKS[#CHECKS + 1] = name
end

describe("weft.nccl with 2 ranks #gpu", function()
  G.rank_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = 2, worker = "tests/helpers/gpu_nccl_worker.lua", timeout = 600, checks = CHECKS,
    pass_end = "\n",  -- "PASS <name>" alone on its line
  })
end)
