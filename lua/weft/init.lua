-- weft — public entry point.
--
--   local weft = require("weft")
--   weft.init()                                  -- world from RANK, WORLD_SIZE, ...
--   weft.initialize_model_parallel{tp = 2, pp = 2}
--   local tp = weft.tp()                         -- a GroupCoordinator
--   tp:all_reduce(x)                             -- backend chosen by weft.policy
--   weft.destroy_model_parallel(); weft.shutdown()
--
-- Submodules (weft.tensor, weft.topology, weft.policy, weft.serialize,
-- weft.cuda, ...) load on first use, so a host-only script never loads CUDA.
local dist = require("weft.dist")

local M = {}

local LAZY = {
  tensor = "weft.tensor", topology = "weft.topology", policy = "weft.policy",
  serialize = "weft.serialize", group_module = "weft.group", ffi = "weft.internal.ffi",
  cuda = "weft.cuda", store = "weft.store", cpugroup = "weft.cpugroup", shm = "weft.shm",
  graph = "weft.graph", fusion = "weft.fusion",
  device_backends = "weft.backends.device_backends", custom_ar = "weft.backends.custom_ar", policy_file = "weft.internal.policy_file",
  quick = "weft.quick", settings = "weft.internal.settings",
}

setmetatable(M, {
  __index = function(t, k)
    local name = LAZY[k]
    if name then
      local m = require(name)
      rawset(t, k, m)
      return m
    end
  end,
})

M.dist = dist
M.GroupCoordinator = require("weft.group").GroupCoordinator

-- world
M.init = dist.init
M.is_initialized = dist.is_initialized
M.shutdown = dist.shutdown
M.recover = dist.recover

-- model parallel
M.initialize_model_parallel = dist.initialize_model_parallel
M.model_parallel_is_initialized = dist.model_parallel_is_initialized
M.destroy_model_parallel = dist.destroy_model_parallel
M.create_custom_group = dist.create_custom_group
M.set_pdmux_status = dist.set_pdmux_status
M.plan = dist.plan

-- group getters: weft.tp(), weft.tp_size(), weft.tp_rank(), ...
local KINDS = { "world", "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp", "dcp",
                "pdmux_prefill_tp" }
for _, kind in ipairs(KINDS) do
  M[kind] = function() return dist.get(kind) end
  M[kind .. "_size"] = function() return dist.get(kind).world_size end
  M[kind .. "_rank"] = function() return dist.get(kind).rank_in_group end
end
M.dcp_or_nil = function() return dist.get_or_nil("dcp") end

-- the seed's names, for code ported from SGLang
M.get_world_group = M.world
M.get_tp_group = M.tp
M.get_tensor_model_parallel_group = M.tp
M.get_pp_group = M.pp
M.get_pipeline_model_parallel_group = M.pp
M.get_attn_tp_group = M.attn_tp
M.get_attn_cp_group = M.attn_cp
M.get_moe_ep_group = M.moe_ep
M.get_moe_tp_group = M.moe_tp
M.get_moe_dp_group = M.moe_dp
M.get_dcp_group = M.dcp
M.get_dcp_group_no_assert = M.dcp_or_nil
M.get_world_size = M.world_size
M.get_world_rank = M.world_rank
M.get_tensor_model_parallel_world_size = M.tp_size
M.get_tensor_model_parallel_rank = M.tp_rank
M.get_pipeline_model_parallel_world_size = M.pp_size
M.get_pipeline_model_parallel_rank = M.pp_rank
M.get_attn_tensor_model_parallel_world_size = M.attn_tp_size
M.get_attn_tensor_model_parallel_rank = M.attn_tp_rank
M.get_attn_context_model_parallel_world_size = M.attn_cp_size
M.get_attn_context_model_parallel_rank = M.attn_cp_rank
M.get_moe_expert_parallel_world_size = M.moe_ep_size
M.get_moe_expert_parallel_rank = M.moe_ep_rank
M.get_moe_tensor_parallel_world_size = M.moe_tp_size
M.get_moe_tensor_parallel_rank = M.moe_tp_rank
M.get_moe_data_parallel_world_size = M.moe_dp_size
M.get_moe_data_parallel_rank = M.moe_dp_rank
M.get_dcp_world_size = M.dcp_size
M.get_dcp_rank = M.dcp_rank

-- monotonic clock in microseconds (a float), for benchmarks and demos
M.now_us = require("weft.internal.clock").now_us

-- true when weft.cuda loads and reports a device; never raises
function M.cuda_available()
  local ok, cuda = pcall(require, "weft.cuda")
  if not ok or type(cuda) ~= "table" or type(cuda.available) ~= "function" then return false end
  local ok2, avail = pcall(cuda.available)
  return ok2 and avail == true
end

return M
