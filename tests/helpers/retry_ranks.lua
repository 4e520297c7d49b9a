-- One rank of tests/fault_retry_spec.lua (issue 36), under weft-run:
--   luajit retry_ranks.lua <op> <group> <victim> <stop_ms> <calls>
-- Every rank runs <calls> iterations of <op> on <group> ("world", "tp",
-- "pp" of tp = 2 x pp = 2, or "custom": a custom group of ranks 0 and 1),
-- each result checked exactly. On an error it calls weft.recover() and
-- retries the same iteration, as a serving loop would (recover() itself is
-- retried until it works). The victim stops
-- itself (SIGSTOP) for <stop_ms> before its 20th call. A recover() that
-- says the ranks' results from some call on cannot be trusted ends the
-- loop (the job would restart from a point it trusts). Lines:
--   STOP <monotonic ms>
--   ERR <i> <message>                (each error of a call)
--   DIVERGED <message>               (recover() found a call completed on some ranks only)
--   RESULT ok=<n> wrong=<n> errors=<n> diverged=<0|1>
local ffi = require "ffi"
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
local weft = require "weft"
local T = weft.tensor
local now_ms = require("weft.clock").now_ms

local op, gkind, victim, stop_ms, calls = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4]), tonumber(arg[5])
local function say(fmt, ...) io.stdout:write(fmt:format(...), "\n"); io.stdout:flush() end
local function sleep_ms(ms) ffi.C.poll(nil, 0, ms) end

local w = weft.init()
local rank = w.rank
if gkind == "tp" or gkind == "pp" then weft.initialize_model_parallel { tp = 2, pp = 2 } end
local custom
local function group()
  if gkind == "world" then return weft.world() end
  if gkind == "custom" then
    if not custom or custom.destroyed then custom = weft.create_custom_group({ 0, 1 }) end
    return custom
  end
  return weft[gkind]()
end
local in_group = gkind ~= "custom" or rank <= 1

local CALLS = {
  all_gather_object = function(g, i)
    local list = g:all_gather_object({ i = i, r = g.rank_in_group })
    for r = 0, g.world_size - 1 do
      local o = list[r + 1]
      if type(o) ~= "table" or o.i ~= i or o.r ~= r then return false end
    end
    return true
  end,
  all_reduce = function(g, i)
    local x = T.full({ 8 }, i * 10 + g.rank_in_group, "i64")
    g:all_reduce(x)
    local n = g.world_size
    return x:to_table()[1] == n * i * 10 + n * (n - 1) / 2
  end,
  broadcast = function(g, i)
    local x = T.full({ 8 }, g.rank_in_group == 0 and i or -1, "i64")
    g:broadcast(x, 0)
    return x:to_table()[8] == i
  end,
}
local call = assert(CALLS[op], "unknown op " .. tostring(op))

w:barrier()
local ok_n, wrong, errs, diverged, i = 0, 0, 0, 0, 1
local stopped = false
while i <= calls and in_group do
  if rank == victim and i == 20 and not stopped then
    stopped = true
    local pid = ffi.C.getpid()
    say("STOP %.0f", now_ms())
    os.execute(("(kill -STOP %d; sleep %.3f; kill -CONT %d) >/dev/null 2>&1 &"):format(pid, stop_ms / 1000, pid))
    sleep_ms(50)
  end
  local ok, res = pcall(call, group(), i)
  if ok then
    ok_n = ok_n + 1
    if not res then wrong = wrong + 1 end
    i = i + 1
  else
    errs = errs + 1
    say("ERR %d %s", i, tostring(res):gsub("\n", " | "):sub(1, 600))
    -- recover until it works (a rank that is still in its failed call
    -- makes the others' recover time out), as a serving loop would
    local rok, rerr
    for _ = 1, 20 do
      rok, rerr = pcall(weft.recover)
      if rok or tostring(rerr):find("cannot be trusted", 1, true) then break end
      sleep_ms(100)
    end
    if not rok then
      rerr = tostring(rerr)
      if rerr:find("cannot be trusted", 1, true) then
        diverged = 1
        say("DIVERGED %s", rerr:gsub("\n", " | "))
        break
      end
      say("RECOVERFAIL %s", rerr:gsub("\n", " | "))
      break
    end
    custom = nil
  end
end
say("RESULT ok=%d wrong=%d errors=%d diverged=%d", ok_n, wrong, errs, diverged)
pcall(weft.shutdown)
os.exit(0)
