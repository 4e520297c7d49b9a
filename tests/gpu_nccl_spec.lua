-- NCCL collectives with 2 real ranks: runs tests/helpers/gpu_nccl_worker.lua under
-- scripts/weft-run once and checks that both ranks passed every check: each
-- per-mode check on the default (blocking calls, split) communicator and,
-- suffixed "_nb", on a non-blocking one; then the checks that run once.
-- Needs 2 CUDA devices; pending otherwise.
local G = require "helpers.gpu_ranks"

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
local WORLD = 2

local output, exit_ok
local function run_once()
  if output then return end
  local p = io.popen("scripts/weft-run -n " .. WORLD .. " --timeout 600 tests/helpers/gpu_nccl_worker.lua 2>&1; echo \"rc=$?\"")
  output = p:read("*a")
  p:close()
  exit_ok = output:match("\nrc=0%s*$") ~= nil or output:match("^rc=0%s*$") ~= nil
end

local function need_gpus() return G.need_gpus(WORLD, pending) end

describe("weft.nccl with 2 ranks #gpu", function()
  for _, name in ipairs(CHECKS) do
    it(name, function()
      if not need_gpus() then return end
      run_once()
      for r = 0, WORLD - 1 do
        local tag = "[rank" .. r .. "] "
        local fail = output:match("%[rank" .. r .. "%] FAIL " .. name .. ": ([^\n]*)")
        assert.is_nil(fail, tag .. name .. ": " .. tostring(fail))
        assert.is_truthy(output:find(tag .. "PASS " .. name .. "\n", 1, true),
                         tag .. "never reported " .. name .. "; output:\n" .. output)
      end
    end)
  end

  it("both ranks exit cleanly", function()
    if not need_gpus() then return end
    run_once()
    assert.is_true(exit_ok, output)
  end)
end)
