-- weft.internal.binding — what the thin bindings over one C handle share (weft.nccl,
-- weft.backends.custom_ar): errors that carry the C library's last message, names or
-- codes for enum arguments, stream arguments, the destroyed-handle check and
-- the local release of a handle.
--
--   local B = binding.new("nccl", "communicator")   -- module name, what a handle is
--   B.raise(op [, level])        -- raises "weft: nccl.<op>: <weft_last_error()>"
--   B.code_of(map, v, what, op)  -- v when a number, else map[v]; raises "unknown <what> <v>"
--   B.live(obj, op)              -- obj.handle; raises "<what> of group <obj.name> was destroyed"
--   B.need_group(cpugroup)       -- raises unless a live weft.cpugroup (for new)
--   binding.stream(s)            -- a weft.cuda stream's handle, or s as it is
--   binding.release(obj)         -- obj.handle without its finalizer, obj.handle = nil
--   binding.destroyer(cfree)     -- a destroy method: release, then cfree(handle)
--   binding.handle_of(msg)       -- a live-handle check for bindings with their own message
--   binding.check(rc)            -- raises "weft: <weft_last_error()>" when rc ~= 0
--   binding.shape_word(shape)    -- a shape table as the word shm / Gloo calls compare (0: nil)
--   binding.args_word(extra)     -- a call's other arguments (sizes, dim, op) as such a word
--   binding.group_comm(g, h, free, mt) -- a communicator object over cpu group g (shm, gloo)
-- Error levels name the caller of the binding's method (the functions here
-- are called straight from the method).
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C

local type, error, tostring, setmetatable = type, error, tostring, setmetatable
local ffi_gc, ffi_string = ffi.gc, ffi.string
local fmt = string.format

local M = {}

function M.new(mod, what)
  local B = {}

  function B.raise(op, level)
    error(fmt("weft: %s.%s: %s", mod, op, ffi_string(C.weft_last_error())), (level or 2) + 1)
  end

  function B.code_of(map, v, kind, op)
    if type(v) == "number" then return v end
    local c = map[v]
    if c == nil then error(fmt("weft: %s.%s: unknown %s %s", mod, op, kind, tostring(v)), 4) end
    return c
  end

  function B.live(obj, op)
    local h = obj.handle
    if h == nil then error(fmt("weft: %s.%s: %s of group %s was destroyed", mod, op, what, obj.name), 3) end
    return h
  end

  function B.need_group(cpugroup)
    if type(cpugroup) ~= "table" or cpugroup.handle == nil then
      error(fmt("weft: %s.new: expected a live weft.cpugroup (with .handle)", mod), 3)
    end
  end

  return B
end

function M.stream(s)
  if type(s) == "table" then return s.handle end
  return s
end

-- (also weft.store, weft.cpugroup: close / destroy)
function M.release(obj)
  local h = obj.handle
  if h == nil then return nil end
  obj.handle = nil
  ffi_gc(h, nil)
  return h
end

-- A destroy method: releases obj.handle (binding.release) and frees it with
-- the C destructor `free`; idempotent.
function M.destroyer(free)
  return function(obj)
    local h = M.release(obj)
    if h ~= nil then free(h) end
  end
end

-- A handle_of(obj, op) for the bindings whose destroyed-handle message is
-- their own (weft.cpugroup, weft.mq, weft.shm, weft.gloo): obj.handle, else
-- raises msg:format(op, obj.name) naming the caller of obj's method.
function M.handle_of(msg)
  return function(obj, op)
    local h = obj.handle
    if h == nil then error(msg:format(op, obj.name), 3) end
    return h
  end
end

-- The shape word of a call (weft_shape_word: exact up to 3 dims, else a
-- hash), 0 for no shape; the shm and Gloo communicators compare it with the
-- peers' so the same count in different shapes fails on every rank.
-- (up to 4 dims without a loop: an inner loop here would leave the caller's
-- trace on every call)
local dims_buf = ffi.new("int64_t[4]")
function M.shape_word(shape)
  if shape == nil then return 0ULL end
  local n = #shape
  if n <= 4 then
    dims_buf[0], dims_buf[1], dims_buf[2], dims_buf[3] = shape[1] or 0, shape[2] or 0, shape[3] or 0, shape[4] or 0
    return C.weft_shape_word(n, dims_buf)
  end
  local d = ffi.new("int64_t[?]", n)
  for i = 1, n do d[i - 1] = shape[i] end
  return C.weft_shape_word(n, d)
end

-- The args word of a call: what weft.group passes besides the tensor (a
-- v-collective's sizes table, all_gather's dim, a gathered reduction's op),
-- written as call descriptions write it (weft.internal.errors.extra_str), as a word
-- (weft_args_word: exact up to 7 bytes, else a hash); 0 for nil.
local extra_str = require("weft.internal.errors").extra_str
function M.args_word(extra)
  if extra == nil then return 0ULL end
  local s = extra_str(extra)
  return C.weft_args_word(s, #s)
end

-- A communicator over a weft.cpugroup (weft.shm, weft.gloo): its handle h,
-- freed by `free` when collected; the group, kept referenced (and its store
-- with it); the group's name and size and this rank's index in it; metatable mt.
function M.group_comm(cpugroup, h, free, mt)
  return setmetatable({
    handle = ffi_gc(h, free),
    cpugroup = cpugroup,
    name = cpugroup.name,
    size = cpugroup.size,
    rank_in_group = cpugroup.my_index,
  }, mt)
end

-- For messages that name the operation already (the C library's do).
function M.check(rc)
  if rc ~= 0 then error("weft: " .. ffi_string(C.weft_last_error()), 3) end
end

return M
