-- temporary: one launch of each codec step of interest at 256 MiB, for ncu
local ffi = require "ffi"
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local weft = require "weft"
local cuda = require "weft.cuda"
local T = weft.tensor
local C = require("weft.internal.ffi").C
local n = 128 * 1048576
local src = T.randn({ n }, "bf16", "cuda:0", { seed = 1 })
local wire = cuda.alloc(n * 2)
local out = cuda.alloc(n * 2)
for _, s in ipairs { { 0, 1 }, { 4, 1 }, { 0, 2 }, { 4, 2 }, { 0, 3 }, { 4, 3 } } do
  assert(C.weft_qr_codec_step(s[1], s[2], 2, 2, src.ptr, wire, nil, n, nil) == 0)
end
cuda.synchronize()
print("ok")
