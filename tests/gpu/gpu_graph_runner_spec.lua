-- weft.graph_runner on 2 GPUs (tests/helpers/graph_runner_gpu.lua under
-- scripts/weft-run): a TP group's device all_reduce and fused all-reduce +
-- RMSNorm captured for batch sizes {1, 2, 4, 8, 16}, replays checked
-- against eager runs, padding, a divergent capture detected on every rank.
-- Then TP 2 x PP 2 at world 4 with the default check group (issue 37 item
-- 2, tests/helpers/graph_runner_tpp_gpu.lua): 16 graphs for batch sizes 1 to
-- 256, both TP groups replaying different sizes at once in a random order,
-- 300 replays per rank checked against a host all_reduce of the same data,
-- a difference inside tp.1 named at every rank. One rank per GPU with 4;
-- with fewer, the 4 ranks share them under MPS (scripts/weft-mps); pending
-- without a GPU or without MPS. With $OUT set, its output is kept there
-- (graph_runner_tpp.log).
local G = require("helpers.gpu_ranks")

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

describe("graph_runner at TP 2 x PP 2, world 4, default check group #gpu", function()
  local shared = require("weft.cuda").device_count() < 4
  G.rank_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = 4, gpus = shared and 1 or 4, wrap = shared and "scripts/weft-mps -n 4 --" or nil,
    worker = "tests/helpers/graph_runner_tpp_gpu.lua", env = "NCCL_NVLS_ENABLE=0 WEFT_TIMEOUT_MS=60000",
    timeout = 400, log = "graph_runner_tpp.log",
    checks = { "tpxpp_capture_default_check_group", "random_concurrent_replays_match_host",
               "difference_inside_tp1_named_everywhere", "usable_after_refusal_and_check_group_tp" },
    pass_end = " (",
  })
end)

-- Issue 37 item 1: a rank that exits on an error while it holds captured
-- graphs (or a fusion workspace, or the custom all-reduce's) exits with the
-- error and code 1, never by a signal (it was SIGSEGV in 3 of 3 runs with a
-- graph_runner: the capture stream was destroyed before the workspace
-- asked it). tests/helpers/graph_exit_error.lua; two ranks, one GPU each
-- or sharing one under MPS.
describe("exit on an error with graphs and workspaces, world 2 #gpu", function()
  local cuda = require("weft.cuda")
  for _, mode in ipairs { "runner", "runner", "fused", "quick", "nccl", "nccl_abort", "async", "plain" } do
    it(mode .. ": both ranks exit 1 with the error, no signal", function()
      if not G.need_gpus(1, pending) then return end
      local shared = cuda.device_count() < 2
      local env = mode == "quick" and "WEFT_QUICK_ALLREDUCE=int8 " or ""
      local cmd = ("cd %s && %sNCCL_NVLS_ENABLE=0 WEFT_TIMEOUT_MS=30000 timeout -s KILL 120 %sscripts/weft-run -n 2 "
                   .. "--timeout 100 tests/helpers/graph_exit_error.lua %s 2>&1; echo \"rc=$?\"")
                  :format(ROOT, env, shared and "scripts/weft-mps -n 2 -- " or "", mode)
      local p = io.popen(cmd)
      local out = p:read("*a")
      p:close()
      local code = tonumber(out:match("rc=(%d+)%s*$"))
      if code == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return end
      assert.is_nil(out:match("killed by signal"), out:sub(-4000))
      assert.is_truthy(out:find("boom", 1, true), out:sub(-4000))
      assert.are.equal(1, code, out:sub(-4000))
    end)
  end
end)
