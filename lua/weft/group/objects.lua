-- weft.group.objects — the object collectives of weft.group
-- (lua/weft/group.lua; over the cpu group, src/host/cpugroup.c): the call
-- agreement (every part names its call, so ranks that called different
-- collectives fail together), broadcast / all-gather / send / recv of Lua
-- objects (weft.serialize), and the tensor-dict broadcast / send / recv.
-- The GroupCoordinator methods here are installed on the class by weft.group.
local ffi = require("ffi")
local serialize = require("weft.serialize")
local K = require("weft.group.checks")
local H = require("weft.group.host")
local calls = require("weft.group.calls")

local ffi_cast = ffi.cast
local type, tostring, error, pcall, ipairs, pairs, require = type, tostring, error, pcall, ipairs, pairs, require
local concat = table.concat
local fail, gname, check_group, check_peer, T = K.fail, K.gname, K.check_group, K.check_peer, K.T
local check_src = K.check_src
local rethrow, cpu = H.rethrow, H.cpu

local M = {}

local u8p = ffi.typeof("uint8_t *")

---------------------------------------------------------------- call agreement
-- weft.group.calls (every part names its call; re-exported here for the
-- modules that reached them through weft.group.objects)
M.CALL_MARK, M.split_call, M.describe_calls = calls.CALL_MARK, calls.split_call, calls.describe_calls
M.frame, M.encode_part, M.check_calls = calls.frame, calls.encode_part, calls.check_calls
local split_call = calls.split_call

-- exchange(g, op, call, payload) -> parts, offsets: every rank's part (raw
-- strings, in group order) and where each payload starts in it.
function M.exchange(g, op, call, payload)
  local list = cpu(g, op, "allgather", M.frame(call, payload))
  return list, M.check_calls(g, op, call, list)
end
local exchange = M.exchange

-- payloads only, as strings (object collectives)
local function exchange_strings(g, op, call, payload)
  local list, offs = exchange(g, op, call, payload)
  for i = 1, #list do list[i] = list[i]:sub(offs[i] + 1) end
  return list
end

-- point to point: the message names the sender's call; the receiver says
-- what it expected when the two differ
local function p2p_send(g, op, payload, dst)
  cpu(g, op, "send", M.frame(op, payload), dst)
end

-- a send whose payload cannot go still sends, marked failed with the
-- reason, so the receiver raises at once instead of at its timeout; then
-- it raises here
local function p2p_send_failed(g, op, why, dst)
  pcall(cpu, g, op, "send", M.frame(calls.failed_call(op, why), ""), dst)
  error(("weft: %s: could not send to rank %d on group %s: %s (the receiver is told)")
        :format(op, g.ranks[dst + 1], gname(g), why), 0)
end

local P2P_PAIR = { recv = "send", recv_object = "send_object", recv_tensor_dict = "send_tensor_dict" }
-- the payload of message s from src, checked against the call op expects
function M.check_message(g, op, s, src)
  local c, off = split_call(s)
  local want = P2P_PAIR[op]
  local base, why = (c or ""):match("^(.-)" .. calls.FAILED .. "(.*)$")
  if base == want then
    error(("weft: %s: rank %d could not send on group %s: %s"):format(op, g.ranks[src + 1], gname(g), why), 0)
  end
  if c ~= want then
    error(("weft: %s: rank %d sent with %s, this rank called %s (expects %s) on group %s")
          :format(op, g.ranks[src + 1], c or "another call (not a weft send)", op, want, gname(g)), 0)
  end
  return s:sub(off + 1)
end
local function p2p_recv(g, op, src)
  return M.check_message(g, op, cpu(g, op, "recv", src), src)
end

---------------------------------------------------------------- objects
-- Object collectives are exchanges (see "call agreement"): a broadcast is an
-- all-gather in which only the source's part carries the object, so every
-- rank, the source too, returns once all have called, and ranks that called
-- something else (or named another source) fail together.
-- On a group whose host collectives run on a shm communicator, an object
-- collective first passes a barrier there marked as one (Comm:announce_object),
-- so a peer in a tensor collective and this rank fail at once, both.
local function announce(g, op)
  if not g._shm then return end
  H.settle(g) -- the group's async operations first (program order), as every blocking call
  local ok, err = pcall(g._shm.announce_object, g._shm)
  if not ok then rethrow(g, op, false, err) end
