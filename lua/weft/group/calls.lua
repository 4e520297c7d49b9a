-- weft.group.calls — the call agreement of the host collectives that go
-- through the cpu group's all-gather (the object collectives, the store
-- path's tensor collectives, the uneven all_to_all_single): every rank's
-- part starts with its call, so ranks whose calls differ all fail at once
-- naming every rank's call. Used by weft.group.host, weft.group.objects and
-- weft.async; depends on nothing of weft.group (no require loop).
local serialize = require("weft.serialize")
local K = require("weft.group.checks")

local tostring, error, pcall, ipairs, require = tostring, error, pcall, ipairs, require
local concat = table.concat
local gname = K.gname

local M = {}

-- Object collectives (and the uneven all_to_all_single) are one all-gather on
-- the cpu group whose parts start with each rank's call ("broadcast_object
-- src=0", "all_gather_object"): ranks that called different operations (or
-- named another source) all complete the same exchange and all fail at once,
-- each naming every rank's call, and the group stays usable -- what the shm
-- engine does for tensor collectives with its call descriptors. weft.async's
-- object collectives use the same parts, so blocking and async calls meet.
-- Point-to-point messages carry the sender's call the same way; the receiver
-- checks it (a send is not waited for, so only the receiver can tell).
local CALL_MARK = "\1weft-call\1"
local MARK_LEN = #CALL_MARK
M.CALL_MARK = CALL_MARK

local topology_mod
local function ranks_str(list)
  topology_mod = topology_mod or require("weft.topology")
  return topology_mod.ranks_str(list)
end

-- The call a part names (nil when it is not a coordinator call: a lower-level
-- exchange of another module) and where its payload starts (0-based).
local function split_call(s)
  if s:sub(1, MARK_LEN) ~= CALL_MARK then return nil, 0 end
  local z = s:find("\0", MARK_LEN + 1, true)
  if not z then return nil, 0 end
  return s:sub(MARK_LEN + 1, z - 1), z
end
M.split_call = split_call

-- "rank 1: all_gather_object; ranks 0,2,3: broadcast_object src=0": ranks
-- (global) grouped by what they called, groups in order of their first rank.
function M.describe_calls(ranks, calls)
  local order, by = {}, {}
  for i = 1, #calls do
    local c = calls[i] or "another call (not a weft collective)"
    if not by[c] then by[c] = {}; order[#order + 1] = c end
    local l = by[c]
    l[#l + 1] = ranks[i]
  end
  local parts = {}
  for k, c in ipairs(order) do
    local l = by[c]
    parts[k] = ("rank%s %s: %s"):format(#l > 1 and "s" or "", ranks_str(l), c)
  end
  return concat(parts, "; ")
end

-- A part: the call, then the payload.
function M.frame(call, payload) return CALL_MARK .. call .. "\0" .. payload end

-- A rank whose object cannot be sent (a function, a cycle, userdata, too
-- deep, larger than the store takes) or whose call is refused before it
-- starts still takes part in the exchange, with its call marked failed and
-- the reason: every rank then raises at once naming it, instead of this
-- rank raising alone and the others waiting for the timeout.
local FAILED = "\2"
M.FAILED = FAILED
function M.failed_call(call, why) return call .. FAILED .. why end

-- The largest part the store takes (WEFT_STORE_MAX_VALUE as the server
-- reads it, 256 MiB when unset), less room for the frame and the key.
local function max_part()
  local v = tonumber(os.getenv("WEFT_STORE_MAX_VALUE") or "")
  if not v or v <= 0 then v = 256 * 1024 * 1024 end
  return v, v - 4096
end

-- obj encoded, or nil and why it cannot be sent
function M.encode_checked(obj)
  local ok, s = pcall(serialize.encode, obj)
  if not ok then return nil, (tostring(s):gsub("^weft: encode: ", "")) end
  local limit, room = max_part()
  if #s > room then
    return nil, ("its encoding is %d bytes, more than the store takes (WEFT_STORE_MAX_VALUE: %d bytes)")
                :format(#s, limit)
  end
  return s
end

function M.encode_part(call, obj)
  local s, why = M.encode_checked(obj)
  if s then return call, s end
  return M.failed_call(call, why), ""
end

-- check_calls(g, op, call, parts) -> offsets: where each part's payload
-- starts (0-based); raises, alike on every rank, when the calls differ.
function M.check_calls(g, op, call, parts)
  local offs, bad = {}, false
  for i = 1, #parts do
    local c, off = split_call(parts[i])
    offs[i] = off
    if c ~= call then bad = true end
  end
  if bad or call:find(FAILED, 1, true) then
    local calls, failed = {}, {}
    for i = 1, #parts do
      calls[i] = split_call(parts[i]) or false
      local why = calls[i] and calls[i]:match(FAILED .. "(.*)$")
      if why then failed[#failed + 1] = ("rank %d: %s"):format(g.ranks[i], why) end
    end
    if #failed > 0 then
      error(("weft: %s: could not send the object of %s on group %s (every rank fails this call; "
             .. "the group stays usable)"):format(op, concat(failed, "; "), gname(g)), 0)
    end
    error(("weft: %s: ranks called different collectives on group %s: %s")
          :format(op, gname(g), M.describe_calls(g.ranks, calls)), 0)
  end
  return offs
end

return M
