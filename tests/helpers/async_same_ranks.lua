-- One rank of tests/faults/fault_async_cross_spec.lua's same-group cases, under
-- weft-run -n 4 (no weft.async.install):
--   async_same_ranks.lua loop      200 x { async all_reduce (i64) on the world,
--                                  blocking all_reduce on the world, wait };
--                                  then 50 x { async all_gather_object,
--                                  blocking all_gather_object, wait }; then
--                                  { async all_gather_object on the world,
--                                  initialize_model_parallel, wait } x 3.
--                                  Prints "SAME rank <r> wrong=<n>"
--   async_same_ranks.lua raw       rank 0's worker waits in an all_gather_object
--                                  (rank 3 submits 1.5 s late) while rank 0
--                                  calls the world's cpu group directly:
--                                  "RAW <ms> <ok|message>" from rank 0
-- Every rank ends with "OK" after a clean shutdown.
local ffi = require("ffi")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
local weft = require("weft")
local async = require("weft.async")
local T = weft.tensor
local now = require("weft.internal.clock").now_ms

local mode = arg[1]
local w = weft.init()
local r, n = w.rank, w.world_size

if mode == "loop" then
  local wrong = 0
  for i = 1, 200 do
    local x = T.full({ 64 }, r + i, "i64")
    local h = async.all_reduce(w, x, "sum")
    local y = T.full({ 64 }, 1000 * i + r, "i64")
    w:all_reduce(y, "sum", y)
    h:wait()
    local px, py = ffi.cast("int64_t *", x.ptr), ffi.cast("int64_t *", y.ptr)
    for k = 0, 63 do
      if tonumber(px[k]) ~= n * i + n * (n - 1) / 2 or tonumber(py[k]) ~= n * 1000 * i + n * (n - 1) / 2 then
        wrong = wrong + 1
        break
      end
    end
  end
  for i = 1, 50 do
    local h = async.all_gather_object(w, { i, r })
    local l2 = w:all_gather_object({ -i, r })
    local l = h:wait()
    for q = 1, n do
      if l[q][1] ~= i or l[q][2] ~= q - 1 or l2[q][1] ~= -i or l2[q][2] ~= q - 1 then wrong = wrong + 1; break end
    end
  end
  for i = 1, 3 do
    local h = async.all_gather_object(w, { i })
    weft.initialize_model_parallel { tp = 2, pp = 2 }
    local l = h:wait()
    for q = 1, n do if l[q][1] ~= i then wrong = wrong + 1; break end end
    weft.destroy_model_parallel()
  end
  print(("SAME rank %d wrong=%d"):format(r, wrong))
elseif mode == "raw" then
  if r == 3 then ffi.C.poll(nil, 0, 1500) end
  local h = async.all_gather_object(w, { r })
  if r == 0 then
    ffi.C.poll(nil, 0, 200)   -- the worker is in the store by now, waiting for rank 3
    local t0 = now()
    local ok, err = pcall(w.cpu_group.allgather, w.cpu_group, "raw")
    print(("RAW %.0f %s"):format(now() - t0, ok and "ok" or tostring(err)))
  end
  h:wait()
end
weft.shutdown()
print("OK done")
