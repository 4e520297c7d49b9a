-- weft.async.tensor — the tensor collectives of weft.async (lua/weft/async.lua;
-- src/async.c runs them): all_reduce, all_gather, reduce_scatter, broadcast,
-- barrier. Each checks its arguments, asks the policy for the backend (NCCL
-- for a device tensor with a communicator, else shm / shm_gather / store),
-- fills the queue's descriptor for that backend and submits; what has no
-- async path runs the blocking method after draining.
local ffi = require("ffi")
local lstring = require("weft.internal.hostmem").string -- refuses lengths a Lua string cannot hold (ffi.string wraps a 64-bit one)
local wffi = require("weft.internal.ffi")
local B = require("weft.async.base")
local show = require("weft.internal.show").value -- names a refused value's type
local Q = require("weft.async.queue")
local GK = require("weft.group.checks") -- the overlap check every out tensor goes through
local check_overlap, outer_of = GK.check_overlap, GK.outer_inner

local C = wffi.C
local ffi_new, ffi_gc, ffi_cast = ffi.new, ffi.gc, ffi.cast
local copy_bytes = require("weft.internal.hostmem").copy -- any size (ffi.copy stops at 2^31)
local type, tostring, error, pcall, tonumber = type, tostring, error, pcall, tonumber
local floor = math.floor
local mod, fail, gname, T = B.mod, B.fail, B.gname, B.T
local check_group, check_tensor, check_src = B.check_group, B.check_tensor, B.check_src
local desc, submit, finished, K = Q.desc, Q.submit, Q.finished, Q.KINDS
local B = require("weft.internal.binding")
local shape_word, args_word = B.shape_word, B.args_word

local M = {}

local group_host  -- weft.group.host (the store path's call frames), loaded on first use
local function GH()
  group_host = group_host or require("weft.group.host")
  return group_host
end

local REDUCE_OPS = { sum = 0, max = 1, min = 2, prod = 4 }
local NAN_DTYPES = { f32 = true, f64 = true, f16 = true, bf16 = true }
local DT_CODE = { f32 = 0, f16 = 1, bf16 = 2, i32 = 3, i64 = 4, u8 = 5, f64 = 6, f8e4m3 = 7 }
local REDUCIBLE = { f32 = true, f16 = true, bf16 = true, i32 = true, i64 = true, u8 = true, f64 = true }
local u8p = ffi.typeof("uint8_t *")

local function is_device(t) return t.device ~= nil and t.device ~= "cpu" end

---------------------------------------------------------------- backends
-- The backend the policy picks for (g, op, t, rop), or nil for a device
-- tensor without a NCCL communicator in g.device_group.
local DET_FLOAT = { f32 = true, f16 = true, bf16 = true, f64 = true }
local function backend(g, op, t, rop)
  if t and is_device(t) then
    -- deterministic mode (docs/policy.md §10): NCCL never sums floats; nil
    -- sends the call to the blocking form, i.e. the group's policy (weft's
    -- deterministic kernels, or its clear refusal)
    if rop ~= nil and rop ~= "max" and rop ~= "min" and DET_FLOAT[t.dtype]
       and mod("weft.policy").deterministic(g) then
      return nil
    end
    -- the quick all-reduce (opt-in): the blocking form, whose policy picks the
    -- quick kernel (or the exact ones below its size); never NCCL behind its back
    if op == "all_reduce" and (t.dtype == "bf16" or t.dtype == "f16") and mod("weft.policy").quick(g) ~= "off" then
      return nil
    end
    local dg = g.device_group
    if dg and dg.handle ~= nil and type(dg.device) == "number" then return "nccl", dg end
    return nil
  end
  local name = mod("weft.policy").select(g, op, t, rop)
  return name
end

-- The group's shm communicator, made like weft.group does (a blocking
-- collective the first time; call weft.async.prepare(g) at start-up to keep
-- it out of a request path).
function M.shm_comm(g)
  local c = g._shm
  if c then return c end
  local group = mod("weft.group")
  local per_rank = tonumber(os.getenv("WEFT_SHM_BYTES")) or group.SHM_BYTES
  Q.drain(g)
  c = mod("weft.shm").new(g.cpu_group, per_rank)
  g._shm = c
  return c
