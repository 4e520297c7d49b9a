-- weft.async.queue — the plumbing of weft.async (lua/weft/async.lua): the
-- per-group queue over src/async.c's progress worker (weft_async_queue_*,
-- weft_async_submit), the descriptor a caller fills, and the handles
-- (weft_async_test / wait / release / result): settling a finished one,
-- pinning the tensors a pending one reads, draining and reaping in order.
local ffi = require("ffi")
local lstring = require("weft.internal.hostmem").string -- refuses lengths a Lua string cannot hold (ffi.string wraps a 64-bit one)
local wffi = require("weft.internal.ffi")
local B = require("weft.async.base")
local release = require("weft.internal.binding").release   -- q.handle without its finalizer, then nil

local C = wffi.C
local ffi_new, ffi_gc, ffi_cast = ffi.new, ffi.gc, ffi.cast
local type, tostring, error, setmetatable, getmetatable, pairs, pcall, tonumber =
  type, tostring, error, setmetatable, getmetatable, pairs, pcall, tonumber
local fail, gname, T = B.fail, B.gname, B.T

local M = {}

local EAGAIN, ETIMEOUT = C.WEFT_EAGAIN, C.WEFT_ETIMEOUT
local K = {
  NOP = C.WEFT_ASYNC_NOP, SLEEP = C.WEFT_ASYNC_SLEEP,
  SHM_ALL_REDUCE = C.WEFT_ASYNC_SHM_ALL_REDUCE, SHM_ALL_GATHER = C.WEFT_ASYNC_SHM_ALL_GATHER,
  SHM_REDUCE_SCATTER = C.WEFT_ASYNC_SHM_REDUCE_SCATTER, SHM_BROADCAST = C.WEFT_ASYNC_SHM_BROADCAST,
  SHM_BARRIER = C.WEFT_ASYNC_SHM_BARRIER,
  CPU_BARRIER = C.WEFT_ASYNC_CPU_BARRIER, CPU_BROADCAST = C.WEFT_ASYNC_CPU_BROADCAST,
  CPU_ALLGATHER = C.WEFT_ASYNC_CPU_ALLGATHER, CPU_ALLREDUCE_I64 = C.WEFT_ASYNC_CPU_ALLREDUCE_I64,
  CPU_SEND = C.WEFT_ASYNC_CPU_SEND, CPU_RECV = C.WEFT_ASYNC_CPU_RECV,
  NCCL_ALL_REDUCE = C.WEFT_ASYNC_NCCL_ALL_REDUCE, NCCL_ALL_GATHER = C.WEFT_ASYNC_NCCL_ALL_GATHER,
  NCCL_BROADCAST = C.WEFT_ASYNC_NCCL_BROADCAST, NCCL_SYNC = C.WEFT_ASYNC_NCCL_SYNC,
  MQ_ENQUEUE = C.WEFT_ASYNC_MQ_ENQUEUE, MQ_DEQUEUE = C.WEFT_ASYNC_MQ_DEQUEUE,
  STORE_GET = C.WEFT_ASYNC_STORE_GET,
}
M.KINDS = K

M.WAIT_MARGIN_MS = 5000        -- a handle's default wait: group timeout + this
M.DEFAULT_TIMEOUT_MS = 60000   -- for groups that carry none

---------------------------------------------------------------- handles
local H = {}
H.__index = H
M.Handle = H

local function release_c(h)
  local c = h._c
  if c ~= nil then
    h._c = nil
    ffi_gc(c, nil)
    C.weft_async_release(c)
  end
end

-- Queue/run/end times in µs (nil where not reached); for benchmarks.
local t3 = ffi_new("int64_t[3]")
function H:times()
  if self._c == nil then return self._times end
  C.weft_async_times(self._c, t3, t3 + 1, t3 + 2)
  return { submit = tonumber(t3[0]) / 1e3, start = tonumber(t3[1]) / 1e3, finish = tonumber(t3[2]) / 1e3 }
end


---------------------------------------------------------------- pins
-- The tensors of an anchor (a tensor, or a table holding tensors or such
-- tables) are pinned while the operation is pending: their free() raises and
-- the GC keeps their storage (lua/weft/tensor.lua PINNED).

local function pin_anchor(a, op, group, pin, depth)
  if type(a) ~= "table" then return end
  local tm = T()
  if getmetatable(a) == tm.Tensor then
    if pin then tm._pin(a, op, group) else tm._unpin(a) end
  elseif depth < 3 and getmetatable(a) == nil then
    for i = 1, #a do pin_anchor(a[i], op, group, pin, depth + 1) end
  end
end

