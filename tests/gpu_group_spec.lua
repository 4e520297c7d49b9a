-- Device collectives through the GroupCoordinator with 2 real ranks: runs
-- tests/helpers/gpu_group_worker.lua under scripts/weft-run once and checks
-- that both ranks passed every check (policy -> NCCL / custom all-reduce /
-- fused kernel / host staging, against the host path or an f64 reference;
-- graphs replayed on refilled inputs; fallbacks; bad input).
-- Needs 2 CUDA devices; pending otherwise.
local cuda = require "weft.cuda"

local CHECKS = {
  "setup_lazy", "all_reduce_nccl_forced", "all_reduce_custom_eager", "all_reduce_out_of_place",
  "all_reduce_fallbacks", "all_gather_dims", "all_gatherv", "reduce_scatter_dims", "reduce_scatterv",
  "broadcast_gather", "send_recv", "all_to_all_single", "tensor_dicts", "graph_capture_replay",
  "fused_kernel", "fused_fallbacks", "fused_graph_replay", "bad_inputs", "host_staging",
  "eager_latency", "destroy",
}
local WORLD = 2

local output, exit_ok
local function run_once()
  if output then return end
  local p = io.popen("WEFT_TIMEOUT_MS=30000 scripts/weft-run -n " .. WORLD
                     .. " --timeout 400 tests/helpers/gpu_group_worker.lua 2>&1; echo \"rc=$?\"")
  output = p:read("*a")
  p:close()
  exit_ok = output:match("\nrc=0%s*$") ~= nil
  local out = os.getenv("OUT")
  if out and out ~= "" then
    local f = io.open(out .. "/gpu_group_worker.log", "w")
    if f then f:write(output); f:close() end
  end
end

local function need_gpus()
  if cuda.device_count() < WORLD then
    pending(cuda.available() and ("needs " .. WORLD .. " CUDA devices") or "no CUDA device")
    return false
  end
  return true
end

describe("device collectives through the group with 2 ranks #gpu", function()
  for _, name in ipairs(CHECKS) do
    it(name, function()
      if not need_gpus() then return end
      run_once()
      for r = 0, WORLD - 1 do
        local tag = "[rank" .. r .. "] "
        local fail = output:match("%[rank" .. r .. "%] FAIL " .. name .. ": ([^\n]*)")
        assert.is_nil(fail, tag .. name .. ": " .. tostring(fail))
        assert.is_truthy(output:find(tag .. "PASS " .. name .. " (", 1, true),
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
