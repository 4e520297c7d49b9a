-- One rank of tests/unit/mq_spec.lua (under scripts/weft-run, or started by
-- helpers.store_util.run_ranks for the modes that kill a rank).
-- Environment: RANK, WORLD_SIZE, MASTER_PORT; MQ_MODE (below); MQ_TIMEOUT_MS;
-- MQ_CHUNK, MQ_CHUNKS (geometry, 0 = defaults); MQ_COUNT (messages).
-- Modes: order | slow | try | full_ring | late_writer | left_reader |
--        dead_reader | dead_writer | mismatch
-- Prints "FAIL ..." for failed checks, "<WHAT> ok=<bool> ms=<n> msg=<text>"
-- for the failure scenarios, and "OK rank N checks=K" last on success.
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")

local ffi = require("ffi")
local cpugroup = require("weft.cpugroup")
local mq = require("weft.mq")
local util = require("helpers.store_util")
local W = require("helpers.rank_util")

local rank, n, port, mode, tmo = W.start("MQ", "order", 30000)
local CHUNK = tonumber(os.getenv("MQ_CHUNK") or "") or 4096
local CHUNKS = tonumber(os.getenv("MQ_CHUNKS") or "") or 4
local COUNT = tonumber(os.getenv("MQ_COUNT") or "") or 500

local say, report = W.say, W.report
local K = W.checker(rank)
local check = K.check

local s, all = W.world_store(rank, n, port, 30000)
local g = cpugroup.new(s, "mqtest", all, rank, math.max(tmo, 30000))

---------------------------------------------------------------- data
-- Message k: a window of a fixed pseudo-random byte pool, starting at an
-- offset of k, preceded by k itself (so a reordered or stale message shows).
local POOL_N = 10 * 1048576 + 8192
local pool = ffi.new("uint8_t[?]", POOL_N)
do
  local x = 12345
  for i = 0, POOL_N - 1 do
    x = (x * 1103515245 + 12345) % 2147483648
    pool[i] = math.floor(x / 65536) % 256
  end