end
local shm_comm = M.shm_comm

local stream1 = ffi_new("void *[1]")
function M.current_stream()
  if C.weft_cuda_stream_get_current(stream1) ~= 0 then return nil end
  return stream1[0]
end
local current_stream = M.current_stream

-- Fills g's descriptor d for a NCCL call on dg: t's elements from t.ptr to
-- out_ptr, on the current stream. (desc(g, op) is called by the collective
-- itself, so its errors keep pointing at the collective's caller.)
local function nccl_fill(d, kind, dg, t, out_ptr)
  d.kind, d.comm, d["in"], d.out, d.count = kind, dg.handle, t.ptr, out_ptr, t.numel
  d.dtype, d.device, d.stream = DT_CODE[t.dtype], dg.device, current_stream()
  return d
end

-- Runs the blocking method (after draining) for what has no async path yet.
local function fallback(g, op, method, ...)
  Q.drain(g)
  local f = g[method]
  local ok, res = pcall(f, g, ...)
  if not ok then error(res, 3) end
  local h = finished(op, gname(g), res)
  h.blocking = true
  return h
end

-- A host buffer of n bytes (64-byte aligned, freed by the GC).
local function host_buffer(n)
  if n < 64 then n = 64 end
  local p = C.weft_host_alloc(n)
  if p == nil then error(("weft: async: out of host memory (%d bytes)"):format(n), 0) end
  return ffi_gc(ffi_cast(u8p, p), C.weft_host_free)
end

-- every rank's part of a finished store all-gather, each checked against
-- this rank's call (the blocking store path's frames: weft.group.host)
local function store_parts(h, g, op, call)
  local parts = Q.result_parts(h, "async " .. op)
  return parts, GH().store_check(g, op, call, parts)
end

