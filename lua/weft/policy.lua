-- weft.policy — which backend serves a collective, as a readable table of rules.
--
-- Rules are tried in order; the first whose predicate holds for (group, op,
-- tensor, reduce_op) serves the call. A rule may list the `ops` it serves
-- (nil: every op). Every rule weft has is written in M.rules below, in the
-- order it is tried: host and device and the fusion patterns'. Nothing
-- inserts rules by position at load time (policy.add_rule is for users).
--
-- A rule's `when` is a function (the host rules: this file owns their
-- predicates) or a key naming a predicate a backend module registers when it
-- loads: policy.predicate("custom_ar", fn [, text]) (weft.backends.
-- device_backends: the device rules; weft.fusion_ext: "fused_ext"); `text`
-- gives the why / why_not / detail the backend computes. Registering
-- resolves the key once: the function is stored on every rule naming it
-- (`r.test`), so select() makes no lookup per call. A rule whose key has no
-- registered function (its backend module not loaded) is skipped: it
-- matches nothing, select() passes over it, and explain shows it as skipped,
-- naming the key. In weft every key has its function (weft.group loads both
-- modules, in a host-only build too); policy.lua loaded alone refuses every
-- device tensor through its own default for "no_cuda" (below), so a device
-- tensor never reaches the host rules.
-- The group module maps the chosen name to an implementation registered
-- with group.register_backend(name, impl).
--
-- select() walks this table and returns constants (no tables or strings are
-- built per call). A rule whose answer depends only on the group, the op, the
-- tensor's dtype and device and the reduction may say `cacheable = true`:
-- the group then remembers the decision (group.lua, per group, invalidated
-- when M.version changes) and skips the walk on the hot path. Rules that look
-- at sizes or runtime state (graph capture, workspace) must leave it unset.
local show = require("weft.internal.show").value -- names a refused value's type

local M = {}
M.version = 1

-- Host dtypes/ops the shared-memory engine reduces natively (src/host/shm.c).
-- Anything else on one node goes through "shm_gather" (all-gather over shared
-- memory, then a local reduction in rank order: same result on every rank).
M.shm_reduce = {
  dtypes = { f32 = true, f16 = true, bf16 = true, f64 = true, i32 = true, i64 = true },
  ops = { sum = true, max = true, min = true },
}

local function is_device(t)
  return t ~= nil and t.device ~= nil and t.device ~= "cpu"
end

local function host_forced(g)
  return g.host_backend
end

local human_bytes   -- below

-- weft was built with Gloo (weft.backends.host_nodes asks the library once)
local function gloo_built()
  local hn = package.loaded["weft.backends.host_nodes"]
  return hn ~= nil and hn.built == true
end

-- Hierarchical all-reduce across nodes (shm inside nodes, Gloo among node
-- leaders) from this many bytes on, or wherever flat Gloo would run its
-- ring; below it, where the Gloo shim's small path applies (a power-of-two
-- group), flat Gloo wins: one exchange per round, no shm hops (2 x 2 nodes:
-- 48-110 µs against 100-180 µs up to 64 KiB; within noise at 256 KiB - 1
-- MiB; the hierarchy 1.7-2x faster from 4 MiB).
-- bench/results/host-allreduce-nodes-*.md has the measurement;
-- WEFT_HIER_MIN_BYTES overrides, WEFT_HOST_BACKEND=gloo|hier forces.
M.hier_min_bytes = tonumber(os.getenv("WEFT_HIER_MIN_BYTES")) or 1048576

-- One rank per node, small all-reduces: one all-gather through the store and
-- a local reduction beat Gloo's ring (each ring step is a hand-off between
-- Gloo's loop thread and the caller): up to this many bytes x ranks, except
-- where the Gloo shim's small path applies (a power-of-two group up to
-- weft_gloo_small_max bytes: synchronous pairs, faster than the store).
M.store_small_max = tonumber(os.getenv("WEFT_STORE_SMALL_MAX")) or 131072