end
local function payload(k, len)
  if len == 0 then return "" end
  local head = ("#%d#"):format(k)
  if len <= #head then return head:sub(1, len) end
  local off = (k * 7919) % 8192
  return head .. ffi.string(pool + off, len - #head)
end

-- Sizes around the chunk edges, bigger than the ring, and 0.
local function size_of(k, chunk, chunks)
  local edges = { 0, 1, 7, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 3 * chunk,
                  chunks * chunk + 17, (chunks + 2) * chunk }
  if k % 3 == 0 then return edges[k / 3 % #edges + 1] end
  return (k * 2654435761) % (3 * chunk + 1)
end

local function new_q(o)
  -- 0 in the environment: the module's defaults (1 MiB x 8)
  return mq.new(g, o or { writer = 0, chunk_bytes = CHUNK > 0 and CHUNK or nil, chunks = CHUNKS > 0 and CHUNKS or nil })
end

local function describe_diff(got, want)
  if #got ~= #want then return ("length %d, expected %d"):format(#got, #want) end
  for i = 1, #got do
    if got:byte(i) ~= want:byte(i) then return ("first difference at byte %d"):format(i) end
  end
  return "equal"
end

---------------------------------------------------------------- modes
local modes = {}

-- Many messages of every size, objects in between; readers alternate
-- recv_bytes, the zero-copy view and polling.
function modes.order()
  local q = new_q()
  local chunk = q.chunk_bytes
  for k = 0, COUNT - 1 do
    if k % 10 == 5 then
      local obj = { k = k, s = payload(k, k % 300), nested = { 1, 2.5, "x", { deep = true } }, flag = false }
      local got = q:broadcast_object(q.is_writer and obj or nil)
      if not q.is_writer then
        check(type(got) == "table" and got.k == k and got.s == obj.s and got.nested[4].deep == true
              and got.flag == false and got.nested[2] == 2.5, "object %d differs", k)
      end
    else
      local len = size_of(k, chunk, q.chunks)
      local want = payload(k, len)
      if q.is_writer then
        q:send_bytes(want)
      else
        local got
        local how = (k + rank) % 3
        if how == 0 then
          got = q:recv_bytes()
        elseif how == 1 then
          local p, l = q:recv_view()
          got = ffi.string(p, l)
        else
          repeat
            got = q:try_recv_bytes()
            if got == nil then util.sleep_ms(1) end
          until got ~= nil
        end
        check(got == want, "message %d (%d bytes, way %d): %s", k, len, how, describe_diff(got, want))
      end
    end
  end
  g:barrier()
  q:destroy()
  q:destroy()
  local ok, e = pcall(q.send_bytes, q, "x")
  check(not ok and tostring(e):find("destroyed", 1, true), "use after destroy: %s", tostring(e))
end

-- One slow reader holding a lent slot: the writer must not overwrite it.
function modes.slow()
  local q = new_q { writer = 0, chunk_bytes = 1024, chunks = 2 }
  local slow = rank == n - 1
  for k = 0, COUNT - 1 do
    local want = payload(k, 1 + k % 1024)
    if q.is_writer then
      q:send_bytes(want)
    elseif slow then
      local p, l = q:recv_view()
      check(ffi.string(p, l) == want, "message %d differs on arrival", k)
      if k % 4 == 0 then util.sleep_ms(2) end
      check(ffi.string(p, l) == want, "message %d was overwritten while lent (no back-pressure)", k)
    else
      check(q:recv_bytes() == want, "message %d differs", k)
    end
  end
  g:barrier()
  q:destroy()
end

-- Readers only poll; messages span more slots than the ring has. The writer
-- destroys its queue right after its last send: what it wrote stays readable,
-- and only then do readers hear that it left.
function modes.try()
  local q = new_q()
  local big = (q.chunks + 3) * q.chunk_bytes + 5
  local sizes = { big, 0, 3, big * 2 + 1, q.chunk_bytes, 17 }
  if not q.is_writer then
    local got, obj = q:try_recv_object()
    check(got == false and obj == nil, "an empty queue gave a message")
  end
  g:barrier() -- the writer starts only after that poll
  for k = 0, #sizes - 1 do
    local want = payload(k, sizes[k + 1])
    if q.is_writer then
      q:send_bytes(want)
    else
      local got
      repeat
        got = q:try_recv_bytes()
        if got == nil then util.sleep_ms(1) end
      until got ~= nil
      check(got == want, "polled message %d: %s", k, describe_diff(got, want))
    end
  end
  if q.is_writer then q:destroy() end
  g:barrier()
  if not q.is_writer then
    local ok, e = pcall(q.try_recv_bytes, q)
    -- this rank found out, or another reader did first and aborted the queue
    check(not ok and tostring(e):find("weft_mq_try_dequeue: group 'mqtest': ", 1, true)
          and tostring(e):find("the writer rank 0 (global 0) destroyed its message queue before "
                               .. "writing message 6", 1, true),
          "poll after the writer left: %s", tostring(e))
    q:destroy()
  end
end

-- Readers stop reading: the writer's enqueue times out naming them, the
-- queue stays usable, and after the readers catch up a retry succeeds.
function modes.full_ring()
  local q = new_q { writer = 0, chunk_bytes = 256, chunks = 2 }
  q:set_timeout(tmo)
  if q.is_writer then
    q:send_bytes(payload(0, 10))
    q:send_bytes(payload(1, 10))
    local t0 = util.now_ms()
    local ok, e = pcall(q.send_bytes, q, payload(2, 10))
    report("FULL", ok, t0, e)
    g:barrier()
    q:send_bytes(payload(2, 10))
    q:send_bytes(payload(3, 600)) -- split over 3 slots of a 2-slot ring
  else
    g:barrier()
    for k = 0, 2 do check(q:recv_bytes() == payload(k, 10), "message %d after the timeout", k) end
    check(q:recv_bytes() == payload(3, 600), "split message after the timeout")
  end
  g:barrier()
  q:destroy()
end

-- The writer is late: readers time out naming it, then still get the message.
function modes.late_writer()
  local q = new_q()
  q:set_timeout(tmo)
  if q.is_writer then
    g:barrier()
    q:send_bytes("late")
  else
    local t0 = util.now_ms()
    local ok, e = pcall(q.recv_bytes, q)
    report("LATE", ok, t0, e)
    local got, msg = pcall(q.try_recv_bytes, q)
    check(got and msg == nil, "poll after a timeout: %s", tostring(msg))
    got, msg = pcall(q.try_recv_bytes, q, 50)
    check(got and msg == nil, "a bounded poll after a timeout: %s", tostring(msg))
    g:barrier()
    check(q:recv_bytes(60000) == "late", "the late message")
  end
  g:barrier()
  q:destroy()
end

-- A reader destroys its queue early: the writer fails naming it, the other
-- readers fail with the writer's reason (the queue is aborted).
function modes.left_reader()
  local q = new_q { writer = 0, chunk_bytes = 128, chunks = 2 }
  q:set_timeout(tmo)
  local leaver = n - 1
  if rank == leaver then
    check(q:recv_bytes() == payload(0, 5), "first message")
    q:destroy()
    say("LEFT_SELF ok=true ms=0 msg=destroyed")
    g:barrier()
    return
  end
  local t0 = util.now_ms()
  local ok, e = pcall(function()
    for k = 0, 20 do
      if q.is_writer then q:send_bytes(payload(k, 5))
      else
        local got = q:recv_bytes()
        if got ~= payload(k, 5) then error("message " .. k .. " differs") end
        t0 = util.now_ms()
      end
    end
  end)
  report("LEFT", ok, t0, e)
  local ok2, e2 = pcall(function() if q.is_writer then q:send_bytes("x") else q:recv_bytes() end end)
  check(not ok2 and tostring(e2):find("aborted", 1, true), "a later call: %s", tostring(e2))
  q:destroy()
  g:barrier()
end

-- A reader is killed: the writer fails naming it; the others learn why.
function modes.dead_reader()
  local q = new_q { writer = 0, chunk_bytes = 128, chunks = 2 }
  q:set_timeout(tmo)
  if rank == n - 1 then
    q:recv_bytes()
    say("DYING rank " .. rank)
    W.kill_self()
  end
  local t0 = util.now_ms()
  local ok, e = pcall(function()
    for k = 0, 50 do
      if q.is_writer then q:send_bytes(payload(k, 5))
      else
        q:recv_bytes()
        t0 = util.now_ms()
      end
    end
  end)
  report("DEAD", ok, t0, e)
  q:destroy()
end

-- The writer (index 1) is killed after 3 messages: readers fail naming it.
function modes.dead_writer()
  local q = new_q { writer = 1, chunk_bytes = 128, chunks = 4 }
  q:set_timeout(tmo)
  if q.is_writer then
    for k = 0, 2 do q:send_bytes(payload(k, 300)) end
    say("DYING rank " .. rank)
    W.kill_self()
  end
  for k = 0, 2 do check(q:recv_bytes() == payload(k, 300), "message %d before the death", k) end
  local t0 = util.now_ms()
  local ok, e = pcall(q.recv_bytes, q)
  report("DEAD", ok, t0, e)
  q:destroy()
end

-- Ranks disagree on the geometry: every rank gets the same error.
function modes.mismatch()
  local ok, e = pcall(mq.new, g, { writer = 0, chunk_bytes = rank == n - 1 and 2048 or 4096, chunks = 4 })
  report("MISMATCH", ok, util.now_ms(), e)
  -- the group still works, and so does a queue made right
  local q = new_q()
  if q.is_writer then q:send_bytes("after") else check(q:recv_bytes() == "after", "queue after a mismatch") end
  g:barrier()
  q:destroy()
end

local f = modes[mode]
if not f then error("mq_worker: unknown MQ_MODE " .. mode) end
f()
K.ok_line()
g:destroy()
s:close()
K.exit()
