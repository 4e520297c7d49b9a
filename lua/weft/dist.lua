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
--   WEFT_HOST_BACKEND       "store" forces the store path for host tensors;
--                           across nodes "gloo" forces flat Gloo, "hier" the
--                           hierarchical all-reduce (where the policy would pick)
--
-- Group names: the world is "world"; a model-parallel group is
-- "<kind>.<index>" with index its position in the plan's list for that kind
-- (tp.0, tp.1, pp.0, ...); a custom group is its name (default "custom").
-- Every rank creates the groups it belongs to in one fixed order (KINDS), so
-- creation never deadlocks; each cpu group's store keys also carry a
-- generation number (its counter in the store, src/host/cpugroup.c), so
-- re-initializing never meets a previous group's keys, and re-creating a
-- group adds no store key.
local group = require("weft.group")
local show = require("weft.internal.show").value -- names a refused value's type

local M = {}

M.DEFAULT_TIMEOUT_MS = 60000

-- Order of creation (the seed's order) and long-name getters.
M.KINDS = { "tp", "pdmux_prefill_tp", "dcp", "attn_cp", "attn_tp", "moe_dp", "moe_ep", "moe_tp", "pp" }

local agree_mp_args   -- defined with initialize_model_parallel

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

local fail = require("weft.internal.errors").fail   -- "weft: <op>: ..." at the caller's level

local function env_int(name, default, lo, hi)
  local v = os.getenv(name)
  if v == nil or v == "" then return default, false end
  local n = tonumber(v)
  if not n or n ~= math.floor(n) then
    fail(3, "init", "%s=%q is not an integer", name, v)
  end
  if (lo and n < lo) or (hi and n > hi) then
    local range = (lo and hi) and ("%d..%d"):format(lo, hi) or lo and (">= " .. lo) or ("<= " .. hi)
    fail(3, "init", "%s=%d is out of range (%s)", name, n, range)
  end
  return n, true
end

-- Reads and checks the environment; returns a table, touches nothing.
-- Without the launcher's variables (plain `luajit script.lua`) the world is
-- this one process (launched = false), as torch's single-process default:
-- no store, no port, nothing shared with other such processes.
function M.parse_env()
  local world, has_world = env_int("WORLD_SIZE", 1, 1, 1048576)
  local rank, has_rank = env_int("RANK", 0, 0)
  if has_rank and not has_world and rank > 0 then
    fail(2, "init", "RANK=%d is set but WORLD_SIZE is not", rank)
  end
  if has_world and world > 1 and not has_rank then
    -- every such process would be rank 0 and start the store
    fail(2, "init", "WORLD_SIZE=%d is set but RANK is not: set RANK (0..%d) for each process, "
         .. "or start ranks with scripts/weft-run", world, world - 1)
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
  if world > 1 and (not has_port or port == 0) then
    fail(2, "init", "WORLD_SIZE=%d needs MASTER_PORT (1..65535; and MASTER_ADDR) to find rank 0's store%s; "
         .. "start ranks with scripts/weft-run", world, has_port and ", not 0 (a port the others cannot know)" or "")
  end
  -- every rank holds a connection to rank 0's store: a cap below the world
  -- leaves a rank waiting at the door until the timeout ("unreachable")
  local conns = tonumber(os.getenv("WEFT_STORE_MAX_CONNS") or "")
  if world > 1 and conns and conns > 0 and conns < world then
    fail(2, "init", "WEFT_STORE_MAX_CONNS=%d is below WORLD_SIZE=%d: every rank holds a connection to the store; "
         .. "set at least %d, or unset it (the default: the fd limit less 1/8)", conns, world, world)
  end
  local addr = os.getenv("MASTER_ADDR")
  if addr == nil or addr == "" then addr = "127.0.0.1" end
  local timeout = env_int("WEFT_TIMEOUT_MS", M.DEFAULT_TIMEOUT_MS, 1)
  local hb = os.getenv("WEFT_HOST_BACKEND")
  if hb == "" then hb = nil end
  return { rank = rank, world_size = world, local_rank = lrank, local_world_size = lws,
           master_addr = addr, master_port = port, timeout_ms = timeout, host_backend = hb,
           launched = has_world }
end

local HOST_BACKENDS = { auto = true, shm = true, store = true, gloo = true, hier = true }
-- forced host paths (groups across nodes): store, flat gloo, hierarchical
local FORCED = { store = true, gloo = true, hier = true }

-- Rank 0 hosts the store: after a failure it keeps serving a moment, so the
-- others read why (a tombstone: "rank R died") rather than "store gone".
local function close_after_failure(store)
  if S.rank == 0 then
    local ffi = require("ffi")
    if not pcall(function() return ffi.C.weft_dist_poll_ end) then
      ffi.cdef [[ int weft_dist_poll_(void *fds, unsigned long n, int timeout) __asm__("poll"); ]]
    end
    ffi.C.weft_dist_poll_(nil, 0, 500)
  end
  store:close()
end

local function sleep_ms(ms)
  local ffi = require("ffi")
  if not pcall(function() return ffi.C.weft_dist_poll_ end) then
    ffi.cdef [[ int weft_dist_poll_(void *fds, unsigned long n, int timeout) __asm__("poll"); ]]
  end
  ffi.C.weft_dist_poll_(nil, 0, ms)
end

-- Rank 0's store, or its own. A rank whose shutdown ended early (rank 0 was
-- still busy) must not join the store of the world it left: that store
-- would close under it a moment later ("rank 0 is gone"). Its key
-- weft/shutdown (the goodbyes) marks it; wait, sleeping, until rank 0 has
-- closed it and opened the next one, within the timeout.
local function open_store(timeout)
  local store = require("weft.store")
  local now_ms = require("weft.internal.clock").now_ms
  local deadline = now_ms() + timeout
  while true do
    local s = store.open { host = S.master_addr, port = S.master_port, server = S.rank == 0,
                           timeout_ms = timeout }
    if S.rank == 0 then return s end
    local ok, old = pcall(s.check, s, { "weft/shutdown" })
    if ok and not old then return s end
    s:close()
    if not ok then error(old, 0) end
    if now_ms() >= deadline then
      error(("weft: init: the store at %s:%d is still the previous world's, which rank 0 is shutting "
             .. "down (weft.shutdown() there did not finish within %d ms)")
            :format(S.master_addr, S.master_port, timeout), 0)
    end
    sleep_ms(100)
  end
