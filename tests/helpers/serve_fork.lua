-- A queue whose worker started before fork() refuses work in the child with
-- a clear error (the worker thread exists only in the parent).
local ffi = require("ffi")
ffi.cdef [[ int fork(void); void _exit(int); int waitpid(int pid, int *status, int options); ]]
local async = require("weft.async")
local g = { unique_name = "forked", timeout_ms = 5000 }
async.nop(g):wait()
local pid = ffi.C.fork()
if pid == 0 then
  local ok, err = pcall(async.nop, g)
  local good = (not ok) and tostring(err):find("before fork", 1, true) ~= nil
  io.stdout:write(good and "child refused: " .. tostring(err) .. "\n" or "child NOT refused\n")
  io.stdout:flush()
  ffi.C._exit(good and 0 or 1)
end
local st = ffi.new("int[1]")
ffi.C.waitpid(pid, st, 0)
assert(async.nop(g):wait() == true, "parent still works")
print(("child_status=%d"):format(st[0]))
