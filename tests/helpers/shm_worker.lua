-- One rank of tests/unit/shm_spec.lua. Environment: RANK, WORLD_SIZE, MASTER_PORT,
-- SHM_MODE = correct | mismatch | late | kill | absent | same_node | zerocopy, SHM_TIMEOUT_MS.
-- Prints "FAIL ..." lines for failed checks, "<WHAT> ok=<bool> ms=<n> msg=<text>"
-- lines for the failure scenarios, and "OK rank N checks=K" last on success.
dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")

local ffi = require("ffi")
local cpugroup = require("weft.cpugroup")
local shm = require("weft.shm")
local wffi = require("weft.internal.ffi")
local util = require("helpers.store_util")
local W = require("helpers.rank_util")

local C = wffi.C

local rank, n, port, mode, tmo = W.start("SHM", "correct", 30000)

local say = W.say
local K = W.checker(rank)
local check = K.check

local s, all = W.world_store(rank, n, port, 30000)
local g = cpugroup.new(s, "shmtest", all, rank, tmo)

---------------------------------------------------------------- data
local DT = { f32 = C.WEFT_F32, f16 = C.WEFT_F16, bf16 = C.WEFT_BF16, f64 = C.WEFT_F64,
             i32 = C.WEFT_I32, i64 = C.WEFT_I64 }
local EPS = { f32 = 2 ^ -24, f16 = 2 ^ -11, bf16 = 2 ^ -8, f64 = 2 ^ -53, i32 = 0, i64 = 0 }
local OPS = { "sum", "max", "min" }

local function buf(count, dt) -- bytes, at least 1
  return ffi.new("uint8_t[?]", math.max(1, count * tonumber(C.weft_dtype_size(DT[dt]))))
end
local function seed_of(base, r) return base * 64 + r end
local function fill(p, count, dt, seed) assert(C.weft_host_fill_random(p, count, DT[dt], seed, 0) == 0) end
local function as_f64(p, count, dt, out) assert(C.weft_host_convert(p, DT[dt], out, C.WEFT_F64, count) == 0) end

-- Reference over ranks 0..n-1 of element (offset_of(r) + i), in f64.
local function reference(dt, op, count, base, total, offset)
  local ref = ffi.new("double[?]", math.max(1, count))
  local sabs = ffi.new("double[?]", math.max(1, count))
  local tmp, tmpd = buf(total, dt), ffi.new("double[?]", math.max(1, total))
  for r = 0, n - 1 do
    fill(tmp, total, dt, seed_of(base, r))
    as_f64(tmp, total, dt, tmpd)
    for i = 0, count - 1 do
      local v = tmpd[offset + i]
      if r == 0 then ref[i] = v
      elseif op == "sum" then ref[i] = ref[i] + v
      elseif op == "max" then if v > ref[i] then ref[i] = v end
      elseif v < ref[i] then ref[i] = v end
      sabs[i] = sabs[i] + math.abs(v)
    end
  end
  return ref, sabs
end

local function compare(what, dt, op, out, count, ref, sabs)
  local got = ffi.new("double[?]", math.max(1, count))
  as_f64(out, count, dt, got)
  local acc = dt == "f64" and 2 ^ -53 or 2 ^ -24
  local bad, first, worst = 0, -1, 0
  for i = 0, count - 1 do
    local err = math.abs(got[i] - ref[i])
    local tol = op == "sum" and (sabs[i] * n * acc + math.abs(ref[i]) * EPS[dt] + 2 ^ -24) or 0
    if err > tol then
      bad = bad + 1
      if first < 0 then first = i end
      if err > worst then worst = err end
    end
  end
  check(bad == 0, "%s: %d wrong elements (first %d, worst error %g)", what, bad, first, worst)
end

