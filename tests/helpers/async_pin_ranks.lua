-- One rank of tests/unit/async_spec.lua's pinned-tensor case (weft-run -n 2):
-- while an async all_reduce of x is pending on the world, every method that
-- reads or writes x's values (fill_, copy_ either way, clone, to, to_table,
-- compare, serialize.encode) and every collective of ANOTHER group on x
-- (blocking or async) raises "in use by a pending all_reduce on group
-- world", and x ends right (2 ranks: 1 + 1 = 2, then 4); a blocking call of
-- the world itself on x runs after it (program order). Prints "OK <name>"
-- per check; a failed one raises (non-zero exit).
package.path = "tests/?.lua;" .. package.path
local W = require("helpers.rank_util")
local weft = require("weft")
local async = require("weft.async")
local S = require("weft.serialize")
local T = weft.tensor
local world = weft.init()
async.install(weft.GroupCoordinator, require("weft.group"))
local other = weft.create_custom_group({ 0, 1 }, "other")
local N = 1048576
local x = T.ones({ N }, "f32")
local want = { "in use by a pending all_reduce on group world" }

local h = world:all_reduce_async(x)
local y = T.zeros({ N }, "f32")
local cases = {
  fill_ = function() x:fill_(100) end,
  copy_into = function() x:copy_(y) end,
  copy_from = function() y:copy_(x) end,
  clone = function() x:clone() end,
  to = function() x:to("f16") end,
  to_table = function() x:to_table() end,
  compare = function() x:compare(y) end,
  encode = function() S.encode({ x }) end,
  other_blocking = function() other:all_reduce(x) end,
  other_async = function() other:all_reduce_async(x) end,
  other_output = function() other:all_reduce(y, "sum", x) end,
}
for _, name in ipairs { "fill_", "copy_into", "copy_from", "clone", "to", "to_table", "compare", "encode",
                        "other_blocking", "other_async", "other_output" } do
  W.expect_error(cases[name], want, name)
  W.ok("pinned " .. name)
end
W.must(x:narrow(0, 0, 4).numel == 4, "a view of a pinned tensor can be made")
h:wait()
W.must(x:to_table()[N] == 2, "x summed once after the refusals")
W.ok("pinned untouched")
h = world:all_reduce_async(x)
world:all_reduce(x)       -- the same group: after the pending one
h:wait()
local v = x:to_table()
W.must(v[1] == 8 and v[N] == 8, ("program order on the world: 8, got %s"):format(tostring(v[1])))
W.ok("pinned same group")
other:destroy()
weft.shutdown()
