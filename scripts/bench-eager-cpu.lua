-- The eager device call's Lua layers on the CPU: a rehearsal of
-- scripts/bench-eager-call.lua where there is no GPU, over the specs' pretend
-- GPU (tests/helpers/fake_device.lua) with weft_ar_run replaced by a no-op once
-- the workspace exists, so what is timed is group:all_reduce's own Lua path
-- (checks, the memoised choice, the backend's call) down to the launch.
--
--   scripts/weft-run -n 2 scripts/bench-eager-cpu.lua
--
-- Per call, 7 runs of 200000 calls of world:all_reduce(x) on an 8 KiB bf16
-- "device" tensor; rank 0 prints the best and median ns and checks that every
-- call reached the launch. Not a GPU figure: the launch itself (about 4 us) is
-- what bench-eager-call.lua measures beside it.
local root = (arg[0]:match("^(.*)/scripts/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
require("helpers.fake_device").install()
local weft = require("weft")
local C = require("weft.internal.ffi").C

local world = weft.init { timeout_ms = 20000 }
local x = weft.tensor.randn({ 4096 }, "bf16", "cuda:" .. require("weft.cuda").current_device())
world:all_reduce(x)   -- makes the workspace
world:all_reduce(x)
local launches = 0
C.weft_ar_run = function() launches = launches + 1; return 0 end

local N, R = 200000, 7
local ns = {}
for r = 1, R do
  world:barrier()
  local t0 = weft.now_us()
  for _ = 1, N do world:all_reduce(x) end
  ns[r] = (weft.now_us() - t0) * 1000 / N
end
table.sort(ns)
if world.rank == 0 then
  local fmt = {}
  for i, v in ipairs(ns) do fmt[i] = ("%.0f"):format(v) end
  print(("eager-cpu: group:all_reduce %.0f ns per call (best), %.0f (median); runs %s; %d of %d calls launched"):format(
    ns[1], ns[(R + 1) / 2], table.concat(fmt, " "), launches, N * R))
end
if launches ~= N * R then os.exit(1) end
