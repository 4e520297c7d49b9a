-- weft.cpugroup — control-plane collectives over the store (src/host/cpugroup.c).
--   local g = cpugroup.new(store, name, ranks, my_index, timeout_ms)
--   g:barrier()  g:broadcast(bytes_or_nil, root_index) -> bytes
--   g:allgather(bytes) -> { bytes_of_index0, ... }
--   g:allreduce_i64(numbers, op) -> array     op: "sum"|"max"|"min"|"and"|"prod"
--   g:send(bytes, dst_index)  g:recv(src_index) -> bytes
--   g:set_timeout(ms)  g:destroy()  g.handle
-- Indices are 0-based positions in `ranks`; `ranks` holds global ranks, which
-- is what timeout messages name. Every member calls collectives in the same
-- order; a member that does not arrive makes the others fail after timeout_ms.
local ffi = require("ffi")
local lstring = require("weft.internal.hostmem").string -- refuses lengths a Lua string cannot hold (ffi.string wraps a 64-bit one)
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")

local C = wffi.C
local ffi_new, ffi_gc = ffi.new, ffi.gc
local tonumber, type, error = tonumber, type, error
local last_error = wffi.last_error

local M = {}

local Group = {}
Group.__index = Group

local OPS = { sum = C.WEFT_SUM, max = C.WEFT_MAX, min = C.WEFT_MIN, ["and"] = C.WEFT_AND,
              prod = C.WEFT_PROD }

local handle_of = binding.handle_of("weft: cpugroup %s: destroyed (group '%s' was destroyed)")

local check = binding.check

local function index_arg(self, op, what, i)
  if type(i) ~= "number" or i < 0 or i >= self.size or i % 1 ~= 0 then
    error(("weft: cpugroup %s: %s index %s outside 0..%d of group '%s'")
          :format(op, what, tostring(i), self.size - 1, self.name), 3)
  end
  return i
end

-- store: a weft.store object (kept referenced, so it outlives the group).
function M.new(store, name, ranks, my_index, timeout_ms)
  if type(store) ~= "table" or store.handle == nil then
    error("weft: cpugroup new: expected an open weft.store", 2)
  end
  if type(name) ~= "string" or name == "" then error("weft: cpugroup new: name must be a non-empty string", 2) end
  if type(ranks) ~= "table" or #ranks == 0 then error("weft: cpugroup new: ranks must be a non-empty array", 2) end
  local n = #ranks
  if type(my_index) ~= "number" or my_index < 0 or my_index >= n then
    error(("weft: cpugroup new: my_index %s outside 0..%d for group '%s'")
          :format(tostring(my_index), n - 1, name), 2)
  end
  local cranks = ffi_new("int[?]", n)
  local copy = {}
  for i = 1, n do cranks[i - 1] = ranks[i]; copy[i] = ranks[i] end
  local out = ffi_new("weft_cpugroup *[1]")
  if C.weft_cpugroup_create(store.handle, name, cranks, n, my_index, timeout_ms or 0, out) ~= 0 then
    error("weft: " .. last_error(), 2)
  end
  local h = ffi_gc(out[0], C.weft_cpugroup_destroy)
  return setmetatable({
    handle = h,
    store = store,
    name = name,
    ranks = copy,
    size = n, world_size = n,
    my_index = my_index, index = my_index, rank_in_group = my_index,
    rank = copy[my_index + 1],
    timeout_ms = timeout_ms,
    -- out-parameters, allocated once per group
    _ptr = ffi_new("const void *[1]"),
    _len = ffi_new("size_t[1]"),
    _lens = ffi_new("const size_t *[1]"),
    _i64 = nil, _i64n = 0,
  }, Group)
end

-- this rank gives up: every member's waits on the group fail, naming why
function Group:abort(why)
  local h = self.handle
  if h ~= nil then C.weft_cpugroup_abort(h, tostring(why or "")) end
end

-- an abort this rank could not publish when it gave up (the store did not
-- answer then) goes out now; weft.recover() calls it first
function Group:publish_abort()
  local h = self.handle
  if h ~= nil then check(C.weft_cpugroup_publish_abort(h)) end
end

function Group:barrier()
  check(C.weft_cpugroup_barrier(handle_of(self, "barrier")))
end

-- Root passes the bytes, the others nil; everyone gets the root's bytes.
function Group:broadcast(bytes, root)
  local h = handle_of(self, "broadcast")
  index_arg(self, "broadcast", "root", root)
  if root == self.my_index then
    if type(bytes) ~= "string" then
      error(("weft: cpugroup broadcast: the root of group '%s' must pass a string"):format(self.name), 2)
    end
    check(C.weft_cpugroup_broadcast(h, root, bytes, #bytes, self._ptr, self._len))
    return bytes
  end
  check(C.weft_cpugroup_broadcast(h, root, nil, 0, self._ptr, self._len))
  return lstring(self._ptr[0], self._len[0], "cpugroup broadcast")
end

function Group:allgather(bytes)
  local h = handle_of(self, "allgather")
  if type(bytes) ~= "string" then error("weft: cpugroup allgather: expected a string", 2) end
  check(C.weft_cpugroup_allgather(h, bytes, #bytes, self._ptr, self._lens))
  local base, lens = ffi.cast("const char *", self._ptr[0]), self._lens[0]
  local res, off = {}, 0
  for i = 0, self.size - 1 do
    local l = tonumber(lens[i])
    res[i + 1] = lstring(base + off, l, "cpugroup allgather")
    off = off + l
  end
  return res
end

function Group:allreduce_i64(numbers, op)
  local h = handle_of(self, "allreduce_i64")
  local code = OPS[op or "sum"]
  if not code then
    error(("weft: cpugroup allreduce_i64: unknown op %q (sum, max, min, and, prod)"):format(tostring(op)), 2)
  end
  if type(numbers) ~= "table" then error("weft: cpugroup allreduce_i64: expected an array of numbers", 2) end
  local n = #numbers
  if n > self._i64n then self._i64 = ffi_new("int64_t[?]", n); self._i64n = n end
  local buf = self._i64
  for i = 1, n do buf[i - 1] = numbers[i] end
  check(C.weft_cpugroup_allreduce_i64(h, buf, n, code))
  local res = {}
  for i = 1, n do res[i] = tonumber(buf[i - 1]) end
  return res
end

function Group:send(bytes, dst)
  local h = handle_of(self, "send")
  index_arg(self, "send", "destination", dst)
  if type(bytes) ~= "string" then error("weft: cpugroup send: expected a string", 2) end
  check(C.weft_cpugroup_send(h, dst, bytes, #bytes))
end

function Group:recv(src)
  local h = handle_of(self, "recv")
  index_arg(self, "recv", "source", src)
  check(C.weft_cpugroup_recv(h, src, self._ptr, self._len))
  return lstring(self._ptr[0], self._len[0], "cpugroup recv")
end

function Group:set_timeout(ms)
  check(C.weft_cpugroup_set_timeout(handle_of(self, "set_timeout"), ms))
  self.timeout_ms = ms
end

-- Idempotent and local (no collective); the store stays usable.
Group.destroy = binding.destroyer(C.weft_cpugroup_destroy)

function Group:__tostring()
  return ("weft.cpugroup('%s', index %d of %d%s)"):format(self.name, self.my_index, self.size,
                                                          self.handle == nil and ", destroyed" or "")
end

M.Group = Group
return M
