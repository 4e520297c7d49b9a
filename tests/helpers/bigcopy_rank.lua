-- One rank (tests/faults/fault_bigcopy_spec.lua): a world all_reduce with an output
-- tensor of 2^31 + 64 bytes; prints the bytes at 0, 2^31 and the end.
local weft = require("weft")
local T = weft.tensor
local ffi = require("ffi")
weft.init()
local w = weft.world()
local n = 2 ^ 31 + 64
local t = T.full({ n }, 3, "u8")
local out = T.empty({ n }, "u8")
w:all_reduce(t, "sum", out)
t:free()
local q = ffi.cast("uint8_t *", out.ptr)
print(("BIG_AR ok %d %d %d"):format(q[0], q[2 ^ 31], q[n - 1]))
out:free()
weft.shutdown()
