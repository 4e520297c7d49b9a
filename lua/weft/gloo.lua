-- weft.gloo — host collectives across nodes on Gloo's TCP transport
-- (src/host/gloo_shim.cc). Raw pointers, counts in elements, C dtype/op codes;
-- the GroupCoordinator's cross-node backends (weft.backends.host_nodes) adapt tensors.
--   gloo.available() -> true when weft was built with Gloo
--   gloo.small_path(size, bytes) -> true when such an all_reduce takes the small path
--   local c = gloo.new(cpugroup [, host])     -- collective over the group
--   c:all_reduce(in_ptr, out_ptr, count, dtype_code, op_code)  -- in == out: in place
--   c:all_gather(in_ptr, out_ptr, bytes)      -- out holds world * bytes
--   c:reduce_scatter(in_ptr, out_ptr, count_out, dtype_code, op_code)
--   c:broadcast(ptr, bytes, root_index)  c:barrier()
--   c:send(ptr, bytes, dst_index)  c:recv(ptr, bytes, src_index)
--   c:set_timeout(ms)  c:destroy()           -- local, idempotent
-- host: where this rank listens (default: the local address of its store
-- connection, i.e. the interface that reaches rank 0; WEFT_GLOO_HOST
-- overrides). The ranks meet through weft's store. Every call is bounded by
-- the group's timeout; a failure names the group, the operation and a rank
-- that died, and leaves the communicator unusable.
local ffi = require("ffi")
local bit = require("bit")
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")

local C = wffi.C
local ffi_new = ffi.new
local error = error
local last_error = wffi.last_error
local shape_word, args_word = binding.shape_word, binding.args_word

local M = {}

local Comm = {}
Comm.__index = Comm

function M.available()
  return C.weft_gloo_available() == 1
end

-- true when all_reduce of `bytes` in a group of `size` ranks takes the
-- shim's small path (synchronous mesh, recursive doubling / halving: weft_gloo_small_max)
function M.small_path(size, bytes)
  return size > 1 and bit.band(size, size - 1) == 0 and bytes <= tonumber(C.weft_gloo_small_max())
end

function M.new(cpugroup, host)
  if type(cpugroup) ~= "table" or cpugroup.handle == nil then
    error("weft: gloo new: expected a live weft.cpugroup", 2)
  end
  host = host or os.getenv("WEFT_GLOO_HOST")
  if host == "" then host = nil end
  local out = ffi_new("weft_gloo *[1]")
  if C.weft_gloo_create(cpugroup.handle, host, out) ~= 0 then error("weft: " .. last_error(), 2) end
  return binding.group_comm(cpugroup, out[0], C.weft_gloo_destroy, Comm)
end

local handle_of = binding.handle_of("weft: gloo %s: communicator of group '%s' was destroyed")

local check = binding.check

-- shape, extra (optional): the caller's tensor shape and its call's other
-- arguments, compared with the peers' with the rest of the call
-- (binding.shape_word, binding.args_word)
local function shaped(self, op, shape, extra)
  local h = handle_of(self, op)
  C.weft_gloo_set_call(h, shape_word(shape), args_word(extra))
  return h
end

function Comm:all_reduce(inp, out, count, dtype, op, shape, extra)
  check(C.weft_gloo_all_reduce(shaped(self, "all_reduce", shape, extra), inp, out, count, dtype, op or 0))
end

function Comm:all_gather(inp, out, bytes, shape, extra)
  check(C.weft_gloo_all_gather(shaped(self, "all_gather", shape, extra), inp, out, bytes))
end

function Comm:reduce_scatter(inp, out, count_out, dtype, op, shape, extra)
  check(C.weft_gloo_reduce_scatter(shaped(self, "reduce_scatter", shape, extra), inp, out, count_out, dtype, op or 0))
end

function Comm:broadcast(ptr, bytes, root, shape, extra)
  check(C.weft_gloo_broadcast(shaped(self, "broadcast", shape, extra), ptr, bytes, root or 0))
end

-- this member refuses the call the others make (weft_gloo_refuse); raises
-- with the mismatch it causes
function Comm:refuse(wait_ms)
  check(C.weft_gloo_refuse(handle_of(self, "refuse"), wait_ms or 1000))
end

function Comm:barrier()
  check(C.weft_gloo_barrier(handle_of(self, "barrier")))
end

function Comm:send(ptr, bytes, dst)
  check(C.weft_gloo_send(handle_of(self, "send"), ptr, bytes, dst))
end

function Comm:recv(ptr, bytes, src)
  check(C.weft_gloo_recv(handle_of(self, "recv"), ptr, bytes, src))
end

function Comm:set_timeout(ms)
  check(C.weft_gloo_set_timeout(handle_of(self, "set_timeout"), ms))
end

-- Local teardown only (closes this rank's connections); idempotent.
Comm.destroy = binding.destroyer(C.weft_gloo_destroy)

return M