local function t_all_reduce(c, dt, op, count, base, inplace)
  local inp = buf(count, dt)
  fill(inp, count, dt, seed_of(base, rank))
  local out = inplace and inp or buf(count, dt)
  local what = ("all_reduce %s %s count %d world %d%s"):format(dt, op, count, n, inplace and " in place" or "")
  local ok, err = pcall(c.all_reduce, c, inp, out, count, DT[dt], C["WEFT_" .. op:upper()])
  check(ok, "%s: %s", what, tostring(err))
  if ok then compare(what, dt, op, out, count, reference(dt, op, count, base, count, 0)) end
end

local function t_reduce_scatter(c, dt, op, cout, base)
  local total = cout * n
  local inp, out = buf(total, dt), buf(cout, dt)
  fill(inp, total, dt, seed_of(base, rank))
  local what = ("reduce_scatter %s %s count_out %d world %d"):format(dt, op, cout, n)
  local ok, err = pcall(c.reduce_scatter, c, inp, out, cout, dt, op) -- names work too
  check(ok, "%s: %s", what, tostring(err))
  if ok then compare(what, dt, op, out, cout, reference(dt, op, cout, base, total, rank * cout)) end
end

local function byte_at(r, i, base) return (r * 131 + i * 7 + base) % 251 end

local function t_all_gather(c, bytes, base)
  local inp, out = ffi.new("uint8_t[?]", bytes + 1), ffi.new("uint8_t[?]", bytes * n + 1)
  for i = 0, bytes - 1 do inp[i] = byte_at(rank, i, base) end
  local ok, err = pcall(c.all_gather, c, inp, out, bytes)
  check(ok, "all_gather %d bytes: %s", bytes, tostring(err))
  local bad = 0
  for r = 0, n - 1 do
    for i = 0, bytes - 1 do if out[r * bytes + i] ~= byte_at(r, i, base) then bad = bad + 1 end end
  end
  check(bad == 0, "all_gather %d bytes world %d: %d wrong bytes", bytes, n, bad)
end

local function t_broadcast(c, bytes, from, base)
  local p = ffi.new("uint8_t[?]", bytes + 1)
  for i = 0, bytes - 1 do p[i] = rank == from and byte_at(from, i, base) or 0 end
  local ok, err = pcall(c.broadcast, c, p, bytes, from)
  check(ok, "broadcast %d bytes: %s", bytes, tostring(err))
  local bad = 0
  for i = 0, bytes - 1 do if p[i] ~= byte_at(from, i, base) then bad = bad + 1 end end
  check(bad == 0, "broadcast %d bytes root %d world %d: %d wrong bytes", bytes, from, n, bad)
end

---------------------------------------------------------------- modes
local function correct()
  local c = shm.new(g, 64 * 1024) -- small slots: the larger sizes take many chunks
  local base = 1
  for _, dt in ipairs { "f32", "f16", "bf16", "f64", "i32", "i64" } do
    for _, op in ipairs(OPS) do
      for k, count in ipairs { 1, 3, 1000, 4099 } do
        t_all_reduce(c, dt, op, count, base, k % 2 == 0); base = base + 1
      end
      t_reduce_scatter(c, dt, op, 777, base); base = base + 1
    end
    t_all_reduce(c, dt, "sum", 70001, base, false); base = base + 1
  end
  t_all_reduce(c, "f32", "sum", 1536 * 1024 + 1, base, true); base = base + 1  -- 6 MiB
  t_all_reduce(c, "bf16", "sum", 2 * 1048576 + 3, base, false); base = base + 1
  t_reduce_scatter(c, "f32", "sum", 300001, base); base = base + 1
  for k, bytes in ipairs { 0, 1, 4097, 300001 } do
    t_all_gather(c, bytes, base); base = base + 1
    t_broadcast(c, bytes, (k - 1) % n, base); base = base + 1
  end
  c:destroy()
  c:destroy() -- idempotent
  local ok, err = pcall(c.all_reduce, c, nil, nil, 0, "f32", "sum")
  check(not ok and tostring(err):find("destroyed", 1, true), "use after destroy: %s", tostring(err))
end