end

local function broadcast_obj(g, op, obj, src)
  local q = g.mq_broadcaster
  if q and src == 0 then   -- the ring's writer (no call check there); other sources use the store
    return rethrow(g, op, pcall(q.broadcast_object, q, obj))
  end
  announce(g, op)
  local me = g.rank_in_group
  local call, part = op .. " src=" .. src, ""
  if me == src then call, part = M.encode_part(call, obj) end
  local list, offs = exchange(g, op, call, part)
  if me == src then return obj end
  return serialize.decode(list[src + 1]:sub(offs[src + 1] + 1))
end

function M.broadcast_object(self, obj, src)
  check_group(self, "broadcast_object")
  src = check_src(self, "broadcast_object", src)
  if self.world_size == 1 then return obj end
  return broadcast_obj(self, "broadcast_object", obj, src)
end

-- all_gather_object(obj) -> list of every rank's object (group order), count
function M.all_gather_object(self, obj)
  check_group(self, "all_gather_object")
  if self.world_size == 1 then return { obj }, 1 end
  announce(self, "all_gather_object")
  local list = exchange_strings(self, "all_gather_object", M.encode_part("all_gather_object", obj))
  local res = {}
  for i = 1, #list do res[i] = serialize.decode(list[i]) end
  return res, #list
end

function M.send_object(self, obj, dst)
  check_group(self, "send_object")
  check_peer(self, "send_object", dst, "dst")
  if dst == self.rank_in_group then
    fail(2, "send_object", "dst %d is this rank's own index in group %s", dst, gname(self))
  end
  local payload, why = calls.encode_checked(obj)
  if not payload then p2p_send_failed(self, "send_object", why, dst) end
  p2p_send(self, "send_object", payload, dst)
end

function M.recv_object(self, src)
  check_group(self, "recv_object")
  check_peer(self, "recv_object", src, "src")
  if src == self.rank_in_group then
    fail(2, "recv_object", "src %d is this rank's own index in group %s", src, gname(self))
  end
  return serialize.decode(p2p_recv(self, "recv_object", src))
end

