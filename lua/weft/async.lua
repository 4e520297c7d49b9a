-- weft.async — non-blocking forms of a group's collectives (src/async.c).
--
--   local async = require "weft.async"
--   local h = async.all_reduce(g, t)          -- returns at once
--   while not h:test() do coroutine.yield() end   -- test() never blocks
--   h:wait([timeout_ms]) -> result            -- blocks (timed condvar)
--   async.poll_wait(h, yield_fn [, timeout_ms]) -> result
--       -- calls yield_fn(i) between tests: ngx.sleep(0) in nginx, coroutine.yield elsewhere
--   async.install(GroupCoordinator)           -- g:all_reduce_async(t), ... and drain-first
--                                             -- blocking methods (see install below)
--
-- Operations of one group run in submission order on that group's progress
-- worker (a C thread made on first use, never at load time), one at a time,
-- each bounded by its communicator's timeout; ranks that submit the same
-- sequence meet in the same order, exactly as with the blocking calls. While
-- a group has operations in flight the worker owns its communicators: the
-- blocking methods drain the queue first (install), and raw use of
-- g.cpu_group / g._shm / the store handle from the caller's thread must wait
-- for the handles (the store's mutex is held by a cpu-group wait).
--
-- Handles: h:test() -> true (done; h.result holds the result) | false;
-- raises the operation's error ("weft: <op>: group <name>: <cause>"), also
-- on every later test/wait. h:wait(timeout_ms) -> result. h.op, h.group.
-- Inputs (tensors, strings, scratch) stay referenced until the operation is
-- done, even when the caller drops the handle.
local ffi = require "ffi"
local wffi = require "weft.ffi"
local serialize = require "weft.serialize"

local C = wffi.C
local ffi_new, ffi_gc, ffi_string, ffi_cast, ffi_copy = ffi.new, ffi.gc, ffi.string, ffi.cast, ffi.copy
local type, tostring, error, setmetatable, getmetatable, pairs, ipairs =
  type, tostring, error, setmetatable, getmetatable, pairs, ipairs
local floor = math.floor

local M = {}

local EAGAIN, ETIMEOUT = C.WEFT_EAGAIN, C.WEFT_ETIMEOUT
local K = {
  NOP = C.WEFT_ASYNC_NOP, SLEEP = C.WEFT_ASYNC_SLEEP,
  SHM_ALL_REDUCE = C.WEFT_ASYNC_SHM_ALL_REDUCE, SHM_ALL_GATHER = C.WEFT_ASYNC_SHM_ALL_GATHER,
  SHM_REDUCE_SCATTER = C.WEFT_ASYNC_SHM_REDUCE_SCATTER, SHM_BROADCAST = C.WEFT_ASYNC_SHM_BROADCAST,
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

local REDUCE_OPS = { sum = 0, max = 1, min = 2, prod = 4 }
local DT_CODE = { f32 = 0, f16 = 1, bf16 = 2, i32 = 3, i64 = 4, u8 = 5, f64 = 6, f8e4m3 = 7 }
local DT_SIZE = { f32 = 4, f16 = 2, bf16 = 2, i32 = 4, i64 = 8, u8 = 1, f64 = 8, f8e4m3 = 1 }
local REDUCIBLE = { f32 = true, f16 = true, bf16 = true, i32 = true, i64 = true, u8 = true, f64 = true }
local u8p = ffi.typeof("uint8_t *")

---------------------------------------------------------------- clock
local now_ms = require("weft.clock").now_ms
M.now_ms = now_ms

---------------------------------------------------------------- lazy modules
local mods = {}
local function mod(name)
  local m = mods[name]
  if not m then m = require(name); mods[name] = m end
  return m
end

local function fail(level, op, fmt, ...)
  error("weft: " .. op .. ": " .. fmt:format(...), level + 1)
end

local function gname(g) return tostring(g.unique_name or g.name or "?") end

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
local function T() return mod("weft.tensor") end

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
  d.dtype, d.op, d.root, d.timeout_ms, d.device, d.stream, d.key = 0, 0, 0, -1, -1, nil, nil
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
M._submit, M._desc = submit, desc

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
-- g:destroy() through group.destroy_hooks (installed by M.install).
function M.close(g)
  local q = g._async
  if not q then return end
  pcall(M.drain, g)
  g._async = nil
  local h = q.handle
  if h ~= nil then
    q.handle = nil
    ffi_gc(h, nil)
    C.weft_async_queue_destroy(h)
  end
  for h2 in pairs(q.live) do settle(h2, C.weft_async_test(h2._c)) end
end

---------------------------------------------------------------- polling
-- Tests h until done, calling yield_fn(i) between tests (i = 1, 2, ...):
-- nginx: function() ngx.sleep(0) end (or a short sleep after a few tries);
-- coroutines: coroutine.yield. Bounded by timeout_ms (default: h's wait bound).
function M.poll_wait(h, yield_fn, timeout_ms)
  local st = probe(h)
  if st == "done" then return h.result end
  if st == "failed" then error(h.err, 2) end
  local deadline = now_ms() + (timeout_ms or h.timeout_ms or M.DEFAULT_TIMEOUT_MS)
  local i = 0
  while true do
    i = i + 1
    yield_fn(i)
    st = probe(h)
    if st == "done" then return h.result end
    if st == "failed" then error(h.err, 2) end
    if now_ms() > deadline then
      error(("weft: %s: group %s: not done within %d ms of polling (still %s)")
            :format(h.op, h.group, timeout_ms or h.timeout_ms, h.state), 2)
    end
  end
end

-- A yield function for OpenResty: ngx.sleep(0) for the first `spins`
-- tests (default 0: only OpenResty's nginx has the "delayed events" patch
-- that makes sleep(0) cheap; Debian's nginx warns on every call), then
-- sleeps of `sleep_s` (default 0.001 s, nginx's timer resolution), so a
-- long step costs the event loop nothing.
function M.ngx_yield(ngx_sleep, spins, sleep_s)
  spins, sleep_s = spins or 0, sleep_s or 0.001
  return function(i)
    if i <= spins then ngx_sleep(0) else ngx_sleep(sleep_s) end
  end
end

-- Waits for every handle in `list` (array), yielding between tests.
function M.poll_all(list, yield_fn, timeout_ms)
  local res = {}
  for i = 1, #list do res[i] = M.poll_wait(list[i], yield_fn, timeout_ms) end
  return res
end

---------------------------------------------------------------- checks

local function check_group(g, op)
  if type(g) ~= "table" then fail(3, op, "expected a GroupCoordinator, got %s", type(g)) end
  if g.destroyed then fail(3, op, "group %s is destroyed", gname(g)) end
  if g.is_member == false then
    fail(3, op, "rank %s is not in group %s", tostring(g.rank), gname(g))
  end
end

local function check_tensor(g, op, t, what)
  what = what or "tensor"
  if not T().is_tensor(t) then
    fail(3, op, "%s must be a weft tensor, got %s (group %s)", what, type(t), gname(g))
  end
  if t.ptr == nil and t.numel > 0 then fail(3, op, "%s storage was freed (group %s)", what, gname(g)) end
  if not t:is_contiguous() then fail(3, op, "%s is not contiguous (group %s)", what, gname(g)) end
end

local function check_peer(g, op, idx, what)
  if type(idx) ~= "number" or idx ~= floor(idx) or idx < 0 or idx >= g.world_size then
    fail(3, op, "%s %s is out of range for group %s of %d ranks", what, tostring(idx), gname(g), g.world_size)
  end
end

local function is_device(t) return t.device ~= nil and t.device ~= "cpu" end

---------------------------------------------------------------- backends
-- The backend the policy picks for (g, op, t, rop), or nil for a device
-- tensor without a NCCL communicator in g.device_group.
local function backend(g, op, t, rop)
  if t and is_device(t) then
    local dg = g.device_group
    if dg and dg.handle ~= nil and type(dg.device) == "number" then return "nccl", dg end
    return nil
  end
  local name = mod("weft.policy").select(g, op, t, rop)
  return name
end

-- The group's shm communicator, made like weft.group does (a blocking
-- collective the first time; call M.prepare(g) at start-up to keep it out
-- of a request path).
local function shm_comm(g)
  local c = g._shm
  if c then return c end
  local group = mod("weft.group")
  local per_rank = tonumber(os.getenv("WEFT_SHM_BYTES")) or group.SHM_BYTES
  M.drain(g)
  c = mod("weft.shm").new(g.cpu_group, per_rank)
  g._shm = c
  return c
end

local stream1 = ffi_new("void *[1]")
local function current_stream()
  if C.weft_cuda_stream_get_current(stream1) ~= 0 then return nil end
  return stream1[0]
end

-- Runs the blocking method (after draining) for what has no async path yet.
local function fallback(g, op, method, ...)
  M.drain(g)
  local f = g[method]
  local ok, res = pcall(f, g, ...)
  if not ok then error(res, 3) end
  local h = completed(op, gname(g), res)
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

-- data (const uint8_t*), lens (const size_t*), n, len of a finished C handle.
local rd, rl, rls, rn = ffi_new("const void *[1]"), ffi_new("size_t[1]"), ffi_new("const size_t *[1]"), ffi_new("int[1]")
function M.result_bytes(h)
  wffi.check(C.weft_async_result(h._c, rd, rl, rls, rn), h.op, 2)
  return ffi_cast("const uint8_t *", rd[0]), rls[0], rn[0], tonumber(rl[0])
end
local function result_string(h)
  wffi.check(C.weft_async_result(h._c, rd, rl, nil, nil), h.op, 2)
  return ffi_string(rd[0], rl[0])
end

-- Gathers nbytes from ptr on every rank into a fresh buffer [world][nbytes]
-- (shm all-gather, or the cpu group's through the store), then
-- finish(buf) -> result. For reductions/gathers without a native path.
local function gather_then(g, op, be, ptr, nbytes, anchor, finish)
  local W = g.world_size
  local buf = host_buffer(nbytes * W)
  if be == "store" then
    local s = ffi_string(ptr, nbytes)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.count = K.CPU_ALLGATHER, g.cpu_group.handle, s, nbytes
    return submit(g, op, { anchor, s, buf }, function(h)
      local data, lens, n = M.result_bytes(h)
      for i = 0, n - 1 do
        if tonumber(lens[i]) ~= nbytes then
          error(("weft: %s: ranks passed different sizes on group %s (rank %d: %d bytes, this rank %d)")
                :format(op, gname(g), g.ranks[i + 1], tonumber(lens[i]), nbytes), 0)
        end
      end
      ffi_copy(buf, data, nbytes * W)
      return finish(buf)
    end)
  end
  local c = shm_comm(g)
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.out, d.count = K.SHM_ALL_GATHER, c.handle, ptr, buf, nbytes
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
  if g.world_size == 1 or t.numel == 0 then return completed(op, gname(g), t) end
  local be, dg = backend(g, op, t, rop)
  if be == "nccl" then
    local stream = current_stream()
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.NCCL_ALL_REDUCE, dg.handle, t.ptr, t.ptr, t.numel
    d.dtype, d.op, d.device, d.stream = DT_CODE[t.dtype], code, dg.device, stream
    return submit(g, op, t, nil, t)
  elseif be == "shm" then
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.SHM_ALL_REDUCE, c.handle, t.ptr, t.ptr, t.numel
    d.dtype, d.op = DT_CODE[t.dtype], code
    return submit(g, op, t, nil, t)
  elseif be == "shm_gather" or be == "store" then
    local nbytes = t.nbytes
    return gather_then(g, op, be, t.ptr, nbytes, t, function(buf)
      local blocks = {}
      for r = 1, g.world_size do blocks[r] = buf + (r - 1) * nbytes end
      g:_reduce_blocks(t.ptr, blocks, t.numel, t.dtype, rop)
      return t
    end)
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
    fail(2, op, "dim %s is invalid for a %d-dim tensor (group %s)", tostring(dim), nd, gname(g))
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
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if W == 1 then
    if out.ptr ~= t.ptr then out:copy_(t) end
    return completed(op, gname(g), out)
  end
  local outer = 1
  for i = 1, dim do outer = outer * t.shape[i] end
  local be, dg = backend(g, op, t)
  if be == "nccl" and outer == 1 then
    local stream = current_stream()
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.NCCL_ALL_GATHER, dg.handle, t.ptr, out.ptr, t.numel
    d.dtype, d.device, d.stream = DT_CODE[t.dtype], dg.device, stream
    return submit(g, op, { t, out }, nil, out)
  end
  if (be == "shm" or be == "shm_gather") and outer == 1 then
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.SHM_ALL_GATHER, c.handle, t.ptr, out.ptr, t.nbytes
    return submit(g, op, { t, out }, nil, out)
  end
  if be == "shm" or be == "shm_gather" or be == "store" then
    local nbytes = t.nbytes
    return gather_then(g, op, be, t.ptr, nbytes, { t, out }, function(buf)
      -- buf is [W][outer][inner]; out is [outer][W][inner]
      local ib = nbytes / outer
      local o = ffi_cast(u8p, out.ptr)
      for r = 0, W - 1 do
        for k = 0, outer - 1 do ffi_copy(o + (k * W + r) * ib, buf + (r * outer + k) * ib, ib) end
      end
      return out
    end)
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
    d.dtype, d.op = DT_CODE[t.dtype], REDUCE_OPS[rop]
    return submit(g, op, { t, out }, nil, out)
  end
  return fallback(g, op, "reduce_scatter", t, dim, out, rop)
end

-- broadcast(g, t [, src=0]) -> handle; result: t (in place)
function M.broadcast(g, t, src)
  local op = "broadcast"
  check_group(g, op)
  src = src or 0
  check_peer(g, op, src, "src")
  check_tensor(g, op, t)
  if g.world_size == 1 or t.numel == 0 then return completed(op, gname(g), t) end
  local be, dg = backend(g, op, t)
  if be == "nccl" then
    local stream = current_stream()
    local d = desc(g, op)
    d.kind, d.comm, d["in"], d.out, d.count = K.NCCL_BROADCAST, dg.handle, t.ptr, t.ptr, t.numel
    d.dtype, d.root, d.device, d.stream = DT_CODE[t.dtype], src, dg.device, stream
    return submit(g, op, t, nil, t)
  elseif be == "shm" or be == "shm_gather" then
    local c = shm_comm(g)
    local d = desc(g, op)
    d.kind, d.comm, d.out, d.count, d.root = K.SHM_BROADCAST, c.handle, t.ptr, t.nbytes, src
    return submit(g, op, t, nil, t)
  elseif be == "store" then
    local me = g.rank_in_group
    local s = me == src and ffi_string(t.ptr, t.nbytes) or nil
    local d = desc(g, op)
    d.kind, d.comm, d.root = K.CPU_BROADCAST, g.cpu_group.handle, src
    if s then d["in"], d.count = s, #s end
    return submit(g, op, { t, s }, function(h)
      if me ~= src then
        local data, _, _, len = M.result_bytes(h)
        if len ~= t.nbytes then
          error(("weft: broadcast: rank %d broadcast %d bytes on group %s, this rank expected %d")
                :format(g.ranks[src + 1], len, gname(g), t.nbytes), 0)
        end
        ffi_copy(t.ptr, data, len)
      end
      return t
    end)
  end
  return fallback(g, op, "broadcast", t, src)
end

-- barrier(g) -> handle
function M.barrier(g)
  check_group(g, "barrier")
  if g.world_size == 1 then return completed("barrier", gname(g), true) end
  local d = desc(g, "barrier")
  d.kind, d.comm = K.CPU_BARRIER, g.cpu_group.handle
  return submit(g, "barrier", nil, nil, true)
end

---------------------------------------------------------------- objects
-- The same parts as the blocking object collectives (weft.group's "call
-- agreement"): each names its call, so blocking and async calls meet, and
-- ranks that called different ones fail together.
local group_mod
local function GM()
  group_mod = group_mod or require "weft.group"
  return group_mod
end

-- every rank's part of a finished all-gather, checked: parts, offsets
local function gathered_parts(h, g, op, call)
  local data, lens, n = M.result_bytes(h)
  local parts, off = {}, 0
  for i = 0, n - 1 do
    local l = tonumber(lens[i])
    parts[i + 1] = ffi_string(data + off, l)
    off = off + l
  end
  return parts, GM().check_calls(g, op, call, parts)
end

-- broadcast_object(g, obj [, src=0]) -> handle; result: the root's object
function M.broadcast_object(g, obj, src)
  local op = "broadcast_object"
  check_group(g, op)
  src = src or 0
  check_peer(g, op, src, "src")
  if g.world_size == 1 then return completed(op, gname(g), obj) end
  local call = op .. " src=" .. src
  local me = g.rank_in_group
  local s = GM().frame(call, me == src and serialize.encode(obj) or "")
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.count = K.CPU_ALLGATHER, g.cpu_group.handle, s, #s
  return submit(g, op, s, function(h)
    local parts, offs = gathered_parts(h, g, op, call)
    if me == src then return obj end
    return serialize.decode(parts[src + 1]:sub(offs[src + 1] + 1))
  end)
end

-- all_gather_object(g, obj) -> handle; result: { obj of index 0, ... }
function M.all_gather_object(g, obj)
  local op = "all_gather_object"
  check_group(g, op)
  if g.world_size == 1 then return completed(op, gname(g), { obj }) end
  local s = GM().frame(op, serialize.encode(obj))
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.count = K.CPU_ALLGATHER, g.cpu_group.handle, s, #s
  return submit(g, op, s, function(h)
    local parts, offs = gathered_parts(h, g, op, op)
    local res = {}
    for i = 1, #parts do res[i] = serialize.decode(parts[i]:sub(offs[i] + 1)) end
    return res
  end)
end

-- send_object(g, obj, dst) -> handle
function M.send_object(g, obj, dst)
  local op = "send_object"
  check_group(g, op)
  check_peer(g, op, dst, "dst")
  if dst == g.rank_in_group then fail(2, op, "dst %d is this rank's own index in group %s", dst, gname(g)) end
  local s = GM().frame(op, serialize.encode(obj))
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.count, d.root = K.CPU_SEND, g.cpu_group.handle, s, #s, dst
  return submit(g, op, s, nil, true)
end

-- recv_object(g, src) -> handle; result: the object
function M.recv_object(g, src)
  local op = "recv_object"
  check_group(g, op)
  check_peer(g, op, src, "src")
  if src == g.rank_in_group then fail(2, op, "src %d is this rank's own index in group %s", src, gname(g)) end
  local d = desc(g, op)
  d.kind, d.comm, d.root = K.CPU_RECV, g.cpu_group.handle, src
  return submit(g, op, nil, function(h)
    return serialize.decode(GM().check_message(g, op, result_string(h), src))
  end)
end

-- allreduce_i64(g, numbers [, op="sum"]) -> handle; result: array (cpu group votes)
local I64_OPS = { sum = 0, max = 1, min = 2, ["and"] = 3, prod = 4 }
function M.allreduce_i64(g, numbers, rop)
  local op = "allreduce_i64"
  check_group(g, op)
  local code = I64_OPS[rop or "sum"]
  if not code then fail(2, op, "unknown op %q (sum, max, min, and, prod)", tostring(rop)) end
  if type(numbers) ~= "table" then fail(2, op, "expected an array of numbers") end
  local n = #numbers
  if g.world_size == 1 then
    local r = {}
    for i = 1, n do r[i] = numbers[i] end
    return completed(op, gname(g), r)
  end
  local buf = ffi_new("int64_t[?]", n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = numbers[i] end
  local d = desc(g, op)
  d.kind, d.comm, d.out, d.count, d.op = K.CPU_ALLREDUCE_I64, g.cpu_group.handle, buf, n, code
  return submit(g, op, buf, function()
    local r = {}
    for i = 1, n do r[i] = tonumber(buf[i - 1]) end
    return r
  end)
end

---------------------------------------------------------------- message queue (weft.mq)
-- mq_send(g, mq, obj [, {raw=true}]) -> handle: the writer's enqueue on g's
-- worker, ordered with g's collectives (raw: send a string as is; else
-- weft.serialize).
function M.mq_send(g, mq, obj, opts)
  local op = "mq_send"
  if type(mq) ~= "table" or mq.handle == nil then fail(2, op, "expected a live weft.mq") end
  local s = (opts and opts.raw) and obj or serialize.encode(obj)
  if type(s) ~= "string" then fail(2, op, "raw messages must be strings") end
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.count = K.MQ_ENQUEUE, mq.handle, s, #s
  return submit(g, op, { s, mq }, nil, obj)
end

local function raw_result(h) return result_string(h) end
local function decode_result(h) return serialize.decode(result_string(h)) end

-- mq_recv(g, mq [, timeout_ms [, {raw=true}]]) -> handle; result: the next message
function M.mq_recv(g, mq, timeout_ms, opts)
  local op = "mq_recv"
  if type(mq) ~= "table" or mq.handle == nil then fail(2, op, "expected a live weft.mq") end
  local d = desc(g, op)
  d.kind, d.comm, d.timeout_ms = K.MQ_DEQUEUE, mq.handle, timeout_ms or -1
  return submit(g, op, mq, (opts and opts.raw) and raw_result or decode_result)
end

---------------------------------------------------------------- misc operations
-- nop(g) -> handle: a round trip through g's worker (the queue's own cost).
function M.nop(g)
  local d = desc(g, "nop")
  d.kind = K.NOP
  return submit(g, "nop", nil, nil, true)
end

-- sleep(g, ms) -> handle: occupies g's worker for ms (tests, demos).
function M.sleep(g, ms)
  local d = desc(g, "sleep")
  d.kind, d.count = K.SLEEP, ms
  return submit(g, "sleep", nil, nil, true)
end

-- nccl_synchronize(g [, stream]) -> handle: waits for the stream on the worker.
function M.nccl_synchronize(g, stream)
  local dg = g.device_group
  if not dg or dg.handle == nil then fail(2, "nccl_synchronize", "group %s has no NCCL communicator", gname(g)) end
  stream = stream or current_stream()
  local d = desc(g, "nccl_synchronize")
  d.kind, d.comm, d.device, d.stream = K.NCCL_SYNC, dg.handle, dg.device, stream
  return submit(g, "nccl_synchronize", nil, nil, true)
end

-- Makes the group's communicators now (the shm segment is a blocking
-- collective), so the first async call of a request path does not block.
-- Collective: every member calls it.
function M.prepare(g)
  check_group(g, "prepare")
  M.queue(g)
  if g.world_size > 1 and g.same_node and not g.host_backend then shm_comm(g) end
  return g
end

---------------------------------------------------------------- store, step by step
-- store_get(store, key, yield_fn [, timeout_ms]) -> value: polls try_get
-- (never blocks in the store) and yields between polls. Note: a cpu-group
-- operation running on a worker holds the store handle's mutex, so polls
-- wait for it; use a separate store handle for polling in that case.
function M.store_get(store, key, yield_fn, timeout_ms)
  local deadline = now_ms() + (timeout_ms or store.timeout_ms or M.DEFAULT_TIMEOUT_MS)
  local i = 0
  while true do
    local v = store:try_get(key)
    if v ~= nil then return v end
    if now_ms() > deadline then
      fail(2, "store_get", "key %q not set within %d ms", key, timeout_ms or store.timeout_ms or M.DEFAULT_TIMEOUT_MS)
    end
    i = i + 1
    yield_fn(i)
  end
end

-- store_wait(store, keys, yield_fn [, timeout_ms]): until every key is set.
function M.store_wait(store, keys, yield_fn, timeout_ms)
  local deadline = now_ms() + (timeout_ms or store.timeout_ms or M.DEFAULT_TIMEOUT_MS)
  local i = 0
  while not store:check(keys) do
    if now_ms() > deadline then
      fail(2, "store_wait", "keys %s not all set within %d ms", table.concat(keys, ", "),
           timeout_ms or store.timeout_ms or M.DEFAULT_TIMEOUT_MS)
    end
    i = i + 1
    yield_fn(i)
  end
end

---------------------------------------------------------------- install
M.ASYNC_METHODS = { "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
                    "broadcast_object", "all_gather_object", "send_object", "recv_object" }
M.BLOCKING_METHODS = { "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
  "reduce_scatter_tensor", "broadcast", "gather", "send", "recv", "all_to_all_single", "barrier",
  "broadcast_object", "all_gather_object", "send_object", "recv_object", "broadcast_tensor_dict",
  "send_tensor_dict", "recv_tensor_dict", "fused_allreduce_rmsnorm" }

-- install(GroupCoordinator [, group_module]): adds g:<op>_async(...) for
-- M.ASYNC_METHODS, g:async_drain(), g:async_pending(); makes each blocking
-- method drain the group's queue first (program order = execution order);
-- closes the queue in g:destroy() (group_module.destroy_hooks). Idempotent.
function M.install(G, group_module)
  if type(G) ~= "table" then error("weft: async.install: expected the GroupCoordinator class", 2) end
  if rawget(G, "__weft_async") then return G end
  for _, name in ipairs(M.ASYNC_METHODS) do G[name .. "_async"] = M[name] end
  G.async_drain = M.drain
  G.async_pending = M.pending
  G.async_reap = M.reap
  for _, name in ipairs(M.BLOCKING_METHODS) do
    local orig = rawget(G, name)
    if type(orig) == "function" then
      G[name] = function(self, ...)
        local q = self._async
        if q and q.npending > 0 then M.drain(self) end
        return orig(self, ...)   -- a tail call: error levels still point at the caller
      end
    end
  end
  rawset(G, "__weft_async", true)
  group_module = group_module or package.loaded["weft.group"]
  if type(group_module) == "table" and type(group_module.destroy_hooks) == "table" then
    local hooks = group_module.destroy_hooks
    local present = false
    for _, f in ipairs(hooks) do if f == M.close then present = true end end
    if not present then table.insert(hooks, 1, M.close) end
  end
  return G
end

return M
