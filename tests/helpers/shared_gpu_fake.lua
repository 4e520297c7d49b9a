-- One rank of tests/unit/shared_gpu_spec.lua on the pretend GPU
-- (tests/helpers/fake_device.lua, every rank on device 0): how the group
-- decides about ranks that share a GPU. SHARED_ALLOW_RANKS (comma list) and
-- SHARED_PCT set WEFT_ALLOW_SHARED_GPU=1 and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
-- on those ranks only (before weft reads them). Prints "INFO <key>=<value>"
-- lines, or "ERROR <message>" when the first device call raised.
local ffi = require("ffi")
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
ffi.cdef "int setenv(const char *name, const char *value, int overwrite);"
local rank = os.getenv("RANK")
for r in (os.getenv("SHARED_ALLOW_RANKS") or ""):gmatch("%d+") do
  if r == rank then
    ffi.C.setenv("WEFT_ALLOW_SHARED_GPU", "1", 1)
    if os.getenv("SHARED_PCT") then ffi.C.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", os.getenv("SHARED_PCT"), 1) end
  end
end
require("helpers.fake_device").install()
local weft = require("weft")
local db = require("weft.backends.device_backends")
local world = weft.init { timeout_ms = 20000 }
local x = weft.tensor.ones({ 16 }, "bf16", "cuda:0")
local ok, err = pcall(world.all_reduce, world, x)
if not ok then
  print("ERROR " .. tostring(err):gsub("\n", " | "))
else
  local info = db.info(world)
  print("INFO sum=" .. x:to_table()[1])
  print("INFO nccl=" .. tostring(info.nccl))
  print("INFO custom_ar=" .. tostring(info.custom_ar) .. " (" .. tostring(info.custom_ar_why) .. ")")
  print("INFO shared_mode=" .. tostring(info.shared_mode))
  print("INFO explain=" .. weft.policy.explain(world, x):gsub("\n", " | "))
end
io.stdout:flush()
weft.shutdown()
