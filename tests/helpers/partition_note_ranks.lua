-- One rank of tests/unit/cpugroup_spec.lua's partition note (issue 37 item 8),
-- under weft-run -n 3: rank 2's host "stops acknowledging" (its store mark
-- weft/rank/2/unreachable is set, as the store server sets it when the
-- kernel gets no TCP acknowledgement from that host: docs/faults.md) and it
-- does not come to a barrier of the world's cpu group; ranks 0 and 1 print
--   BARRIER <error message on one line>
-- The store path must add the same note as the Gloo routes.
local weft = require("weft")
local dist = require("weft.dist")

local w = weft.init()
local st = dist.state.store
local cg = w.cpu_group
if w.rank == 2 then
  st:set("weft/rank/2/unreachable", st:get("weft/rank/2"))
  st:set("test/marked", "1")
  pcall(st.get, st, "test/done", 30000)
else
  st:get("test/marked", 30000)
  cg:set_timeout(1000)
  local ok, err = pcall(cg.barrier, cg)
  io.stdout:write("BARRIER ", ok and "ok" or tostring(err):gsub("\n", " "), "\n")
  io.stdout:flush()
  st:set("test/done." .. w.rank, "1")
  if w.rank == 0 then
    st:get("test/done.1", 30000)
    st:set("test/done", "1")
  else
    pcall(st.get, st, "test/done", 30000)
  end
end
os.exit(0) -- the world's cpu group is broken on purpose: no shutdown barrier
