-- weft.mq — message-queue broadcaster: one writer to the other ranks of a node
-- through a shared-memory ring (src/host/mq.c; SGLang's MessageQueue).
--   local q = mq.new(cpugroup, {writer = 0, chunk_bytes = 1048576, chunks = 8})  -- collective
--   q:send_bytes(s)                   writer: a string (or ptr, len)
--   q:recv_bytes([timeout_ms]) -> s   readers: the next message
--   q:try_recv_bytes([wait_ms]) -> s | nil   readers: nil when nothing came (default:
--                                     never waits; poll from a coroutine or a REPL loop)
--   q:broadcast_object(obj) -> obj    writer sends obj; readers return the writer's
--   q:recv_object([timeout_ms]) -> obj   q:try_recv_object([wait_ms]) -> got, obj
--   q:recv_view([timeout_ms]) -> ptr, len   zero-copy, valid until the next call on q
--   q:set_timeout(ms)  q:destroy()  q.handle  q.is_writer  q.writer  q.index  q.size
-- Objects go through weft.serialize (safe: decoding never runs code). Every
-- rank of the group must be on one node and pass the same options. Messages
-- larger than a chunk are split over consecutive slots; waits are bounded by
-- the cpu group's timeout (or timeout_ms): a reader's timeout leaves the
-- queue usable (call again), while a dead or departed peer, or a writer stuck
-- in the middle of a split message, aborts the queue on every rank with a
-- message naming who and why. Messages already in the ring stay readable.
local ffi = require("ffi")
local lstring = require("weft.internal.hostmem").string -- refuses lengths a Lua string cannot hold (ffi.string wraps a 64-bit one)
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")
local show = require("weft.internal.show").value -- names a refused value's type
local serialize = require("weft.serialize")

local C = wffi.C
local ffi_new, ffi_gc = ffi.new, ffi.gc
local type, error, tostring = type, error, tostring
local last_error = wffi.last_error
local encode, decode = serialize.encode, serialize.decode
local EAGAIN, ETIMEOUT = C.WEFT_EAGAIN, C.WEFT_ETIMEOUT

local M = {}

M.DEFAULT_CHUNK_BYTES = 1048576
M.DEFAULT_CHUNKS = 8

local Q = {}
Q.__index = Q

local handle_of = binding.handle_of("weft: mq %s: the message queue of group '%s' was destroyed")

local function fail()
  error("weft: " .. last_error(), 3)
end

-- The message just dequeued on h, copied out (a length no Lua string can
-- hold is refused, naming op), then released.
local function take(self, h, op)
  local s = lstring(self._ptr[0], self._len[0], op)
  C.weft_mq_release(h)
  return s
end

local function int_opt(o, k, dflt, min)
  local v = o[k]
  if v == nil then return dflt end
  if type(v) ~= "number" or v % 1 ~= 0 or v < min then
    error(("weft: mq new: option %s must be an integer >= %d, got %s"):format(k, min, show(v)), 3)
  end
  return v
end

-- cpugroup: a live weft.cpugroup (kept referenced). opts: writer (group index,
-- default 0), chunk_bytes (default 1 MiB), chunks (default 8), timeout_ms
-- (default: the group's).
function M.new(g, opts)
  if type(g) ~= "table" or g.handle == nil then
    error("weft: mq new: expected a live weft.cpugroup", 2)
  end
  opts = opts or {}
  if type(opts) ~= "table" then error("weft: mq new: options must be a table", 2) end
  local writer = int_opt(opts, "writer", 0, 0)
  if writer >= g.size then
    error(("weft: mq new: writer index %d outside 0..%d of group '%s'"):format(writer, g.size - 1, g.name), 2)
  end
  local chunk_bytes = int_opt(opts, "chunk_bytes", M.DEFAULT_CHUNK_BYTES, 1)
  local chunks = int_opt(opts, "chunks", M.DEFAULT_CHUNKS, 1)
  local out = ffi_new("weft_mq *[1]")
  if C.weft_mq_create(g.handle, writer, chunk_bytes, chunks, out) ~= 0 then
    error("weft: " .. last_error(), 2)
  end
  local h = ffi_gc(out[0], C.weft_mq_destroy)
  local self = setmetatable({
    handle = h, group = g, name = g.name,
    writer = writer, index = g.my_index, size = g.size,
    is_writer = g.my_index == writer,
    chunk_bytes = chunk_bytes, chunks = chunks,
    _ptr = ffi_new("const void *[1]"),
    _len = ffi_new("size_t[1]"),
  }, Q)
  if opts.timeout_ms then self:set_timeout(opts.timeout_ms) end
  return self
end

---------------------------------------------------------------- bytes
-- send_bytes(s) or send_bytes(ptr, len): writer only; returns when the
-- message is in the ring (readers may not have read it yet).
function Q:send_bytes(s, len)
  local h = handle_of(self, "send_bytes")
  if type(s) == "string" then
    len = #s
  elseif type(s) ~= "cdata" or type(len) ~= "number" then
    error("weft: mq send_bytes: expected a string, or a pointer and a length", 2)
  end
  if C.weft_mq_enqueue(h, s, len) ~= 0 then fail() end
end

-- The next message as (pointer, length), valid until the next call on q
-- (no copy for a message that fits one chunk); readers only.
function Q:recv_view(timeout_ms)
  local h = handle_of(self, "recv_view")
  if C.weft_mq_dequeue(h, timeout_ms or -1, self._ptr, self._len) ~= 0 then fail() end
  return self._ptr[0], self._len[0]
end

function Q:recv_bytes(timeout_ms)
  local h = handle_of(self, "recv_bytes")
  if C.weft_mq_dequeue(h, timeout_ms or -1, self._ptr, self._len) ~= 0 then fail() end
  return take(self, h, "mq recv_bytes")
end

-- nil when no complete message is there (wait_ms > 0: within wait_ms; by
-- default it never waits). Fragments of a split message that already arrived
-- are taken, so the writer can go on; the rest comes with a later call.
-- Failures other than "nothing yet" (a dead writer, an aborted queue) raise.
function Q:try_recv_bytes(wait_ms)
  local h = handle_of(self, "try_recv_bytes")
  local rc
  if wait_ms and wait_ms > 0 then
    rc = C.weft_mq_dequeue(h, wait_ms, self._ptr, self._len)
    if rc == ETIMEOUT then return nil end
  else
    rc = C.weft_mq_try_dequeue(h, self._ptr, self._len)
    if rc == EAGAIN then return nil end
  end
  if rc ~= 0 then fail() end
  return take(self, h, "mq try_recv_bytes")
end

---------------------------------------------------------------- objects
-- Like SGLang's MessageQueue.broadcast_object: the writer enqueues obj and
-- returns it; a reader ignores its argument and returns the writer's object.
function Q:broadcast_object(obj)
  local h = handle_of(self, "broadcast_object")
  if self.is_writer then
    local s = encode(obj)
    if C.weft_mq_enqueue(h, s, #s) ~= 0 then fail() end
    return obj
  end
  if C.weft_mq_dequeue(h, -1, self._ptr, self._len) ~= 0 then fail() end
  return decode(take(self, h, "mq broadcast_object"))
end

function Q:recv_object(timeout_ms)
  return decode(self:recv_bytes(timeout_ms))
end

-- got, obj: got is false when no complete message is there (within wait_ms).
function Q:try_recv_object(wait_ms)
  local s = self:try_recv_bytes(wait_ms)
  if s == nil then return false end
  return true, decode(s)
end

---------------------------------------------------------------- lifetime
function Q:set_timeout(ms)
  local h = handle_of(self, "set_timeout")
  if C.weft_mq_set_timeout(h, ms) ~= 0 then fail() end
  self.timeout_ms = ms
end

-- Local and idempotent (no collective). Peers that still wait on this rank
-- get an error naming it.
Q.destroy = binding.destroyer(C.weft_mq_destroy)

function Q:__tostring()
  return ("weft.mq(group '%s', index %d of %d, writer %d, %d chunks of %d bytes%s)")
    :format(self.name, self.index, self.size, self.writer, self.chunks, self.chunk_bytes,
            self.handle == nil and ", destroyed" or "")
end

M.MessageQueue = Q
return M