end

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

local function same_world_size(store, timeout)
  if S.rank == 0 then store:set("weft/world_size", tostring(S.world_size)); return end
  local v = store:get("weft/world_size", timeout)
  if tonumber(v) ~= S.world_size then
    error(("weft: init: this rank (RANK=%d) started with WORLD_SIZE=%d, rank 0 with WORLD_SIZE=%s: every rank "
           .. "needs the same (start ranks with scripts/weft-run)"):format(S.rank, S.world_size, tostring(v)), 0)
  end
end

-- a timeout the C waits take as it is (an int of milliseconds): NaN, inf,
-- fractions and 2^40 would become another bound there
local function valid_timeout(v)
  return type(v) == "number" and v >= 1 and v <= 2147483647 and v == math.floor(v)
end

-- init{timeout_ms=, backend=} -> the world GroupCoordinator. Idempotent.
-- backend: "auto" (default), or "store" to force the store path for host tensors.
local ledgers_differ   -- recover's comparison of the groups' ledgers (below)

function M.init(opts)
  opts = opts or {}
  if type(opts) ~= "table" then fail(2, "init", "options must be a table, got %s", type(opts)) end
  for k in pairs(opts) do
    if k ~= "timeout_ms" and k ~= "backend" then fail(2, "init", "unknown option %q (timeout_ms, backend)", tostring(k)) end
  end
  if S.initialized then return S.world end
  -- every WEFT_* variable set: a bad value raises here, on every rank; an
  -- unknown name is reported once (rank 0) with the closest known one
  require("weft.internal.settings").check_environment()
  local env = M.parse_env()
  local timeout = opts.timeout_ms or env.timeout_ms
  if not valid_timeout(timeout) then
    fail(2, "init", "timeout_ms must be a whole number of milliseconds in 1..2147483647 (as WEFT_TIMEOUT_MS), got %s",
         show(timeout))
  end
  local hb = opts.backend or env.host_backend or "auto"
  if not HOST_BACKENDS[hb] then
    fail(2, "init", "unknown backend %q (auto, shm, store, gloo, hier)", tostring(hb))
  end
  S.rank, S.world_size = env.rank, env.world_size
  S.launched = env.launched
  S.local_rank, S.local_world_size = env.local_rank, env.local_world_size
  S.master_addr, S.master_port = env.master_addr, env.master_port
  S.timeout_ms = timeout
  S.host_backend = FORCED[hb] and hb or nil
  S.world_same_node = nil
  if S.world_size > 1 then
    S.store = open_store(timeout)
    -- from here a death of this rank is seen by the others within ~200 ms
    local rok, rerr = pcall(S.store.register_rank, S.store, S.rank, S.world_size)
    -- every rank started with rank 0's WORLD_SIZE: one with another would
    -- wait for ranks that do not exist, and the others for it
    if rok then rok, rerr = pcall(same_world_size, S.store, timeout) end
    if not rok then S.store:close(); S.store = nil; error(rerr, 2) end
  end
  local ranks = {}
  for r = 0, S.world_size - 1 do ranks[r + 1] = r end
  local ok, world = pcall(group.new, group_opts("world", ranks))
  if not ok then
    if S.store then close_after_failure(S.store); S.store = nil end
    error(world, 2)
  end
  S.world = world
  S.world_same_node = world.same_node and true or nil
  S.initialized = true
  S.init_opts = opts
  S.pending_recover = nil
  -- the end of a recover (this one's, or one whose shutdown failed on this
  -- rank: its init comes here too, while the others are in recover): every
  -- rank compares the groups' ledgers first, before any other collective
  local ledgers = S.recovering
  S.recovering = nil
  if ledgers and S.world_size > 1 then
    local why = ledgers_differ(world:all_gather_object(ledgers))
    world._ledger = nil   -- this exchange is recover's own, not the caller's
    if why then fail(2, "recover", "%s", why) end
  end
  return world
