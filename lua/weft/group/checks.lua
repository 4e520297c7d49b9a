-- weft.group.checks — the argument checks of weft.group (lua/weft/group.lua):
-- every collective validates its group, tensors, peers, reduction and dims
-- with these BEFORE anything is sent, raising "weft: <op>: ..." at the
-- user's call site. Pure Lua (no C binding).
local ffi = require("ffi")
local floor = math.floor
local type, tostring, require = type, tostring, require
local concat = table.concat
local show = require("weft.internal.show").value -- names a refused value's type
local E = require("weft.internal.errors")

local M = {}

M.REDUCE_OPS = { sum = 0, max = 1, min = 2, prod = 4 }
local REDUCE_OPS = M.REDUCE_OPS
-- dtypes that can be reduced; f8e4m3 is storage only
local REDUCIBLE = { f32 = true, f16 = true, bf16 = true, i32 = true, i64 = true, u8 = true, f64 = true }

local tensor_mod
function M.T()
  if not tensor_mod then tensor_mod = require("weft.tensor") end
  return tensor_mod
end
local T = M.T

---------------------------------------------------------------- errors
-- weft.internal.errors: "weft: <op>: ..." at a level, shapes and group names
local fail, shape_str, gname, same_shape = E.fail, E.shape_str, E.gname, E.same_shape

-- A tensor collective's call as its ranks compare it (the agreement word of
-- the routes without a descriptor of their own: the store, Gloo):
-- "all_reduce bf16 {8,4096} sum", "broadcast f32 {4} src=1". extra: the
-- reduction, the dim (a number), the root, or a list (all_gatherv's sizes).
function M.call_desc(op, t, extra)
  local e = E.extra_str(extra)
  if e == nil then return ("%s %s %s"):format(op, t.dtype, shape_str(t.shape)) end
  return ("%s %s %s %s"):format(op, t.dtype, shape_str(t.shape), e)
end

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
  if not tm.is_tensor(t) or type(t._storage) ~= "table" then
    fail(3, op, "%s must be a weft tensor, got %s (group %s)", what, show(t), gname(g))
  end
  if t.ptr == nil and t.numel > 0 then
    fail(3, op, "%s storage was freed (group %s)", what, gname(g))
  end
  -- in use by a pending async operation of another group: its worker may be
  -- reading or writing it now (one of this group's runs first: this call
  -- drains the group's queue before it starts)
  local pop, pgroup = tm.pinned_by(t)
  if pop and pgroup ~= gname(g) then
    fail(3, op, "%s is in use by a pending %s on group %s: wait for its handle (h:wait()) or drain that "
         .. "group (g:async_drain()) first (group %s)", what, pop, pgroup, gname(g))
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
  return idx
end

-- a rooted call's src (default 0), checked as check_peer does; a tail call,
-- so the error still names the method's caller
local function check_src(g, op, src) return check_peer(g, op, src or 0, "src") end

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

-- products of the dims before / from `dim` (0-based)
local function outer_inner(shape, dim)
  local outer, inner = 1, 1
  for i = 1, #shape do
    if i <= dim then outer = outer * shape[i] else inner = inner * shape[i] end
  end
  return outer, inner
end

-- Byte address of a tensor's first element, as a Lua number (exact: user
-- and device addresses are below 2^53).
local function addr(t) return tonumber(ffi.cast("uintptr_t", t.ptr)) end

-- An output `b` that shares memory with `a` is refused unless it is exactly
-- where the operation allows it: `slot` is the byte offset from a.ptr where b
-- may lie (b's bytes then sit wholly inside a's: in place, or this rank's
-- chunk of a gather/scatter buffer); nil: no sharing at all. Any other
-- overlap of the two byte ranges would be read after being written (the
-- result is garbage, silently, on every backend), so it is refused here,
-- before anything is enqueued, with both ranges named. Tensors are
-- contiguous here (check_tensor), so a tensor's bytes are [ptr, ptr + nbytes).
-- Host and device tensors of one call share a place (check_place first).
-- level: as fail's (3: the caller of the function that calls this one; 0: no
-- position).
local function check_overlap(g, op, a, an, b, bn, slot, level)
  if a.nbytes == 0 or b.nbytes == 0 or a.ptr == nil or b.ptr == nil then return end
  local a0, b0 = addr(a), addr(b)
  local a1, b1 = a0 + a.nbytes, b0 + b.nbytes
  if b1 <= a0 or a1 <= b0 then return end -- apart
  if slot and b0 == a0 + slot and b1 <= a1 then return end -- exactly where allowed
  local where
  if slot == nil then
    where = "they must not share memory"
  elseif slot == 0 and a.nbytes == b.nbytes then
    where = "they must be the same memory (in place) or not share memory at all"
  else
    where = ("%s may only be %s's bytes [%d, %d) (this rank's chunk) or apart"):format(
      bn, an, slot, slot + b.nbytes)
  end
  fail(level or 3, op, "%s and %s overlap in part (%s %s of %d bytes starts at byte %d of %s "
       .. "%s of %d bytes): %s; results would be silently wrong (group %s)", an, bn, bn,
       shape_str(b.shape), b.nbytes, b0 - a0, an, shape_str(a.shape), a.nbytes, where, gname(g))
