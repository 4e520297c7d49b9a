-- weft.shm — host data plane: shared-memory collectives among the ranks of
-- one node (src/host/shm.c). Raw pointers, counts in elements, C dtype/op codes;
-- the GroupCoordinator adapts tensors.
--   local c = shm.new(cpugroup, bytes_per_rank)     -- collective
--   c:all_reduce(in_ptr, out_ptr, count, dtype_code, op_code)   -- in == out: in place
--   c:all_gather(in_ptr, out_ptr, bytes)            -- out holds world * bytes
--   c:reduce_scatter(in_ptr, out_ptr, count_out, dtype_code, op_code)
--   c:broadcast(ptr, bytes, root_index)
--   c:barrier()                                     -- agreed like a collective
--   c:info() -> { world, zero_copy, zero_copy_min, zero_copy_calls, segment_calls }
--   c:abort(why)                                    -- every member's calls fail, naming why
--   c:set_timeout(ms)                               -- this rank's later waits (default: the group's)
--   c:destroy()                                     -- local, idempotent
--   shm.is_shared(ptr, bytes) -> true when the range is weft's shared host
--                                memory (weft_host_alloc from 64 KiB on)
--   shm.same_node(cpugroup, root_index) -> { true/false per group index }
-- dtype/op may also be given by name ("bf16", "sum"). bytes_per_rank is the
-- chunk each rank moves per step (rounded up to whole pages, double-buffered:
-- the segment holds 2 * world * bytes_per_rank plus a control page); any
-- message size works. Every call is bounded by the cpu group's timeout; a
-- timeout, a dead or departed rank aborts the communicator on every rank.
-- Ranks that call different collectives or sizes all get an error (the
-- communicator stays usable).
-- Zero-copy: a collective of at least zero_copy_min bytes (64 KiB) whose
-- buffers are shared host memory on every rank (broadcast: the root's; weft
-- host tensors of 64 KiB and more are) reads the peers' buffers in place
-- instead of copying through the segment (src/host/shm_zc.c); info() counts the
-- calls on each path.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")

local C = wffi.C
local ffi_new = ffi.new
local type, error = type, error
local check = binding.check
local shape_word, args_word = binding.shape_word, binding.args_word

local M = {}

M.DEFAULT_BYTES_PER_RANK = 1048576

local DTYPES = {
  f32 = C.WEFT_F32, f16 = C.WEFT_F16, bf16 = C.WEFT_BF16, f64 = C.WEFT_F64,
  i32 = C.WEFT_I32, i64 = C.WEFT_I64, u8 = C.WEFT_U8,
  float32 = C.WEFT_F32, float16 = C.WEFT_F16, bfloat16 = C.WEFT_BF16, float64 = C.WEFT_F64,
  int32 = C.WEFT_I32, int64 = C.WEFT_I64, uint8 = C.WEFT_U8,
}
local OPS = { sum = C.WEFT_SUM, max = C.WEFT_MAX, min = C.WEFT_MIN }
M.dtypes, M.ops = DTYPES, OPS

local Comm = {}
Comm.__index = Comm

local handle_of = binding.handle_of("weft: shm %s: communicator of group '%s' was destroyed")

local function code(map, v, op, what)
  if type(v) == "number" then return v end
  local c = map[v]
  if c == nil then error(("weft: shm %s: unknown %s %s"):format(op, what, tostring(v)), 3) end
  return c
end

local function group_handle(g, op)
  if type(g) ~= "table" or g.handle == nil then
    error(("weft: shm %s: expected a live weft.cpugroup"):format(op), 3)
  end
  return g.handle
end

function M.new(cpugroup, bytes_per_rank)
  local gh = group_handle(cpugroup, "new")
  bytes_per_rank = bytes_per_rank or M.DEFAULT_BYTES_PER_RANK
  if type(bytes_per_rank) ~= "number" or bytes_per_rank < 1 or bytes_per_rank % 1 ~= 0 then
    error("weft: shm new: bytes_per_rank must be a positive integer, got "
          .. tostring(bytes_per_rank), 2)
  end
  local out = ffi_new("weft_shm *[1]")
  check(C.weft_shm_create(gh, bytes_per_rank, out))
  local c = binding.group_comm(cpugroup, out[0], C.weft_shm_destroy, Comm)
  c.bytes_per_rank = bytes_per_rank
  return c
