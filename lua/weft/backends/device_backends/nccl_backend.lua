-- weft.backends.device_backends.nccl_backend — the GroupCoordinator's device backends
-- that move data through NCCL (the communicators themselves are weft.nccl):
-- nccl (every device collective, one communicator per group; layouts along a
-- dim by 2-D copies) and device_host (NCCL unusable: ranks sharing a GPU, no
-- libnccl; the data goes through host memory and the host path; eager only).
-- weft.backends.device_backends registers them and re-exports M.nccl_backend and
-- M.stage; the group's device state comes from weft.backends.device_backends.setup.
local ffi = require("ffi")
local S = require("weft.backends.device_backends.setup")

local tostring, error = tostring, error
local fmt = string.format
local mod, T, gname = S.mod, S.T, S.gname
local dev_of, stream_capturing, scratch = S.dev_of, S.stream_capturing, S.scratch

local M = {}

local U8 = 5                 -- byte-moving collectives go as u8 (any dtype, f8 too)
local MAX = 1                -- the op code of max (the NaN masks)

local C_
local function C()
  if C_ == nil then C_ = require("weft.internal.ffi").C end
  return C_
end

local function copy2d(dst, dpitch, src, spitch, width, height)
  if C().weft_cuda_memcpy2d_async(dst, dpitch, src, spitch, width, height, nil) ~= 0 then
    error("weft: copy2d: " .. require("weft.internal.ffi").last_error(), 0)
  end
end

local function outer_of(shape, dim)
  local o = 1
  for i = 1, dim do o = o * shape[i] end
  return o
end

local u8p = ffi.typeof("uint8_t *")

---------------------------------------------------------------- host staging
-- The host path with device data: copy in, run the group's host collective,
-- copy out. Correct anywhere, fast nowhere; refused while capturing.
local function stage_check(g, op, a, b)
  local d = dev_of(g, op, a, b)
  if stream_capturing() then
    error(fmt("weft: %s: group %s cannot run device collectives inside a graph capture: %s; "
              .. "its host staging path is eager only", op, gname(g), tostring(d.nccl_why)), 0)
  end
  return d
end

local function host_clone(t) return t:clone("cpu") end

local stage = {}
function stage.all_reduce(g, op, t, out_ptr, rop)
  stage_check(g, op, t)
  local h = host_clone(t)
  g:all_reduce(h, rop)
  local dst = t
  if out_ptr ~= t.ptr then dst = T().wrap(out_ptr, t.shape, t.dtype, t.device) end
  dst:copy_(h)
  h:free()
end
-- t staged on the host, host_op(h) -> a new host tensor, copied into out
local function via_host(g, op, t, out, host_op)
  stage_check(g, op, t, out)
  local h = host_clone(t)
  local ho = host_op(h)
  out:copy_(ho)
  h:free(); ho:free()
end
-- the gathers and scatters, (g, op, t, dim or sizes, out [, rop]): out from
-- host_call(g, h, dim or sizes [, rop]) on a host copy of t
local function staged(host_call)
  return function(g, op, t, a, out, b) via_host(g, op, t, out, function(h) return host_call(g, h, a, b) end) end
end
stage.all_gather = staged(function(g, h, dim) return g:all_gather(h, dim) end)
stage.reduce_scatter = staged(function(g, h, dim, rop) return g:reduce_scatter(h, dim, nil, rop) end)
stage.all_gatherv = staged(function(g, h, sizes) return g:all_gatherv(h, sizes) end)
stage.reduce_scatterv = staged(function(g, h, sizes, rop) return g:reduce_scatterv(h, nil, sizes, rop) end)
-- t staged on the host (a copy of it, or an empty tensor where it is only
-- written: recv), host_op(h) run, and h copied back into t where asked
local function on_host(g, op, t, host_op, copy_in, copy_back)
  stage_check(g, op, t)
  local h = copy_in and host_clone(t) or T().empty(t.shape, t.dtype, "cpu")
  host_op(h)
  if copy_back then t:copy_(h) end
  h:free()
end
function stage.broadcast_tensor(g, op, t, src)
  on_host(g, op, t, function(h) g:broadcast(h, src) end, true, true)
end
function stage.gather(g, op, t, dst, dim)
  stage_check(g, op, t)
  local h = host_clone(t)
  local ho = g:gather(h, dst, dim)
  h:free()
  if ho == nil then return nil end
  local o = ho:clone(t.device)
  ho:free()
  return o
end
function stage.send(g, op, t, dst)
  on_host(g, op, t, function(h) g:send(h, dst) end, true, false)
end
function stage.recv(g, op, t, src)
  on_host(g, op, t, function(h) g:recv(h, src) end, false, true)
