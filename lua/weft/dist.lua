-- weft.dist — world bring-up from the environment and the model-parallel
-- groups (SGLang's init_distributed_environment / initialize_model_parallel).
--
-- Environment (torchrun names, set by scripts/weft-run):
--   RANK, WORLD_SIZE        default 0 and 1 (a single process needs nothing)
--   LOCAL_RANK              default RANK % LOCAL_WORLD_SIZE
--   LOCAL_WORLD_SIZE        default WORLD_SIZE
--   MASTER_ADDR             default 127.0.0.1 (rank 0 serves the store there)
--   MASTER_PORT             required when WORLD_SIZE > 1
--   WEFT_TIMEOUT_MS         default bound of every wait (60000)
--   WEFT_HOST_BACKEND       "store" forces the store path for host tensors
--
-- Group names: the world is "world"; a model-parallel group is
-- "<kind>.<index>" with index its position in the plan's list for that kind
-- (tp.0, tp.1, pp.0, ...); a custom group is its name (default "custom").
-- Every rank creates the groups it belongs to in one fixed order (KINDS), so
-- creation never deadlocks; each cpu group's store keys also carry a
-- generation number, so re-initializing never meets a previous group's keys.
local group = require "weft.group"

local M = {}

M.DEFAULT_TIMEOUT_MS = 60000

-- Order of creation (the seed's order) and long-name getters.
M.KINDS = { "tp", "pdmux_prefill_tp", "dcp", "attn_cp", "attn_tp", "moe_dp", "moe_ep", "moe_tp", "pp" }

local S = {
  initialized = false,
  world = nil,
  groups = {},          -- kind -> GroupCoordinator (aliases share the object)
  custom = {},          -- created custom groups (destroyed at shutdown)
  custom_counter = {},  -- name -> times created (keeps store keys unique)
  generation = 0,
  pdmux = false,
  plan = nil,
}
M.state = S

local function fail(level, op, fmt, ...)
  error("weft: " .. op .. ": " .. fmt:format(...), level + 1)
end

local function env_int(name, default, lo, hi)
  local v = os.getenv(name)
  if v == nil or v == "" then return default, false end
  local n = tonumber(v)
  if not n or n ~= math.floor(n) then
    fail(3, "init", "%s=%q is not an integer", name, v)
  end
  if (lo and n < lo) or (hi and n > hi) then
    fail(3, "init", "%s=%d is out of range (%s..%s)", name, n, tostring(lo), tostring(hi))
  end
  return n, true
end

-- Reads and checks the environment; returns a table, touches nothing.
function M.parse_env()
  local world, has_world = env_int("WORLD_SIZE", 1, 1, 1048576)
  local rank, has_rank = env_int("RANK", 0, 0)
  if has_rank and not has_world and rank > 0 then
    fail(2, "init", "RANK=%d is set but WORLD_SIZE is not", rank)
  end
  if rank >= world then
    fail(2, "init", "RANK=%d is not below WORLD_SIZE=%d", rank, world)
  end
  local lws = env_int("LOCAL_WORLD_SIZE", world, 1, world)
  local lrank = env_int("LOCAL_RANK", rank % lws, 0)
  if lrank >= lws then
    fail(2, "init", "LOCAL_RANK=%d is not below LOCAL_WORLD_SIZE=%d", lrank, lws)
  end
  local port, has_port = env_int("MASTER_PORT", 0, 0, 65535)
  if world > 1 and not has_port then
    fail(2, "init", "WORLD_SIZE=%d needs MASTER_PORT (and MASTER_ADDR) to find rank 0's store; "
         .. "start ranks with scripts/weft-run", world)
  end
  local addr = os.getenv("MASTER_ADDR")
  if addr == nil or addr == "" then addr = "127.0.0.1" end
  local timeout = env_int("WEFT_TIMEOUT_MS", M.DEFAULT_TIMEOUT_MS, 1)
  local hb = os.getenv("WEFT_HOST_BACKEND")
  if hb == "" then hb = nil end
  return { rank = rank, world_size = world, local_rank = lrank, local_world_size = lws,
           master_addr = addr, master_port = port, timeout_ms = timeout, host_backend = hb }
end

local HOST_BACKENDS = { auto = true, shm = true, store = true }

local function group_opts(name, ranks, extra)
  local o = {
    name = name, ranks = ranks, rank = S.rank, local_rank = S.local_rank, store = S.store,
    timeout_ms = S.timeout_ms, host_backend = S.host_backend,
    -- a world on one node makes every subgroup single-node: skip their probes
    same_node = S.world_same_node or nil,
  }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

-- init{timeout_ms=, backend=} -> the world GroupCoordinator. Idempotent.
-- backend: "auto" (default), or "store" to force the store path for host tensors.
function M.init(opts)
  opts = opts or {}
  if type(opts) ~= "table" then fail(2, "init", "options must be a table, got %s", type(opts)) end
  for k in pairs(opts) do
    if k ~= "timeout_ms" and k ~= "backend" then fail(2, "init", "unknown option %q (timeout_ms, backend)", tostring(k)) end
  end
  if S.initialized then return S.world end
  local env = M.parse_env()
  local timeout = opts.timeout_ms or env.timeout_ms
  if type(timeout) ~= "number" or timeout <= 0 then
    fail(2, "init", "timeout_ms must be a positive number, got %s", tostring(timeout))
  end
  local hb = opts.backend or env.host_backend or "auto"
  if not HOST_BACKENDS[hb] then
    fail(2, "init", "unknown backend %q (auto, shm, store)", tostring(hb))
  end
  S.rank, S.world_size = env.rank, env.world_size
  S.local_rank, S.local_world_size = env.local_rank, env.local_world_size
  S.master_addr, S.master_port = env.master_addr, env.master_port
  S.timeout_ms = timeout
  S.host_backend = (hb == "store") and "store" or nil
  S.world_same_node = nil
  if S.world_size > 1 then
    local store = require "weft.store"
    S.store = store.open { host = S.master_addr, port = S.master_port, server = S.rank == 0,
                           timeout_ms = timeout }
  end
  local ranks = {}
  for r = 0, S.world_size - 1 do ranks[r + 1] = r end
  local ok, world = pcall(group.new, group_opts("world", ranks))
  if not ok then
    if S.store then S.store:close(); S.store = nil end
    error(world, 2)
  end
  S.world = world
  S.world_same_node = world.same_node and true or nil
  S.initialized = true
  return world
end

function M.is_initialized() return S.initialized end

local function need_init(op)
  if not S.initialized then fail(3, op, "weft is not initialized (call weft.init() first)") end
end

---------------------------------------------------------------- model parallel
local function resolve_alias(aliases, kind)
  local seen = {}
  while aliases[kind] do
    if seen[kind] then fail(4, "initialize_model_parallel", "alias cycle at %s in the topology plan", kind) end
    seen[kind] = true
    kind = aliases[kind]
  end
  return kind
end

-- initialize_model_parallel{tp=, pp=, ep=, moe_dp=, attn_cp=, attn_dp=, dcp=,
--   duplicate_tp_group=bool}; long SGLang names are accepted too.
function M.initialize_model_parallel(opts)
  local op = "initialize_model_parallel"
  opts = opts or {}
  if type(opts) ~= "table" then fail(2, op, "options must be a table, got %s", type(opts)) end
  if not S.initialized then M.init() end
  if S.groups.tp then
    fail(2, op, "model parallel groups are already initialized (call weft.destroy_model_parallel() first)")
  end
  -- sizes, names and divisibility are checked by the topology module, with
  -- messages naming this operation
  local topology = require "weft.topology"
  local plan, dup = topology.validate(opts, S.world_size, 2)
  S.generation = S.generation + 1
  local gen = S.generation
  local aliases = plan.aliases or {}
  local created = {}
  local function build(kind, lists, name_prefix)
    for i, ranks in ipairs(lists) do
      for _, r in ipairs(ranks) do
        if r == S.rank then
          local name = name_prefix .. "." .. (i - 1)
          return group.new(group_opts(name, ranks, { cpugroup_name = ("mp%d/%s"):format(gen, name),
            -- the seed gives the TP group the message-queue broadcaster
            use_mq_broadcaster = kind == "tp" and os.getenv("WEFT_USE_MQ_BROADCASTER") == "1" }))
        end
      end
    end
    fail(4, op, "rank %d is in no %s group of the plan", S.rank, kind)
  end
  local ok2, err = pcall(function()
    for _, kind in ipairs(M.KINDS) do
      if kind == "pdmux_prefill_tp" then
        if dup then created[kind] = build(kind, plan.groups.tp, "pdmux_prefill_tp") end
      elseif aliases[kind] then
        local target = resolve_alias(aliases, kind)
        created[kind] = created[target]
        if not created[kind] then
          fail(3, op, "plan aliases %s to %s, which is not created before it", kind, target)
        end
      elseif plan.groups[kind] then
        created[kind] = build(kind, plan.groups[kind], kind)
      end
    end
  end)
  if not ok2 then
    local seen = {}
    for _, g in pairs(created) do if not seen[g] then seen[g] = true; g:destroy() end end
    error(err, 2)
  end
  S.groups = created
  S.plan = plan
  return plan
end

function M.model_parallel_is_initialized()
  return S.groups.tp ~= nil and S.groups.pp ~= nil
end

-- Destroys each distinct coordinator once (aliases share one), locally.
function M.destroy_model_parallel()
  local seen = {}
  for _, kind in ipairs(M.KINDS) do
    local g = S.groups[kind]
    if g and not seen[g] then seen[g] = true; g:destroy() end
  end
  S.groups = {}
  S.plan = nil
  S.pdmux = false
end

---------------------------------------------------------------- custom groups
-- create_custom_group(ranks [, name [, {timeout_ms=}]]) -> GroupCoordinator.
-- Collective among `ranks` only: members create it together; a non-member
-- gets a coordinator that knows the group (is_member = false) and refuses
-- collectives clearly.
function M.create_custom_group(ranks, name, opts)
  local op = "create_custom_group"
  need_init(op)
  if type(ranks) ~= "table" or #ranks == 0 then
    fail(2, op, "ranks must be a non-empty array of global ranks")
  end
  local seen = {}
  for i = 1, #ranks do
    local r = ranks[i]
    if type(r) ~= "number" or r ~= math.floor(r) or r < 0 or r >= S.world_size then
      fail(2, op, "rank %s is out of range for a world of %d", tostring(r), S.world_size)
    end
    if seen[r] then fail(2, op, "rank %d appears twice", r) end
    seen[r] = true
  end
  name = name or "custom"
  if type(name) ~= "string" or name == "" or #name > 100 or name:find("[%s/]") then
    fail(2, op, "name must be a string of 1..100 characters without spaces or '/', got %s", tostring(name))
  end
  -- store key prefix: the name and the rank set (hashed when long), so two
  -- groups of one name but different ranks never share keys
  local list = table.concat(ranks, ",")
  if #list > 64 then
    local h = 5381
    for i = 1, #list do h = (h * 33 + list:byte(i)) % 4294967296 end
    list = ("%d:%08x"):format(#ranks, h)
  end
  local key = name .. "[" .. list .. "]"
  if opts ~= nil and type(opts) ~= "table" then fail(2, op, "options must be a table, got %s", type(opts)) end
  local timeout = opts and opts.timeout_ms or S.timeout_ms
  if type(timeout) ~= "number" or timeout <= 0 then
    fail(2, op, "timeout_ms must be a positive number, got %s", tostring(timeout))
  end
  local gen = (S.custom_counter[key] or 0)
  local g
  if seen[S.rank] then
    -- only members count, so the counter agrees among exactly those who meet
    S.custom_counter[key] = gen + 1
    g = group.new(group_opts(name, ranks, { cpugroup_name = ("cg%d/%s"):format(gen, key),
                                            timeout_ms = timeout }))
  else
    g = group.new(group_opts(name, ranks, { timeout_ms = timeout }))
  end
  S.custom[#S.custom + 1] = g
  return g
end

---------------------------------------------------------------- getters
local DESCR = {
  tp = "tensor model parallel", pp = "pipeline model parallel", attn_tp = "attention tensor parallel",
  attn_cp = "attention context parallel", moe_ep = "expert model parallel",
  moe_tp = "moe tensor parallel", moe_dp = "moe data parallel", dcp = "decode context parallel",
  pdmux_prefill_tp = "PD-multiplexing prefill tensor parallel",
}

function M.get(kind)
  if kind == "world" then
    need_init(kind)
    return S.world
  end
  if kind == "tp" and S.pdmux then kind = "pdmux_prefill_tp" end
  local g = S.groups[kind]
  if not g then
    local extra = kind == "dcp" and " (dcp > 1 not requested)" or
                  kind == "pdmux_prefill_tp" and " (pass duplicate_tp_group=true)" or ""
    fail(3, kind, "%s group is not initialized%s (call weft.initialize_model_parallel first)",
         DESCR[kind] or kind, extra)
  end
  return g
end

function M.get_or_nil(kind)
  if kind == "world" then return S.world end
  return S.groups[kind]
end

function M.set_pdmux_status(enable)
  S.pdmux = enable and true or false
end

function M.plan() return S.plan end

---------------------------------------------------------------- shutdown
-- Destroys every group (locally), then closes the store. Rank 0 (the store
-- server) waits until every other rank has said goodbye, bounded by the
-- timeout, so no rank loses the store in the middle of its last request.
function M.shutdown()
  if not S.initialized then return end
  local world, store = S.world, S.store
  local err
  M.destroy_model_parallel()
  for _, g in ipairs(S.custom) do g:destroy() end
  S.custom = {}
  if world then world:destroy() end
  if store then
    if not err then
      local ok, e = pcall(function()
        local need = S.world_size - 1
        if S.rank ~= 0 then
          if store:add("weft/shutdown", 1) == need then store:set("weft/shutdown/done", "1") end
          -- return only once rank 0 closed the server (this wait then fails
          -- with "closed"), so an init right after never meets the old store
          local ok2, e2 = pcall(store.get, store, "weft/shutdown/closed", S.timeout_ms)
          if ok2 or not tostring(e2):find("closed", 1, true) then
            error(("weft: shutdown: rank 0 did not close the store within %d ms"):format(S.timeout_ms), 0)
          end
        else
          store:get("weft/shutdown/done", S.timeout_ms)
        end
      end)
      if not ok then err = e end
    end
    store:close()
  end
  S.store, S.world = nil, nil
  S.initialized = false
  S.groups, S.plan = {}, nil
  if err then error(err, 2) end
end

return M
