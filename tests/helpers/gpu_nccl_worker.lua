-- One rank of the NCCL test (tests/gpu/gpu_nccl_spec.lua runs it as
-- `scripts/weft-run -n 2 tests/helpers/gpu_nccl_worker.lua`). Every collective runs
-- on device buffers and is checked against a host reference computed from
-- every rank's input (inputs are small integers, so sums are exact in every
-- dtype and the comparison is exact). Prints "PASS <name>" or
-- "FAIL <name>: <error>" per check; exits 1 if any failed.
--
-- Every collective check runs twice: on the default communicator (blocking
-- calls on a communicator split from a non-blocking parent) and on a
-- non-blocking one (names with the suffix "_nb"). The fault checks make one
-- rank miss NCCL init, the split, a send or destroy, and expect the rank that
-- waits for it to get an error naming the group after the timeout, instead
-- of waiting for the late peer.
--
-- A failing check must not desynchronize the ranks for the next ones:
--  * every check gets a fresh cpu group (its own keys and sequence numbers),
--    so a collective that one rank skipped cannot shift later ones;
--  * result comparisons and the fault checks' expectations are soft: they
--    are recorded and reported at the end of the check, so every rank still
--    reaches the check's collectives and barriers;
--  * after every check, passed or failed, all ranks meet at a sync point in
--    the store (bounded by SYNC_MS, longer than any wait inside a check, so
--    it absorbs the lag a failure causes) and agree on one verdict (the first
--    rank to write it decides: compare-and-set). When it is not "ok", every
--    rank prints RESYNC and re-creates the shared communicators, which the
--    failed check may have aborted or left mid-collective.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local ffi = require("ffi")
local G = require("helpers.gpu_ranks")
local wffi = require("weft.internal.ffi")
local C = wffi.C
local cuda = require("weft.cuda")
local tensor = require("weft.tensor")
local nccl = require("weft.nccl")
local graph = require("weft.graph")
local store_mod = require("weft.store")
local cpugroup = require("weft.cpugroup")
local bench = require("weft.tools.bench")

local rank = assert(tonumber(os.getenv("RANK")), "RANK not set (run under weft-run)")
local world = assert(tonumber(os.getenv("WORLD_SIZE")))
local TIMEOUT = 60000   -- connecting to the store at start-up
local CHECK_MS = 20000  -- the cpu groups and shared communicators: the longest wait in a check
local SYNC_MS = 45000   -- the sync point after each check (> CHECK_MS)
local FAULT_MS = 1500   -- the timeout of the fault checks
local STALL_MS = 5000   -- the most the late rank stays away (> 3 x FAULT_MS)

local failed = 0
-- hard: ends the check (for preconditions without which it cannot go on)
local function expect(cond, msg, ...)
  if not cond then error(msg:format(...), 2) end
end

-- soft (want, expect_error): recorded, reported when the check ends; the
-- check goes on, so every rank still reaches its collectives and barriers
local S = G.soft_checks()
local want, expect_error = S.want, S.expect_error
-- Rank r's input for a test: n small integers (-16..15) as dtype, on the host.
local ints = G.ints

local function vals(seed, n, dt) return ints(seed, n, dt):to_table() end

local function on_device(h) return h:clone("cuda") end

