-- One rank of tests/faults/fault_retry_spec.lua (issue 36), under weft-run:
--   luajit retry_ranks.lua <op> <group> <victims> <stops_ms> <nstops> [period]
-- Every rank runs iterations of <op> on <group> ("world", "tp", "pp" of
-- tp = 2 x pp = 2, or "custom": a custom group of ranks 0 and 1), each
-- result checked exactly. On an error it calls weft.recover() and retries
-- the same iteration, as a serving loop would (recover() itself is retried
-- until it works). <nstops> times, every <period> calls (default 12) from
-- the 20th, a victim stops itself (SIGSTOP): the victims (a comma list of
-- ranks) and the stop lengths (a comma list of ms: just under and just
-- over the timeout) taken in turn. A recover() that says the ranks'
-- results from some call on cannot be trusted (a call completed on some
-- ranks only) is counted, and the loop goes on from a point every rank
-- agrees on (the furthest rank's next call, through an all_gather_object),
-- as a job would from its last trusted point. Lines:
--   STOP <k> <rank> <ms>
--   ERR <i> <message>                (each error of a call)
--   DIVERGED <message>               (recover() found a call completed on some ranks only)
--   RESULT ok=<n> wrong=<n> errors=<n> diverged=<n> skipped=<n> (calls passed over by a resync)
local ffi = require("ffi")
pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")
local weft = require("weft")
local T = weft.tensor
local now_ms = require("weft.internal.clock").now_ms

local op, gkind = arg[1], arg[2]
local function nums(str)
  local t = {}
  for v in tostring(str):gmatch("%d+") do t[#t + 1] = tonumber(v) end
  return t
end
local victims, stops, nstops, period = nums(arg[3]), nums(arg[4]), tonumber(arg[5]), tonumber(arg[6] or 12)
local calls = 20 + nstops * period + 10
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
local skipped = 0   -- calls passed over by a resync after a divergence
local done_stop = {}

-- the stop due before call i, if any: k (0-based), victim, ms
local function stop_at(ii)
  local k = (ii - 20) / period
  if ii < 20 or k ~= math.floor(k) or k >= nstops then return nil end
  return k, victims[k % #victims + 1], stops[k % #stops + 1]
end

-- after a divergence: every rank goes on from the furthest rank's next call
local function resync()
  local all = weft.world():all_gather_object(i)
  local m = i
  for _, v in ipairs(all) do if v > m then m = v end end
  if in_group then skipped = skipped + (m - i) end
  i = m
end

local function recover_all()
  local rok, rerr
  for _ = 1, 40 do
    rok, rerr = pcall(weft.recover)
    if rok or tostring(rerr):find("cannot be trusted", 1, true) then break end
    sleep_ms(100)
  end
  return rok, rerr
end

while true do
  local k, victim, ms = stop_at(i)
  if k and rank == victim and not done_stop[k] then
    done_stop[k] = true
    local pid = ffi.C.getpid()
    say("STOP %d %d %d", k, rank, ms)
    os.execute(("(kill -STOP %d; sleep %.3f; kill -CONT %d) >/dev/null 2>&1 &"):format(pid, ms / 1000, pid))
    sleep_ms(50)
  end
  local ok, res = true, true
  if in_group and i <= calls then ok, res = pcall(call, group(), i) end
  if ok then
    if in_group and i <= calls then
      ok_n = ok_n + 1
      if not res then wrong = wrong + 1 end
    end
    i = i + 1
  else
    errs = errs + 1
    say("ERR %d %s", i, tostring(res):gsub("\n", " | "):sub(1, 600))
  end
  -- recover() is for every rank: the job learns whether any rank failed
  -- through a world-level check of the harness's own, which also ends the
  -- loop once every rank is through (groups retry apart); its iteration
  -- numbers never choose what a group's call pairs with
  local wok, flags = pcall(w.all_gather_object, weft.world(), { ok, i })
  local all_ok, through = wok, wok
  if wok then
    for _, f in ipairs(flags) do all_ok, through = all_ok and f[1], through and f[2] > calls end
  end
  if through and all_ok then break end
  if not all_ok then
    local rok, rerr = recover_all()
    while not rok and tostring(rerr):find("cannot be trusted", 1, true) do
      diverged = diverged + 1
      say("DIVERGED %s", tostring(rerr):gsub("\n", " | "):sub(1, 600))
      local sok, serr = pcall(resync)
      if sok then rok = true else rok, rerr = recover_all() end
    end
    if not rok then
      say("RECOVERFAIL %s", tostring(rerr):gsub("\n", " | "))
      break
    end
    w = weft.world()
    custom = nil
  end
end
say("RESULT ok=%d wrong=%d errors=%d diverged=%d skipped=%d", ok_n, wrong, errs, diverged, skipped)
pcall(weft.shutdown)
os.exit(0)
