-- One rank of tests/faults/fault_stale_spec.lua (issue 24 item 1), under weft-run:
--   luajit stale_ranks.lua <op> <victim> <stop_ms> <loop_ms>
-- Every rank runs a loop of <op> that verifies each result exactly and, on
-- an error, sleeps 100 ms and retries the same call (as a serving loop
-- would), until <loop_ms> after the start. The victim stops itself
-- (SIGSTOP) before its 20th call for <stop_ms>, longer than the timeout.
-- Then every rank calls weft.recover() and checks 5 all-reduces. Lines:
--   STOP <monotonic ms>                     (the victim, just before it stops)
--   FIRSTERR <monotonic ms> <message>       (each rank's first error)
--   RESULT ok=<n> wrong=<n> errors=<n>
--   RECOVERED ok | RECOVERED fail <message>
-- Every rank exits 0 (weft-run would stop the others otherwise).
local ffi = require("ffi")
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
local weft = require("weft")
local T = weft.tensor
local now_ms = require("weft.internal.clock").now_ms

local op, victim, stop_ms, loop_ms = arg[1], tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4])
local function say(fmt, ...) io.stdout:write(fmt:format(...), "\n"); io.stdout:flush() end
local function sleep_ms(ms) ffi.C.poll(nil, 0, ms) end

local w = weft.init()
local rank, n = w.rank, w.world_size
local NUM = 8
local x = T.zeros({ NUM }, "i64")
local out = T.zeros({ NUM * n }, "i64")
local xp = ffi.cast("int64_t *", x.ptr)
local op_ = ffi.cast("int64_t *", out.ptr)

local function val(i, r, k) return i * 1000 + r * 10 + k end

-- one call of iteration i; true when the result is exactly right
local CALLS = {
  all_reduce = function(g, i)
    for k = 0, NUM - 1 do xp[k] = val(i, rank, k) end
    local o = T.zeros({ NUM }, "i64")
    g:all_reduce(x, "sum", o)
    local p = ffi.cast("int64_t *", o.ptr)
    for k = 0, NUM - 1 do
      if tonumber(p[k]) ~= n * (i * 1000 + k) + 10 * n * (n - 1) / 2 then return false end
    end
    return true
  end,
  all_gather = function(g, i)
    for k = 0, NUM - 1 do xp[k] = val(i, rank, k) end
    g:all_gather(x, 0, out)
    for r = 0, n - 1 do
      for k = 0, NUM - 1 do if tonumber(op_[r * NUM + k]) ~= val(i, r, k) then return false end end
    end
    return true
  end,
  broadcast = function(g, i)   -- from the victim
    for k = 0, NUM - 1 do xp[k] = rank == victim and val(i, rank, k) or -1 end
    g:broadcast(x, victim)
    for k = 0, NUM - 1 do if tonumber(xp[k]) ~= val(i, victim, k) then return false end end
    return true
  end,
  all_gather_object = function(g, i)
    local list = g:all_gather_object({ i = i, r = rank })
    for r = 0, n - 1 do
      local o = list[r + 1]
      if type(o) ~= "table" or o.i ~= i or o.r ~= r then return false end
    end
    return true
  end,
  broadcast_object = function(g, i)   -- from the victim
    local o = g:broadcast_object(rank == victim and { i = i } or nil, victim)
    return type(o) == "table" and o.i == i
  end,
}
local call = assert(CALLS[op], "unknown op " .. tostring(op))

w:barrier()
local t_end = now_ms() + loop_ms
local ok_n, wrong, errs, i, stopped = 0, 0, 0, 1, false
while now_ms() < t_end do
  if rank == victim and i == 20 and not stopped then
    stopped = true
    local pid = ffi.C.getpid()
    say("STOP %.0f", now_ms())
    os.execute(("(kill -STOP %d; sleep %.3f; kill -CONT %d) >/dev/null 2>&1 &"):format(pid, stop_ms / 1000, pid))
    sleep_ms(50)   -- stopped in here, or in the call right after
  end
  local ok, res = pcall(call, w, i)
  if ok then
    ok_n = ok_n + 1
    if not res then wrong = wrong + 1 end
    i = i + 1
  else
    errs = errs + 1
    if errs == 1 then say("FIRSTERR %.0f %s", now_ms(), tostring(res):gsub("\n", " | ")) end
    sleep_ms(100)
  end
end
say("RESULT ok=%d wrong=%d errors=%d", ok_n, wrong, errs)

local rok, rerr = pcall(function()
  local g = weft.recover()
  for j = 1, 5 do
    if not CALLS.all_reduce(g, 100000 + j) then error("wrong result after recover", 0) end
  end
end)
say(rok and "RECOVERED ok" or ("RECOVERED fail " .. tostring(rerr):gsub("\n", " | ")))
pcall(weft.shutdown)
os.exit(0)
