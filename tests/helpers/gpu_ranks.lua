-- Plumbing of the 2-GPU specs (gpu_allreduce, gpu_fusion, gpu_nccl): whether
-- enough devices are there, a harness built on demand, one run of N ranks
-- through scripts/weft-run, and the PASS/FAIL lines of one check group.
local cuda = require "weft.cuda"

local G = {}

-- true when there are `world` CUDA devices; else calls pending(why) (busted's,
-- passed in by the spec) and returns false
function G.need_gpus(world, pending)
  if cuda.device_count() < world then
    pending(cuda.available() and ("needs " .. world .. " CUDA devices") or "no CUDA device")
    return false
  end
  return true
end

-- a harness binary: $env, else `default`, built with `make -s target` if absent
function G.harness(env, default, target)
  local bench = os.getenv(env) or default
  if not io.open(bench, "r") then
    local p = io.popen("make -s " .. target .. " 2>&1; echo rc=$?")
    local o = p:read("*a"); p:close()
    assert(o:match("rc=0"), "weft: cannot build " .. bench .. ":\n" .. o)
  end
  return bench
end

-- Runs `harness args` on `world` ranks through weft-run (NVLS off), `args`
-- holding one %s for a fresh output directory, removed afterwards. Returns the
-- whole output (ending in "rc=<exit code>") and whether it exited 0.
function G.run_harness(world, harness, args)
  local dir = os.tmpname(); os.remove(dir); os.execute("mkdir -p " .. dir)
  local cmd = ("NCCL_NVLS_ENABLE=0 scripts/weft-run -n %d --timeout 600 -- %s " .. args
               .. " 2>&1; echo \"rc=$?\""):format(world, harness, dir)
  local p = io.popen(cmd)
  local output = p:read("*a")
  p:close()
  os.execute("rm -rf " .. dir)
  return output, output:match("rc=0%s*$") ~= nil
end

-- The lines of check group `label` in the output: its FAIL lines (and any
-- FATAL), and whether it reported PASS.
function G.group_result(output, label)
  local fails = {}
  for line in output:gmatch("[^\n]+") do
    if line:find("FAIL " .. label, 1, true) or line:find("FATAL", 1, true) then
      fails[#fails + 1] = line
    end
  end
  return fails, output:find("PASS " .. label, 1, true) ~= nil
end

return G
