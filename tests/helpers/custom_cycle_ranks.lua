-- One rank of tests/faults/fault_custom_groups_spec.lua (issue 24 item 8), under
-- weft-run: create_custom_group + barrier + destroy, <warm> times, then
-- <cycles> times more; prints
--   CYCLES keys <before> <after> rss_kb <before> <after> custom <n>
-- (keys: the store's key count, read by rank 0; custom: #dist.state.custom);
-- with a third argument "mp", initialize_model_parallel + destroy_model_parallel
-- cycles instead, and the line starts with MPCYCLES; with "named", every
-- cycle's group has a name of its own ("g1", "g2", ...: issue 37 item 5).
local weft = require("weft")
local dist = require("weft.dist")
local warm, cycles, mp = tonumber(arg[1]), tonumber(arg[2]), arg[3] == "mp"
local named = arg[3] == "named"
local n = 0

local function rss_kb()
  local f = assert(io.open("/proc/self/status"))
  local s = f:read("*a")
  f:close()
  return tonumber(s:match("VmRSS:%s+(%d+)"))
end

local w = weft.init()
local ranks = {}
for r = 0, w.world_size - 1 do ranks[#ranks + 1] = r end
local function cycle()
  if mp then
    weft.initialize_model_parallel { tp = #ranks }
    weft.tp():barrier()
    weft.destroy_model_parallel()
    return
  end
  n = n + 1
  local g = weft.create_custom_group(ranks, named and ("g" .. n) or "cycled")
  g:barrier()
  g:destroy()
end
local function settle()
  w:barrier()   -- every rank's cycles are done before rank 0 counts
  collectgarbage(); collectgarbage()
  local k = w.rank == 0 and dist.state.store:num_keys() or -1
  -- the others wait until rank 0 has counted, in a cpu group broadcast,
  -- whose non-roots set no key (a barrier or an object collective here
  -- would have them set one, maybe before rank 0 counts)
  w.cpu_group:broadcast(w.rank == 0 and tostring(k) or nil, 0)
  return k, rss_kb()
end
for _ = 1, warm do cycle() end
local k0, r0 = settle()
for _ = 1, cycles do cycle() end
local k1, r1 = settle()
print(((mp and "MP" or "") .. "CYCLES keys %d %d rss_kb %d %d custom %d"):format(k0, k1, r0, r1, #dist.state.custom))
w:barrier()
weft.shutdown()
