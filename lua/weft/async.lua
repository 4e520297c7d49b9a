-- weft.async — non-blocking forms of a group's collectives (src/async.c).
--
--   local async = require("weft.async")
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
-- a group has operations in flight the worker owns its communicators: every
-- blocking call on the group drains its queue first (lua/weft/group/host.lua,
-- with or without install), and raw use of g.cpu_group / g._shm from the
-- caller's thread must wait for the handles (a cpu group, shm, Gloo or mq
-- handle in use by the worker refuses it).
-- Each worker reaches the store through connections of its own
-- (src/store/store_thread.c), so an operation pending on one group never
-- holds up the caller's blocking calls on another group, nor its store use.
--
-- Handles: h:test() -> true (done; h.result holds the result) | false;
-- raises the operation's error ("weft: <op>: group <name>: <cause>"), also
-- on every later test/wait. h:wait(timeout_ms) -> result. h.op, h.group.
-- Inputs (tensors, strings, scratch) stay referenced until the operation is
-- done, even when the caller drops the handle.
--
-- This file is the public surface; its parts are in lua/weft/async/:
-- queue.lua (the queue, descriptors and handles over src/async.c),
-- tensor.lua (tensor collectives and their backends), objects.lua (object
-- collectives, int64 votes, weft.mq send/recv), base.lua (what they share).
local queue = require("weft.async.queue")
local tensor = require("weft.async.tensor")
local objects = require("weft.async.objects")
local B = require("weft.async.base")

local type, error, setmetatable, ipairs, rawget, rawset =
  type, error, setmetatable, ipairs, rawget, rawset
local fail, gname, check_group = B.fail, B.gname, B.check_group
local probe, desc, submit, K = queue.probe, queue.desc, queue.submit, queue.KINDS

local M = {}

M.KINDS, M.Handle, M.completed, M.result_bytes = K, queue.Handle, queue.completed, queue.result_bytes
M._submit, M._desc = submit, desc
for _, name in ipairs({ "queue", "drain", "reap", "pending", "stats", "close" }) do
  M[name] = queue[name]
end
for _, name in ipairs({ "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier" }) do
  M[name] = tensor[name]
end
for _, name in ipairs({ "broadcast_object", "all_gather_object", "send_object", "recv_object",
                        "allreduce_i64", "mq_send", "mq_recv" }) do
  M[name] = objects[name]
end

-- The wait bounds live in weft.async.queue (submit reads them); reading or
-- setting async.WAIT_MARGIN_MS (a handle's default wait: group timeout +
-- this) or async.DEFAULT_TIMEOUT_MS (for groups that carry none) goes there.
local BOUNDS = { WAIT_MARGIN_MS = true, DEFAULT_TIMEOUT_MS = true }
setmetatable(M, {
  __index = function(_, k) if BOUNDS[k] then return queue[k] end end,
  __newindex = function(t, k, v)
    if BOUNDS[k] then queue[k] = v else rawset(t, k, v) end
  end,
})

---------------------------------------------------------------- clock
local now_ms = require("weft.internal.clock").now_ms
M.now_ms = now_ms

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
  stream = stream or tensor.current_stream()
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
  if g.world_size > 1 and g.same_node and not g.host_backend then tensor.shm_comm(g) end
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
