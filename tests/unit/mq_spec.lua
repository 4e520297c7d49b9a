-- weft.mq: the message-queue broadcaster (shared-memory ring, one writer).
-- In one process (a group of one, argument checks, lifetime) and across real
-- processes through scripts/weft-run (2, 4, 8 ranks): ordering of many
-- messages of 0 B .. more than the whole ring, wrap-around many times,
-- objects, zero-copy views, polling, a slow reader holding a slot
-- (back-pressure), a full ring and a late writer (timeouts naming who), a
-- reader that leaves, ranks that disagree; killed readers and writers
-- (processes started directly, since weft-run stops everyone when a rank
-- dies); and nothing left behind in /dev/shm.
local ffi = require("ffi")
local mq = require("weft.mq")
local wffi = require("weft.internal.ffi")
local util = require("helpers.store_util")
local spec = require("helpers.spec_util")

local WORKER = "tests/helpers/mq_worker.lua"

local err_of, lines_of = spec.err_of, spec.lines_of

local function leftovers()
  return spec.dev_shm(function(name) return name:match("^weft%-mq%-") end)
end

local before_all = leftovers()

describe("weft.mq in one process", function()
  local s, g
  before_each(function() s, g = util.one_rank_group("solo", 7, 2000) end)
  after_each(function()
    g:destroy()
    s:close()
  end)

  it("a group of one: the writer sends to nobody, with defaults", function()
    local q = mq.new(g)
    assert.is_true(q.is_writer)
    assert.are.equal(1048576, q.chunk_bytes)
    assert.are.equal(8, q.chunks)
    local w, i, n, cb, ch = ffi.new("int[1]"), ffi.new("int[1]"), ffi.new("int[1]"),
                            ffi.new("size_t[1]"), ffi.new("int[1]")
    assert.are.equal(0, wffi.C.weft_mq_info(q.handle, w, i, n, cb, ch))
    assert.are.same({ 0, 0, 1, 1048576, 8 }, { w[0], i[0], n[0], tonumber(cb[0]), ch[0] })
    for k = 1, 50 do q:send_bytes(("x"):rep(k * 1000)) end -- more than the ring, nobody to wait for
    q:send_bytes("")
    assert.are.same({ a = 1 }, q:broadcast_object({ a = 1 }))
    local buf = ffi.new("uint8_t[3]", { 1, 2, 3 })
    q:send_bytes(buf, 3)
    assert.is_truthy(tostring(q):find("group 'solo', index 0 of 1, writer 0, 8 chunks", 1, true))
    q:destroy()
    q:destroy()
    assert.is_truthy(tostring(q):find("destroyed", 1, true))
    assert.is_truthy(err_of(q.send_bytes, q, "x"):find("weft: mq send_bytes: the message queue of group 'solo' was destroyed", 1, true))
    assert.are.same(0, (leftovers():len()))
  end)

  it("names the problem in its errors", function()
    assert.is_truthy(err_of(mq.new, nil):find("weft: mq new: expected a live weft.cpugroup", 1, true))
    assert.is_truthy(err_of(mq.new, g, { writer = 1 }):find("writer index 1 outside 0..0 of group 'solo'", 1, true))
    assert.is_truthy(err_of(mq.new, g, { chunk_bytes = 0 }):find("chunk_bytes must be an integer >= 1", 1, true))
    assert.is_truthy(err_of(mq.new, g, { chunks = 1.5 }):find("chunks must be an integer >= 1, got 1.5", 1, true))
    assert.is_truthy(err_of(mq.new, g, { chunks = 100000 }):find("weft_mq_create: group 'solo': chunks 100000 outside 1..65536", 1, true))
    assert.is_truthy(err_of(mq.new, g, { chunk_bytes = 2 ^ 31 }):find("chunk_bytes 2147483648 outside", 1, true))
    local q = mq.new(g, { chunk_bytes = 100, chunks = 2, timeout_ms = 500 })
    assert.are.equal(500, q.timeout_ms)
    assert.is_truthy(err_of(q.recv_bytes, q):find("weft_mq_dequeue: group 'solo': rank 0 (global 7) is the writer; only readers dequeue", 1, true))
    assert.is_truthy(err_of(q.try_recv_bytes, q):find("weft_mq_try_dequeue: group 'solo'", 1, true))
    assert.is_truthy(err_of(q.send_bytes, q, 42):find("expected a string, or a pointer and a length", 1, true))
    assert.is_truthy(err_of(q.set_timeout, q, 0):find("weft_mq_set_timeout: group 'solo': timeout 0 ms must be > 0", 1, true))
    assert.is_truthy(err_of(q.broadcast_object, q, { f = print }):find("weft: encode: cannot serialize a function", 1, true))
    q:send_bytes(("y"):rep(1000)) -- split over 10 slots of a 2-slot ring: no readers, no wait
    q:destroy()
    local C = wffi.C
    assert.are.equal(C.WEFT_EINVAL, C.weft_mq_enqueue(nil, nil, 0))
    assert.is_truthy(wffi.last_error():find("NULL message queue", 1, true))
    assert.are.equal(0, C.weft_mq_destroy(nil))
  end)
end)