-- Shared host memory (weft_host_alloc: the arena from 64 KiB on), freed by the GC.
local function abuf(count, dt)
  local p = C.weft_host_alloc(math.max(1, count * tonumber(C.weft_dtype_size(DT[dt]))))
  assert(p ~= nil, "weft_host_alloc failed")
  return ffi.gc(ffi.cast("uint8_t *", p), C.weft_host_free)
end

pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite);")
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

-- all_reduce through shared buffers: every rank's buffers in its arena take the
-- zero-copy path (src/host/shm_zc.c) from zero_copy_min bytes on, bit-identical to
-- the segment path; one rank with heap buffers sends everyone through the segment.
local function zerocopy()
  local c = shm.new(g)
  local info = c:info()
  local zc = n > 1
  check(info.zero_copy == zc, "zero_copy is %s with %d ranks", tostring(info.zero_copy), n)
  check(info.zero_copy_min == 65536, "zero_copy_min %s", tostring(info.zero_copy_min))
  local want_zc, want_seg, base = 0, 0, 5000
  local function case(comm, dt, op, count, inplace, heap)
    local mk = heap and buf or abuf
    local inp = mk(count, dt)
    fill(inp, count, dt, seed_of(base, rank))
    local out = inplace and inp or mk(count, dt)
    local what = ("zero-copy all_reduce %s %s count %d world %d%s%s"):format(dt, op, count, n,
      inplace and " in place" or "", heap and " (heap buffers on the last rank)" or "")
    local ok, err = pcall(comm.all_reduce, comm, inp, out, count, DT[dt], C["WEFT_" .. op:upper()])
    check(ok, "%s: %s", what, tostring(err))
    if ok then compare(what, dt, op, out, count, reference(dt, op, count, base, count, 0)) end
    base = base + 1
    return out
  end
  local function expect(comm, what)
    local i = comm:info()
    check(i.zero_copy_calls == want_zc and i.segment_calls == want_seg,
          "%s: %d zero-copy / %d segment calls, want %d / %d", what, i.zero_copy_calls,
          i.segment_calls, want_zc, want_seg)
  end
  -- at and just below the threshold (f32: 16384 elements = 64 KiB)
  case(c, "f32", "sum", 16384, true)
  if zc then want_zc = want_zc + 1 else want_seg = want_seg + 1 end
  case(c, "f32", "sum", 16383, false)
  want_seg = want_seg + 1
  expect(c, "threshold")
  -- every dtype, in place and not, odd counts (shares end mid cache line)
  local k = 0
  for _, t in ipairs { { "f32", "sum" }, { "f16", "max" }, { "bf16", "sum" }, { "f64", "min" },
                       { "i32", "sum" }, { "i64", "max" } } do
    k = k + 1
    case(c, t[1], t[2], 150001, k % 2 == 0)
    if zc then want_zc = want_zc + 1 else want_seg = want_seg + 1 end
  end
  expect(c, "dtypes")
  -- one rank's buffers on the heap: everybody takes the segment path
  case(c, "bf16", "sum", 200003, true, rank == n - 1)
  want_seg = want_seg + 1
  expect(c, "mixed")
  -- bit-identical to the segment path: the same data through heap buffers
  local count = 131075
  local seg_base = base
  local zc_out = case(c, "f32", "sum", count, false)
  if zc then want_zc = want_zc + 1 else want_seg = want_seg + 1 end
  base = seg_base
  local seg_out = case(c, "f32", "sum", count, false, true)
  want_seg = want_seg + 1
  check(C.memcmp(zc_out, seg_out, count * 4) == 0, "zero-copy and segment results differ (f32 sum, %d)", count)
  expect(c, "identical")
  -- all_gather, reduce_scatter, broadcast straight from the owners' buffers
  local bytes = 150001
  local agin = abuf(bytes, "f32")
  local agout = abuf(bytes * n / 4 + n, "f32") -- n * bytes bytes at least
  local ap = ffi.cast("uint8_t *", agin)
  for i = 0, bytes - 1 do ap[i] = byte_at(rank, i, 77) end
  c:all_gather(agin, agout, bytes)
  local op8 = ffi.cast("uint8_t *", agout)
  local bad = 0
  for r = 0, n - 1 do
    for i = 0, bytes - 1 do if op8[r * bytes + i] ~= byte_at(r, i, 77) then bad = bad + 1 end end
  end
  check(bad == 0, "zero-copy all_gather %d bytes world %d: %d wrong bytes", bytes, n, bad)
  if zc and bytes * n >= 65536 then want_zc = want_zc + 1 else want_seg = want_seg + 1 end
  -- in place: my piece already sits at out + rank * bytes
  for i = 0, bytes - 1 do op8[rank * bytes + i] = byte_at(rank, i, 78) end
  c:all_gather(op8 + rank * bytes, op8, bytes)
  bad = 0
  for r = 0, n - 1 do
    for i = 0, bytes - 1 do if op8[r * bytes + i] ~= byte_at(r, i, 78) then bad = bad + 1 end end
  end
  check(bad == 0, "zero-copy all_gather in place world %d: %d wrong bytes", n, bad)
  if zc and bytes * n >= 65536 then want_zc = want_zc + 1 else want_seg = want_seg + 1 end
  for _, t in ipairs { { "f32", "sum" }, { "bf16", "max" } } do
    local cout = 70001
    local total = cout * n
    local inp, out = abuf(total, t[1]), abuf(cout, t[1])
    fill(inp, total, t[1], seed_of(base, rank))
    c:reduce_scatter(inp, out, cout, t[1], t[2])
    compare(("zero-copy reduce_scatter %s %s world %d"):format(t[1], t[2], n), t[1], t[2], out, cout,
            reference(t[1], t[2], cout, base, total, rank * cout))
    base = base + 1
    if zc and total * tonumber(C.weft_dtype_size(DT[t[1]])) >= 65536 then want_zc = want_zc + 1 else want_seg = want_seg + 1 end
  end
  for _, from in ipairs { 0, n - 1 } do
    local bb = 300001
    -- the root's buffer is shared; the others' may be anything (here: heap on odd ranks)
    local p = (rank == from or rank % 2 == 0) and ffi.cast("uint8_t *", abuf(bb, "f32")) or ffi.new("uint8_t[?]", bb)
    for i = 0, bb - 1 do p[i] = rank == from and byte_at(from, i, 79) or 0 end
    c:broadcast(p, bb, from)
    bad = 0
    for i = 0, bb - 1 do if p[i] ~= byte_at(from, i, 79) then bad = bad + 1 end end
    check(bad == 0, "zero-copy broadcast root %d world %d: %d wrong bytes", from, n, bad)
    want_zc = want_zc + (zc and 1 or 0); want_seg = want_seg + (zc and 0 or 1)
  end
  -- a root with a heap buffer: the segment path
  local hb = ffi.new("uint8_t[?]", 300001)
  for i = 0, 300000 do hb[i] = rank == 0 and byte_at(0, i, 80) or 0 end
  c:broadcast(hb, 300001, 0)
  bad = 0
  for i = 0, 300000 do if hb[i] ~= byte_at(0, i, 80) then bad = bad + 1 end end
  check(bad == 0, "broadcast from a heap buffer world %d: %d wrong bytes", n, bad)
  want_seg = want_seg + 1
  expect(c, "other collectives")
  c:destroy()
  -- many rounds (64 KiB of the message each) on a second communicator
  ffi.C.setenv("WEFT_SHM_ZEROCOPY_ROUND", "65536", 1)
  local c2 = shm.new(g)
  ffi.C.setenv("WEFT_SHM_ZEROCOPY_ROUND", "0", 1)
  want_zc, want_seg = 0, 0
  case(c2, "f32", "sum", 300007, true)
  case(c2, "bf16", "min", 300007, false)
  if zc then want_zc = want_zc + 2 else want_seg = want_seg + 2 end
  expect(c2, "rounds")
  c2:destroy()
