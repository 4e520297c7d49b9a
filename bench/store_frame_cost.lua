-- store_frame_cost.lua — what the store route's call agreement costs in Lua per call:
-- the frame of a 2-rank all_reduce part (1 KiB) and the check of both parts
-- (weft.group.host store_part / store_check), 2 * 10^5 times.
--   WEFT_LIB=build/libweft.so luajit bench/store_frame_cost.lua   (from the repository root)
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local H = require("weft.group.host")
local T = require("weft.tensor")
local clock = os.clock
local t = T.full({ 256 }, 1, "f32")
local payload = string.rep("x", 1024)
local g = { ranks = { 0, 1 }, unique_name = "world" }
local n = 200000
-- the frame and the check of a 2-rank store all_reduce (1 KiB per part)
local t0 = clock()
for i = 1, n do
  local part, call = H.store_part("all_reduce", payload, t, "sum")
  local offs = H.store_check(g, "all_reduce", call, { part, part })
end
local framed = (clock() - t0) / n * 1e6
t0 = clock()
for i = 1, n do
  local part = payload .. ""   -- the unframed part, as a string the exchange sends
  local l = #part
end
local bare = (clock() - t0) / n * 1e6
print(("frame + check per call: %.3f us (bare string: %.3f us)"):format(framed, bare))