---------------------------------------------------------------- processes
-- Runs the worker on n ranks through weft-run; returns rc, per-rank lines
-- (0-based) and the whole output.
local function weft_run(n, env, limit)
  local vars = {}
  for k, v in pairs(env) do vars[#vars + 1] = ("%s='%s'"):format(k, v) end
  limit = limit or 120
  local cmd = ("cd '%s' && %s timeout -s KILL %d luajit scripts/weft-run -n %d --timeout %d %s 2>&1; echo \"rc=$?\"")
              :format(util.root(), table.concat(vars, " "), limit + 10, n, limit, WORKER)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  local per = {}
  for r = 0, n - 1 do per[r] = {} end
  for _, l in ipairs(lines_of(out)) do
    local r, text = l:match("^%[rank(%d+)%] (.*)$")
    if r and per[tonumber(r)] then table.insert(per[tonumber(r)], text) end
  end
  return rc, per, out
end

local function all_ok(n, rc, per, out)
  assert.are.equal(0, rc, out)
  for r = 0, n - 1 do
    local found = false
    for _, l in ipairs(per[r]) do
      assert.is_falsy(l:find("^FAIL"), out)
      if l:find("^OK rank " .. r .. " ") then found = true end
    end
    assert.is_true(found, ("rank %d did not finish:\n%s"):format(r, out))
  end
end

-- "<WHAT> ok=<bool> ms=<n> msg=<text>" lines of one tag, by rank
local function reports(per, n, tag)
  local got = {}
  for r = 0, n - 1 do got[r] = spec.report_of(per[r], tag) end
  return got
end

local function run_mode(n, mode, extra, limit)
  local env = { MQ_MODE = mode }
  for k, v in pairs(extra or {}) do env[k] = v end
  return weft_run(n, env, limit)
end

describe("weft.mq across processes", function()
  for _, n in ipairs { 2, 4, 8 } do
    it(("keeps the order of many messages, 0 B to more than the ring, wrapping many times (%d ranks)"):format(n), function()
      -- 4 slots of 4 KiB: each message takes 1..6 slots, hundreds of laps
      all_ok(n, run_mode(n, "order", { MQ_CHUNK = 4096, MQ_CHUNKS = 4, MQ_COUNT = n == 8 and 400 or 800 }))
    end)

    it(("default geometry (8 x 1 MiB): messages up to 10 MiB, split and reassembled (%d ranks)"):format(n), function()
      all_ok(n, run_mode(n, "order", { MQ_CHUNK = 0, MQ_CHUNKS = 0, MQ_COUNT = 31 }, 240))
    end)

    it(("a slow reader holding a lent slot holds the writer back (%d ranks)"):format(n), function()
      all_ok(n, run_mode(n, "slow", { MQ_COUNT = 200 }))
    end)
  end

  it("a ring of one 7-byte slot: every message split, the writer waits on every fragment (3 ranks)", function()
    all_ok(3, run_mode(3, "order", { MQ_CHUNK = 7, MQ_CHUNKS = 1, MQ_COUNT = 200 }))
  end)

  for _, n in ipairs { 2, 4 } do
    it(("readers that only poll get split messages larger than the ring (%d ranks)"):format(n), function()
      all_ok(n, run_mode(n, "try"))
    end)

    it(("ranks that disagree on the geometry all get the same error (%d ranks)"):format(n), function()
      local rc, per, out = run_mode(n, "mismatch")
      all_ok(n, rc, per, out)
      local got = reports(per, n, "MISMATCH")
      for r = 0, n - 1 do
        local m = assert(got[r], out)
        assert.are.equal("false", m.ok)
        assert.is_truthy(m.msg:find(("weft: weft_mq_create: group 'mqtest': rank %d (global %d): ranks disagree on the queue "
                                     .. "(index 0: writer 0, 4 chunks of 4096 bytes; this rank: writer 0, 4 chunks of 2048 bytes)")
                                    :format(n - 1, n - 1), 1, true), m.msg)
      end
    end)
  end

  it("a full ring: the writer times out naming every reader that did not read, and can retry", function()
    local n, tmo = 4, 1000
    local rc, per, out = run_mode(n, "full_ring", { MQ_TIMEOUT_MS = tmo })
    all_ok(n, rc, per, out)
    local m = assert(reports(per, n, "FULL")[0], out)
    assert.are.equal("false", m.ok)
    assert.is_true(m.ms < tmo + 2000, out)
    assert.is_truthy(m.msg:find("weft_mq_enqueue: group 'mqtest': timed out after 1000 ms (message 2) waiting for "
                                .. "rank 1 (global 1), rank 2 (global 2), rank 3 (global 3) to read", 1, true), m.msg)
  end)

  it("a late writer: readers time out naming it, then still get the message", function()
    local n, tmo = 3, 1000
    local rc, per, out = run_mode(n, "late_writer", { MQ_TIMEOUT_MS = tmo })
    all_ok(n, rc, per, out)
    local got = reports(per, n, "LATE")
    for r = 1, n - 1 do
      local m = assert(got[r], out)
      assert.are.equal("false", m.ok)
      assert.is_true(m.ms < tmo + 2000, out)
      assert.is_truthy(m.msg:find("weft_mq_dequeue: group 'mqtest': timed out after 1000 ms waiting for the writer "
                                  .. "rank 0 (global 0) to write message 0", 1, true), m.msg)
    end
  end)

  it("a reader that destroys its queue: the writer names it, the others learn why", function()
    local n = 3
    local rc, per, out = run_mode(n, "left_reader", { MQ_TIMEOUT_MS = 5000 })
    all_ok(n, rc, per, out)
    local got = reports(per, n, "LEFT")
    assert.is_truthy(got[0] and got[0].msg:find("weft_mq_enqueue: group 'mqtest': rank 2 (global 2) destroyed its "
                                                .. "message queue while the writer waited", 1, true), out)
    assert.is_truthy(got[1] and got[1].msg:find("message queue aborted by rank 0 (global 0): rank 2 (global 2) "
                                                .. "destroyed its message queue", 1, true), out)
  end)

  local function killed(n, mode, tmo)
    local res = util.run_ranks(n, WORKER, { MQ_MODE = mode, MQ_TIMEOUT_MS = tmo }, 60)
    local per, all = {}, {}
    for r = 0, n - 1 do
      per[r] = lines_of(res[r].out)
      all[#all + 1] = ("rank %d rc=%s:\n%s"):format(r, tostring(res[r].rc), res[r].out)
    end
    return res, per, table.concat(all, "\n")
  end

  for _, n in ipairs { 2, 4, 8 } do
    it(("a killed reader: every other rank fails within the timeout + 2 s, naming it (%d ranks)"):format(n), function()
      local tmo = 3000
      local res, per, out = killed(n, "dead_reader", tmo)
      assert.are.equal(137, res[n - 1].rc, out)
      local got = reports(per, n, "DEAD")
      local who = ("rank %d (global %d, pid"):format(n - 1, n - 1)
      for r = 0, n - 2 do
        assert.are.equal(0, res[r].rc, out)
        local m = assert(got[r], out)
        assert.are.equal("false", m.ok)
        assert.is_true(m.ms < tmo + 2000, out)
        assert.is_truthy(m.msg:find(who, 1, true), m.msg)
        assert.is_truthy(m.msg:find("died", 1, true), m.msg)
      end
      assert.is_truthy(got[0].msg:find("weft_mq_enqueue: group 'mqtest': reader " .. who, 1, true), got[0].msg)
    end)
  end

  for _, n in ipairs { 2, 4 } do
    it(("a killed writer: every reader fails within the timeout + 2 s, naming it (%d ranks)"):format(n), function()
      local tmo = 3000
      local res, per, out = killed(n, "dead_writer", tmo)
      assert.are.equal(137, res[1].rc, out)
      local got = reports(per, n, "DEAD")
      for r = 0, n - 1 do
        if r ~= 1 then
          assert.are.equal(0, res[r].rc, out)
          local m = assert(got[r], out)
          assert.are.equal("false", m.ok)
          assert.is_true(m.ms < tmo + 2000, out)
          assert.is_truthy(m.msg:find("the writer rank 1 (global 1, pid", 1, true), m.msg)
          assert.is_truthy(m.msg:find("died", 1, true), m.msg)
        end
      end
    end)
  end

  it("leaves nothing in /dev/shm", function()
    assert.are.equal(before_all, leftovers())
  end)
end)