end

local function expect_error(what, f, needle)
  local ok, err = pcall(f)
  err = tostring(err)
  check(not ok and err:find(needle, 1, true) ~= nil, "%s: want an error with %q, got %s", what, needle,
        ok and "success" or err)
end

local function mismatch()
  local last = rank == n - 1
  -- different bytes_per_rank at creation: every rank fails, the group stays usable
  expect_error("create with different sizes", function() shm.new(g, last and 8192 or 4096) end,
               "disagree on bytes_per_rank")
  local c = shm.new(g, 4096)
  local x = ffi.new("float[?]", 4096)
  expect_error("count mismatch", function() c:all_reduce(x, x, last and 17 or 16, "f32", "sum") end,
               "different collectives or sizes")
  expect_error("two-shot count mismatch", function() c:all_reduce(x, x, last and 4096 or 4000, "f32", "sum") end,
               "count=4096")
  expect_error("dtype mismatch", function() c:all_reduce(x, x, 16, last and "i32" or "f32", "sum") end,
               "i32 sum")
  expect_error("kind mismatch", function()
    if last then c:broadcast(x, 64, 0) else c:all_gather(x, ffi.new("uint8_t[?]", 64 * n), 64) end
  end, "broadcast bytes=64 root=0")
  expect_error("unknown dtype name", function() c:all_reduce(x, x, 1, "f8", "sum") end, "unknown dtype")
  -- still consistent afterwards
  t_all_reduce(c, "f32", "sum", 5000, 900, false)
  t_all_reduce(c, "bf16", "max", 100, 901, true)
  c:destroy()