end

-- shape, extra (optional, every method): the caller's tensor shape and its
-- call's other arguments, compared with the peers' with the rest of the
-- call (binding.shape_word, binding.args_word)
function Comm:all_reduce(inp, out, count, dtype, op, shape, extra)
  local h = handle_of(self, "all_reduce")
  C.weft_shm_set_call(h, shape_word(shape), args_word(extra))
  check(C.weft_shm_all_reduce(h, inp, out, count, code(DTYPES, dtype, "all_reduce", "dtype"),
                              code(OPS, op or 0, "all_reduce", "op")))
end

function Comm:all_gather(inp, out, bytes, shape, extra)
  local h = handle_of(self, "all_gather")
  C.weft_shm_set_call(h, shape_word(shape), args_word(extra))
  check(C.weft_shm_all_gather(h, inp, out, bytes))
end

function Comm:reduce_scatter(inp, out, count_out, dtype, op, shape, extra)
  local h = handle_of(self, "reduce_scatter")
  C.weft_shm_set_call(h, shape_word(shape), args_word(extra))
  check(C.weft_shm_reduce_scatter(h, inp, out, count_out,
                                  code(DTYPES, dtype, "reduce_scatter", "dtype"),
                                  code(OPS, op or 0, "reduce_scatter", "op")))
end

function Comm:broadcast(ptr, bytes, root, shape, extra)
  local h = handle_of(self, "broadcast")
  C.weft_shm_set_call(h, shape_word(shape), args_word(extra))
  check(C.weft_shm_broadcast(h, ptr, bytes, root or 0))
end

-- a barrier whose call is compared with the peers' like a collective's
function Comm:barrier()
  check(C.weft_shm_barrier(handle_of(self, "barrier")))
end

-- the barrier an object collective (which goes over the store) passes first
-- on a group whose host collectives use this communicator: a rank in a
-- collective here and a rank in an object collective fail together at once
-- ("an object collective (over the store)") instead of each waiting its
-- timeout on another channel
local OBJECT_WORD = C.weft_args_word("object", 6)
M.OBJECT_WORD = OBJECT_WORD   -- weft.async.objects queues the same barrier
function Comm:announce_object()
  local h = handle_of(self, "announce_object")
  C.weft_shm_set_call(h, 0, OBJECT_WORD)
  check(C.weft_shm_barrier(h))
end

-- the bound of this rank's later waits (the group's timeout at create)
function Comm:set_timeout(ms)
  local h = handle_of(self, "set_timeout")
  check(C.weft_shm_set_timeout(h, ms))
end

-- this rank gives up: every member's calls fail with "aborted by rank R: why"
function Comm:abort(why)
  local h = self.handle
  if h ~= nil then C.weft_shm_abort(h, tostring(why or "")) end
end

local info_buf = ffi_new("weft_shm_info")

function Comm:info()
  local h = handle_of(self, "info")
  check(C.weft_shm_get_info(h, info_buf))
  return {
    world = info_buf.world,
    zero_copy = info_buf.zero_copy ~= 0,
    zero_copy_min = tonumber(info_buf.zero_copy_min),
    zero_copy_calls = tonumber(info_buf.zero_copy_calls),
    segment_calls = tonumber(info_buf.segment_calls),
  }
end

function M.is_shared(ptr, bytes)
  return C.weft_host_is_shared(ptr, bytes) ~= 0
end

-- Local teardown only (never a collective); idempotent.
Comm.destroy = binding.destroyer(C.weft_shm_destroy)

function Comm:__tostring()
  return ("weft.shm(group '%s', %d ranks, %d bytes per rank%s)")
    :format(self.name, self.size, self.bytes_per_rank, self.handle == nil and ", destroyed" or "")
end

-- Collective: which ranks of the group share memory with group index root.
function M.same_node(cpugroup, root)
  local gh = group_handle(cpugroup, "same_node")
  root = root or 0
  local n = cpugroup.size
  local flags = ffi_new("uint8_t[?]", n)
  check(C.weft_same_node(gh, root, flags))
  local t = {}
  for i = 1, n do t[i] = flags[i - 1] ~= 0 end
  return t
end

return M
