-- One rank of tests/unit/cpugroup_spec.lua. Environment: RANK, WORLD_SIZE,
-- MASTER_PORT; CPG_MODE=normal|absent; CPG_ABSENT="3,5" (ranks that never
-- come, absent mode); CPG_TIMEOUT_MS (absent mode). Prints result lines; the
-- last line is "OK rank N" on success. Exit status 0 only on success.
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")

local bit = require("bit")
local ffi = require("ffi")
local cpugroup = require("weft.cpugroup")
local util = require("helpers.store_util")
local W = require("helpers.rank_util")

local rank, n, port, mode = W.start("CPG", "normal")
local absent = {}
for r in (os.getenv("CPG_ABSENT") or ""):gmatch("%d+") do absent[tonumber(r)] = true end

local say = W.say
local function check(cond, fmt, ...)
  if not cond then error(("rank %d: " .. fmt):format(rank, ...), 2) end
end

if absent[rank] then say("ABSENT rank " .. rank); os.exit(0) end

local s, all = W.world_store(rank, n, port, 20000)

local function normal()
  local world = cpugroup.new(s, "world", all, rank, 10000)
  for _ = 1, 3 do world:barrier() end

  -- broadcast from every root, different sizes (root 0 sends an empty string)
  for root = 0, n - 1 do
    local payload = root == 0 and "" or (("root%d:"):format(root) .. ("\0" .. string.char(65 + root)):rep(root * 100))
    local got = world:broadcast(rank == root and payload or nil, root)
    check(got == payload, "broadcast from %d: got %d bytes, want %d", root, #got, #payload)
  end

  -- all-gather with a different size per rank (rank 1 contributes nothing)
  local function contrib(r, round)
    if r == 1 then return "" end
    return ("r%d.%d|"):format(r, round) .. string.char(97 + r % 26):rep(r * 37 + round) .. "\0\255"
  end
  for round = 1, 3 do
    local got = world:allgather(contrib(rank, round))
    check(#got == n, "allgather: %d parts, want %d", #got, n)
    for r = 0, n - 1 do check(got[r + 1] == contrib(r, round), "allgather round %d: part of rank %d differs", round, r) end
  end

  -- all-reduce, every op, negative and large values
  local function vals(r) return { r + 1, -3 * r, 2 ^ 40 + r, 7 - r, bit.bor(0xF0, r), r % 2 == 0 and -1 or 5 } end
  local i64 = ffi.typeof("int64_t")
  local reducers = {
    sum = function(a, b) return a + b end, max = math.max, min = math.min,
    ["and"] = function(a, b) return tonumber(bit.band(i64(a), i64(b))) end,  -- 64-bit AND
  }
  -- in one order on every rank (pairs' order differs between processes:
  -- the ranks then called different reductions, which is now refused)
  for _, op in ipairs { "sum", "max", "min", "and" } do
    local f = reducers[op]
    local want = vals(0)
    for r = 1, n - 1 do
      local v = vals(r)
      for i = 1, #want do want[i] = f(want[i], v[i]) end
    end
    local got = world:allreduce_i64(vals(rank), op)
    for i = 1, #want do check(got[i] == want[i], "allreduce %s [%d]: got %s want %s", op, i, got[i], want[i]) end
  end

  -- send/recv around the ring, several sizes
  local nxt, prv = (rank + 1) % n, (rank - 1) % n
  for round = 1, 4 do
    local function msg(from) return ("from %d round %d "):format(from, round) .. ("m"):rep(round * round * 3000) end
    world:send(msg(rank), nxt)
    local got = world:recv(prv)
    check(got == msg(prv), "recv round %d from %d differs", round, prv)
  end
  -- several queued messages to one peer keep their order
  for i = 1, 3 do world:send("queued " .. i, nxt) end
  for i = 1, 3 do check(world:recv(prv) == "queued " .. i, "queued message %d out of order", i) end

  -- concurrent groups with overlapping members, interleaved with the world
  local mine, rev = {}, {}
  for r = rank % 2, n - 1, 2 do mine[#mine + 1] = r end
  for r = n - 1, 0, -1 do rev[#rev + 1] = r end
  local function index_of(list, r) for i, x in ipairs(list) do if x == r then return i - 1 end end end
  local half = cpugroup.new(s, rank % 2 == 0 and "even" or "odd", mine, index_of(mine, rank), 10000)
  local back = cpugroup.new(s, "reversed", rev, index_of(rev, rank), 10000)
  for it = 1, 20 do
    local h = half:allgather(("h%d.%d"):format(rank, it))
    for i, r in ipairs(mine) do check(h[i] == ("h%d.%d"):format(r, it), "half group part %d", i) end
    local b = back:allgather(("b%d.%d"):format(rank, it))
    for i, r in ipairs(rev) do check(b[i] == ("b%d.%d"):format(r, it), "reversed group part %d", i) end
    local v = back:broadcast(back.my_index == it % n and ("bc" .. it) or nil, it % n)
    check(v == "bc" .. it, "reversed broadcast %d", it)
    world:barrier()
    half:barrier()
  end

  -- keys do not pile up: after all this only the generation counters (one per
  -- group and member) and at most one pending key per rank remain
  world:barrier()
  if rank == 0 then
    local k = s:num_keys()
    say(("KEYS %d"):format(k))
    check(k <= 3 * n + n, "store holds %d keys after the run (bound %d)", k, 4 * n)
  end
  world:barrier()
  half:destroy(); back:destroy(); world:destroy(); world:destroy()
  local ok, e = pcall(world.barrier, world)
  check(not ok and tostring(e):find("destroyed", 1, true), "barrier after destroy: %s", tostring(e))
end

local function missing_rank()
  local tmo = tonumber(os.getenv("CPG_TIMEOUT_MS") or "1500")
  local first_absent
  for r = n - 1, 0, -1 do if absent[r] then first_absent = r end end
  -- a collective that timed out aborts its group (issue 24): each operation
  -- runs on a fresh group of the same name, and a second call on the same
  -- group must be refused at once
  local function timed(name, method, ...)
    local world = cpugroup.new(s, "world", all, rank, tmo)
    local t0 = util.now_ms()
    local ok, e = pcall(world[method], world, ...)
    say(("%s ok=%s ms=%d msg=%s"):format(name, tostring(ok), util.now_ms() - t0, tostring(e)))
    t0 = util.now_ms()
    ok, e = pcall(world[method], world, ...)
    say(("AGAIN_%s ok=%s ms=%d msg=%s"):format(name, tostring(ok), util.now_ms() - t0, tostring(e)))
    world:destroy()
  end
  timed("BARRIER", "barrier")
  timed("ALLGATHER", "allgather", "x")
  timed("ALLREDUCE", "allreduce_i64", { 1 }, "and")
  timed("BROADCAST", "broadcast", nil, first_absent)
  timed("RECV", "recv", first_absent)
end

local ok, err = pcall(mode == "absent" and missing_rank or normal)

-- Goodbye: rank 0 hosts the store, so it waits for every present rank.
local okb, errb = pcall(function()
  if rank ~= 0 then
    s:set("bye/" .. rank, "1")
  else
    local keys = {}
    for r = 1, n - 1 do if not absent[r] then keys[#keys + 1] = "bye/" .. r end end
    if #keys > 0 then s:wait(keys, 30000) end
  end
end)
s:close()
if not ok then say("FAIL " .. tostring(err)); os.exit(1) end
if not okb then say("FAIL goodbye: " .. tostring(errb)); os.exit(1) end
say("OK rank " .. rank)
os.exit(0)