-- true, or false and why not (explain's text)
function M.store_small_applies(g, op, t, rop)
  if g.same_node then return false, "all ranks on one node" end
  if not gloo_built() then return false, "weft was built without Gloo (the store path is taken anyway)" end
  if t == nil then return false, "no tensor given" end
  local f = host_forced(g)
  if f == "gloo" or f == "hier" then return false, ("%s forced (WEFT_HOST_BACKEND=%s)"):format(f, f) end
  local nc = g.node_count or g.world_size
  if nc < g.world_size then
    return false, ("not one rank per node (%d ranks on %d nodes)"):format(g.world_size, nc)
  end
  local nb = tonumber(t.nbytes) or 0
  if op == "all_reduce" and require("weft.gloo").small_path(g.world_size, nb) then
    return false, ("Gloo's small path takes %s over %d ranks (synchronous pairs: faster than the store)")
      :format(human_bytes(nb), g.world_size)
  end
  if nb * g.world_size > M.store_small_max then
    return false, ("%s x %d ranks gathered is above policy.store_small_max (%s)")
      :format(human_bytes(nb), g.world_size, human_bytes(M.store_small_max))
  end
  return true
end

-- true, or false and why not (explain's text)
-- Deterministic mode (M.deterministic, §10 of docs/policy.md): a float sum
-- or product over Gloo (a ring: each chunk starts at another rank) is not in
-- rank order; such host calls across nodes take the store path instead,
-- which reduces in rank order like shm (weft_host_reduce).
local DET_FLOAT = { f32 = true, f16 = true, bf16 = true, f64 = true }
local DET_ARITH = { sum = true, prod = true, avg = true, mean = true }
local DET_OPS = { all_reduce = true, reduce_scatter = true, reduce_scatterv = true }
local function det_host_ring(g, op, t, rop)
  return DET_OPS[op] and t ~= nil and DET_FLOAT[t.dtype] and DET_ARITH[rop or "sum"]
         and M.deterministic(g) or false
end
M.det_host_ring = det_host_ring
-- whether deterministic mode decides the route of this host call (ranks on
-- several nodes, a float sum or product): the ranks must agree on the mode
-- first (weft.group.host, once per group), or they meet on no route
function M.det_host_routed(g, op, t, rop)
  return not g.same_node and DET_OPS[op] and t ~= nil and DET_FLOAT[t.dtype] and DET_ARITH[rop or "sum"]
         and not (t.device ~= nil and t.device ~= "cpu") or false
end

function M.hier_applies(g, op, t, rop)
  if g.same_node then return false, "all ranks on one node" end
  if det_host_ring(g, op, t, rop) then return false, "deterministic mode: Gloo's ring is not in rank order" end
  if not gloo_built() then return false, "weft was built without Gloo" end
  if host_forced(g) == "gloo" then return false, "flat Gloo forced (WEFT_HOST_BACKEND=gloo)" end
  if t == nil then return false, "no tensor given" end
  local nc = g.node_count or g.world_size
  if nc >= g.world_size then return false, "one rank per node: nothing to reduce inside a node" end
  if not (M.shm_reduce.dtypes[t.dtype] and M.shm_reduce.ops[rop or "sum"]) then
    return false, ("shm does not reduce %s %s natively"):format(tostring(t.dtype), tostring(rop or "sum"))
  end
  if host_forced(g) == "hier" then return true end
  local nb = tonumber(t.nbytes) or 0
  if nb < M.hier_min_bytes and op == "all_reduce" and require("weft.gloo").small_path(g.world_size, nb) then
    return false, ("%s is below policy.hier_min_bytes (%s) and flat Gloo takes its small path "
                   .. "(recursive doubling over %d ranks): faster there")
      :format(human_bytes(nb), human_bytes(M.hier_min_bytes), g.world_size)
  end
  return true
end

-- Rules that look at the size only across nodes: on one node they never
-- match whatever the size, so the decision past them may be memoized (the
-- small host call's dispatch is then a table lookup, not this list).
local function same_node_group(g) return g.same_node == true end

-- The table itself. Fields: name (shown by explain), backend, ops, when, why,
-- cacheable (true, or a function of the call saying so).
M.rules = {
  { name = "single rank", backend = "bypass", cacheable = true,
    when = function(g) return g.world_size == 1 end,
    why = "group of one rank: nothing to exchange (the seed's bypass)" },
  -- device rules (device = true; explain folds them for host tensors): the
  -- seed's all_reduce order and its eager/graph table. Predicates, and the
  -- texts computed from the device state, from weft.backends.device_backends
  -- (the "fused_ext" rule's from weft.fusion_ext).
  { name = "no CUDA", device = true, backend = "no_device_backend", cacheable = true,
    when = "no_cuda",
    why = "device tensor, but this process has no CUDA device (or libweft was built without CUDA)" },
  { name = "invalid WEFT_ALLREDUCE", device = true, backend = "invalid_override", cacheable = true,
    ops = { all_reduce = true },
    when = "invalid_override",
    why = function() return tostring(M.override_error) end,
    why_not = "no invalid override" },
  { name = "custom all-reduce (should_custom_ar)", device = true, backend = "custom_ar",
    ops = { all_reduce = true },
    when = "custom_ar" },
  { name = "fused kernel", device = true, backend = "fused", cacheable = true,
    ops = { fused_allreduce_rmsnorm = true },
    when = "fused",
    why = "device tensors: the fused all-reduce + residual + RMSNorm kernel where it applies, "
          .. "else all_reduce + the norm kernel (checks below)",
    why_not = "host tensors: all-reduce, then weft_host_rmsnorm" },
  { name = "fused kernel (MoE, pre/post norm, reduce-scatter)", device = true, backend = "fused_ext",
    cacheable = true,
    ops = { fused_moe_allreduce_rmsnorm = true, fused_moe_finalize_allreduce_rmsnorm = true,
            fused_allreduce_prepost_rmsnorm = true, fused_reduce_scatter_rmsnorm = true },
    when = "fused_ext",
    why = "device tensors: the fused kernel (kernels/fused_ext.cu) where it applies, else the same steps as "
          .. "separate device calls (checks below)",
    why_not = "host tensors: the local steps and the group's host collectives (weft.fusion_ext host path)" },
  { name = "deterministic mode", device = true, backend = "determ_refused", cacheable = true,
    ops = { all_reduce = true, reduce_scatter = true, reduce_scatterv = true },
    when = "deterministic" },
  { name = "host staging (no NCCL)", device = true, backend = "device_host", cacheable = true,
    when = "host_staging" },
  { name = "NCCL", device = true, backend = "nccl", cacheable = true,
    when = "nccl",
    why = "device tensor: NCCL (one communicator per group, made on first device use; the seed's PyNccl "
          .. "in graphs and torch.distributed when eager are both this)",
    why_not = "host tensor" },
  -- host rules
  { name = "forced store", backend = "store", cacheable = true,
    when = function(g) return host_forced(g) == "store" end,
    why = "host tensor, store backend forced (weft.init{backend=\"store\"} or WEFT_HOST_BACKEND)" },
  { name = "hierarchical across nodes", backend = "gloo_hier", ops = { all_reduce = true },
    cacheable = same_node_group,
    when = function(g, op, t, rop) return M.hier_applies(g, op, t, rop) == true end,
    why = function(g, _, t)
      return ("host tensor of %s across %d nodes: shm all-reduce inside each node, Gloo among "
        .. "the %d node leaders (small: Gloo's synchronous small path for a power-of-two number of leaders, else through the store), shm broadcast back (faster "
        .. "than flat Gloo from %s on: policy.hier_min_bytes, measured on simulated nodes)")
        :format(human_bytes(t and tonumber(t.nbytes) or 0), g.node_count or 0, g.node_count or 0,
                human_bytes(M.hier_min_bytes))
    end,
    why_not = function(g, op, t, rop) return select(2, M.hier_applies(g, op, t, rop)) end },
  { name = "small across nodes", backend = "store", ops = { all_reduce = true },
    cacheable = same_node_group,
    when = function(g, op, t, rop) return M.store_small_applies(g, op, t, rop) == true end,
    why = function(g, _, t)
      return ("host tensor of %s, one rank per node: one all-gather through the store and a "
        .. "local reduction (below policy.store_small_max = %s gathered, faster than Gloo's ring)")
        :format(human_bytes(t and tonumber(t.nbytes) or 0), human_bytes(M.store_small_max))
    end,
    why_not = function(g, op, t, rop) return select(2, M.store_small_applies(g, op, t, rop)) end },
  { name = "gloo across nodes", backend = "gloo", cacheable = true,
    when = function(g, op, t, rop) return not g.same_node and gloo_built() and not det_host_ring(g, op, t, rop) end,
    why = "host tensor, ranks on several nodes: Gloo over TCP (full mesh, ring all-reduce)",
    why_not = function(g, op, t, rop)
      if g.same_node then return "all ranks on one node" end
      if det_host_ring(g, op, t, rop) then
        return "deterministic mode: a float reduction over Gloo's ring is not in rank order (the store path is)"
      end
      return "weft was built without Gloo (libgloo-dev)"
    end },
  { name = "ranks on several nodes", backend = "store", cacheable = true,
    when = function(g) return not g.same_node end,
    why = "host tensor, ranks are not all on one node and weft has no Gloo: exchanged through "
          .. "the TCP store (every byte through rank 0's server; install libgloo-dev and rebuild)" },
  { name = "shm native reduction", backend = "shm", cacheable = true,
    ops = { all_reduce = true, reduce_scatter = true },
    when = function(_, op, t, opname)
      return t ~= nil and M.shm_reduce.dtypes[t.dtype] and M.shm_reduce.ops[opname or "sum"] or false
    end,
    why = "host tensor, all ranks on one node: shared-memory reduction (f32 accumulation)" },
  { name = "shm gather-reduce", backend = "shm_gather", cacheable = true,
    ops = { all_reduce = true, reduce_scatter = true },
    when = function() return true end,
    why = "host tensor on one node, dtype/op not reduced natively by shm: "
          .. "shared-memory all-gather, then a local reduction in rank order" },
  { name = "shm", backend = "shm", cacheable = true,
    when = function() return true end,
    why = "host tensor, all ranks on one node: shared memory" },
}

local rules = M.rules

---------------------------------------------------------------- predicates
-- M.predicates[key] = { when = fn, text = {why=, why_not=, detail=} | nil }:
-- what the backends registered. A rule naming `key` gets `r.test = fn` (the
-- function select() calls: resolved here once, not per call) and the texts
-- given; texts not given are the ones written in the table.
M.predicates = {}
local TEXTS = { "why", "why_not", "detail" }
local written = setmetatable({}, { __mode = "k" })   -- rule -> the texts the table wrote

local function resolve(r)
  local w = r.when
  if type(w) == "function" then r.test = w; return end
  if written[r] == nil then written[r] = { why = r.why, why_not = r.why_not, detail = r.detail } end
  local p = M.predicates[w]
  local text = p and p.text or {}
  r.test = p and p.when or nil
  for _, f in ipairs(TEXTS) do
    local v = text[f]
    if v == nil then v = written[r][f] end
    r[f] = v
  end
end

-- predicate(key, fn [, text]): fn(g, op, t, rop [, out]) -> matched [, choice] for
-- every rule whose `when` is key; text: {why=, why_not=, detail=} (strings
-- or functions of (g, op, t, rop)) for the texts the backend computes. A
-- second call for the same key replaces the first.
function M.predicate(key, fn, text)
  if type(key) ~= "string" or key == "" then
    error("weft: policy.predicate: key must be a non-empty string, got " .. type(key), 2)
  end
  if type(fn) ~= "function" then
    error(("weft: policy.predicate: %q: expected a function, got %s"):format(key, type(fn)), 2)
  end
  if text ~= nil and type(text) ~= "table" then
    error(("weft: policy.predicate: %q: text must be a table {why=, why_not=, detail=}"):format(key), 2)
  end
  M.predicates[key] = { when = fn, text = text }
  for i = 1, #rules do
    if rules[i].when == key then resolve(rules[i]) end
  end
  M.version = M.version + 1
end

-- "no CUDA" before weft.backends.device_backends registers its own: every
-- device tensor is refused (as weft.policy alone, without weft.group)
M.predicate("no_cuda", function(_, _, t) return is_device(t) end,
  { why = "device tensor, and no device backend is registered (weft.backends.device_backends not loaded)" })
for _, r in ipairs(rules) do resolve(r) end

-- select(group, op, tensor [, reduce_op [, out]]) -> backend name, reason,
-- cacheable, choice (cacheable: every rule consulted said cacheable = true, or a
-- function of (group, op, tensor, reduce_op) that returned true: its answer
-- does not depend on the size for this call's group; device rules do not
-- count for host tensors). choice: the matching rule's second value, what
-- it chose inside its backend (the "custom_ar" rule: the algorithm and the
-- kernel, or the error the call raises), handed to the backend with the
-- call; a rule's predicate returns it beside true. out: the call's output
-- pointer where it is not the input's (all_reduce with `out`), handed to the
-- predicates as their fifth argument (the custom all-reduce checks its
-- alignment); nil: in place, or a question about the input alone (explain).
-- Rules with no predicate (test == nil) are passed over.
function M.select(g, op, t, rop, out)
  local cacheable = true
  for i = 1, #rules do
    local r = rules[i]
    local test, ops = r.test, r.ops
    if test ~= nil and (ops == nil or ops[op]) then
      local c = r.cacheable
      -- a device rule (device = true) decides nothing for a host tensor
      if c ~= true and not (r.device and not is_device(t)) and not (c and c(g, op, t, rop)) then
        cacheable = false
      end
      local hit, choice = test(g, op, t, rop, out)
      if hit then return r.backend, r.why, cacheable, choice end
    end
  end
  return nil, "no rule matched", false
end

local function index_of(name)
  for i = 1, #rules do
    if rules[i].name == name or rules[i].backend == name then return i end
  end
end

-- add_rule{name=, backend=, when=, why=, ops=} [, {before = name_or_backend}]
-- For users: a rule of their own (when: a function, or a predicate key).
-- Without `before`, the rule goes second, just after "single rank". (A
-- rule's predicate is resolved here and by policy.predicate: assigning
-- r.when later changes nothing; remove the rule and add it again.)
function M.add_rule(rule, where)
  assert(type(rule) == "table" and type(rule.backend) == "string"
         and (type(rule.when) == "function" or type(rule.when) == "string"),
         "weft: policy.add_rule: need {backend=string, when=function or predicate key, why=string}")
  rule.name = rule.name or rule.backend
  rule.why = rule.why or rule.backend
  local pos = 2
  if where and where.before then
    pos = index_of(where.before)
    if not pos then error("weft: policy.add_rule: no rule named " .. tostring(where.before), 2) end
  end
  resolve(rule)
  table.insert(rules, pos, rule)
  M.version = M.version + 1
  return rule
end

function M.remove_rule(name)
  local i = index_of(name)
  if i then table.remove(rules, i); M.version = M.version + 1; return true end
  return false
end

function human_bytes(n)
  if n >= 1048576 then return ("%.4g MiB"):format(n / 1048576) end
  if n >= 1024 then return ("%.4g KiB"):format(n / 1024) end
  return ("%d B"):format(n)
end
M.human_bytes = human_bytes

---------------------------------------------------------------- modes
-- "graph" while this thread captures through weft.graph, else "eager": the
-- two columns of the seed's eager/graph backend table (graph_capture).
function M.mode()
  local gm = package.loaded["weft.graph"]
  if gm ~= nil and gm.current() ~= nil then return "graph" end
  return "eager"
end

---------------------------------------------------------------- overrides
-- policy.set{all_reduce = "nccl"|"oneshot"|"twoshot"|"oneshot_flag"|"auto"|"default",
--            fused = "oneshot"|"twoshot"|"auto"|"unfused"|"default",
--            group = a GroupCoordinator or its name (default: every group)}
-- A group's own setting wins over the global one; "default" removes it.
-- WEFT_ALLREDUCE=nccl|oneshot|twoshot|auto sets the global all_reduce one at
-- load. Device backends register M.checkers[key](g, value) -> ok, why: a
-- value the group cannot use is refused at set time when the group is given
-- as an object, else the call that needs it raises, naming why.
M.OVERRIDES = {
  all_reduce = { nccl = true, oneshot = true, twoshot = true, oneshot_flag = true, auto = true },
  fused = { oneshot = true, twoshot = true, auto = true, unfused = true },
  -- the quick (compressed) all-reduce, opt-in (docs/quick-allreduce.md);
  -- agreed across the group like deterministic mode
  quick = { int8 = true, int4 = true, fp8 = true, off = true },
}
M.overrides = { global = {}, groups = {} }
M.checkers = {}
M.override_error = nil     -- an invalid WEFT_ALLREDUCE, raised by the calls it would steer

local function choices(set)
  local l = {}
  for k in pairs(set) do l[#l + 1] = k end
  table.sort(l)
  return table.concat(l, ", ")
end

do
  local v = os.getenv("WEFT_ALLREDUCE")
  if v ~= nil and v ~= "" and v ~= "default" then
    if M.OVERRIDES.all_reduce[v] then
      M.overrides.global.all_reduce, M.overrides.global.all_reduce_src = v, "WEFT_ALLREDUCE"
    else
      M.override_error = ("WEFT_ALLREDUCE=%q is not one of %s (or unset it)")
        :format(v, choices(M.OVERRIDES.all_reduce))
    end
  end
end

---------------------------------------------------------------- deterministic mode
-- policy.set{deterministic = true|false|"default" [, group = g]} or
-- WEFT_DETERMINISTIC=1 (read at load): every device all_reduce and
-- fused_allreduce_rmsnorm of f32/f16/bf16 gives bits that depend only on the
-- row's inputs (docs/policy.md §10). The value is local to this process; a
-- group agrees on it over its cpu group (weft.backends.device_backends.setup): at its first
-- device call, and at set time when policy.set is given the group object
-- (then policy.set is collective over that group). M.determ_hooks.agree(g,
-- value) is that agreement (installed by weft.backends.device_backends.setup).
M.determ_hooks = {}
M.determ_env_error = nil
M.determ_env = false
do
  local v = os.getenv("WEFT_DETERMINISTIC")
  if v == "1" or v == "true" or v == "on" then M.determ_env = true
  elseif v ~= nil and v ~= "" and v ~= "0" and v ~= "false" and v ~= "off" then
    M.determ_env_error = ("WEFT_DETERMINISTIC=%q is not 1 or 0 (or unset it)"):format(v)
  end
end

-- deterministic(g) -> on (bool), source: the group's own setting, else the
-- global one, else WEFT_DETERMINISTIC (false when none)
function M.deterministic(g)
  local v, src = M.override(g, "deterministic")
  if v ~= nil then return v, src end
  if M.determ_env then return true, "WEFT_DETERMINISTIC=1" end
  return false, "default"
end

local function set_deterministic(o, g, name)
  local v = o.deterministic
  if v ~= true and v ~= false and v ~= "default" then
    error(("weft: policy.set: deterministic = %s is not true, false or \"default\""):format(tostring(v)), 3)
  end
  local slot = M.overrides.global
  if name then slot = M.overrides.groups[name] or {} end
  -- the value the group will see once this is stored
  local eff = v
  if v == "default" then
    eff = name and M.overrides.global.deterministic
    if eff == nil then eff = M.determ_env end
  end
  if type(g) == "table" and M.determ_hooks.agree then
    local ok, err = pcall(M.determ_hooks.agree, g, eff)   -- collective over g; raises on disagreement
    if not ok then error(tostring(err), 3) end
  end
  if name then M.overrides.groups[name] = slot end
  if v == "default" then slot.deterministic, slot.deterministic_src = nil, nil
  else slot.deterministic, slot.deterministic_src = v, name and "policy.set{group=...}" or "policy.set" end
end

function M.set(o)
  if type(o) ~= "table" then error("weft: policy.set: expected a table like {all_reduce = \"nccl\"}", 2) end
  local g, name = o.group, nil
  if g ~= nil then
    if type(g) == "table" and type(g.unique_name) == "string" then name = g.unique_name
    elseif type(g) == "string" and g ~= "" then name = g
    else error("weft: policy.set: group must be a GroupCoordinator or a group name, got " .. type(g), 2) end
  end
  for k, v in pairs(o) do
    if k ~= "group" and k ~= "deterministic" then
      local allowed = M.OVERRIDES[k]
      if not allowed then
        error(("weft: policy.set: unknown key %q (%s, deterministic, group)"):format(tostring(k), choices(M.OVERRIDES)), 2)
      end
      if v ~= "default" and not allowed[v] then
        error(("weft: policy.set: %s = %s is not one of %s, default"):format(k, tostring(v), choices(allowed)), 2)
      end
      if v ~= "default" and type(g) == "table" and M.checkers[k] then
        local ok, why = M.checkers[k](g, v)
        if not ok then
          error(("weft: policy.set: %s = %q cannot be used on group %s: %s"):format(k, v, name, tostring(why)), 2)
        end
      end
    end
  end
  if o.deterministic ~= nil then set_deterministic(o, g, name) end
  if o.quick ~= nil and type(g) == "table" and M.quick_hooks.agree then
    local ok, err = pcall(M.quick_hooks.agree, g, M.quick_effective(o.quick, name))   -- collective over g
    if not ok then error(tostring(err), 2) end
  end
  local slot = M.overrides.global
  if name then
    slot = M.overrides.groups[name] or {}
    M.overrides.groups[name] = slot
  end
  for k, v in pairs(o) do
    if k ~= "group" and k ~= "deterministic" then
      if v == "default" then slot[k], slot[k .. "_src"] = nil, nil
      else slot[k], slot[k .. "_src"] = v, name and "policy.set{group=...}" or "policy.set" end
      if k == "all_reduce" and not name then M.override_error = nil end
    end
  end
  M.version = M.version + 1
end

-- override(g, key) -> value, source   (nil when none applies; g nil: the
-- global override only)
function M.override(g, key)
  local gs = g ~= nil and M.overrides.groups[g.unique_name] or nil
  if gs ~= nil and gs[key] ~= nil then return gs[key], gs[key .. "_src"] end
  local v = M.overrides.global[key]
  if v ~= nil then return v, M.overrides.global[key .. "_src"] end
  return nil
end

---------------------------------------------------------------- quick all-reduce
-- policy.set{quick = "int8"|"int4"|"fp8"|"off"|"default" [, group = g]} or
-- WEFT_QUICK_ALLREDUCE=... (read at load): device all_reduce sums of bf16/f16
-- from the codec's minimum size (weft.quick.min_bytes) go through the quick
-- all-reduce, whose wire is compressed (it changes the numerics: off by
-- default). Local like deterministic mode; the group agrees on it at its
-- first device call and at policy.set time when given the group object
-- (M.quick_hooks.agree, installed by weft.backends.device_backends.setup; collective over g).
M.quick_hooks = {}
M.quick_env, M.quick_env_error = nil, nil
do
  local v = os.getenv("WEFT_QUICK_ALLREDUCE")
  if v ~= nil and v ~= "" and v ~= "default" then
    if M.OVERRIDES.quick[v] then M.quick_env = v
    else M.quick_env_error = ("WEFT_QUICK_ALLREDUCE=%q is not one of %s (or unset it)"):format(v, choices(M.OVERRIDES.quick)) end
  end
end

-- quick(g) -> "int8" | "int4" | "fp8" | "off", source
function M.quick(g)
  local v, src = M.override(g, "quick")
  if v ~= nil then return v, src end
  if M.quick_env then return M.quick_env, "WEFT_QUICK_ALLREDUCE" end
  return "off", "default"
end

-- the value group `name` will see once policy.set stores v
function M.quick_effective(v, name)
  if v ~= "default" then return v end
  local e = name and M.overrides.global.quick
  if e == nil then e = M.quick_env or "off" end
  return e
end

---------------------------------------------------------------- tuned policy file
-- M.tuned: the validated table of weft.internal.policy_file (nil: the built-in policy).
M.tuned, M.tuned_path, M.tuned_error = nil, nil, nil

-- load_file(path): validate and use it; raises (naming the file and the
-- entry) and keeps the previous policy on any error.
function M.load_file(path)
  local t = require("weft.internal.policy_file").load(path)
  M.tuned, M.tuned_path, M.tuned_error = t, path, nil
  M.version = M.version + 1
  return t
end

function M.clear_file()
  M.tuned, M.tuned_path, M.tuned_error = nil, nil, nil
  M.version = M.version + 1
end

-- autoload([getenv [, warn]]): WEFT_POLICY_FILE, else the default location
-- (weft.internal.policy_file.default_path). A bad file is reported once (warn, default
-- stderr) and kept in M.tuned_error; weft goes on with the built-in policy.
function M.autoload(getenv, warn)
  local pf = require("weft.internal.policy_file")
  local path = pf.default_path(getenv)
  if not path then return nil end
  local ok, err = pcall(M.load_file, path)
  if ok then return path end
  M.tuned_error = tostring(err)
  warn = warn or function(msg) io.stderr:write(msg, "\n") end
  warn(M.tuned_error .. " (ignored: weft uses the built-in policy)")
  return nil, M.tuned_error
end

-- tuned_backend(section, world, dtype, bytes) -> backend, where-text | nil
function M.tuned_backend(section, world, dtype, bytes)
  local t = M.tuned
  if t == nil then return nil end
  local pf = package.loaded["weft.internal.policy_file"]
  local be, s, wk, dk, i = pf.lookup(t, section, world, dtype, bytes)
  if be == nil then return nil end
  return be, s, wk, dk, i
end

---------------------------------------------------------------- decisions
-- decide(g, op, t [, rop]) -> { op=, backend=, why=, mode=, chain = { {index=,
--   name=, backend=, applies=, reason=, detail = {lines}, skipped=} ... } }:
-- every rule serving op up to the one that applied, in order, and why it did
-- or did not apply (index: its place in M.rules; skipped: no predicate
-- registered for its key). Rules may carry `why_not`
-- (string or function(g, op, t, rop)) and `detail` (function -> list of
-- lines: the sub-checks, e.g. should_custom_ar's).
local function text_of(v, g, op, t, rop)
  if type(v) == "function" then return v(g, op, t, rop) end
  return v
end

function M.decide(g, op, t, rop)
  op = op or "all_reduce"
  local res = { op = op, mode = M.mode(), chain = {} }
  for i = 1, #rules do
    local r = rules[i]
    if r.ops == nil or r.ops[op] then
      local e = { index = i, name = r.name, backend = r.backend, device = r.device, applies = false }
      local test = r.test
      if test == nil then
        e.skipped = true
        e.reason = ("skipped: no predicate registered for when = %q (its backend module is not loaded)")
          :format(tostring(r.when))
      else
        e.applies = test(g, op, t, rop) and true or false
        e.reason = e.applies and text_of(r.why, g, op, t, rop) or text_of(r.why_not, g, op, t, rop)
        if r.detail then e.detail = r.detail(g, op, t, rop) end
      end
      res.chain[#res.chain + 1] = e
      if e.applies then
        res.backend, res.why = r.backend, e.reason
        return res
      end
    end
  end
  res.why = "no rule matched"
  return res
end

-- explain(group, tensor [, op [, rop]]) -> a readable string: the backend
-- chosen for `op` (default all_reduce), why, the mode, and every rule tried.
function M.explain(g, t, op, rop)
  op = op or "all_reduce"
  if type(g) ~= "table" or type(g.world_size) ~= "number" then
    error("weft: policy.explain: expected a group (a GroupCoordinator), got " .. show(g), 2)
  end
  -- an op is a method of the group class (a test's table for g has none)
  local G = package.loaded["weft.group"]
  G = type(G) == "table" and G.GroupCoordinator
  if type(op) ~= "string" or (G and type(G[op]) ~= "function") then
    error(("weft: policy.explain: %s is not an operation of a group (all_reduce, all_gather, broadcast, ...)")
          :format(show(op)), 2)
  end
  if t ~= nil and type(t) ~= "table" and type(t) ~= "cdata" then
    error("weft: policy.explain: expected a tensor (or nil), got " .. show(t), 2)
  end
  local what
  if t ~= nil and type(t) == "table" or type(t) == "cdata" then
    what = ("%s %s {%s} (%s, %s)"):format(op, tostring(t.dtype),
      table.concat(t.shape or {}, ","), human_bytes(tonumber(t.nbytes) or 0), tostring(t.device))
  else
    what = op
  end
  local head = ("%s on %s (%d ranks):"):format(what, tostring(g.unique_name), g.world_size)
  local d = M.decide(g, op, t, rop)
  local out = {}
  if d.backend then
    out[1] = ("%s %s — %s"):format(head, d.backend, tostring(d.why))
  else
    out[1] = head .. " no backend (no rule matched)"
  end
  out[#out + 1] = "  mode: " .. d.mode
  out[#out + 1] = "  rules, in order:"
  local host = not (type(t) == "table" and t.device ~= nil and t.device ~= "cpu")
  -- rules are numbered by their place in M.rules (those that do not serve
  -- op are left out, so the numbers may jump); device rules a host tensor
  -- passes over show as one line where they stand ("2-9. (the device rules
  -- passed over ..."; no count: the range also holds the device rules that
  -- do not serve op, which the chain leaves out)
  local skip_from, skip_to, skipped = nil, nil, 0
  local function flush_skipped()
    if skipped == 0 then return end
    local at = skip_from == skip_to and tostring(skip_from) or ("%d-%d"):format(skip_from, skip_to)
    out[#out + 1] = ("    %s. (the device rule%s passed over: host tensor)"):format(at,
                                                                            skip_from == skip_to and "" or "s")
    skip_from, skip_to, skipped = nil, nil, 0
  end
  for _, e in ipairs(d.chain) do
    if e.device and host and not e.applies then
      skip_from, skip_to = skip_from or e.index, e.index
      skipped = skipped + 1
    else
      flush_skipped()
      out[#out + 1] = ("    %d. %s: %s%s"):format(e.index, e.name, e.applies and ("yes -> " .. e.backend) or "no",
                                                 e.reason and (" (" .. tostring(e.reason) .. ")") or "")
      for _, line in ipairs(e.detail or {}) do out[#out + 1] = "         " .. line end
    end
  end
  flush_skipped()
  local ov = {}
  for _, k in ipairs { "all_reduce", "fused" } do
    local v, src = M.override(g, k)
    if v then ov[#ov + 1] = ("%s=%s (%s)"):format(k, v, tostring(src)) end
  end
  if #ov > 0 then out[#out + 1] = "  overrides: " .. table.concat(ov, ", ") end
  local det, dsrc = M.deterministic(g)
  if det then
    out[#out + 1] = ("  deterministic: on (%s): weft's kernels sum in rank order at every size, NCCL never "
                     .. "sums floats; the group agrees on it at its first device call"):format(tostring(dsrc))
  end
  if M.determ_env_error then out[#out + 1] = "  deterministic error: " .. M.determ_env_error end
  local qv, qsrc = M.quick(g)
  if qv ~= "off" then
    out[#out + 1] = ("  quick all-reduce: %s (%s): bf16/f16 sums from the codec's minimum size go through the "
                     .. "compressed two-shot (docs/quick-allreduce.md)"):format(qv, tostring(qsrc))
  end
  if M.quick_env_error then out[#out + 1] = "  quick error: " .. M.quick_env_error end
  if M.override_error then out[#out + 1] = "  override error: " .. M.override_error end
  if M.tuned_path then out[#out + 1] = "  policy file: " .. M.tuned_path
  elseif M.tuned_error then out[#out + 1] = "  policy file ignored: " .. M.tuned_error
  else out[#out + 1] = "  policy file: none (built-in crossovers)" end
  return table.concat(out, "\n")
end

pcall(M.autoload)

return M
