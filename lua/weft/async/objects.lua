-- weft.async.objects — the control-plane operations of weft.async
-- (lua/weft/async.lua; src/async.c runs them on the cpu group or a weft.mq):
-- object broadcast / all-gather / send / recv with weft.group's call
-- agreement, the cpu group's int64 vote, and a message queue's send/recv
-- ordered with the group's collectives.
local ffi = require("ffi")
local serialize = require("weft.serialize")
local B = require("weft.async.base")
local Q = require("weft.async.queue")

local ffi_new = ffi.new
local type, tostring, tonumber, require = type, tostring, tonumber, require
local fail, gname = B.fail, B.gname
local check_group, check_peer, check_src = B.check_group, B.check_peer, B.check_src
local desc, submit, finished, result_string, K = Q.desc, Q.submit, Q.finished, Q.result_string, Q.KINDS

local M = {}

-- The same parts as the blocking object collectives (weft.group's "call
-- agreement"): each names its call, so blocking and async calls meet, and
-- ranks that called different ones fail together.
local group_mod
local function GM()
  group_mod = group_mod or require("weft.group")
  return group_mod
end

-- The blocking object collectives' barrier (weft.group.objects: on a group
-- whose host collectives run on shm they pass a barrier there marked
-- "object" first): the worker passes the same one before the exchange, so
-- blocking and async object collectives still meet, and either fails at
-- once against a tensor collective.
local function announce(g, d)
  local c = g._shm
  if c and c.handle ~= nil then
    d.announce, d.args = c.handle, require("weft.shm").OBJECT_WORD
  end
end

-- The object all-gather under both object collectives: this rank's framed
-- call and part out, then finish(parts, offsets) with every rank's part,
-- checked against the call.
local function submit_gather(g, op, call, part, finish)
  local s = GM().frame(call, part)
  local d = desc(g, op)
  d.kind, d.comm, d["in"], d.count = K.CPU_ALLGATHER, g.cpu_group.handle, s, #s
  announce(g, d)
  return submit(g, op, s, function(h)
    local parts = Q.result_parts(h, "async all_gather_object")
    return finish(parts, GM().check_calls(g, op, call, parts))
  end)
end

-- broadcast_object(g, obj [, src=0]) -> handle; result: the root's object
function M.broadcast_object(g, obj, src)
  local op = "broadcast_object"
  check_group(g, op)
  src = check_src(g, op, src)
  if g.world_size == 1 then return finished(op, gname(g), obj) end
  local call = op .. " src=" .. src
  local me = g.rank_in_group
  local part = ""
  if me == src then call, part = GM().encode_part(call, obj) end
  return submit_gather(g, op, call, part, function(parts, offs)
    if me == src then return obj end
    return serialize.decode(parts[src + 1]:sub(offs[src + 1] + 1))
  end)
end

-- all_gather_object(g, obj) -> handle; result: { obj of index 0, ... }
function M.all_gather_object(g, obj)
  local op = "all_gather_object"
  check_group(g, op)
  if g.world_size == 1 then return finished(op, gname(g), { obj }) end
  local call, part = GM().encode_part(op, obj)
  return submit_gather(g, op, call, part, function(parts, offs)
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
    return finished(op, gname(g), r)
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

return M