-- Moves a finished handle to done/failed (once): runs its finisher (copying
-- results out of the C handle), drops the anchors (unpinning their tensors)
-- and the C handle. rc == EAGAIN (a queue closed under a worker that still
-- runs): the anchors stay pinned, leaked rather than freed under it.
local function settle(h, rc)
  if h._pinned and rc ~= EAGAIN then
    h._pinned = nil
    pin_anchor(h._anchor, h.op, h.group, false, 0)
  end
  local q = h._q
  if q then q.live[h] = nil; q.npending = q.npending - 1; h._q = nil end
  if rc ~= 0 then
    h.state = "failed"
    h.err = ("weft: %s: group %s: %s"):format(h.op, h.group, wffi.last_error())
  else
    local fin = h._finish
    if fin then
      local ok, res = pcall(fin, h)
      if ok then h.result = res; h.state = "done"
      else
        h.state = "failed"
        local msg = tostring(res)
        local i = msg:find("weft: ", 1, true)
        if i then msg = msg:sub(i + 6) end
        if msg:sub(1, #h.op + 2) == h.op .. ": " then msg = msg:sub(#h.op + 3) end
        h.err = ("weft: %s: group %s: %s"):format(h.op, h.group, msg)
      end
    else
      h.state = "done"
    end
  end
  h._finish, h._anchor = nil, nil
  if h._c ~= nil then h._times = h:times() end
  release_c(h)
end

-- "done" | "failed" | "pending", settling a finished handle; never raises.
local function probe(h)
  local st = h.state
  if st ~= "pending" then return st end
  local rc = C.weft_async_test(h._c)
  if rc == EAGAIN then return "pending" end
  settle(h, rc)
  return h.state
end

-- true when done; false while pending; raises the operation's error.
function H:test()
  local st = probe(self)
  if st == "pending" then return false end
  if st == "failed" then error(self.err, 2) end
  return true
end

-- Blocks the calling thread until done or timeout_ms (default: the group's
-- timeout + WAIT_MARGIN_MS); returns the result or raises.
function H:wait(timeout_ms)
  if timeout_ms ~= nil and (type(timeout_ms) ~= "number" or timeout_ms < 0 or timeout_ms > 2147483647
                            or timeout_ms ~= math.floor(timeout_ms)) then
    error(("weft: %s: wait: timeout_ms must be a whole number of milliseconds in 0..2147483647, got %s")
          :format(self.op, require("weft.internal.show").value(timeout_ms)), 2)
  end
  local st = self.state
  if st == "pending" then
    local rc = C.weft_async_wait(self._c, timeout_ms or self.timeout_ms)
    if rc == ETIMEOUT and C.weft_async_test(self._c) == EAGAIN then
      error(("weft: %s: group %s: %s"):format(self.op, self.group, wffi.last_error()), 2)
    end
    if rc ~= 0 then rc = C.weft_async_test(self._c) end  -- re-read: the op's own status
    settle(self, rc)
    st = self.state
  end
  if st == "failed" then error(self.err, 2) end
  return self.result
end

function H:done() return self.state ~= "pending" or C.weft_async_test(self._c) ~= EAGAIN end

function H:__tostring()
  return ("weft.async(%s on %s: %s)"):format(self.op, self.group, self.state)
end

-- An already finished handle (world of one, fallbacks).
local function completed(op, group, result)
  return setmetatable({ op = op, group = group, state = "done", result = result }, H)
end
M.completed = function(result, op) return completed(op or "value", "-", result) end
M.finished = completed

---------------------------------------------------------------- queues
local Q = {}
Q.__index = Q

local function new_queue(name)
  local out = ffi_new("weft_async_queue *[1]")
  wffi.check(C.weft_async_queue_create(name, out), "async queue", 3)
  return setmetatable({
    handle = ffi_gc(out[0], C.weft_async_queue_destroy),
    name = name,
    live = {},          -- handles not yet settled (anchors their inputs)
    fifo = {}, head = 1, tail = 0,
    npending = 0,
    desc = ffi_new("weft_async_desc"),
    out = ffi_new("weft_async *[1]"),
    stats_buf = ffi_new("weft_async_stats"),
  }, Q)
end

-- The group's queue (made on first use; no thread until the first submit).
function M.queue(g)
  local q = g._async
  if q == nil then
    q = new_queue(gname(g))
    g._async = q
  end
  return q
end

-- The group's queue descriptor, reset; fill it, then call submit.
local function desc(g, op)
  local q = M.queue(g)
  if q.handle == nil then fail(3, op, "group %s: its async queue was closed", gname(g)) end
  local d = q.desc
  d.kind, d.comm, d["in"], d.out, d.count = 0, nil, nil, nil, 0
  d.dtype, d.op, d.root, d.timeout_ms, d.device, d.stream, d.key, d.shape, d.args = 0, 0, 0, -1, -1, nil, nil, 0, 0
  d.announce = nil
  return d
end

-- Submits g's filled descriptor; returns a pending handle. anchor: what must
-- stay alive until done; finish(h) -> result (copies results out of the C
-- handle), or nil: the result is `result`. No closure needed on hot paths.
local function submit(g, op, anchor, finish, result)
  local q = g._async
  if C.weft_async_submit(q.handle, q.desc, q.out) ~= 0 then
    error(("weft: %s: group %s: %s"):format(op, gname(g), wffi.last_error()), 3)
  end
  local h = setmetatable({
    _c = ffi_gc(q.out[0], C.weft_async_release),
    _q = q, _anchor = anchor, _finish = finish, result = result,
    op = op, group = gname(g), state = "pending",
    timeout_ms = (g.timeout_ms or M.DEFAULT_TIMEOUT_MS) + M.WAIT_MARGIN_MS,
  }, H)
  if anchor ~= nil then
    pin_anchor(anchor, op, h.group, true, 0)
    h._pinned = true
  end
  q.live[h] = true
  q.npending = q.npending + 1
  -- forget settled handles at the front (they finish in order), so the
  -- list stays as long as what is pending
  local fifo, head = q.fifo, q.head
  while head <= q.tail and fifo[head].state ~= "pending" do fifo[head] = nil; head = head + 1 end
  if head > q.tail then head, q.tail = 1, 0 end
  q.head = head
  q.tail = q.tail + 1
  fifo[q.tail] = h
  return h
end
M.submit, M.desc = submit, desc


-- Waits for everything submitted on g (blocking; each bounded by the group
-- timeout). Errors of handles nobody holds are dropped; held handles keep
-- theirs for their own test/wait. Returns how many were drained.
function M.drain(g, timeout_ms)
  local q = g._async
  if not q or q.npending == 0 then
    if q then q.fifo, q.head, q.tail = {}, 1, 0 end
    return 0
  end
  local n = 0
  for i = q.head, q.tail do
    local h = q.fifo[i]
    q.fifo[i] = nil
    if h and h.state == "pending" then
      local rc = C.weft_async_wait(h._c, timeout_ms or h.timeout_ms)
      if rc == ETIMEOUT and C.weft_async_test(h._c) == EAGAIN then
        q.head = i
        q.fifo[i] = h
        error(("weft: drain: group %s: %s"):format(gname(g), wffi.last_error()), 2)
      end
      settle(h, C.weft_async_test(h._c))
      n = n + 1
    end
  end
  q.head, q.tail = 1, 0
  return n
end

-- Settles finished handles in order without blocking; returns how many are
-- still pending (a cheap way for a scheduler to reap dropped handles).
function M.reap(g)
  local q = g._async
  if not q then return 0 end
  while q.head <= q.tail do
    local h = q.fifo[q.head]
    if h and h.state == "pending" then
      local rc = C.weft_async_test(h._c)
      if rc == EAGAIN then break end
      settle(h, rc)
    end
    q.fifo[q.head] = nil
    q.head = q.head + 1
  end
  return q.npending
end

function M.pending(g)
  local q = g._async
  return q and q.npending or 0
end

-- {submitted, completed, failed, pending, started} of g's queue (zeros if none).
function M.stats(g)
  local q = g._async
  if not q or q.handle == nil then
    return { submitted = 0, completed = 0, failed = 0, pending = 0, started = false }
  end
  local s = q.stats_buf
  C.weft_async_queue_stats(q.handle, s)
  return { submitted = tonumber(s.submitted), completed = tonumber(s.completed),
           failed = tonumber(s.failed), pending = s.pending, started = s.started ~= 0 }
end

-- Drains (bounded) and destroys g's queue; local, idempotent. Used by
-- g:destroy() through group.destroy_hooks (installed by weft.async.install).
function M.close(g)
  local q = g._async
  if not q then return end
  pcall(M.drain, g)
  g._async = nil
  local h = release(q)
  if h ~= nil then C.weft_async_queue_destroy(h) end
  for h2 in pairs(q.live) do settle(h2, C.weft_async_test(h2._c)) end
end


---------------------------------------------------------------- results
-- data (const uint8_t*), lens (const size_t*), n, len of a finished C handle.
local rd, rl, rls, rn = ffi_new("const void *[1]"), ffi_new("size_t[1]"), ffi_new("const size_t *[1]"), ffi_new("int[1]")
function M.result_bytes(h)
  wffi.check(C.weft_async_result(h._c, rd, rl, rls, rn), h.op, 2)
  return ffi_cast("const uint8_t *", rd[0]), rls[0], rn[0], tonumber(rl[0])
end
-- every rank's part of a finished all-gather, as strings (a part too long for
-- a Lua string is refused, naming `what`)
function M.result_parts(h, what)
  local data, lens, n = M.result_bytes(h)
  local parts, off = {}, 0
  for i = 0, n - 1 do
    local l = tonumber(lens[i])
    parts[i + 1] = lstring(data + off, l, what)
    off = off + l
  end
  return parts
end
local function result_string(h)
  wffi.check(C.weft_async_result(h._c, rd, rl, nil, nil), h.op, 2)
  return lstring(rd[0], rl[0], "async result")
end
M.probe, M.result_string = probe, result_string

return M
