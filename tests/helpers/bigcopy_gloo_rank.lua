-- One rank of tests/faults/fault_bigcopy_spec.lua across simulated nodes: a world
-- all_reduce (in place, sum) of 2^31 + 64 u8 on the Gloo route; prints the
-- bytes at 0, 2^31 - 1, 2^31 (rank + 10 on each rank) and the end (rank + 20).
local weft = require("weft")
local T = weft.tensor
local ffi = require("ffi")
local w = weft.init()
local n = 2 ^ 31 + 64
local t = T.full({ n }, 3, "u8")
local q = ffi.cast("uint8_t *", t.ptr)
q[2 ^ 31] = w.rank + 10; q[n - 1] = w.rank + 20
w:all_reduce(t)
print(("GLOO_BIG %d %d %d %d"):format(q[0], q[2 ^ 31 - 1], q[2 ^ 31], q[n - 1]))
t:free()
weft.shutdown()
