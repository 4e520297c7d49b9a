-- One rank of the "recv against a collective" checks
-- (tests/faults/fault_mismatch_spec.lua): on a group whose host collectives
-- run on shm, rank 1 waits in a recv from `peer` for a message that rank
-- never sent, while the others call a collective. Every rank prints
--   CASE <name> <ERR|OK> <ms> <message>
-- Usage: luajit recv_vs_collective_ranks.lua <case>
--   tensor  rank 1: recv(tensor) from the last rank; the others: all_reduce
--   object  rank 1: recv_object from the last rank; the others: broadcast_object
--   legit   the last rank sends a tensor and an object to rank 1, then every
--           rank all_reduces; rank 1 reaches its recvs late (the senders wait
--           at the barrier meanwhile): must pass, 10 rounds
local weft = require("weft")
local ffi = require("ffi")
pcall(ffi.cdef, "int usleep(unsigned int usec);")
local T = weft.tensor
local w = weft.init()
local case, last = arg[1], w.world_size - 1
local x = T.full({ 256 }, 1, "f32")
w:all_reduce(x)   -- the shm communicator is up

local now_ms = require("weft.internal.clock").now_ms
local t0 = now_ms()
local ok, err = pcall(function()
  if case == "tensor" then
    if w.rank == 1 then w:recv(x, last) else w:all_reduce(x) end
  elseif case == "object" then
    if w.rank == 1 then w:recv_object(last) else w:broadcast_object("o", 0) end
  elseif case == "legit" then
    for i = 1, 10 do
      if w.rank == last then w:send(x, 1); w:send_object(i, 1) end
      if w.rank == 1 then
        ffi.C.usleep(100000)
        w:recv(x, last)
        assert(w:recv_object(last) == i)
      end
      w:all_reduce(x)
    end
  end
end)
print(("CASE %s %s %d %s"):format(case, ok and "OK" or "ERR", now_ms() - t0, tostring(err):gsub("\n", " | ")))
io.stdout:flush()
if ok then weft.shutdown() end
os.exit(0, false)   -- an aborted group: no collective teardown