end
function stage.all_to_all_single(g, op, out, inp, in_splits, out_splits)
  stage_check(g, op, inp, out)
  local hi, ho = host_clone(inp), T().empty(out.shape, out.dtype, "cpu")
  local splits = nil
  if in_splits then splits = { input = in_splits, output = out_splits } end
  g:all_to_all_single(ho, hi, splits)
  out:copy_(ho)
  hi:free(); ho:free()
end
M.stage = stage

---------------------------------------------------------------- NaN pass
-- NCCL's float max/min drop NaN (fmaxf/__hmax: NaN only where every rank
-- holds one); torch propagates it. For float max/min weft brackets the NCCL
-- call, on the same stream (so it is captured and replayed with it):
--   mask = isnan(input)              (u8 per element, the group's scratch)
--   NCCL max of the mask             (u8, n bytes: "some rank holds a NaN")
--   NCCL max/min of the data         (as before)
--   fixup: output = quiet NaN where the reduced mask is set
-- Integers and sum/prod are unchanged (NaN propagates through + and *).
local NAN_DTYPES = { f32 = true, f64 = true, f16 = true, bf16 = true }
local NAN_OPS = { max = true, min = true }
M.NAN_DTYPES, M.NAN_OPS = NAN_DTYPES, NAN_OPS

-- true when a call of dtype and rop takes the NaN pass
function M.nan_pass(dtype, rop) return NAN_OPS[rop] == true and NAN_DTYPES[dtype] == true end

local CUDA = S.CUDA

-- the mask of n elements of src (dtype code), in the group's scratch slot `slot`
local function nan_mask(d, slot, src, n, dcode)
  local m = scratch(d, slot, n)
  CUDA().nan_mask(src, m, n, dcode)
  return m
end

---------------------------------------------------------------- NCCL backend
-- comm(g, op, a, b) -> nccl comm, or nil when the group stages through the host
local function comm(g, op, a, b)
  local d = dev_of(g, op, a, b)
  return d.nccl, d
end

-- point-to-point before set-up: only a group of two can set up in a send/recv
local function p2p_comm(g, op, t)
  if g._dev == nil and g.world_size > 2 then
    error(fmt("weft: %s: group %s (%d ranks) has no device communicator yet, and a point-to-point "
              .. "call cannot make one (only 2 of its ranks take part): run a device collective on the "
              .. "group first, or call weft.backends.device_backends.prepare(g) on every rank", op, gname(g),
              g.world_size), 0)
  end
  return comm(g, op, t)
end

local nccl_be = {}
function nccl_be.all_reduce(g, op, t, out_ptr, rop, code)
  local c, d = comm(g, op, t)
  if c == nil then return stage.all_reduce(g, op, t, out_ptr, rop, code) end
  local n = t.numel
  if n == 0 then return end
  if NAN_OPS[rop] and NAN_DTYPES[t.dtype] then
    local m = nan_mask(d, "nan_mask", t.ptr, n, t._code)
    c:all_reduce(m, m, n, U8, MAX)
    c:all_reduce(t.ptr, out_ptr, n, t._code, code)
    return CUDA().nan_fixup(out_ptr, m, n, t._code)
  end
  c:all_reduce(t.ptr, out_ptr, n, t._code, code)
end

-- along `dim`: NCCL gathers [W][outer][inner]; the layout wanted is
-- [outer][W][inner]: one 2-D copy per rank
function nccl_be.all_gather(g, op, t, dim, out)
  local c, d = comm(g, op, t, out)
  if c == nil then return stage.all_gather(g, op, t, dim, out) end
  local nb, W = t.nbytes, g.world_size
  if nb == 0 then return end
  local outer = outer_of(t.shape, dim)
  if outer == 1 then return c:all_gather(t.ptr, out.ptr, nb, U8) end
  local buf = scratch(d, "gather", nb * W)
  c:all_gather(t.ptr, buf, nb, U8)
  local ib = nb / outer
  local o = ffi.cast(u8p, out.ptr)
  for r = 0, W - 1 do copy2d(o + r * ib, W * ib, buf + r * nb, ib, ib, outer) end
end

-- along `dim`: the input [outer][W][chunk] is laid out [W][outer][chunk] first
function nccl_be.reduce_scatter(g, op, t, dim, out, rop, code)
  local c, d = comm(g, op, t, out)
  if c == nil then return stage.reduce_scatter(g, op, t, dim, out, rop, code) end
  local nb, W = t.nbytes, g.world_size
  if nb == 0 then return end
  local outer = outer_of(t.shape, dim)
  local src = t.ptr
  if outer > 1 then
    local cb = nb / W / outer
    local buf = scratch(d, "rs_in", nb)
    local i = ffi.cast(u8p, t.ptr)
    for r = 0, W - 1 do copy2d(buf + r * outer * cb, cb, i + r * cb, W * cb, cb, outer) end
    src = buf
  end
  if NAN_OPS[rop] and NAN_DTYPES[t.dtype] then
    local n = out.numel
    local m = nan_mask(d, "nan_mask", src, n * W, t._code)
    local mo = scratch(d, "nan_mask_out", n)
    c:reduce_scatter(m, mo, n, U8, MAX)
    c:reduce_scatter(src, out.ptr, n, t._code, code)
    return CUDA().nan_fixup(out.ptr, mo, n, t._code)
  end
  c:reduce_scatter(src, out.ptr, out.numel, t._code, code)
end

function nccl_be.broadcast_tensor(g, op, t, src)
  local c = comm(g, op, t)
  if c == nil then return stage.broadcast_tensor(g, op, t, src) end
  if t.nbytes == 0 then return end
  c:broadcast(t.ptr, t.nbytes, U8, src)
end

-- gather(t, dst, dim) -> on dst the concatenation along dim, elsewhere nil
function nccl_be.gather(g, op, t, dst, dim)
  local c, d = comm(g, op, t)
  if c == nil then return stage.gather(g, op, t, dst, dim) end
  local W, me, nb = g.world_size, g.rank_in_group, t.nbytes
  local out
  if me == dst then
    local shape = {}
    for i = 1, #t.shape do shape[i] = t.shape[i] end
    shape[dim + 1] = shape[dim + 1] * W
    out = T().empty(shape, t.dtype, t.device)
  end
  if nb == 0 then return out end
  local outer = outer_of(t.shape, dim)
  if outer == 1 then
    c:gather(t.ptr, out and out.ptr or nil, nb, U8, dst)
    return out
  end
  local buf = me == dst and scratch(d, "gather", nb * W) or nil
  c:gather(t.ptr, buf, nb, U8, dst)
  if out then
    local ib = nb / outer
    local o = ffi.cast(u8p, out.ptr)
    for r = 0, W - 1 do copy2d(o + r * ib, W * ib, buf + r * nb, ib, ib, outer) end
  end
  return out
end

function nccl_be.send(g, op, t, dst)
  local c = p2p_comm(g, op, t)
  if c == nil then return stage.send(g, op, t, dst) end
  if t.nbytes == 0 then return end
  c:send(t.ptr, t.nbytes, U8, dst)
end

function nccl_be.recv(g, op, t, src)
  local c = p2p_comm(g, op, t)
  if c == nil then return stage.recv(g, op, t, src) end
  if t.nbytes == 0 then return end
  c:recv(t.ptr, t.nbytes, U8, src)
end

local function row_bytes(t)
  local rb = t:elem_size()
  for i = 2, #t.shape do rb = rb * t.shape[i] end
  return rb
end

-- The split tables of an uneven all_to_all_single, agreed over the cpu
-- group (eager, or under WEFT_NCCL_CHECK): every rank's input splits, output
-- rows and output splits, framed as the store route frames a call ("splits"
-- and the shape past dim 0: the even form's frame differs), then checked
-- whole on every rank (weft.group.checks.check_split_tables) before NCCL
-- moves a row. Returns the rows this rank receives from each rank.
local function agree_splits(g, op, inp, out, in_splits, out_splits)
  local H, K, ser = require("weft.group.host"), require("weft.group.checks"), mod("weft.serialize")
  local shape = { "rows" }
  for i = 2, #inp.shape do shape[i] = inp.shape[i] end
  local part, call = H.store_part(op, ser.encode({ input = in_splits, rows = out.shape[1], output = out_splits }),
                                  { dtype = inp.dtype, shape = shape }, "splits")
  local list = g.cpu_group:allgather(part)
  local offs = H.store_check(g, op, call, list)
  local all = {}
  for r = 1, g.world_size do all[r] = ser.decode(list[r]:sub(offs[r] + 1)) end
  K.check_split_tables(g, op, all, 0)
  local recv, me = {}, g.rank_in_group
  for r = 1, g.world_size do recv[r] = all[r].input[me + 1] end
  return recv
end

-- all_to_all_single: rows of inp split per peer (equal, or in_splits); the
-- receive sizes are out_splits when given on every rank, else exchanged over
-- the cpu group (eager only) and checked whole on every rank. Under
-- WEFT_NCCL_CHECK the tables are exchanged and checked even when given, and
-- the even form is agreed like the other collectives.
function nccl_be.all_to_all_single(g, op, out, inp, in_splits, out_splits)
  local c = comm(g, op, inp, out)
  if c == nil then return stage.all_to_all_single(g, op, out, inp, in_splits, out_splits) end
  local W = g.world_size
  if in_splits == nil then
    if M.CHECK then M.agree_call(g, op, inp) end
    if inp.nbytes == 0 then return end
    return c:all_to_all(inp.ptr, out.ptr, inp.nbytes, U8)
  end
  local rb = row_bytes(inp)
  local recv = out_splits
  if recv == nil or M.CHECK then
    if recv == nil and stream_capturing() then
      error(fmt("weft: %s: uneven splits inside a graph capture need the output splits too "
                .. "({input = ..., output = ...}) on group %s", op, gname(g)), 0)
    end
    recv = agree_splits(g, op, inp, out, in_splits, out_splits)
  end
  local total = 0
  for r = 1, W do total = total + recv[r] end
  if total ~= out.shape[1] then
    error(fmt("weft: %s: this rank receives %d rows, output has %d (group %s)", op, total, out.shape[1], gname(g)), 0)
  end
  local sc, rc = {}, {}
  for r = 1, W do sc[r] = in_splits[r] * rb; rc[r] = recv[r] * rb end
  c:all_to_all(inp.ptr, out.ptr, 0, U8, sc, rc)
end

function nccl_be.all_gatherv(g, op, t, sizes, out)
  local c = comm(g, op, t, out)
  if c == nil then return stage.all_gatherv(g, op, t, sizes, out) end
  local rb = row_bytes(t)
  local counts = {}
  for r = 1, g.world_size do counts[r] = sizes[r] * rb end
  c:all_gatherv(t.ptr, out.ptr, counts, U8)
end

function nccl_be.reduce_scatterv(g, op, t, sizes, out, rop, code)
  local c, d = comm(g, op, t, out)
  if c == nil then return stage.reduce_scatterv(g, op, t, sizes, out, rop, code) end
  local re = row_bytes(t) / t:elem_size()
  local counts = {}
  for r = 1, g.world_size do counts[r] = sizes[r] * re end
  if NAN_OPS[rop] and NAN_DTYPES[t.dtype] and t.numel > 0 then
    local n = counts[g.rank_in_group + 1]
    local m = nan_mask(d, "nan_mask", t.ptr, t.numel, t._code)
    local mo = scratch(d, "nan_mask_out", n)
    c:reduce_scatterv(m, mo, counts, U8, MAX)     -- counts are elements: the same for u8
    c:reduce_scatterv(t.ptr, out.ptr, counts, t._code, code)
    if n > 0 then CUDA().nan_fixup(out.ptr, mo, n, t._code) end
    return
  end
  c:reduce_scatterv(t.ptr, out.ptr, counts, t._code, code)
end
---------------------------------------------------------------- check mode
-- NCCL pairs whatever the ranks enqueue: calls that differ give garbage or
-- a hang until the watchdog. WEFT_NCCL_CHECK=1 agrees every NCCL collective
-- first, as the store route does (its call frame, weft.group.host): one
-- extra exchange over the group's cpu group before the launch, in which
-- ranks whose calls differ all fail at once naming every rank's call. Off
-- by default (it costs a host round trip per call; under capture, once per
-- captured call). Not for send/recv (the two ends make different calls)
-- or all_to_all_single, which checks its own split tables (above).
M.CHECK = os.getenv("WEFT_NCCL_CHECK") == "1"
local CHECKED = { "all_reduce", "all_gather", "reduce_scatter", "broadcast_tensor", "gather", "all_gatherv",
                  "reduce_scatterv" }

-- the call's words beyond the tensor: numbers, strings and lists; no
-- pointers or tensors (they differ between ranks)
local function extra_of(...)
  local parts = {}
  for i = 1, select("#", ...) do
    local v = select(i, ...)
    local tv = type(v)
    if tv == "number" or tv == "string" or tv == "boolean" then parts[#parts + 1] = tostring(v)
    elseif tv == "table" and not T().is_tensor(v) and v[1] ~= nil then
      parts[#parts + 1] = "{" .. table.concat(v, ",") .. "}"
    end
  end
  return #parts > 0 and table.concat(parts, " ") or nil
end

function M.agree_call(g, op, t, ...)
  local H = require("weft.group.host")
  local part, call = H.store_part(op, "", t, extra_of(...))
  H.store_check(g, op, call, g.cpu_group:allgather(part))
end

function M.checked(be)
  local c = setmetatable({}, { __index = be })
  for _, name in ipairs(CHECKED) do
    local f = be[name]
    c[name] = function(g, op, t, ...)
      M.agree_call(g, op, t, ...)
      return f(g, op, t, ...)
    end
  end
  return c
end

M.nccl_backend = M.CHECK and M.checked(nccl_be) or nccl_be

return M