---------------------------------------------------------------- tensor dicts
-- Metadata: an array of {key, "t", dtype, shape, device} or {key, "v", value};
-- tensors then travel by the group's data path in that order.
local function split_dict(g, op, dict)
  if type(dict) ~= "table" then
    fail(3, op, "expected a table of tensors and values, got %s (group %s)", type(dict), gname(g))
  end
  local tm = T()
  local meta, tensors = {}, {}
  local keys = {}
  for k in pairs(dict) do keys[#keys + 1] = k end
  table.sort(keys, serialize.key_less)
  for _, k in ipairs(keys) do
    local v = dict[k]
    if tm.is_tensor(v) then
      if not v:is_contiguous() then
        fail(3, op, "tensor %s is not contiguous (group %s)", tostring(k), gname(g))
      end
      if v.ptr == nil and v.numel > 0 then
        fail(3, op, "tensor %s: its storage was freed (group %s)", tostring(k), gname(g))
      end
      local pop, pgroup = tm.pinned_by(v)
      if pop and pgroup ~= gname(g) then
        fail(3, op, "tensor %s is in use by a pending %s on group %s: wait for its handle first (group %s)",
             tostring(k), pop, pgroup, gname(g))
      end
      meta[#meta + 1] = { k, "t", v.dtype, v.shape, v.device }
      tensors[#tensors + 1] = v
    else
      meta[#meta + 1] = { k, "v", v }
    end
  end
  return meta, tensors
end

local function device_for(dev)
  if dev == nil or dev == "cpu" then return "cpu" end
  return "cuda"       -- the receiver's current device
end

-- The dict that meta describes: its values, and its tensors made here
-- (empty) and filled by fill(t) in meta's order (all but the empty ones).
local function dict_of(meta, fill)
  local res = {}
  local tm = T()
  for _, m in ipairs(meta) do
    if m[2] == "t" then
      local t = tm.empty(m[4], m[3], device_for(m[5]))
      if t.numel > 0 then fill(t) end
      res[m[1]] = t
    else
      res[m[1]] = m[3]
    end
  end
  return res
end

function M.broadcast_tensor_dict(self, dict, src)
  local op = "broadcast_tensor_dict"
  check_group(self, op)
  src = check_src(self, op, src)
  if self.world_size == 1 then return dict end
  if self.rank_in_group == src then
    local ok, meta, tensors = pcall(split_dict, self, op, dict)
    if not ok then   -- every rank fails at once (the others wait in the metadata's exchange)
      exchange(self, op, calls.failed_call(op .. " src=" .. src, (tostring(meta):gsub("^.-weft: [%w_]+: ", ""))), "")
    end
    broadcast_obj(self, op, meta, src)
    for _, t in ipairs(tensors) do
      if t.numel > 0 then self:broadcast(t, src) end
    end
    return dict
  end
  return dict_of(broadcast_obj(self, op, nil, src), function(t) self:broadcast(t, src) end)
end

-- send_tensor_dict(dict [, dst [, all_gather_group]]): with all_gather_group,
-- each tensor whose numel divides by its size sends only this rank's slice
-- (the receiver all-gathers them back), as in the seed.
function M.send_tensor_dict(self, dict, dst, ag)
  local op = "send_tensor_dict"
  check_group(self, op)
  if self.world_size == 1 then return dict end
  if dst == nil then dst = (self.rank_in_group + 1) % self.world_size end
  check_peer(self, op, dst, "dst")
  if dst == self.rank_in_group then
    fail(2, op, "dst %d is this rank's own index in group %s", dst, gname(self))
  end
  local ok, meta, tensors = pcall(split_dict, self, op, dict)
  if not ok then p2p_send_failed(self, op, (tostring(meta):gsub("^.-weft: [%w_]+: ", "")), dst) end
  local payload, why = calls.encode_checked(meta)
  if not payload then p2p_send_failed(self, op, why, dst) end
  p2p_send(self, op, payload, dst)
  local agw = ag and ag.world_size or 1
  local agr = ag and ag.rank_in_group or 0
  local tm = T()
  for _, t in ipairs(tensors) do
    if t.numel > 0 then
      if ag and t.numel % agw == 0 then
        local n = t.numel / agw
        local part = tm.wrap(ffi_cast(u8p, t.ptr) + agr * n * t:elem_size(), { n }, t.dtype, t.device, t)
        self:send(part, dst)
      else
        self:send(t, dst)
      end
    end
  end
end

function M.recv_tensor_dict(self, src, ag)
  local op = "recv_tensor_dict"
  check_group(self, op)
  if self.world_size == 1 then return nil end
  if src == nil then src = (self.rank_in_group - 1) % self.world_size end
  check_peer(self, op, src, "src")
  if src == self.rank_in_group then
    fail(2, op, "src %d is this rank's own index in group %s", src, gname(self))
  end
  local meta = serialize.decode(p2p_recv(self, op, src))
  if type(meta) ~= "table" then
    error(("weft: %s: rank %d sent a %s, not tensor-dict metadata (group %s)")
          :format(op, self.ranks[src + 1], type(meta), gname(self)), 2)
  end
  local agw = ag and ag.world_size or 1
  local tm = T()
  return dict_of(meta, function(t)
    if ag and t.numel % agw == 0 then
      local part = self:recv(tm.empty({ t.numel / agw }, t.dtype, t.device), src)
      local full = ag:all_gather(part, 0)
      t:copy_(full)
      part:free(); full:free()
    else
      self:recv(t, src)
    end
  end)
end


M.exchange_strings, M.p2p_send, M.p2p_recv, M.broadcast_obj = exchange_strings, p2p_send, p2p_recv, broadcast_obj

return M
