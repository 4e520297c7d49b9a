-- One rank of tests/faults/fault_bigcopy_spec.lua's host memory bound (issue 37
-- item 6), under weft-run -n 2: a u8 all_reduce of <MiB> MiB (the generic
-- path: shm gathers, the reduction is local) and prints
--   HOSTMEM <tensor bytes> <peak growth of the call in bytes> <result ok|bad>
-- The growth is VmHWM after the call minus VmRSS before it (the tensor is
-- resident then). Zero-copy is off (WEFT_SHM_ZEROCOPY=0 from the spec): it
-- maps the peer's tensor, shared pages that RSS counts but that are not
-- this call's memory.
local weft = require("weft")
local MiB = tonumber(arg[1])

local function status(k)
  local f = assert(io.open("/proc/self/status"))
  local s = f:read("*a")
  f:close()
  return tonumber(s:match(k .. ":%s+(%d+) kB")) * 1024
end

local w = weft.init()
local x = weft.tensor.full({ MiB * 2 ^ 20 }, w.rank + 1, "u8")
w:barrier()
local before = status("VmRSS")
w:all_reduce(x)
local grew = status("VmHWM") - before
-- the sum of 1 and 2 everywhere: spot checks at both ends and the middle
local p = require("ffi").cast("uint8_t *", x.ptr)
local n = x.numel
local ok = p[0] == 3 and p[n - 1] == 3 and p[math.floor(n / 2)] == 3
print(("HOSTMEM %d %d %s"):format(x.nbytes, grew, ok and "ok" or "bad"))
w:barrier()
weft.shutdown()
