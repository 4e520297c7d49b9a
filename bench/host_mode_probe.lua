-- host_mode_probe.lua — is a slow host all-reduce a property of the moment or
-- of the shared-memory segment? Six 2-rank groups (six segments), 300 calls
-- of 16 KiB f32 on each in turn, four rounds: the median of each block, rank 0
-- prints a line per round. Blocks of one round run a few ms apart, one group's
-- blocks tens of ms apart (bench/results/host-busy-trace-vm-2cpu-2026-12-07.md).
--   taskset -c 0 sh -c 'while :; do :; done' & B=$!
--   WEFT_LIB=$PWD/build/libweft.so scripts/weft-run -n 2 bench/host_mode_probe.lua; kill $B
local root = arg[0]:match("^(.*)/bench/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local ffi = require("ffi")
local weft = require("weft")
local T = weft.tensor
pcall(ffi.cdef, "int sched_setaffinity(int pid, size_t size, const uint8_t *mask);")
local world = weft.init()
local mask = ffi.new("uint8_t[128]")
mask[0] = 2 ^ world.rank -- rank r on CPU r, as the benchmark binds them
ffi.C.sched_setaffinity(0, 128, mask)
local gs, xs, sync = {}, {}, T.zeros({ 1 }, "f32")
for k = 1, 6 do gs[k] = weft.create_custom_group({ 0, 1 }, "g" .. k); xs[k] = T.randn({ 4096 }, "f32") end
local lines = {}
for _ = 1, 4 do
  local out = {}
  for k = 1, 6 do
    local ts = {}
    for c = 1, 300 do
      gs[k]:all_reduce(sync)
      local t0 = weft.now_us()
      gs[k]:all_reduce(xs[k])
      ts[c] = weft.now_us() - t0
      if c % 16 == 0 then xs[k]:fill_(0.5) end -- keep the sums finite
    end
    table.sort(ts)
    out[#out + 1] = ("%.1f"):format(ts[150])
  end
  lines[#lines + 1] = table.concat(out, " ")
end
if world.rank == 0 then print("µs, median of 300 calls; groups 1-6 across, rounds 1-4 down:\n" .. table.concat(lines, "\n")) end
weft.shutdown()