end

function M.is_initialized() return S.initialized end

-- What to do when a world of one process (no launcher) meets a call that
-- needs more ranks: "": the world came from a launcher, nothing to add.
local function launcher_hint(n)
  if S.launched ~= false then return "" end
  local script = (arg and arg[0] and arg[0] ~= "" and not arg[0]:find("^%-")) and arg[0] or "script.lua"
  return (": this process runs alone (no launcher environment); start %s ranks with scripts/weft-run -n %s %s")
         :format(n and tostring(n) or "N", n and tostring(n) or "N", script)
end
M.launcher_hint = launcher_hint

-- How a user of the launcher fixes a world that is not tp x pp (for
-- topology.world_mismatch): the weft-run line that starts that many ranks
-- (-n counts ranks per node), or the tp / pp that fit the ranks started.
local function mismatch_words()
  local script = (arg and arg[0] and arg[0] ~= "" and not arg[0]:find("^%-")) and arg[0] or "script.lua"
  if script:find("weft%-repl$") then script = "--repl" end   -- the REPL's ranks run scripts/weft-repl
  local nodes = tonumber(os.getenv("WEFT_NNODES")) or 1
  local function world(n)
    if nodes > 1 then
      if n % nodes ~= 0 then return ("a world of %d ranks (not a multiple of --nnodes %d)"):format(n, nodes) end
      return ("scripts/weft-run --nnodes %d -n %d %s on each node"):format(nodes, n / nodes, script)
    end
    return ("scripts/weft-run -n %d %s"):format(n, script)
  end
  return { world = world, tp = "tp = %d", pp = "pp = %d" }
end

local function need_init(op)
  if not S.initialized then fail(3, op, "weft is not initialized (call weft.init() first)") end
end

---------------------------------------------------------------- model parallel
local concat = table.concat

-- Arguments as every rank must pass them: long names folded to short ones,
-- defaults dropped (tp=1 is no argument), values as text ("k=v" sorted).
local function mp_args(topology, opts)
  local t = {}
  for k, v in pairs(opts) do
    local key = topology.LONG_NAMES[k] or tostring(k)
    local tv = type(v)
    local text = (tv == "number" or tv == "string" or tv == "boolean") and tostring(v) or ("<" .. tv .. ">")
    if key == "duplicate_tp_group" then text = v and "true" or nil end
    if text ~= "1" or key == "duplicate_tp_group" then t[key] = text end
  end
  if os.getenv("WEFT_USE_MQ_BROADCASTER") == "1" then t["WEFT_USE_MQ_BROADCASTER"] = "1" end
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = k .. "=" .. t[k] end
  return concat(parts, " ")
