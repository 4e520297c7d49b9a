-- #gpu: device collectives across two simulated nodes (issue "several
-- nodes", item 4): scripts/weft-sim-nodes -N 2 -n 1 runs
-- tests/helpers/gpu_nodes_worker.lua, one rank per node. NCCL runs across
-- the nodes over its socket transport (P2P and SHM off, NVLS off), the custom
-- all-reduce and the fused kernel are refused with the reason in explain,
-- and every result is exact against the host path. On a 2-GPU machine each
-- node gets its own GPU; on one GPU both nodes use it (NCCL tells the nodes
-- apart by hostname). Needs a CUDA device and root for the namespaces;
-- pending otherwise. With $OUT set, the output is kept there (nodes-gpu.log).
local G = require("helpers.gpu_ranks")
local N = require("helpers.nodes_util")

local CHECKS = { "nodes_layout", "nccl_across_nodes", "other_collectives", "custom_ar_refused",
                 "fused_refused_and_right" }

local output, rc
local function run()
  if output then return output, rc end
  local cuda = require("weft.cuda")
  local node_env = {}
  if cuda.device_count() >= 2 then node_env = { "0:CUDA_VISIBLE_DEVICES=0", "1:CUDA_VISIBLE_DEVICES=1" } end
  output, rc = N.run { nodes = 2, per_node = 1, timeout = 900, node_env = node_env,
    env = { NCCL_NVLS_ENABLE = "0", NCCL_P2P_DISABLE = "1", NCCL_SHM_DISABLE = "1", NCCL_SOCKET_IFNAME = "weft0" },
    args = { "tests/helpers/gpu_nodes_worker.lua" } }
  local dir = os.getenv("OUT")
  if dir and dir ~= "" then
    local f = io.open(dir .. "/nodes-gpu.log", "w")
    if f then f:write(output); f:close() end
  end
  return output, rc
end

local function usable()
  if not G.need_gpus(1, function(why) pending(why) end) then return nil end
  local out, code = run()
  if code == N.SKIP then pending(N.skipped(out)); return nil end
  return out, code
end

describe("#gpu device collectives across simulated nodes", function()
  for _, name in ipairs(CHECKS) do
    it(name, function()
      local out = usable()
      if not out then return end
      G.assert_ranks_passed(assert, out, name, 2, function(r) return ("[node%d rank%d] "):format(r, r) end)
    end)
  end

  it("both nodes exit cleanly and leave no namespace", function()
    local out, code = usable()
    if not out then return end
    assert.are.equal(0, code, out:sub(-4000))
    assert.are.equal("", N.leftover_namespaces())
  end)
end)
