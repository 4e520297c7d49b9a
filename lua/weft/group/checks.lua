-- weft.group.checks — the argument checks of weft.group (lua/weft/group.lua):
-- every collective validates its group, tensors, peers, reduction and dims
-- with these BEFORE anything is sent, raising "weft: <op>: ..." at the
-- user's call site. Pure Lua (no C binding).
local floor = math.floor
local type, tostring, error, require = type, tostring, error, require
local concat = table.concat
local show = require("weft.show").value -- names a refused value's type

local M = {}

M.REDUCE_OPS = { sum = 0, max = 1, min = 2, prod = 4 }
local REDUCE_OPS = M.REDUCE_OPS
-- dtypes that can be reduced; f8e4m3 is storage only
local REDUCIBLE = { f32 = true, f16 = true, bf16 = true, i32 = true, i64 = true, u8 = true, f64 = true }

local tensor_mod
function M.T()
  if not tensor_mod then tensor_mod = require "weft.tensor" end
  return tensor_mod
end
local T = M.T

---------------------------------------------------------------- errors
local function fail(level, op, fmt, ...)
  error("weft: " .. op .. ": " .. fmt:format(...), level + 1)
end

local function shape_str(shape)
  return "{" .. concat(shape, ",") .. "}"
end

local function gname(g) return g.unique_name end

-- Checks shared by every collective; raised at the user's call site (level 3:
-- check -> method -> caller).
local function check_group(g, op)
  if g.destroyed then
    fail(3, op, "group %s is destroyed", gname(g))
  end
  if not g.is_member then
    fail(3, op, "rank %d is not in group %s (ranks %s)", g.rank, gname(g), concat(g.ranks, ","))
  end
end

local function check_tensor(g, op, t, what)
  what = what or "tensor"
  local tm = T()
  if not tm.is_tensor(t) then
    fail(3, op, "%s must be a weft tensor, got %s (group %s)", what, type(t), gname(g))
  end
  if t.ptr == nil and t.numel > 0 then
    fail(3, op, "%s storage was freed (group %s)", what, gname(g))
  end
  if not t:is_contiguous() then
    fail(3, op, "%s is not contiguous (shape %s, strides %s) on group %s: pass t:clone() or a contiguous tensor",
         what, shape_str(t.shape), shape_str(t.strides or {}), gname(g))
  end
end

-- host and device tensors (or two devices) never mix in one call
local function check_place(g, op, a, b, an, bn)
  if a.device ~= b.device then
    fail(3, op, "%s is on %s and %s on %s: host and device tensors (or two devices) cannot mix in one call (group %s)",
         an, tostring(a.device), bn, tostring(b.device), gname(g))
  end
end

local function check_peer(g, op, idx, what)
  if type(idx) ~= "number" then
    fail(3, op, "%s must be an integer rank of group %s (0..%d), got %s",
         what, gname(g), g.world_size - 1, show(idx))
  end
  if idx ~= floor(idx) or idx < 0 or idx >= g.world_size then
    fail(3, op, "%s %s is out of range for group %s of %d ranks (valid: 0..%d)",
         what, show(idx), gname(g), g.world_size, g.world_size - 1)
  end
end

local function check_reduce(g, op, t, rop)
  local code = REDUCE_OPS[rop]
  if not code then
    fail(3, op, "unknown reduction %q on group %s (sum, max, min, prod)", tostring(rop), gname(g))
  end
  if not REDUCIBLE[t.dtype] then
    fail(3, op, "dtype %s cannot be reduced on group %s (f32, f16, bf16, f64, i32, i64, u8)", t.dtype, gname(g))
  end
  return code
end

local function norm_dim(g, op, t, dim)
  local nd = #t.shape
  if type(dim) ~= "number" or dim ~= floor(dim) or dim < -nd or dim >= nd then
    fail(3, op, "dim %s is invalid for a tensor of shape %s (group %s)", show(dim), shape_str(t.shape), gname(g))
  end
  if dim < 0 then dim = dim + nd end
  return dim
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- products of the dims before / from `dim` (0-based)
local function outer_inner(shape, dim)
  local outer, inner = 1, 1
  for i = 1, #shape do
    if i <= dim then outer = outer * shape[i] else inner = inner * shape[i] end
  end
  return outer, inner
end


M.fail, M.shape_str, M.gname = fail, shape_str, gname
M.check_group, M.check_tensor, M.check_place, M.check_peer = check_group, check_tensor, check_place, check_peer
M.check_reduce, M.norm_dim, M.same_shape, M.outer_inner = check_reduce, norm_dim, same_shape, outer_inner

return M
