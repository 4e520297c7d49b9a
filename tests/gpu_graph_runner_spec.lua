-- weft.graph_runner on 2 GPUs (tests/helpers/graph_runner_gpu.lua under
-- scripts/weft-run): a TP group's device all_reduce and fused all-reduce +
-- RMSNorm captured for batch sizes {1, 2, 4, 8, 16}, replays checked
-- against eager runs, padding, a divergent capture detected on every rank.
local G = require "helpers.gpu_ranks"

local ROOT = os.getenv("PWD") or "."
local output, rc

local function run_once()
  if output then return output end
  local cmd = ("NCCL_NVLS_ENABLE=0 WEFT_TIMEOUT_MS=60000 LUA_PATH='%s/tests/?.lua;%s/lua/?.lua;;' "
               .. "timeout -s KILL 400 %s/scripts/weft-run -n 2 --timeout 380 %s/tests/helpers/graph_runner_gpu.lua "
               .. "2>&1; echo \"rc=$?\""):format(ROOT, ROOT, ROOT, ROOT)
  local p = io.popen(cmd)
  output = p:read("*a")
  p:close()
  rc = tonumber(output:match("rc=(%d+)%s*$"))
  return output
end

describe("graph_runner with 2 GPUs #gpu", function()
  for _, name in ipairs {
    "captured 5 sizes over all_reduce and the fused path",
    "replays match eager runs, padded sizes included",
    "run pads to the next captured size",
    "divergent capture detected on every rank",
    "the group is usable after a refused capture",
  } do
    it(name, function()
      if not G.need_gpus(2, pending) then return end
      local o = run_once()
      local n = 0
      for _ in o:gmatch("%] OK " .. name:gsub("%p", "%%%0") .. "\n") do n = n + 1 end
      assert.are.equal(2, n, "expected 'OK " .. name .. "' from both ranks:\n" .. o:sub(-6000))
    end)
  end

  it("both ranks exit cleanly", function()
    if not G.need_gpus(2, pending) then return end
    run_once()
    assert.are.equal(0, rc, output:sub(-6000))
  end)
end)