-- exact comparison of a device/host tensor with a Lua table of numbers
local function same(t, ref, what)
  if not want(t.numel == #ref, "%s: %d elements, reference %d", what, t.numel, #ref) then return end
  if #ref == 0 then return end
  local ma = t:compare(ref)
  want(ma == 0, "%s: max abs difference %g", what, ma)
end

local REDUCE = {
  sum = function(a, b) return a + b end,
  max = math.max, min = math.min,
  prod = function(a, b) return a * b end,
}

local function reduce_ref(seed_base, n, dt, op)
  local acc = vals(seed_base, n, dt)
  for r = 1, world - 1 do
    local v = vals(seed_base + r, n, dt)
    for i = 1, n do acc[i] = REDUCE[op](acc[i], v[i]) end
  end
  return acc
end

-- ---------------------------------------------------------------- setup

local st = store_mod.open { host = os.getenv("MASTER_ADDR") or "127.0.0.1",
                            port = tonumber(os.getenv("MASTER_PORT")), server = rank == 0,
                            timeout_ms = TIMEOUT }
local ranks = {}
for i = 0, world - 1 do ranks[i + 1] = i end

for _, decl in ipairs { "int setenv(const char *name, const char *value, int overwrite);",
                        "int unsetenv(const char *name);" } do
  pcall(ffi.cdef, decl)   -- another module may have declared it already
end
local function now_s() return bench.now_ns() / 1e9 end

-- The shared communicators: `comms.default` (blocking calls, split) and
-- `comms.nb` (non-blocking). Re-created (collectively, on a fresh cpu group)
-- after a check that failed on any rank.
local comms, generation = {}, 0
local function make_comms()
  for _, k in ipairs { "default", "nb" } do
    if comms[k] then comms[k]:abort(); comms[k]:destroy(); comms[k] = nil end   -- local
  end
  generation = generation + 1
  local g = cpugroup.new(st, generation == 1 and "gpu_nccl" or "gpu_nccl_r" .. generation, ranks,
                         rank, CHECK_MS)
  local ok, err = pcall(function()
    comms.default = nccl.new(g)
    comms.nb = nccl.new(g, { blocking = false })
  end)
  g:destroy()
  if not ok then print("RESYNC: re-creating the communicators failed: " .. tostring(err)) end
end

make_comms()
assert(comms.nb, "creating the communicators failed")
print(("nccl %s on cuda:%d (%s), world %d"):format(tostring(nccl.version()), comms.default.device,
      cuda.device_name(comms.default.device), world))

-- The store keys a late rank waits on: set by the rank that was measured,
-- so the late rank comes back as soon as that rank is done (or after
-- STALL_MS, if the measured call waits for it: then the check fails).
local function release(key) st:set("gpu_nccl/release/" .. key, "1") end
local function stay_away(key) pcall(st.get, st, "gpu_nccl/release/" .. key, STALL_MS) end

-- After every check: wait (bounded) for every rank to finish it, then agree
-- on one verdict. The first rank to write the verdict decides it; a rank
-- that timed out writes why, so the late one reads the same verdict.
local syncs = 0
local function sync_point(name, ok)
  syncs = syncs + 1
  local base = ("gpu_nccl/sync/%d/"):format(syncs)
  local keys = {}
  for r = 0, world - 1 do keys[r + 1] = base .. r end
  st:set(keys[rank + 1], ok and "ok" or "fail")
  local got, vals = pcall(st.multi_get, st, keys, SYNC_MS)
  local view = "ok"
  if not got then
    view = ("rank %d waited %d ms after %s: a rank did not finish it"):format(rank, SYNC_MS, name)
  else
    local bad = {}
    for r = 0, world - 1 do if vals[r + 1] ~= "ok" then bad[#bad + 1] = r end end
    if #bad > 0 then view = name .. " failed on rank(s) " .. table.concat(bad, ",") end
  end
  return st:compare_set(base .. "verdict", "", view)
end

-- Runs fn(g) with g a fresh cpu group for this check; PASS/FAIL, then the
-- sync point; on a verdict other than "ok" the shared communicators are
-- re-created on every rank.
local function check_once(name, fn)
  local ok, err = S.run(function()
    local g = cpugroup.new(st, "gpu_nccl_c/" .. name, ranks, rank, CHECK_MS)
    fn(g)
    g:destroy()
  end)
  if ok then
    print("PASS " .. name)
  else
    failed = failed + 1
    print("FAIL " .. name .. ": " .. tostring(err))
  end
  io.stdout:flush()
  local verdict = sync_point(name, ok)
  if verdict ~= "ok" then
    print(("RESYNC after %s: %s; re-creating the shared communicators"):format(name, verdict))
    io.stdout:flush()
    make_comms()
  end
end

check_once("default_is_blocking", function()
  -- the default communicator is the fast one (blocking calls); blocking=false
  -- keeps the pure non-blocking mode
  expect(comms.default.blocking == true, "default communicator: blocking=%s",
         tostring(comms.default.blocking))
  expect(comms.nb.blocking == false, "blocking=false communicator: blocking=%s",
         tostring(comms.nb.blocking))
end)

-- ---------------------------------------------------------------- per mode

-- Every check below runs on the shared communicator `comms[kind]` (`blocking`:
-- its mode), passed in as `comm` together with the check's cpu group `g`;
-- names get `sfx`.
local function suite(kind, blocking, sfx)
  local function check(name, fn)
    return check_once(name .. sfx, function(g)
      local comm = comms[kind]
      expect(comm, "no %s communicator (re-creating it failed)", kind)
      return fn(comm, g)
    end)
  end

  -- ---------------------------------------------------------------- collectives

  check("all_reduce", function(comm, g)
    local seed = 100
    for _, dt in ipairs { "f32", "f16", "bf16", "i32", "i64", "f64", "u8" } do
      for _, n in ipairs { 1, 7, 1000, 262147 } do
        seed = seed + 10
        local x = on_device(ints(seed + rank, n, dt))
        local y = tensor.empty({ n }, dt, "cuda")
        comm:all_reduce(x.ptr, y.ptr, n, x:dtype_code(), "sum")
        comm:synchronize()
        if dt == "u8" then  -- wraps modulo 256
          local ref = reduce_ref(seed, n, dt, "sum")
          for i = 1, n do ref[i] = ref[i] % 256 end
          same(y, ref, "u8 sum")
        else
          same(y, reduce_ref(seed, n, dt, "sum"), dt .. " sum n=" .. n)
        end
        x:free(); y:free()
      end
    end
  end)

  check("all_reduce_inplace_ops", function(comm, g)
    local seed = 1000
    for _, op in ipairs { "sum", "max", "min", "prod" } do
      for _, dt in ipairs { "bf16", "f32", "i32" } do
        seed = seed + 10
        local n = 4099
        local x = on_device(ints(seed + rank, n, dt))
        comm:all_reduce(x.ptr, x.ptr, n, dt, op)
        comm:synchronize()
        same(x, reduce_ref(seed, n, dt, op), dt .. " " .. op)
        x:free()
      end
    end
  end)

  check("all_gather", function(comm, g)
    local n = 5003
    local x = on_device(ints(2000 + rank, n, "bf16"))
    local y = tensor.empty({ world * n }, "bf16", "cuda")
    comm:all_gather(x.ptr, y.ptr, n, "bf16")
    comm:synchronize()
    local ref = {}
    for r = 0, world - 1 do
      for _, v in ipairs(vals(2000 + r, n, "bf16")) do ref[#ref + 1] = v end
    end
    same(y, ref, "all_gather")
  end)

  local function counts_for(base)
    local c = {}
    for r = 0, world - 1 do c[r + 1] = base + 17 * r end
    return c
  end

  check("all_gatherv", function(comm, g)
    for _, counts in ipairs { counts_for(5), counts_for(1001), (function()
        local c = counts_for(3); c[1] = 0; return c end)() } do
      local total = 0
      for i = 1, world do total = total + counts[i] end
      local x = on_device(ints(3000 + rank, math.max(counts[rank + 1], 1), "f16"))
      local y = tensor.empty({ total }, "f16", "cuda")
      comm:all_gatherv(x.ptr, y.ptr, counts, "f16")
      comm:synchronize()
      local ref = {}
      for r = 0, world - 1 do
        local v = vals(3000 + r, math.max(counts[r + 1], 1), "f16")
        for i = 1, counts[r + 1] do ref[#ref + 1] = v[i] end
      end
      same(y, ref, "all_gatherv")
    end
  end)

  check("reduce_scatter", function(comm, g)
    local n = 3001                         -- per rank out
    local x = on_device(ints(4000 + rank, world * n, "bf16"))
    local y = tensor.empty({ n }, "bf16", "cuda")
    comm:reduce_scatter(x.ptr, y.ptr, n, "bf16", "sum")
    comm:synchronize()
    local full = reduce_ref(4000, world * n, "bf16", "sum")
    local ref = {}
    for i = 1, n do ref[i] = full[rank * n + i] end
    same(y, ref, "reduce_scatter")
  end)

  check("reduce_scatterv", function(comm, g)
    local counts = counts_for(9)
    local total, off = 0, 0
    for i = 1, world do total = total + counts[i] end
    for i = 1, rank do off = off + counts[i] end
    local x = on_device(ints(5000 + rank, total, "f32"))
    local y = tensor.empty({ counts[rank + 1] }, "f32", "cuda")
    comm:reduce_scatterv(x.ptr, y.ptr, counts, "f32", "sum")
    comm:synchronize()
    local full = reduce_ref(5000, total, "f32", "sum")
    local ref = {}
    for i = 1, counts[rank + 1] do ref[i] = full[off + i] end
    same(y, ref, "reduce_scatterv")
  end)

  check("broadcast", function(comm, g)
    local n = 7777
    for root = 0, world - 1 do
      local x = on_device(ints(6000 + rank, n, "bf16"))
      comm:broadcast(x.ptr, n, "bf16", root)
      comm:synchronize()
      same(x, vals(6000 + root, n, "bf16"), "broadcast from " .. root)
      -- out of place
      local src = on_device(ints(6100 + rank, n, "i64"))
      local dst = tensor.zeros({ n }, "i64", "cuda")
      comm:broadcast(src.ptr, n, "i64", root, nil, dst.ptr)
      comm:synchronize()
      same(dst, vals(6100 + root, n, "i64"), "broadcast out of place from " .. root)
    end
  end)

  check("gather", function(comm, g)
    local n = 999
    for root = 0, world - 1 do
      local x = on_device(ints(7000 + rank, n, "f32"))
      local y = rank == root and tensor.empty({ world * n }, "f32", "cuda") or nil
      comm:gather(x.ptr, y and y.ptr, n, "f32", root)
      comm:synchronize()
      if y then
        local ref = {}
        for r = 0, world - 1 do
          for _, v in ipairs(vals(7000 + r, n, "f32")) do ref[#ref + 1] = v end
        end
        same(y, ref, "gather to " .. root)
      end
    end
  end)

  check("send_recv", function(comm, g)
    local n = 12345
    -- a ring: everyone sends to next and receives from prev, batched in a group
    local nxt, prv = (rank + 1) % world, (rank - 1) % world
    local x = on_device(ints(8000 + rank, n, "bf16"))
    local y = tensor.empty({ n }, "bf16", "cuda")
    nccl.group(function()
      comm:send(x.ptr, n, "bf16", nxt)
      comm:recv(y.ptr, n, "bf16", prv)
    end)
    comm:synchronize()
    same(y, vals(8000 + prv, n, "bf16"), "ring recv")
    -- one direction at a time, unbatched
    if world >= 2 then
      local z = tensor.zeros({ n }, "bf16", "cuda")
      if rank == 0 then comm:send(x.ptr, n, "bf16", 1) elseif rank == 1 then comm:recv(z.ptr, n, "bf16", 0) end
      comm:synchronize()
      if rank == 1 then same(z, vals(8000, n, "bf16"), "p2p 0->1") end
    end
  end)

  check("all_to_all_equal", function(comm, g)
    local k = 1031
    local x = on_device(ints(9000 + rank, world * k, "f32"))
    local y = tensor.empty({ world * k }, "f32", "cuda")
    comm:all_to_all(x.ptr, y.ptr, world * k, "f32")
    comm:synchronize()
    local ref = {}
    for src = 0, world - 1 do
      local v = vals(9000 + src, world * k, "f32")
      for i = 1, k do ref[#ref + 1] = v[rank * k + i] end
    end
    same(y, ref, "all_to_all equal")
  end)

  check("all_to_all_splits", function(comm, g)
    local function split(src, dst) return 1 + 3 * src + 5 * dst end  -- elements src sends dst
    local sc, rc, stot, rtot = {}, {}, 0, 0
    for j = 0, world - 1 do
      sc[j + 1] = split(rank, j); stot = stot + sc[j + 1]
      rc[j + 1] = split(j, rank); rtot = rtot + rc[j + 1]
    end
    local x = on_device(ints(9500 + rank, stot, "bf16"))
    local y = tensor.empty({ rtot }, "bf16", "cuda")
    comm:all_to_all(x.ptr, y.ptr, nil, "bf16", sc, rc)
    comm:synchronize()
    local ref = {}
    for src = 0, world - 1 do
      local total, off = 0, 0
      for j = 0, world - 1 do total = total + split(src, j) end
      for j = 0, rank - 1 do off = off + split(src, j) end
      local v = vals(9500 + src, total, "bf16")
      for i = 1, split(src, rank) do ref[#ref + 1] = v[off + i] end
    end
    same(y, ref, "all_to_all splits")
  end)

  -- ---------------------------------------------------------------- graphs

  check("graph_replay", function(comm, g)
    local n = 65536
    local x = tensor.empty({ n }, "bf16", "cuda")
    local y = tensor.empty({ n }, "bf16", "cuda")
    local z = tensor.empty({ n }, "bf16", "cuda")
    local function load(seed)
      local h = ints(seed + rank, n, "bf16")
      x:copy_(h)
      h:free()
    end
    load(10000)
    g:barrier()
    -- two collectives in one graph: y = allreduce(x), z = allgather-of-halves
    local gr = graph.capture(function()
      comm:all_reduce(x.ptr, y.ptr, n, "bf16", "sum")
      comm:all_gather(x.ptr, z.ptr, n / world, "bf16")
    end, { warmup = 1 })
    g:barrier()
    for round = 1, 4 do
      local seed = 10000 + 100 * round
      load(seed)
      gr:replay()
      comm:synchronize()
      same(y, reduce_ref(seed, n, "bf16", "sum"), "graph round " .. round .. " all_reduce")
      local ref = {}
      for r = 0, world - 1 do
        local v = vals(seed + r, n, "bf16")
        for i = 1, n / world do ref[#ref + 1] = v[i] end
      end
      same(z, ref, "graph round " .. round .. " all_gather")
    end
    gr:destroy()
    g:barrier()
    x:free(); y:free(); z:free()
  end)

  -- ---------------------------------------------------------------- bad input

  check("bad_input", function(comm, g)
    local n = 64
    local d = tensor.zeros({ n }, "f32", "cuda")
    local h = tensor.zeros({ n }, "f32", "cpu")
    expect_error("host memory", comm.all_reduce, comm, h.ptr, d.ptr, n, "f32", "sum")
    expect_error("NULL", comm.all_reduce, comm, nil, nil, n, "f32", "sum")
    expect_error("unknown dtype 99", comm.all_reduce, comm, d.ptr, d.ptr, n, 99, "sum")
    expect_error("unknown op", comm.all_reduce, comm, d.ptr, d.ptr, n, "f32", "xor")
    expect_error("root 5 outside the group", comm.broadcast, comm, d.ptr, n, "f32", 5)
    expect_error("peer %-1 outside", comm.send, comm, d.ptr, n, "f32", -1)
    expect_error("expected " .. world .. " per%-rank counts", comm.all_gatherv, comm, d.ptr, d.ptr,
                 { 1 }, "f32")
    if world > 1 then
      expect_error("do not split equally", comm.all_to_all, comm, d.ptr, d.ptr, world * 3 + 1, "f32")
    end
    if cuda.device_count() >= 2 then
      local other = (comm.device + 1) % cuda.device_count()
      local p = cuda.alloc(n * 4, other)
      expect_error("is on cuda:" .. other, comm.all_reduce, comm, p, p, n, "f32", "sum")
      cuda.free(p)
    end
    -- nothing was enqueued: the communicator still works
    local x = on_device(ints(11000 + rank, n, "f32"))
    comm:all_reduce(x.ptr, x.ptr, n, "f32", "sum")
    comm:synchronize()
    same(x, reduce_ref(11000, n, "f32", "sum"), "after bad input")
  end)

  check("destroyed_communicator", function(comm, g)
    local cg2 = cpugroup.new(st, "gpu_nccl_2" .. sfx, ranks, rank, CHECK_MS)
    local c2 = nccl.new(cg2, { blocking = blocking })
    local d = tensor.zeros({ 8 }, "f32", "cuda")
    c2:all_reduce(d.ptr, d.ptr, 8, "f32", "sum")
    c2:synchronize()
    c2:destroy()
    c2:destroy()   -- idempotent
    expect_error("destroyed", c2.all_reduce, c2, d.ptr, d.ptr, 8, "f32", "sum")
    cg2:destroy()
    d:free()
  end)

  check("timeout_aborts", function(comm, g)
    -- rank 0 starts a collective that rank 1 never joins: a bounded wait, then
    -- the communicator is aborted and every later call on it fails clearly.
    local cg3 = cpugroup.new(st, "gpu_nccl_late" .. sfx, ranks, rank, CHECK_MS)
    local c3 = nccl.new(cg3, { blocking = blocking, timeout_ms = FAULT_MS })
    local d = tensor.zeros({ 1024 }, "f32", "cuda")
    -- one joint call first, so connections exist and the lone call below is
    -- enqueued at once and hangs in its kernel (the case the abort must end)
    c3:all_reduce(d.ptr, d.ptr, 1024, "f32", "sum")
    c3:synchronize()
    cg3:barrier()
    if rank == 0 then
      local s = cuda.stream()
      local t0 = now_s()
      expect_error("gpu_nccl_late" .. sfx .. ".*within " .. FAULT_MS .. " ms.*aborted", function()
        c3:all_reduce(d.ptr, d.ptr, 1024, "f32", "sum", s)
        c3:synchronize(s)
      end)
      want(now_s() - t0 < 30, "timeout took %.1f s", now_s() - t0)
      expect_error("aborted", c3.all_reduce, c3, d.ptr, d.ptr, 1024, "f32", "sum")
    end
    g:barrier()
    c3:abort()     -- local on every rank: no wait on the rank that never joined
    c3:destroy()
    cg3:destroy()
    d:free()
  end)

  check("lone_send_bounded", function(comm, g)
    -- rank 0 sends on a fresh communicator to a rank that is away: the
    -- connection setup (inside the NCCL call for a blocking communicator) or the
    -- kernel waits for it; the wait must end after the timeout, not when the
    -- peer comes back (rank 1 stays away until rank 0 is done, at most STALL_MS).
    local name = "gpu_nccl_lone" .. sfx
    local lg = cpugroup.new(st, name, ranks, rank, CHECK_MS)
    local c = nccl.new(lg, { blocking = blocking, timeout_ms = FAULT_MS })
    local d = tensor.zeros({ 1024 }, "f32", "cuda")
    lg:barrier()
    if rank == 0 then
      local s = cuda.stream()
      local t0 = now_s()
      local ok, err = pcall(function()
        c:send(d.ptr, 1024, "f32", 1, s)
        c:synchronize(s)
      end)
      local dt = now_s() - t0
      release(name)
      print(("lone send: %s after %.2f s"):format(ok and "success" or tostring(err), dt))
      if want(not ok, "a send to an absent peer succeeded") then
        want(tostring(err):match(name .. ".*within " .. FAULT_MS .. " ms.*aborted"),
             "unexpected error: %s", tostring(err))
        expect_error("aborted", c.send, c, d.ptr, 1024, "f32", 1, s)
      end
      want(dt < STALL_MS / 1000, "the send waited %.2f s: for the peer, not %d ms", dt, FAULT_MS)
    else
      stay_away(name)
    end
    g:barrier()
    c:abort()
    c:destroy()
    lg:destroy()
    d:free()
  end)

  check("destroy_bounded", function(comm, g)
    -- rank 1 comes to destroy late (when rank 0's destroy returned, at most
    -- STALL_MS): rank 0's destroy must not wait for it (a finalize inside NCCL
    -- is bounded by the timeout; the release is local)
    local name = "gpu_nccl_late_destroy" .. sfx
    local lg = cpugroup.new(st, name, ranks, rank, CHECK_MS)
    local c = nccl.new(lg, { blocking = blocking, timeout_ms = FAULT_MS })
    local n = 4096
    local x = on_device(ints(12000 + rank, n, "f32"))
    c:all_reduce(x.ptr, x.ptr, n, "f32", "sum")
    c:synchronize()
    same(x, reduce_ref(12000, n, "f32", "sum"), "before destroy")
    lg:barrier()
    if rank == 0 then
      local t0 = now_s()
      local ok, err = pcall(c.destroy, c)
      local dt = now_s() - t0
      release(name)
      print(("late destroy: %s after %.2f s"):format(ok and "returned" or tostring(err), dt))
      want(ok or tostring(err):match(name .. ".*within " .. FAULT_MS .. " ms"),
           "unexpected error: %s", tostring(err))
      want(dt < STALL_MS / 1000, "destroy waited %.2f s: for the peer, not %d ms", dt, FAULT_MS)
    else
      local t0 = now_s()
      stay_away(name)
      local t1 = now_s()
      local ok, err = pcall(c.destroy, c)   -- its peer is gone: either outcome, but bounded
      print(("late destroy on rank %d (away %.2f s): %s after %.2f s"):format(rank, t1 - t0,
            ok and "returned" or tostring(err), now_s() - t1))
    end
    g:barrier()
    lg:destroy()
    x:free()
  end)

end

suite("default", true, "")
suite("nb", false, "_nb")

-- ---------------------------------------------------------------- once

check_once("store_collective_refused_in_capture", function(g)
  expect_error("captur", graph.capture, function() g:barrier() end)
  g:barrier()   -- usable afterwards: the refused barrier did not count
end)

-- Rank 1 stalls before `phase` of create (init or split; the test hook
-- WEFT_NCCL_TEST_STALL of src/coll/nccl.c). Rank 0's create must fail after the
-- timeout (its phase, then the vote that waits for rank 1: 2 x timeout), not
-- when rank 1 comes back; rank 1's create fails too then.
local function late_create(g, phase, timeout_ms)
  local name = "gpu_nccl_late_" .. phase
  local stall = 3 * timeout_ms + 1000
  local lg = cpugroup.new(st, name, ranks, rank, timeout_ms)
  if rank == 1 then ffi.C.setenv("WEFT_NCCL_TEST_STALL", phase .. ":" .. stall, 1) end
  local t0 = now_s()
  local ok, err = pcall(nccl.new, lg)
  local dt = now_s() - t0
  if rank == 1 then ffi.C.unsetenv("WEFT_NCCL_TEST_STALL") end
  print(("late %s: %s after %.2f s"):format(phase, ok and "success" or tostring(err), dt))
  if ok then err:destroy() end
  lg:destroy()
  g:barrier()
  want(not ok, "create succeeded although rank 1 stalled before %s", phase)
  if rank == 0 and not ok then
    want(tostring(err):match("nccl " .. phase .. ": group '" .. name .. "'.*within " ..
                             timeout_ms .. " ms"), "unexpected error: %s", tostring(err))
    want(dt < stall / 1000, "create waited %.2f s: for the peer, not %d ms", dt, timeout_ms)
  end
end

check_once("init_timeout", function(g) late_create(g, "init", FAULT_MS) end)
-- rank 0's healthy init must fit in this timeout too, hence a longer one
check_once("split_timeout", function(g) late_create(g, "split", 2500) end)

check_once("eager_timing", function(g)
  -- prints what one eager call costs in each mode (not asserted: no timed
  -- assertions; scripts/bench --only eager measures it properly)
  local n = 512   -- 1 KiB of bf16
  local x = on_device(ints(13000 + rank, n, "bf16"))
  local y = tensor.empty({ n }, "bf16", "cuda")
  local s = cuda.stream()
  local ref = reduce_ref(13000, n, "bf16", "sum")
  for _, m in ipairs { { "default", "default" }, { "nb", "non-blocking" } } do
    local c, label, calls = comms[m[1]], m[2], 500
    expect(c, "no %s communicator (re-creating it failed)", m[1])
    for _ = 1, 20 do c:all_reduce(x.ptr, y.ptr, n, "bf16", "sum", s) end
    c:synchronize(s)
    g:barrier()
    local t0 = bench.now_ns()
    for _ = 1, calls do c:all_reduce(x.ptr, y.ptr, n, "bf16", "sum", s) end
    local t1 = bench.now_ns()
    c:synchronize(s)
    local t2 = bench.now_ns()
    print(("eager all_reduce 1 KiB, %s communicator (blocking=%s): %.1f us per call on the " ..
           "host, %.1f us per call until the GPU is done"):format(label, tostring(c.blocking),
           (t1 - t0) / calls / 1e3, (t2 - t0) / calls / 1e3))
    same(y, ref, label .. " eager result")
  end
  x:free(); y:free()
end)

-- every rank destroys: bounded and local (docs/gpu-runtime.md), so no rank
-- waits here for another; then one last meeting before the store goes away
local t_end = now_s()
for _, k in ipairs { "default", "nb" } do
  if comms[k] then
    local ok, err = pcall(comms[k].destroy, comms[k])
    if not ok then failed = failed + 1; print("FAIL teardown: " .. tostring(err)) end
  end
end
print(("teardown: both communicators destroyed in %.2f s"):format(now_s() - t_end))
local last = cpugroup.new(st, "gpu_nccl_end", ranks, rank, SYNC_MS)
last:barrier()
last:destroy()
st:close()
print(("done: %d failed"):format(failed))
io.stdout:flush()
os.exit(failed == 0 and 0 or 1)
