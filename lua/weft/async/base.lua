-- weft.async.base — what the parts of weft.async share (lua/weft/async.lua;
-- the C side is src/async.c): the error format, a group's name in messages,
-- lazy requires (weft.async loads before weft.group and weft.tensor need
-- it) and the argument checks that run before anything is enqueued.
local type, tostring, require = type, tostring, require
local floor = math.floor
local show = require("weft.internal.show").value -- names a refused value's type

local M = {}

local mods = {}
function M.mod(name)
  local m = mods[name]
  if not m then m = require(name); mods[name] = m end
  return m
end

M.fail = require("weft.internal.errors").fail   -- "weft: <op>: ..." at the caller's level

function M.gname(g) return tostring(g.unique_name or g.name or "?") end
local mod, fail, gname = M.mod, M.fail, M.gname
function M.T() return mod("weft.tensor") end
local T = M.T

---------------------------------------------------------------- checks
function M.check_group(g, op)
  if type(g) ~= "table" then fail(3, op, "expected a GroupCoordinator, got %s", type(g)) end
  if g.destroyed then fail(3, op, "group %s is destroyed", gname(g)) end
  if g.is_member == false then
    fail(3, op, "rank %s is not in group %s", tostring(g.rank), gname(g))
  end
end

function M.check_tensor(g, op, t, what)
  what = what or "tensor"
  local tm = T()
  if not tm.is_tensor(t) or type(t._storage) ~= "table" then
    fail(3, op, "%s must be a weft tensor, got %s (group %s)", what, show(t), gname(g))
  end
  if t.ptr == nil and t.numel > 0 then fail(3, op, "%s storage was freed (group %s)", what, gname(g)) end
  -- pinned by another group's pending operation: the two workers would touch
  -- it at once (this group's own pending ones run before this one)
  local pop, pgroup = tm.pinned_by(t)
  if pop and pgroup ~= gname(g) then
    fail(3, op, "%s is in use by a pending %s on group %s: wait for its handle (h:wait()) or drain that "
         .. "group (g:async_drain()) first (group %s)", what, pop, pgroup, gname(g))
  end
  if not t:is_contiguous() then fail(3, op, "%s is not contiguous (group %s)", what, gname(g)) end
end

function M.check_peer(g, op, idx, what)
  if type(idx) ~= "number" then
    fail(3, op, "%s must be an integer rank of group %s (0..%d), got %s", what, gname(g),
         g.world_size - 1, show(idx))
  end
  if idx ~= floor(idx) or idx < 0 or idx >= g.world_size then
    fail(3, op, "%s %s is out of range for group %s of %d ranks", what, show(idx), gname(g), g.world_size)
  end
  return idx
end

-- a rooted call's src (default 0), checked as check_peer does; a tail call,
-- so the error still names the method's caller
function M.check_src(g, op, src) return M.check_peer(g, op, src or 0, "src") end

return M
