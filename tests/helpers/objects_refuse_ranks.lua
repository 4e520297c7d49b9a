-- One rank of tests/faults/fault_mismatch_spec.lua's "what cannot be sent"
-- case (weft-run -n 2, WEFT_STORE_MAX_VALUE=1048576): an object over the
-- store's largest value, a tensor dict holding a freed tensor, a function,
-- each in a broadcast and in a send. Every rank raises at once naming the
-- sender's reason (never the timeout), and the group stays usable after
-- each. Prints "OK <name>" per check; a failed one raises.
package.path = "tests/?.lua;" .. package.path
local W = require("helpers.rank_util")
local weft = require("weft")
local now = require("weft.internal.clock").now_ms
local w = weft.init()
local r = w.rank
local big = string.rep("y", 2 * 1048576)
local t = weft.tensor.ones({ 4 }); t:free()

local function check(name, fn, wants)
  local t0 = now()
  W.expect_error(fn, wants, name)
  W.must(now() - t0 < 5000, ("%s: %d ms (the timeout is 20 s)"):format(name, now() - t0))
  local all = w:all_gather_object(r)
  W.must(all[1] == 0 and all[2] == 1, name .. ": the group works after it")
  W.ok(name)
end

check("bcast big", function() w:broadcast_object(r == 0 and big or nil, 0) end,
      { "more than the store takes", "every rank fails this call" })
check("bcast dict freed", function() w:broadcast_tensor_dict(r == 0 and { a = t } or nil, 0) end,
      { "tensor a: its storage was freed" })
check("send dict freed", function()
  if r == 0 then w:send_tensor_dict({ a = t }, 1) else w:recv_tensor_dict(0) end
end, { "tensor a: its storage was freed" })
check("send function", function()
  if r == 0 then w:send_object({ f = print }, 1) else w:recv_object(0) end
end, { "cannot serialize a function" })
check("send big", function()
  if r == 0 then w:send_object(big, 1) else w:recv_object(0) end
end, { "more than the store takes" })
weft.shutdown()