end

local function parse_args_text(s)
  local t = {}
  for k, v in s:gmatch("([^%s=]+)=(%S+)") do t[k] = v end
  return t
end

-- "rank 1: tp=4; ranks 0,2,3: tp=2": only the arguments that differ, ranks
-- grouped by what they passed (a missing argument shows its default).
function M.describe_disagreement(views, ranks, default)
  local parsed, keys, seen = {}, {}, {}
  for i = 1, #views do
    parsed[i] = parse_args_text(views[i])
    for k in pairs(parsed[i]) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
  end
  table.sort(keys)
  local differ = {}
  for _, k in ipairs(keys) do
    for i = 2, #views do
      if parsed[i][k] ~= parsed[1][k] then differ[#differ + 1] = k; break end
    end
  end
  local texts = {}
  for i = 1, #views do
    local parts = {}
    for j, k in ipairs(differ) do parts[j] = k .. "=" .. (parsed[i][k] or default(k)) end
    texts[i] = concat(parts, " ")
  end
  -- grouped as a call mismatch's ranks are
  return require("weft.group.objects").describe_calls(ranks, texts)
end

local function mp_default(k)
  if k == "duplicate_tp_group" then return "false" end
  if k == "WEFT_USE_MQ_BROADCASTER" then return "unset" end
  return "1"
end

-- One all-gather on the world of every rank's normalised arguments: ranks
-- that disagree all fail at once, naming who passed what (instead of building
-- different groups and meeting nobody until the timeout).
agree_mp_args = function(topology, opts)
  local world = S.world
  if S.world_size == 1 or not world then return end
  local op = "initialize_model_parallel"
  local list, offs = group.exchange(world, op, op, mp_args(topology, opts))
  local views, differ = {}, false
  for i = 1, #list do
    views[i] = list[i]:sub(offs[i] + 1)
    if views[i] ~= views[1] then differ = true end
  end
  if differ then
    error(("weft: %s: ranks passed different arguments: %s"):format(op,
          M.describe_disagreement(views, world.ranks, mp_default)), 3)
  end
end
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
--   duplicate_tp_group=bool}; long SGLang names are accepted too. Returns
-- nothing (weft.plan() has the plan). Collective on the world: the ranks
-- first agree on the arguments (one all-gather), so a rank that passed
-- others fails at once on every rank.
function M.initialize_model_parallel(opts)
  local op = "initialize_model_parallel"
  opts = opts or {}
  if type(opts) ~= "table" then fail(2, op, "options must be a table, got %s", type(opts)) end
  if not S.initialized then M.init() end
  if S.groups.tp then
    fail(2, op, "model parallel groups are already initialized (call weft.destroy_model_parallel() first)")
  end
  local topology = require("weft.topology")
  agree_mp_args(topology, opts)
  -- sizes, names and divisibility are checked by the topology module, with
  -- messages naming this operation
  local okv, plan, dup = pcall(topology.validate, opts, S.world_size, 2, mismatch_words())
  if not okv then
    local need
    if type(opts) == "table" then
      local tp = opts.tp or opts.tensor_model_parallel_size or 1
      local pp = opts.pp or opts.pipeline_model_parallel_size or 1
      if type(tp) == "number" and type(pp) == "number" then need = tp * pp end
    end
    local msg = tostring(plan)
    msg = msg:sub(msg:find("weft: ", 1, true) or 1)   -- its position is validate's caller's: ours now
    -- a process alone: the fix is the launcher (not tp=1 pp=1)
    if need and need > S.world_size and S.launched == false then
      msg = msg:gsub(" = %d+: use .*$", "") .. launcher_hint(need)
    end
    error(msg, 2)
  end
  S.generation = S.generation + 1   -- initializations so far (the cpu groups count their own)
  local aliases = plan.aliases or {}
  local created = {}
  local function build(kind, lists, name_prefix)
    for i, ranks in ipairs(lists) do
      for _, r in ipairs(ranks) do
        if r == S.rank then
          local name = name_prefix .. "." .. (i - 1)
          return group.new(group_opts(name, ranks, { cpugroup_name = "mp/" .. name,
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
  S.mp_opts = opts
  -- nothing returned (and so nothing printed by the REPL, on every rank):
  -- weft.plan() gives the plan, print(weft.plan()) or weft.plan():show() its table
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
  S.mp_opts = nil
  S.pdmux = false
end

---------------------------------------------------------------- custom groups
-- Members agree on the rank list before they build the group. The group's
-- store keys carry its rank list, so members that disagree would never meet;
-- here each member posts its list under a key of the name alone (a "lobby")
-- and reads the lists of the ranks on its own list as they come: a list that
-- differs fails at once, on both sides, naming who passed what.
local now_ms = require("weft.internal.clock").now_ms
local function agree_custom(name, ranks, gen, timeout)
  local op = "create_custom_group"
  local store = S.store
  local base = ("weft/cg-lobby/%s/%d/"):format(name, gen)
  local mine = concat(ranks, ",")
  store:set(base .. S.rank, mine)
  local pending = {}
  for _, r in ipairs(ranks) do if r ~= S.rank then pending[#pending + 1] = r end end
  local deadline = now_ms() + timeout
  while #pending > 0 do
    local still = {}
    for _, r in ipairs(pending) do
      local v = store:try_get(base .. r)
      if v == nil then
        still[#still + 1] = r
      elseif v ~= mine then
        local a, b = { r, v }, { S.rank, mine }
        if a[1] > b[1] then a, b = b, a end
        error(("weft: %s: ranks passed different rank lists for group %s: rank %d: ranks %s; rank %d: ranks %s")
              :format(op, name, a[1], a[2], b[1], b[2]), 3)
      end
    end
    if #still > 0 then   -- wait a slice for one of them, on the server (no spinning)
      local left = deadline - now_ms()
      if left > 0 then pcall(store.wait, store, { base .. still[1] }, math.max(1, math.min(100, left))) end
    end
    pending = still
    if #pending > 0 and now_ms() >= deadline then
      local t = {}
      for i, r in ipairs(pending) do t[i] = tostring(r) end
      error(("weft: %s: timed out after %d ms creating group %s (ranks %s); rank%s %s did not call create_custom_group")
            :format(op, timeout, name, mine, #t > 1 and "s" or "", concat(t, ", ")), 3)
    end
  end
end

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
    if type(r) ~= "number" then
      fail(2, op, "ranks must be integers, got %s at index %d", show(r), i)
    end
    if r ~= math.floor(r) or r < 0 or r >= S.world_size then
      fail(2, op, "rank %s is out of range for a world of %d%s", tostring(r), S.world_size,
           launcher_hint(type(r) == "number" and r >= S.world_size and r == math.floor(r) and r + 1 or nil))
    end
    if seen[r] then fail(2, op, "rank %d appears twice", r) end
    seen[r] = true
  end
  name = name or "custom"
  if type(name) ~= "string" or name == "" or #name > 100 or name:find("[%s/]") then
    fail(2, op, "name must be a string of 1..100 characters without spaces or '/', got %s", show(name))
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
  if not valid_timeout(timeout) then
    fail(2, op, "timeout_ms must be a whole number of milliseconds in 1..2147483647 (as WEFT_TIMEOUT_MS), got %s",
         show(timeout))
  end
  local gen = (S.custom_counter[key] or 0)
  local g
  if seen[S.rank] then
    if #ranks > 1 then agree_custom(name, ranks, gen, timeout) end
    -- only members count, so the counter agrees among exactly those who meet
    S.custom_counter[key] = gen + 1
    -- one cpu group name per rank set, whatever the group's name: its
    -- generation counter (a store key per member, src/host/cpugroup.c) gives
    -- every creation keys of its own (members create the groups of one rank
    -- set together, in one order, so their counters agree), and create +
    -- destroy cycles add no keys, whether they reuse a name (issue 24) or
    -- name every group anew (issue 37: a counter per name left one key per
    -- member for each name ever used)
    g = group.new(group_opts(name, ranks, { cpugroup_name = "cg/[" .. list .. "]", timeout_ms = timeout }))
    if #ranks > 1 then
      -- every member has read every list: the lobby key can go
      group.exchange(g, op, op, "")
      S.store:delete(("weft/cg-lobby/%s/%d/%d"):format(name, gen, S.rank))
    end
  else
    g = group.new(group_opts(name, ranks, { timeout_ms = timeout }))
  end
  S.custom[#S.custom + 1] = g
  return g
end

-- g:destroy() forgets a custom group here too (shutdown destroys the rest)
group.destroy_hooks[#group.destroy_hooks + 1] = function(g)
  local list = S.custom
  for i = #list, 1, -1 do
    if list[i] == g then table.remove(list, i); return end
  end
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
    if S.groups.tp and kind == "dcp" then
      fail(3, kind, "%s group is not created: dcp is 1 (pass dcp > 1 to weft.initialize_model_parallel; "
           .. "weft.dcp_or_nil() returns nil instead of raising)", DESCR[kind])
    elseif S.groups.tp and kind == "pdmux_prefill_tp" then
      fail(3, kind, "%s group is not created (pass duplicate_tp_group=true to weft.initialize_model_parallel)",
           DESCR[kind])
    end
    fail(3, kind, "%s group is not initialized (call weft.initialize_model_parallel first)", DESCR[kind] or kind)
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

-- the plan of the model-parallel groups (a topology plan: print() or :show()
-- gives its table), nil before initialize_model_parallel
function M.plan() return S.plan end

---------------------------------------------------------------- recover
-- recover() -> the new world GroupCoordinator. After an interrupted or
-- aborted collective (docs/faults.md) the groups refuse work, as their ranks
-- may disagree on how far they got. Called on EVERY rank, recover shuts
-- weft down (local destroys, then the usual goodbye through the store) and
-- brings it up again with the same options: init, then the same
-- initialize_model_parallel when there was one. Custom groups are not
-- re-created (create them again). Not for a dead rank: its job is over.
-- Every group counts the host calls it completed and the last one that
-- failed (weft.group.host's rethrow). A rank that was stopped between its
-- last receive and its return, or whose store did not answer when it gave
-- up, can complete a call another member aborted: no protocol prevents
-- that. recover() finds it: each rank publishes the aborts its groups could
-- not (the store did not answer then), takes its groups' counts before the
-- shutdown, and after the new init every rank compares every group's counts
-- over the new world; a difference raises on every rank, naming the call,
-- who completed it and who aborted it. The groups are rebuilt all the same
-- (the job may go on from a point it trusts), but a loop that just retried
-- its call would pair one rank's retry with another's next call.
local function ledger_of(g, kind)
  local L = g._ledger
  return { name = tostring(g.unique_name or kind), ranks = table.concat(g.ranks, ","),
           done = L and L.done or 0, fail_op = L and L.fail_op or false,
           gen = S.generation }
end

local function take_ledgers()
  local list, seen = {}, {}
  local function add(g, kind)
    if g and not seen[g] then
      seen[g] = true
      if g.cpu_group then pcall(g.cpu_group.publish_abort, g.cpu_group) end
      list[#list + 1] = ledger_of(g, kind)
    end
  end
  add(S.world, "world")
  for _, kind in ipairs(M.KINDS) do add(S.groups[kind], kind) end
  for _, g in ipairs(S.custom) do add(g, "custom") end
  return list
end

-- the first group whose members' counts differ, as a message; nil if none
function ledgers_differ(all)   -- declared above M.init
  local by = {}      -- "name|ranks" -> { rank -> ledger }
  local order = {}
  for r = 1, #all do
    for _, l in ipairs(all[r]) do
      local k = l.name .. "|" .. l.ranks
      if not by[k] then by[k] = {}; order[#order + 1] = k end
      by[k][r - 1] = l
    end
  end
  for _, k in ipairs(order) do
    local m = by[k]
    local lo, hi = math.huge, -1
    for _, l in pairs(m) do lo = math.min(lo, l.done); hi = math.max(hi, l.done) end
    if lo ~= hi then
      local completed, aborted, op, name, gen = {}, {}, nil, nil, nil
      for r, l in pairs(m) do
        name, gen = l.name, l.gen
        if l.done > lo then completed[#completed + 1] = r
        else aborted[#aborted + 1] = r; op = op or l.fail_op end
      end
      table.sort(completed); table.sort(aborted)
      local n = lo + 1
      return ("group %s: its %s call #%d of generation %d completed on %s %s and was aborted on %s %s: "
              .. "results from #%d on cannot be trusted (the groups are rebuilt and usable; go on "
              .. "from a point every rank agrees on, e.g. redo the work from call #%d on)")
        :format(name, op or "host", n, gen, #completed > 1 and "ranks" or "rank", table.concat(completed, ","),
                #aborted > 1 and "ranks" or "rank", table.concat(aborted, ","), n, n)
    end
  end
end

-- The second half of a recover: init with the same options, then the same
-- model parallel groups. A divergence found by init's ledger comparison is
-- raised after the groups are rebuilt, so the caller can go on from a point
-- every rank agrees on.
local function finish_recover(init_opts, mp_opts)
  S.pending_recover = { init_opts = init_opts, mp_opts = mp_opts }
  local ok, world = pcall(M.init, init_opts)
  if not ok and not S.initialized then error(world, 0) end   -- recover() again finishes it
  S.pending_recover = nil
  if mp_opts then M.initialize_model_parallel(mp_opts) end
  if not ok then error(world, 0) end
  return world
end

function M.recover()
  if not S.initialized then
    -- an earlier recover() got through its shutdown but not its init (a
    -- rank was still busy, the store not up yet): finish that one
    local p = S.pending_recover
    if p then return finish_recover(p.init_opts, p.mp_opts) end
    fail(2, "recover", "weft is not initialized (nothing to recover; call weft.init())")
  end
  local init_opts, mp_opts = S.init_opts, S.mp_opts
  local ledgers = take_ledgers()
  local ok, err = pcall(M.shutdown)
  if not ok then
    S.store, S.world, S.initialized, S.groups, S.plan = nil, nil, false, {}, nil
    S.recovering = ledgers   -- the next weft.init() or weft.recover() finishes the recovery with the others
    S.pending_recover = { init_opts = init_opts, mp_opts = mp_opts }
    fail(2, "recover", "shutting down failed: %s (weft.recover() or weft.init() finishes the recovery; "
         .. "if a rank died, restart the job)", tostring(err))
  end
  S.recovering = ledgers
  return finish_recover(init_opts, mp_opts)
end

---------------------------------------------------------------- shutdown
-- Returns only once rank 0 closed the server, so an init right after (as in
-- weft.recover()) never meets the old store. The C wait never reconnects: a
-- connection the server closed is the answer, and a new one to that port
-- could reach whatever holds it next and wait there for nothing.
local function wait_store_closed(store)
  local wffi = require("weft.internal.ffi")
  local C = wffi.C
  local rc = C.weft_store_wait_closed(store.handle, S.timeout_ms)
  -- ECLOSED: a rank of the world is gone; this rank's part is done all the same
  if rc == 0 or rc == C.WEFT_ECLOSED then return end
  if rc == C.WEFT_ETIMEOUT then
    error(("weft: shutdown: rank 0 did not close the store within %d ms (it has not called "
           .. "weft.shutdown() yet, or is still busy: %s); this rank's groups are gone, and "
           .. "weft.init() waits until rank 0 has closed that store"):format(S.timeout_ms, wffi.last_error()), 0)
  end
  error(("weft: shutdown: waiting for rank 0 to close the store: %s"):format(wffi.last_error()), 0)
end

-- Destroys every group (locally), then closes the store. Rank 0 (the store
-- server) waits until every other rank has said goodbye, bounded by the
-- timeout, so no rank loses the store in the middle of its last request.
function M.shutdown()
  if not S.initialized then return end
  local world, store = S.world, S.store
  local err
  M.destroy_model_parallel()
  for i = #S.custom, 1, -1 do S.custom[i]:destroy() end  -- each removes itself
  S.custom = {}
  if world then world:destroy() end
  if store then
    if not err then
      local ok, e = pcall(function()
        local need = S.world_size - 1
        if S.rank ~= 0 then
          if store:add("weft/shutdown", 1) == need then store:set("weft/shutdown/done", "1") end
          wait_store_closed(store)
        else
          store:get("weft/shutdown/done", S.timeout_ms)
        end
      end)
      if not ok then err = e end
    end
    if err then
      close_after_failure(store)
    else
      -- this rank's part is done: its leave ends no peer's wait for weft.shutdown
      require("weft.internal.ffi").C.weft_store_finish(store.handle)
      store:close()
    end
  end
  S.store, S.world = nil, nil
  S.initialized = false
  S.groups, S.plan = {}, nil
  if err then error(err, 2) end
end

return M
