-- weft.policy — which backend serves a collective, as a readable table of rules.
--
-- Rules are tried in order; the first whose `when(group, op, tensor)` is true
-- serves the call. A rule may list the `ops` it serves (nil: every op). Device
-- backends (NCCL, one-shot, two-shot, ...) are inserted by their modules with
-- policy.add_rule{...}; the group module maps the chosen name to an
-- implementation registered with group.register_backend(name, impl).
--
-- select() walks this table and returns constants (no tables or strings are
-- built per call). A rule whose answer depends only on the group, the op, the
-- tensor's dtype and device and the reduction may say `cacheable = true`:
-- the group then remembers the decision (group.lua, per group, invalidated
-- when M.version changes) and skips the walk on the hot path. Rules that look
-- at sizes or runtime state (graph capture, workspace) must leave it unset.
local M = {}
M.version = 1

-- Host dtypes/ops the shared-memory engine reduces natively (src/shm.c).
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

-- The table itself. Fields: name (shown by explain), backend, ops, when, why.
M.rules = {
  { name = "single rank", backend = "bypass", cacheable = true,
    when = function(g) return g.world_size == 1 end,
    why = "group of one rank: nothing to exchange (the seed's bypass)" },
  { name = "device tensor", backend = "no_device_backend", cacheable = true,
    when = function(_, _, t) return is_device(t) end,
    why = "device tensor, and no device backend is registered yet" },
  { name = "forced store", backend = "store", cacheable = true,
    when = function(g) return host_forced(g) == "store" end,
    why = "host tensor, store backend forced (weft.init{backend=\"store\"} or WEFT_HOST_BACKEND)" },
  { name = "ranks on several nodes", backend = "store", cacheable = true,
    when = function(g) return not g.same_node end,
    why = "host tensor, ranks are not all on one node: exchanged through the TCP store" },
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

-- select(group, op, tensor [, reduce_op]) -> backend name, reason, cacheable
-- (cacheable: every rule consulted said cacheable = true)
function M.select(g, op, t, rop)
  local cacheable = true
  for i = 1, #rules do
    local r = rules[i]
    local ops = r.ops
    if ops == nil or ops[op] then
      if r.cacheable ~= true then cacheable = false end
      if r.when(g, op, t, rop) then return r.backend, r.why, cacheable end
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
-- Without `before`, the rule goes just after the device-tensor guard's
-- predecessor, i.e. ahead of everything but "single rank".
function M.add_rule(rule, where)
  assert(type(rule) == "table" and type(rule.backend) == "string" and type(rule.when) == "function",
         "weft: policy.add_rule: need {backend=string, when=function, why=string}")
  rule.name = rule.name or rule.backend
  rule.why = rule.why or rule.backend
  local pos = 2
  if where and where.before then
    pos = index_of(where.before)
    if not pos then error("weft: policy.add_rule: no rule named " .. tostring(where.before), 2) end
  end
  table.insert(rules, pos, rule)
  M.version = M.version + 1
  return rule
end

function M.remove_rule(name)
  local i = index_of(name)
  if i then table.remove(rules, i); M.version = M.version + 1; return true end
  return false
end

local function human_bytes(n)
  if n >= 1048576 then return ("%.4g MiB"):format(n / 1048576) end
  if n >= 1024 then return ("%.4g KiB"):format(n / 1024) end
  return ("%d B"):format(n)
end

-- explain(group, tensor [, op]) -> a readable string: the backend chosen for
-- `op` (default all_reduce), why, and which rules were passed over.
function M.explain(g, t, op, rop)
  op = op or "all_reduce"
  local what
  if t ~= nil and type(t) == "table" or type(t) == "cdata" then
    what = ("%s %s {%s} (%s, %s)"):format(op, tostring(t.dtype),
      table.concat(t.shape or {}, ","), human_bytes(tonumber(t.nbytes) or 0), tostring(t.device))
  else
    what = op
  end
  local head = ("%s on %s (%d ranks):"):format(what, tostring(g.unique_name), g.world_size)
  local skipped = {}
  for i = 1, #rules do
    local r = rules[i]
    local applies = r.ops == nil or r.ops[op]
    if applies and r.when(g, op, t, rop) then
      local s = ("%s %s — %s"):format(head, r.backend, r.why)
      if #skipped > 0 then s = s .. "\n  (rules tried first: " .. table.concat(skipped, "; ") .. ")" end
      return s
    end
    skipped[#skipped + 1] = applies and r.name or (r.name .. ": not for " .. op)
  end
  return head .. " no backend (rules tried: " .. table.concat(skipped, "; ") .. ")"
end

return M