end

local function timed(what, f)
  local t0 = util.now_ms()
  local ok, err = pcall(f)
  W.report(what, ok, t0, err)
end

local function late()
  local c = shm.new(g, 4096)
  local x = ffi.new("float[?]", 64)
  if rank == n - 1 then
    util.sleep_ms(tmo + 1000)
    timed("LATE_SELF", function() c:all_reduce(x, x, 64, "f32", "sum") end)
  else
    timed("LATE", function() c:all_reduce(x, x, 64, "f32", "sum") end)
  end
  c:destroy()
end

-- SHM_KILL_ZC=1: the calls are zero-copy (1 MiB of shared memory): the dead
-- rank's arena stays mapped in the survivors, who fail at the next barrier
local function kill()
  local c = shm.new(g, 4096)
  local zc = os.getenv("SHM_KILL_ZC") == "1"
  local count = zc and 262144 or 64
  local x = zc and abuf(count, "f32") or ffi.new("float[?]", count)
  c:all_reduce(x, x, count, "f32", "sum")
  check(not zc or c:info().zero_copy_calls == 1, "the first call was not zero-copy")
  if rank == n - 1 then W.kill_self() end
  timed("KILLED", function() c:all_reduce(x, x, count, "f32", "sum") end)
  c:destroy()
end

-- the last rank never creates its communicator: the others fail within the
-- group's timeout and the creator still removes the segment's name
local function absent()
  if rank == n - 1 then
    say("ABSENT")
    return
  end
  timed("ABSENT_CREATE", function() shm.new(g, 4096) end)
  -- rank 0 hosts the store: keep it up until every survivor has its answer
  local rest = {}
  for r = 0, n - 2 do rest[r + 1] = r end
  local sg = cpugroup.new(s, "survivors", rest, rank, 30000)
  sg:barrier()
  sg:destroy()
end

local function same_node()
  for from = 0, n - 1 do
    local flags = shm.same_node(g, from)
    check(#flags == n, "same_node: %d flags for %d ranks", #flags, n)
    for i = 1, n do check(flags[i] == true, "same_node root %d: index %d says %s", from, i - 1, tostring(flags[i])) end
  end
end

local modes = { correct = correct, mismatch = mismatch, late = late, kill = kill, same_node = same_node,
                absent = absent, zerocopy = zerocopy }
local ok, err = pcall(assert(modes[mode], "unknown SHM_MODE"))
check(ok, "%s: %s", mode, tostring(err))
if mode ~= "late" and mode ~= "kill" and mode ~= "absent" then g:barrier() end
g:destroy()
s:close()
K.ok_line()
K.exit()