end

-- The fused all-reduce + RMSNorm family: each output (norm_out,
-- residual_out, quant_out when given) is either the very memory of the input
-- or of the residual (in place, row by row) or apart from every input and
-- from the other outputs; the weight is read by every row, so no output may
-- touch it. level: as fail's, counted from check_overlap (one more than from
-- here); 0: the message carries no position (the device path's errors).
local function check_fused_outputs(g, op, x, residual, weight, outs, level)
  for i = 1, #outs, 2 do
    local o, on = outs[i], outs[i + 1]
    if o ~= nil then
      local same = o.nbytes == x.nbytes and 0 or nil -- quant_out (1-byte) is never in place
      check_overlap(g, op, x, "input", o, on, same, level)
      check_overlap(g, op, residual, "residual", o, on, same, level)
      check_overlap(g, op, weight, "weight", o, on, nil, level)
      for j = i + 2, #outs, 2 do
        if outs[j] ~= nil then check_overlap(g, op, o, on, outs[j], outs[j + 1], nil, level) end
      end
    end
  end
end

M.fail, M.shape_str, M.gname = fail, shape_str, gname
M.check_overlap, M.check_fused_outputs = check_overlap, check_fused_outputs
M.check_group, M.check_tensor, M.check_place, M.check_peer = check_group, check_tensor, check_place, check_peer
M.check_src = check_src
M.check_reduce, M.norm_dim, M.same_shape, M.outer_inner = check_reduce, norm_dim, same_shape, outer_inner

-- The split tables of an uneven all_to_all_single, every rank's as it came
-- (all[r] = { input = rows rank r-1 sends to each rank, rows = its output's
-- rows, output = its output splits or nil }), checked whole, the same way on
-- every rank: every receiver's rows add up to its output and match its
-- output splits. Raises the same error on every rank (level: fail's).
function M.check_split_tables(g, op, all, level)
  local W, bad = g.world_size, {}
  for j = 1, W do
    local total = 0
    for r = 1, W do total = total + all[r].input[j] end
    if total ~= all[j].rows then
      bad[#bad + 1] = ("rank %d receives %d rows, its output has %d"):format(g.ranks[j], total, all[j].rows)
    end
    local want = all[j].output
    if want then
      for r = 1, W do
        if want[r] ~= all[r].input[j] then
          bad[#bad + 1] = ("rank %d's output split %d says %d rows, rank %d sends %d")
                          :format(g.ranks[j], r - 1, want[r], g.ranks[r], all[r].input[j])
        end
      end
    end
  end
  if #bad > 0 then
    fail(level, op, "the ranks' split tables do not match on group %s (every rank fails this call; the group "
         .. "stays usable): %s", gname(g), concat(bad, "; "))
  end
end

return M
