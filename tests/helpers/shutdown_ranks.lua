-- One rank of tests/faults/fault_shutdown_spec.lua (issue 24 item 6), 2 ranks under
-- weft-run. Rank 0 is busy for the timeout + 0.6 s, then recovers; rank 1
-- recovers at once, so its shutdown cannot see rank 0 close the store within
-- the timeout; then it calls weft.init(), which must wait for rank 0's next
-- store rather than join the old one. Lines:
--   RECOVER <ok> <ms> <message>   INIT <ok> <ms> <message>
--   AR ok|fail <message>          SHUTDOWN ok|fail <message>
local weft = require("weft")
local now_ms = require("weft.internal.clock").now_ms
local ffi = require("ffi")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")

local function say(fmt, ...) io.stdout:write(fmt:format(...), "\n"); io.stdout:flush() end
local function one_line(e) return (tostring(e):gsub("\n", " | ")) end
local tmo = tonumber(os.getenv("WEFT_TIMEOUT_MS"))

local w = weft.init()
local rank = w.rank
w:barrier()
-- busy past rank 1's shutdown bound (the timeout), but well inside its
-- init's (a second timeout): with tmo + 1500 both ends met at 2 x tmo and
-- rank 1's init failed in about half the runs on the shared VM
if rank == 0 then ffi.C.poll(nil, 0, tmo + 600) end
local t0 = now_ms()
local ok, e = pcall(weft.recover)
say("RECOVER %s %d %s", tostring(ok), now_ms() - t0, ok and "-" or one_line(e))
if not ok then
  t0 = now_ms()
  ok, e = pcall(weft.init)
  say("INIT %s %d %s", tostring(ok), now_ms() - t0, ok and "-" or one_line(e))
end
local aok, aerr = pcall(function()
  local x = weft.tensor.full({ 4 }, rank + 1, "i64")
  weft.world():all_reduce(x)
  if tonumber(ffi.cast("int64_t *", x.ptr)[0]) ~= 3 then error("wrong sum", 0) end
end)
say("AR %s", aok and "ok" or ("fail " .. one_line(aerr)))
local sok, serr = pcall(weft.shutdown)
say("SHUTDOWN %s", sok and "ok" or ("fail " .. one_line(serr)))
os.exit(0)