-- Gathers nbytes from ptr on every rank into a fresh buffer [world][nbytes]
-- (shm all-gather, or the cpu group's through the store), then
-- finish(buf) -> result. For reductions/gathers without a native path.
local function gather_then(g, op, be, ptr, nbytes, anchor, finish, t, extra)
  local W = g.world_size
  local buf = host_buffer(nbytes * W)
  if be == "store" then
    local s, call = GH().store_part(op, lstring(ptr, nbytes, "async " .. op), t, extra)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.count = K.CPU_ALLGATHER, g.cpu_group.handle, s, #s
    return submit(g, op, { anchor, s, buf }, function(h)
      local parts, offs = store_parts(h, g, op, call)
      for i = 1, W do
        local l = #parts[i] - offs[i]
        if l ~= nbytes then
          error(("weft: %s: ranks passed different sizes on group %s (rank %d: %d bytes, this rank %d)")
                :format(op, gname(g), g.ranks[i], l, nbytes), 0)
        end
        copy_bytes(buf + (i - 1) * nbytes, ffi_cast("const uint8_t *", parts[i]) + offs[i], nbytes)
      end
      return finish(buf)
    end)
  end
  local c = shm_comm(g)
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.out, d.count = K.SHM_ALL_GATHER, c.handle, ptr, buf, nbytes
  d.shape, d.args = shape_word(t and t.shape), args_word(extra)
  return submit(g, op, { anchor, buf }, function() return finish(buf) end)
end

---------------------------------------------------------------- tensor collectives
-- all_reduce(g, t [, op="sum"]) -> handle; result: t (reduced in place)
function M.all_reduce(g, t, rop)
  local op = "all_reduce"
  check_group(g, op)
  check_tensor(g, op, t)
  rop = rop or "sum"
  local code = REDUCE_OPS[rop]
  if not code then fail(2, op, "unknown reduction %q on group %s (sum, max, min, prod)", tostring(rop), gname(g)) end
  if not REDUCIBLE[t.dtype] then fail(2, op, "dtype %s cannot be reduced on group %s", t.dtype, gname(g)) end
  if g.world_size == 1 or t.numel == 0 then return finished(op, gname(g), t) end
  local be, dg = backend(g, op, t, rop)
  -- float max/min on device need the NaN pass (weft.backends.device_backends.nccl_backend): several
  -- calls on the communicator, so the blocking form serves them
  if be == "nccl" and (rop == "max" or rop == "min") and NAN_DTYPES[t.dtype] then be = nil end
  if be == "nccl" then
    nccl_fill(desc(g, op), K.NCCL_ALL_REDUCE, dg, t, t.ptr).op = code
    return submit(g, op, t, nil, t)
  elseif be == "shm" then
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.SHM_ALL_REDUCE, c.handle, t.ptr, t.ptr, t.numel
    d.shape = shape_word(t.shape)
    d.dtype, d.op = DT_CODE[t.dtype], code
    return submit(g, op, t, nil, t)
  elseif be == "shm_gather" or be == "store" then
    local nbytes = t.nbytes
    return gather_then(g, op, be, t.ptr, nbytes, t, function(buf)
      local blocks = {}
      for r = 1, g.world_size do blocks[r] = buf + (r - 1) * nbytes end
      g:_reduce_blocks(t.ptr, blocks, t.numel, t.dtype, rop)
      return t
    end, t, rop)
  end
  return fallback(g, op, "all_reduce", t, rop)
end

-- all_gather(g, t [, dim=-1 [, out]]) -> handle; result: out
function M.all_gather(g, t, dim, out)
  local op = "all_gather"
  check_group(g, op)
  check_tensor(g, op, t)
  local nd = #t.shape
  dim = dim or -1
  if type(dim) ~= "number" or dim ~= floor(dim) or dim < -nd or dim >= nd then
    fail(2, op, "dim %s is invalid for a %d-dim tensor (group %s)", show(dim), nd, gname(g))
  end
  if dim < 0 then dim = dim + nd end
  local W = g.world_size
  local oshape = {}
  for i = 1, nd do oshape[i] = t.shape[i] end
  oshape[dim + 1] = oshape[dim + 1] * W
  if out ~= nil then
    check_tensor(g, op, out, "output")
    local ok = out.dtype == t.dtype and #out.shape == nd
    for i = 1, nd do ok = ok and out.shape[i] == oshape[i] end
    if not ok then fail(2, op, "output must be %s {%s} (group %s)", t.dtype, table.concat(oshape, ","), gname(g)) end
    -- as the blocking form: t may be this rank's block of out (dim 0 blocks), else apart
    local slot = outer_of(t.shape, dim) == 1 and g.rank_in_group * t.nbytes or nil
    check_overlap(g, op, out, "output", t, "input", slot, 3)
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if W == 1 then
    if out.ptr ~= t.ptr then out:copy_(t) end
    return finished(op, gname(g), out)
  end
  local outer = 1
  for i = 1, dim do outer = outer * t.shape[i] end
  local be, dg = backend(g, op, t)
  if be == "nccl" and outer == 1 then
    nccl_fill(desc(g, op), K.NCCL_ALL_GATHER, dg, t, out.ptr)
    return submit(g, op, { t, out }, nil, out)
  end
  if (be == "shm" or be == "shm_gather") and outer == 1 then
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.SHM_ALL_GATHER, c.handle, t.ptr, out.ptr, t.nbytes
    d.shape, d.args = shape_word(t.shape), args_word(dim)   -- as the blocking form's words
    return submit(g, op, { t, out }, nil, out)
  end
  if be == "shm" or be == "shm_gather" or be == "store" then
    local nbytes = t.nbytes
    return gather_then(g, op, be, t.ptr, nbytes, { t, out }, function(buf)
      -- buf is [W][outer][inner]; out is [outer][W][inner]
      local ib = nbytes / outer
      local o = ffi_cast(u8p, out.ptr)
      for r = 0, W - 1 do
        for k = 0, outer - 1 do copy_bytes(o + (k * W + r) * ib, buf + (r * outer + k) * ib, ib) end
      end
      return out
    end, t, dim)
  end
  return fallback(g, op, "all_gather", t, dim, out)
end

-- reduce_scatter(g, t [, dim=-1 [, out [, op]]]) -> handle; result: out.
-- Native for shm along dim 0; other layouts use the blocking form.
function M.reduce_scatter(g, t, dim, out, rop)
  local op = "reduce_scatter"
  check_group(g, op)
  check_tensor(g, op, t)
  rop = rop or "sum"
  local nd = #t.shape
  local d0 = dim or -1
  if type(d0) == "number" and d0 < 0 then d0 = d0 + nd end
  local W = g.world_size
  if out ~= nil then -- on every path (the blocking fallback's included), at the caller's line
    check_tensor(g, op, out, "output")
    local slot = type(d0) == "number" and d0 >= 0 and d0 < nd and outer_of(t.shape, d0) == 1
                 and g.rank_in_group * out.nbytes or nil
    check_overlap(g, op, t, "input", out, "output", slot, 3)
  end
  local be = W > 1 and backend(g, op, t, rop) or nil
  if be == "shm" and d0 == 0 and t.shape[1] % W == 0 and REDUCE_OPS[rop] then
    local oshape = {}
    for i = 1, nd do oshape[i] = t.shape[i] end
    oshape[1] = oshape[1] / W
    out = out or T().empty(oshape, t.dtype, t.device)
    check_tensor(g, op, out, "output")
    if out.numel * W ~= t.numel or out.dtype ~= t.dtype then
      fail(2, op, "output must hold %d %s elements (group %s)", t.numel / W, t.dtype, gname(g))
    end
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.SHM_REDUCE_SCATTER, c.handle, t.ptr, out.ptr, out.numel
    d.shape = shape_word(t.shape)
    d.dtype, d.op = DT_CODE[t.dtype], REDUCE_OPS[rop]
    return submit(g, op, { t, out }, nil, out)
  end
  return fallback(g, op, "reduce_scatter", t, dim, out, rop)
end

-- broadcast(g, t [, src=0]) -> handle; result: t (in place)
function M.broadcast(g, t, src)
  local op = "broadcast"
  check_group(g, op)
  src = check_src(g, op, src)
  check_tensor(g, op, t)
  if g.world_size == 1 or t.numel == 0 then return finished(op, gname(g), t) end
  local be, dg = backend(g, op, t)
  if be == "nccl" then
    nccl_fill(desc(g, op), K.NCCL_BROADCAST, dg, t, t.ptr).root = src
    return submit(g, op, t, nil, t)
  elseif be == "shm" or be == "shm_gather" then
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d.out, d.count, d.root = K.SHM_BROADCAST, c.handle, t.ptr, t.nbytes, src
    d.shape = shape_word(t.shape)
    return submit(g, op, t, nil, t)
  elseif be == "store" then
    -- the blocking store path's exchange (weft.group.host): only the root's
    -- part carries the bytes, every part names its call
    local me = g.rank_in_group
    local s, call = GH().store_part(op, me == src and lstring(t.ptr, t.nbytes, "async broadcast") or "",
                                    t, "src=" .. tostring(src))
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.count = K.CPU_ALLGATHER, g.cpu_group.handle, s, #s
    return submit(g, op, { t, s }, function(h)
      local parts, offs = store_parts(h, g, op, call)
      local len = #parts[src + 1] - offs[src + 1]
      if len ~= t.nbytes then
        error(("weft: broadcast: rank %d broadcast %d bytes on group %s, this rank expected %d")
              :format(g.ranks[src + 1], len, gname(g), t.nbytes), 0)
      end
      if me ~= src then copy_bytes(t.ptr, ffi_cast("const uint8_t *", parts[src + 1]) + offs[src + 1], len) end
      return t
    end)
  end
  return fallback(g, op, "broadcast", t, src)
end

-- barrier(g) -> handle
function M.barrier(g)
  check_group(g, "barrier")
  if g.world_size == 1 then return finished("barrier", gname(g), true) end
  -- where the blocking barrier goes (weft.group.host's barrier rule)
  local be = backend(g, "barrier")
  if (be == "shm" or be == "shm_gather") and g._shm then
    local d = desc(g, "barrier")
    d.kind, d.comm = K.SHM_BARRIER, g._shm.handle
    return submit(g, "barrier", nil, nil, true)
  elseif be == "gloo" and g._gloo then
    return fallback(g, "barrier", "barrier")
  end
  local d = desc(g, "barrier")
  d.kind, d.comm = K.CPU_BARRIER, g.cpu_group.handle
  return submit(g, "barrier", nil, nil, true)
end

return M
