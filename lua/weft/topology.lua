-- weft.topology — rank layouts of every model-parallel group kind (pure).
--
-- plan{} reproduces SGLang's initialize_model_parallel
-- (python/sglang/srt/distributed/parallel_state.py) group for group, with two changes:
--  * where SGLang floors a size by integer division (attention TP =
--    idiv(tp, attn_cp * attn_dp), MoE TP = idiv(tp, ep * moe_dp)) and would build
--    wrong or empty groups, plan raises an error naming the sizes;
--  * every argument is checked to be a positive integer, unknown keys are refused.
--
-- Kinds, in the fixed order used by to_json/format (topology.KINDS):
--   tp, pp, attn_tp, attn_cp, moe_ep, moe_tp, moe_dp, dcp (dcp only when dcp > 1)
-- Aliases follow the seed's `_X = _Y` assignments (the same group object):
--   attn_cp -> tp       when attn_cp == tp
--   attn_tp -> tp       when attn_tp == tp
--   moe_dp  -> attn_cp  when attn_cp > moe_dp   (CP partners share tokens)
--           -> tp       elif moe_dp == tp
--   moe_ep  -> tp       when ep == tp           (the seed's non-NPU rule)
--   moe_tp  -> tp       when moe_tp == tp
-- An alias always names a kind that is a group of its own: when moe_dp
-- aliases attn_cp and attn_cp itself is the TP group, aliases.moe_dp = "tp".
-- groups[kind] of an aliased kind holds the ranks of the group it aliases.
-- pp and dcp are never aliases (the seed always creates them).
local M = {}

local fmt, concat, floor = string.format, table.concat, math.floor
local show = require("weft.internal.show").value -- names a refused value's type
local E = require("weft.internal.errors")

local function idiv(a, b) return floor(a / b) end

M.KINDS = { "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp", "dcp" }
-- the order of the keys of the topology's JSON (to_json, weft-topo --json)
M.JSON_ORDER = { "valid", "rank", "world_size", "gpus_per_node", "groups", "aliases", "group_index" }
for _, k in ipairs(M.KINDS) do M.JSON_ORDER[#M.JSON_ORDER + 1] = k end

local ARGS = { world_size = true, tp = true, pp = true, ep = true, attn_dp = true,
               attn_cp = true, moe_dp = true, dcp = true }

-- "weft: topology.plan: <msg>" where weft.internal.errors.fail((level or 1) + 1, ...)
-- would put it (+ 1 for this frame)
local function fail(msg, level)
  E.fail((level or 1) + 2, "topology.plan", "%s", msg)
end

local function range(st, en, step)
  local r = {}
  for i = st, en - 1, step or 1 do r[#r + 1] = i end
  return r
end

-- The commonest mistake: a world that is not tp x pp. Says what would fit,
-- in the caller's words (spell: formats for a world, a tp and a pp; default
-- plan{}'s argument names; initialize_model_parallel and weft-topo pass
-- theirs): the world that fits these sizes, and the tp or pp that fit this
-- world keeping the other size.
local PLAN_WORDS = { world = "world_size=%d", tp = "tp=%d", pp = "pp=%d" }
local function say(f, n) if type(f) == "function" then return f(n) end return fmt(f, n) end
function M.world_mismatch(world, tp, pp, spell)
  spell = spell or PLAN_WORDS
  local keep = {}
  if world % tp == 0 then keep[#keep + 1] = say(spell.pp, world / tp) end
  if world % pp == 0 then keep[#keep + 1] = say(spell.tp, world / pp) end
  if #keep == 0 then keep[1] = say(spell.tp, world) .. " " .. say(spell.pp, 1) end
  return fmt("world_size (%d) is not equal to tp (%d) x pp (%d) = %d: use %s, or for %d ranks %s",
             world, tp, pp, tp * pp, say(spell.world, tp * pp), world, concat(keep, " or "))
end

local function posint(args, key, dflt)
  local v = args[key]
  if v == nil then return dflt end
  if type(v) ~= "number" or v ~= math.floor(v) or v < 1 or v == math.huge then
    fail(fmt("%s must be a positive integer (got %s)", key, show(v)), 2)
  end
  return v
end

local function copy_groups(g)
  local out = {}
  for i, r in ipairs(g) do
    local c = {}
    for j, x in ipairs(r) do c[j] = x end
    out[i] = c
  end
  return out
end

function M.plan(args)
  args = args or {}
  if type(args) ~= "table" then fail("arguments must be a table") end
  for k in pairs(args) do
    if not ARGS[k] then
      fail(fmt("unknown argument '%s' (known: world_size, tp, pp, ep, attn_dp, attn_cp, moe_dp, dcp)",
               tostring(k)))
    end
  end
  local tp = posint(args, "tp", 1)
  local pp = posint(args, "pp", 1)
  local world = posint(args, "world_size", tp * pp)
  local ep = posint(args, "ep", 1)
  local attn_dp = posint(args, "attn_dp", 1)
  local attn_cp = posint(args, "attn_cp", 1)
  local moe_dp = posint(args, "moe_dp", 1)
  local dcp = posint(args, "dcp", 1)

  if world ~= tp * pp then
    fail(M.world_mismatch(world, tp, pp))
  end
  if tp % dcp ~= 0 then
    fail(fmt("tp (%d) must be divisible by dcp (%d)", tp, dcp))
  end
  if tp % (attn_cp * attn_dp) ~= 0 then
    fail(fmt("tp (%d) is not divisible by attn_cp (%d) x attn_dp (%d) = %d: the attention TP size "
             .. "would be floored to %d (SGLang floors it silently)",
             tp, attn_cp, attn_dp, attn_cp * attn_dp, idiv(tp, attn_cp * attn_dp)))
  end
  if tp % (ep * moe_dp) ~= 0 then
    fail(fmt("tp (%d) is not divisible by ep (%d) x moe_dp (%d) = %d: the MoE TP size "
             .. "would be floored to %d (SGLang floors it silently)",
             tp, ep, moe_dp, ep * moe_dp, idiv(tp, ep * moe_dp)))
  end

  local attn_tp = idiv(tp, attn_cp * attn_dp)
  local moe_tp = idiv(tp, ep * moe_dp)
  local ntp = idiv(world, tp)
  local groups, aliases = {}, {}

  -- tensor parallel: consecutive blocks of tp ranks
  local g = {}
  for i = 0, ntp - 1 do g[#g + 1] = range(i * tp, (i + 1) * tp) end
  groups.tp = g

  -- decode context parallel: consecutive slices of each TP group
  if dcp > 1 then
    g = {}
    for _, r in ipairs(groups.tp) do
      for st = 1, #r, dcp do
        local s = {}
        for j = st, st + dcp - 1 do s[#s + 1] = r[j] end
        g[#g + 1] = s
      end
    end
    groups.dcp = g
  end

  -- The sub-groups of every TP group: each TP group is `outer` blocks of
  -- size * stride ranks; a block holds `stride` groups of `size` ranks,
  -- `stride` apart (stride 1: consecutive ranks).
  local function inside_tp(outer, size, stride)
    local out = {}
    for t = 0, ntp - 1 do
      for d = 0, outer - 1 do
        for a = 0, stride - 1 do
          local st = t * tp + d * size * stride + a
          out[#out + 1] = range(st, st + size * stride, stride)
        end
      end
    end
    return out
  end

  -- attention context parallel: stride attn_tp inside each (TP group, DP slice)
  if attn_cp == tp then aliases.attn_cp = "tp" else groups.attn_cp = inside_tp(attn_dp, attn_cp, attn_tp) end

  -- attention tensor parallel: consecutive blocks of attn_tp
  if attn_tp == tp then aliases.attn_tp = "tp" else groups.attn_tp = inside_tp(attn_cp * attn_dp, attn_tp, 1) end

  -- MoE data parallel: stride moe_tp * ep across each TP group
  if attn_cp > moe_dp then
    aliases.moe_dp = aliases.attn_cp or "attn_cp"
  elseif moe_dp == tp then
    aliases.moe_dp = "tp"
  else
    groups.moe_dp = inside_tp(1, moe_dp, moe_tp * ep)
  end

  -- MoE expert parallel: stride moe_tp inside each (TP group, MoE DP slice)
  if ep == tp then aliases.moe_ep = "tp" else groups.moe_ep = inside_tp(moe_dp, ep, moe_tp) end

  -- MoE tensor parallel: consecutive blocks of moe_tp
  if moe_tp == tp then aliases.moe_tp = "tp" else groups.moe_tp = inside_tp(ep * moe_dp, moe_tp, 1) end

  -- pipeline parallel: stride world/pp
  local npp = idiv(world, pp)
  g = {}
  for i = 0, npp - 1 do g[#g + 1] = range(i, world, npp) end
  groups.pp = g

  -- aliased kinds carry the ranks of the group they alias (own copies)
  for kind, target in pairs(aliases) do groups[kind] = copy_groups(groups[target]) end

  local group_sizes = {}
  for kind, list in pairs(groups) do group_sizes[kind] = #list[1] end

  return setmetatable({
    world_size = world,
    groups = groups,
    aliases = aliases,
    -- the configured / derived sizes (keys as SGLang names them: tp_size, ...)
    sizes = {
      world_size = world, tp_size = tp, pp_size = pp, attn_tp_size = attn_tp,
      attn_cp_size = attn_cp, attn_dp_size = attn_dp, moe_ep_size = ep,
      moe_tp_size = moe_tp, moe_dp_size = moe_dp, dcp_size = dcp,
    },
    -- the world size each group kind actually has (moe_dp aliasing attn_cp
    -- has attn_cp's size, as SGLang's get_moe_data_parallel_world_size reports)
    group_sizes = group_sizes,
  }, M.Plan)   -- print(plan) shows its table (M.Plan, below)
end

---------------------------------------------------------------- validate
-- The checks of weft.initialize_model_parallel (lua/weft/dist.lua), so a
-- dry run (scripts/weft-topo --dry-run) and a real run refuse the same
-- arguments with the same words.
--
-- validate(opts, world_size [, level [, spell]]) -> plan, duplicate_tp_group
--   opts: {tp=, pp=, ep=, moe_dp=, attn_cp=, attn_dp=, dcp=, duplicate_tp_group=}
--         or SGLang's long names (tensor_model_parallel_size, ...).
--   world_size: the world the groups are cut from (WORLD_SIZE in a real run).
--   level: as error()'s: 1 (default) blames validate's caller, 2 its caller.
--   spell: how the caller's user writes a world, a tp and a pp (formats for
--          world_mismatch: "-n %d", "--tp %d", ...); default "world_size=%d", ...
-- Every error reads "weft: initialize_model_parallel: <what>"; when several
-- options are wrong, the first in sorted key order is named.
M.LONG_NAMES = {
  tensor_model_parallel_size = "tp", pipeline_model_parallel_size = "pp",
  expert_model_parallel_size = "ep", attention_data_parallel_size = "attn_dp",
  attention_context_model_parallel_size = "attn_cp", moe_data_model_parallel_size = "moe_dp",
  decode_context_parallel_size = "dcp",
}
local SIZES = { tp = true, pp = true, ep = true, attn_dp = true, attn_cp = true, moe_dp = true, dcp = true }
local VOP = "initialize_model_parallel"

function M.validate(opts, world_size, level, spell)
  level = (level or 1) + 1
  local function vfail(msg, ...)
    E.fail(level + 1, VOP, msg, ...)
  end
  opts = opts or {}
  if type(opts) ~= "table" then vfail("options must be a table, got %s", type(opts)) end
  local keys = {}
  for k in pairs(opts) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local args, dup = { world_size = world_size }, false
  for _, k in ipairs(keys) do
    local v = opts[k]
    local key = M.LONG_NAMES[k] or k
    if key == "duplicate_tp_group" then
      dup = v and true or false
    elseif SIZES[key] then
      if type(v) ~= "number" or v ~= floor(v) or v < 1 or v == math.huge then
        vfail("%s must be a positive integer, got %s", tostring(k), show(v))
      end
      args[key] = v
    else
      vfail("unknown option %q (tp, pp, ep, moe_dp, attn_cp, attn_dp, dcp, duplicate_tp_group)", tostring(k))
    end
  end
  local tp, pp = args.tp or 1, args.pp or 1
  if world_size ~= tp * pp and type(world_size) == "number" then
    vfail("%s", M.world_mismatch(world_size, tp, pp, spell))
  end
  local ok, plan = pcall(M.plan, args)
  if not ok then
    -- plan's own words, named after the operation the user called
    local msg = tostring(plan):gsub("^.-weft: topology%.plan: ", "")
    error("weft: " .. VOP .. ": " .. msg, level)
  end
  return plan, dup
end

local function check_plan(plan, op)
  if type(plan) ~= "table" or type(plan.groups) ~= "table" or type(plan.world_size) ~= "number" then
    error("weft: topology." .. op .. ": argument is not a plan from topology.plan{}", 3)
  end
end

-- Kinds present in the plan, in KINDS order.
local function kinds_of(plan)
  local out = {}
  for _, k in ipairs(M.KINDS) do
    if plan.groups[k] then out[#out + 1] = k end
  end
  return out
end
M.kinds_of = kinds_of

-- {"world_size":N,"groups":{"tp":[[0,1],[2,3]],...},"aliases":{"attn_tp":"tp"}}
-- kinds (in groups and aliases) in KINDS order; no whitespace (weft.internal.json).
function M.to_json(plan)
  check_plan(plan, "to_json")
  local json = require("weft.internal.json")
  local groups, aliases = json.object(), json.object()
  for _, k in ipairs(kinds_of(plan)) do
    groups[k] = plan.groups[k]
    aliases[k] = plan.aliases and plan.aliases[k] or nil
  end
  return json.encode({ world_size = plan.world_size, groups = groups, aliases = aliases },
                     { order = M.JSON_ORDER })
end

-- A readable table: one line per kind with its group size, count and groups.
function M.format(plan)
  check_plan(plan, "format")
  local s = plan.sizes or {}
  local lines = {}
  if s.tp_size then
    lines[1] = fmt("world_size %d: tp=%d pp=%d attn_tp=%d attn_cp=%d attn_dp=%d moe_ep=%d moe_tp=%d moe_dp=%d dcp=%d",
                   plan.world_size, s.tp_size, s.pp_size, s.attn_tp_size, s.attn_cp_size,
                   s.attn_dp_size, s.moe_ep_size, s.moe_tp_size, s.moe_dp_size, s.dcp_size)
  else
    lines[1] = fmt("world_size %d", plan.world_size)
  end
  lines[#lines + 1] = fmt("%-8s %5s %7s  %s", "kind", "size", "groups", "ranks")
  for _, k in ipairs(kinds_of(plan)) do
    local list = plan.groups[k]
    local gs = {}
    for i, r in ipairs(list) do gs[i] = "[" .. concat(r, ",") .. "]" end
    local line = fmt("%-8s %5d %7d  %s", k, #list[1], #list, concat(gs, " "))
    local a = plan.aliases and plan.aliases[k]
    if a then line = line .. fmt("  (same as %s)", a) end
    lines[#lines + 1] = line
  end
  return concat(lines, "\n") .. "\n"
end

-- Plans print as their table: print(plan), tostring(plan), plan:show().
local Plan = {}
Plan.__index = Plan
Plan.__tostring = function(p) return (M.format(p):gsub("\n$", "")) end
function Plan.show(p) io.write(M.format(p)) end
function Plan.format(p) return M.format(p) end
function Plan.to_json(p) return M.to_json(p) end
M.Plan = Plan

-- For each kind, the group (a fresh list of global ranks) that contains rank.
function M.groups_of(plan, rank)
  check_plan(plan, "groups_of")
  if type(rank) ~= "number" or rank ~= math.floor(rank) or rank < 0 or rank >= plan.world_size then
    error(fmt("weft: topology.groups_of: rank %s out of range [0, %d)", show(rank), plan.world_size), 2)
  end
  local out = {}
  for kind, list in pairs(plan.groups) do
    for _, r in ipairs(list) do
      for _, x in ipairs(r) do
        if x == rank then
          local c = {}
          for j, y in ipairs(r) do c[j] = y end
          out[kind] = c
        end
      end
    end
  end
  return out
end

-- For each kind present, where every rank sits: idx[kind][rank + 1] is the
-- 0-based index of its group in plan.groups[kind] (weft.dist names that
-- group "<kind>.<index>"), pos[kind][rank + 1] its 0-based rank in the group.
-- O(world) per kind, unlike world calls of groups_of.
function M.index_of(plan)
  check_plan(plan, "index_of")
  local idx, pos = {}, {}
  for kind, list in pairs(plan.groups) do
    local ik, pk = {}, {}
    for g, r in ipairs(list) do
      for j, x in ipairs(r) do
        ik[x + 1], pk[x + 1] = g - 1, j - 1
      end
    end
    idx[kind], pos[kind] = ik, pk
  end
  return idx, pos
end

-- The most nodes any one group of list touches, ranks placed node by node
-- (gpus_per_node ranks a node): 1 means every group stays inside a node.
function M.node_span(list, gpus_per_node)
  local most = 0
  for _, r in ipairs(list) do
    local seen, n = {}, 0
    for _, x in ipairs(r) do
      local node = floor(x / gpus_per_node)
      if not seen[node] then seen[node] = true; n = n + 1 end
    end
    if n > most then most = n end
  end
  return most
end

-- A short text for a list of ranks: "4-7", "1,9,..,57" (a stride), "0,3,5".
function M.ranks_str(r)
  local n = #r
  if n == 0 then return "" end
  if n == 1 then return tostring(r[1]) end
  local step = r[2] - r[1]
  local even = step > 0
  for i = 3, n do
    if r[i] - r[i - 1] ~= step then even = false; break end
  end
  if even and step == 1 and n >= 3 then return fmt("%d-%d", r[1], r[n]) end
  if even and n >= 4 then return fmt("%d,%d,..,%d", r[1], r[2], r[n]) end
  if n > 12 then
    return concat({ unpack(r, 1, 10) }, ",") .. fmt(",.. (%d ranks)", n)
  end
  return concat(r, ",")
end

return M
