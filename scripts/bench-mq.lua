#!/usr/bin/env luajit
-- bench-mq.lua — object broadcast from group index 0 to the other ranks of a
-- node: the message-queue broadcaster (weft.mq, shared-memory ring) against
-- the store path (weft.cpugroup broadcast through rank 0's TCP store), both
-- with weft.serialize, same objects, same method, one run.
--
--   luajit scripts/bench-mq.lua [--worlds 2,4,8] [--sizes 64,1024,65536,1048576]
--        [--iters 200] [--stream 1000] [--reps 3] [--machine NAME] [--out bench/results]
--        [--chunk-bytes 1048576] [--chunks 8] [--quick]
--
-- Objects: { seq = i, t = <send time>, data = <bytes> } sized so that the
-- serialized object is exactly the nominal size. Two measurements per size
-- and backend:
--  latency: rank 0 stamps the object with CLOCK_MONOTONIC (one clock for all
--    processes of the host) just before broadcast_object; each reader takes
--    the time once it holds the decoded object. A round ends when the last
--    reader has it: per round the slowest reader counts; median and p99 over
--    rounds are reported. Rounds are paced (a barrier, then 0.5 ms idle) so
--    readers are parked waiting, as in serving, and queueing never counts.
--  stream: `stream` objects back to back; messages per second = count / the
--    slowest rank's time from a common barrier to its last object; `reps`
--    passes, the best counts.
-- The backends' rounds and passes are interleaved, so a busy host's noise
-- falls on both alike. Also measured: broadcast_bytes, the same without
-- serialization (the transport alone).
-- Writes bench/results/mq-broadcast-<machine>-<date>.json (results format, docs/architecture.md#conventions-in-one-place:
-- op "broadcast_object", backend "mq" | "store") and a .md table beside it.
--
-- Under weft-run (RANK set, --worker) this file is the worker; otherwise the driver.
local ffi = require("ffi")
local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local bench = require("weft.tools.bench")

local function help(o) o.help = true end
local opts = bench.parse_args(arg or {}, {
  worlds = "2,4,8", sizes = "64,1024,65536,1048576", iters = 200, stream = 1000, reps = 3,
  out = "bench/results", chunk_bytes = 1048576, chunks = 8, pace_us = 500,
}, {
  ["--worker"] = "worker",
  ["--quick"] = function(o) o.iters, o.stream, o.reps = 30, 100, 1 end,
  ["-h"] = help, ["--help"] = help,
}, "bench-mq")
if opts.help then
  local f = assert(io.open(arg[0]))
  f:read("*l")
  for l in f:lines() do
    if not l:match("^%-%-") then break end
    io.stdout:write(l:gsub("^%-%- ?", ""), "\n")
  end
  f:close()
  os.exit(0)
end

local function list_of(s)
  local t = {}
  for v in tostring(s):gmatch("%d+") do t[#t + 1] = tonumber(v) end
  return t
end

-- Fewer rounds for big objects: keep each point to a few seconds on a busy host.
local function rounds(base, bytes)
  local n = base
  if bytes >= 1048576 then n = math.floor(base / 4) elseif bytes >= 65536 then n = math.floor(base / 2) end
  return math.max(n, 10)
end

---------------------------------------------------------------- worker
local function worker()
  local store = require("weft.store")
  local cpugroup = require("weft.cpugroup")
  local mq = require("weft.mq")
  local serialize = require("weft.serialize")
  local now_ns, encode, decode = bench.now_ns, serialize.encode, serialize.decode

  local rank = assert(tonumber(os.getenv("RANK")))
  local W = assert(tonumber(os.getenv("WORLD_SIZE")))
  local s = store.open { host = os.getenv("MASTER_ADDR") or "127.0.0.1",
                         port = assert(tonumber(os.getenv("MASTER_PORT"))),
                         server = rank == 0, timeout_ms = 60000 }
  local ranks = {}
  for r = 0, W - 1 do ranks[r + 1] = r end
  local g = cpugroup.new(s, "bench-mq", ranks, rank, 60000)
  local q = mq.new(g, { writer = 0, chunk_bytes = opts.chunk_bytes, chunks = opts.chunks })
  local writer = rank == 0

  local ts = ffi.new("struct { long s; long ns; }")
  if not pcall(ffi.typeof, "mqb_marker") then
    ffi.cdef [[ typedef struct { int unused; } mqb_marker;
                int mqb_nanosleep(const void *req, void *rem) __asm__("nanosleep"); ]]
  end
  local function pause_us(us)
    ts.s, ts.ns = 0, us * 1000
    ffi.C.mqb_nanosleep(ts, nil)
  end

  -- an object whose encoding is exactly `bytes` long (t is never integral,
  -- so it always encodes as an 8-byte double)
  local function make_obj(bytes)
    local obj = { seq = 0, t = 0.5, data = "" }
    local base = #encode(obj)
    local len = bytes - base
    for _ = 1, 4 do                       -- the varint of #data grows with it
      obj.data = ("x"):rep(math.max(len, 0))
      local got = #encode(obj)
      if got == bytes then break end
      len = len + (bytes - got)
    end
    return obj, #encode(obj)
  end

  -- Each case: send(obj) on the writer, recv() -> { seq =, t =, n = payload bytes } on readers.
  -- Objects go through weft.serialize; raw bytes skip it (a preallocated
  -- buffer, seq and t in its first 16 bytes; mq readers use the zero-copy
  -- view, store readers the C reply buffer), which shows the transport alone.
  local raw, raw_n = nil, 0
  local hdr = ffi.typeof("const double *")
  local box = { seq = 0, t = 0, n = 0 }
  local function fill_raw(obj, n)
    if raw_n < n then raw = ffi.new("uint8_t[?]", n); raw_n = n end
    local d = ffi.cast("double *", raw)
    d[0], d[1] = obj.seq, obj.t
    return raw
  end
  local function read_raw(p, n)
    local d = ffi.cast(hdr, p)
    box.seq, box.t, box.n = d[0], d[1], tonumber(n)
    return box
  end
  local C = require("weft.internal.ffi").C
  local optr, olen = ffi.new("const void *[1]"), ffi.new("size_t[1]")
  local cases = {
    { op = "broadcast_object", backend = "mq",
      send = function(obj) return q:broadcast_object(obj) end,
      recv = function() local o = q:broadcast_object(); o.n = #o.data; return o end },
    { op = "broadcast_object", backend = "store",
      send = function(obj) g:broadcast(encode(obj), 0); return obj end,
      recv = function() local o = decode(g:broadcast(nil, 0)); o.n = #o.data; return o end },
    { op = "broadcast_bytes", backend = "mq",
      send = function(obj, n) q:send_bytes(fill_raw(obj, n), n) end,
      recv = function() return read_raw(q:recv_view()) end },
    { op = "broadcast_bytes", backend = "store",
      send = function(obj, n)
        assert(C.weft_cpugroup_broadcast(g.handle, 0, fill_raw(obj, n), n, optr, olen) == 0)
      end,
      recv = function()
        assert(C.weft_cpugroup_broadcast(g.handle, 0, nil, 0, optr, olen) == 0)
        return read_raw(optr[0], olen[0])
      end },
  }

  local f64s = ffi.typeof("double[?]")
  for _, bytes in ipairs(list_of(opts.sizes)) do
    local obj, real = make_obj(bytes)
    local nlat, nstream = rounds(opts.iters, bytes), rounds(opts.stream, bytes)
    -- warm-up (traces compiled, pages touched) and a check that what
    -- arrives is what was sent
    for _, case in ipairs(cases) do
      local want = case.op == "broadcast_object" and #obj.data or real
      for i = 1, 10 do
        g:barrier()
        if writer then obj.seq = -i; case.send(obj, real)
        else
          local got = case.recv()
          assert(got.seq == -i and got.n == want, "bench-mq: wrong message received")
        end
      end
    end
    -- latency: paced rounds, the cases interleaved so that a busy host's
    -- noise falls on all of them alike
    for _, case in ipairs(cases) do case.lat = f64s(nlat) end
    for i = 0, nlat - 1 do
      for _, case in ipairs(cases) do
        g:barrier()
        if writer then
          pause_us(opts.pace_us)
          obj.seq = i
          local t = now_ns() * 1e-3
          if t == math.floor(t) then t = t + 0.25 end
          obj.t = t
          case.send(obj, real)
        else
          local got = case.recv()
          case.lat[i] = now_ns() * 1e-3 - got.t
          if got.seq ~= i then
            error(("bench-mq: %s %s: round %d got message %s"):format(case.op, case.backend, i, tostring(got.seq)))
          end
        end
      end
    end
    -- stream: `reps` passes per case, interleaved; the best pass counts
    for _, case in ipairs(cases) do case.best = math.huge end
    for _ = 1, opts.reps do
      for _, case in ipairs(cases) do
        g:barrier()
        local t0 = now_ns()
        if writer then
          for i = 1, nstream do obj.seq = i; case.send(obj, real) end
        else
          for i = 1, nstream do
            local got = case.recv()
            if got.seq ~= i then
              error(("bench-mq: %s %s: stream message %d is %s"):format(case.op, case.backend, i, tostring(got.seq)))
            end
          end
        end
        local el = g:allreduce_i64({ math.floor(now_ns() - t0) }, "max")[1]
        if el < case.best then case.best = el end
      end
    end
    for _, case in ipairs(cases) do
      local all = g:allgather(ffi.string(case.lat, nlat * 8))
      if writer then
        local per = {}
        for i = 0, nlat - 1 do
          local m = 0
          for r = 2, W do
            local v = ffi.cast("const double *", all[r])[i]
            if v > m then m = v end
          end
          per[#per + 1] = m
        end
        table.sort(per)
        local med = bench.median(per)
        local p99 = per[math.max(1, math.ceil(#per * 0.99))]
        print(("REC op=%s backend=%s world=%d bytes=%d iters=%d us=%.3f p99_us=%.3f min_us=%.3f msgs_per_s=%.1f stream=%d")
              :format(case.op, case.backend, W, real, nlat, med, p99, per[1], nstream / (case.best * 1e-9), nstream))
        io.stdout:flush()
      end
    end
  end
  g:barrier()
  q:destroy()
  g:destroy()
  s:close()
  os.exit(0)
end

if os.getenv("RANK") and opts.worker then return worker() end

---------------------------------------------------------------- driver

local sh = bench.sh

local function machine_name()
  if opts.machine then return opts.machine end
  local env = os.getenv("WEFT_MACHINE")
  if env and env ~= "" then return env end
  local nproc = tonumber((sh("nproc"))) or 0
  local f = io.open("/proc/cpuinfo")
  local model = f and f:read("*a"):match("model name%s*:%s*([^\n]+)") or "cpu"
  if f then f:close() end
  model = model:gsub("%(R%)", ""):gsub("%(TM%)", ""):gsub("[Pp]rocessor", ""):gsub("CPU", "")
               :gsub("@.*$", ""):lower():gsub("[^%w]+", "-"):gsub("^-+", ""):gsub("-+$", "")
  return ("%s-%dcpu"):format(model ~= "" and model or "cpu", nproc)
end

local function driver()
  local machine = machine_name()
  local doc = { machine = machine, date = os.date("%Y-%m-%d"), commit = bench.commit(), records = {} }
  local f = io.open("/proc/loadavg")
  local load = f and f:read("*l"):match("^(%S+)") or "?"
  if f then f:close() end
  local nproc = (sh("nproc"):gsub("%s+$", ""))
  local by = {}
  local args = ("--sizes %s --iters %d --stream %d --reps %d --chunk-bytes %d --chunks %d --pace-us %d")
               :format(table.concat(list_of(opts.sizes), ","), opts.iters, opts.stream, opts.reps,
                       opts.chunk_bytes, opts.chunks, opts.pace_us)
  local failed = false
  for _, W in ipairs(list_of(opts.worlds)) do
    io.stderr:write(("bench-mq: %d ranks ...\n"):format(W))
    local out, ok = sh(("%s/scripts/weft-run -n %d --timeout 1800 %s/scripts/bench-mq.lua --worker %s")
                       :format(root, W, root, args))
    local n = 0
    for body in out:gmatch("REC ([^\n]+)") do
      local r = {}
      for k, v in body:gmatch("([%w_]+)=(%S+)") do r[k] = tonumber(v) or v end
      local rec = { op = r.op, backend = r.backend, world = r.world, bytes = r.bytes,
                    us = r.us, p99_us = r.p99_us, min_us = r.min_us, msgs_per_s = r.msgs_per_s,
                    iters = r.iters, stream = r.stream }
      if r.backend == "mq" then rec.chunk_bytes, rec.chunks = opts.chunk_bytes, opts.chunks end
      doc.records[#doc.records + 1] = rec
      local key = r.op .. " " .. W
      by[key] = by[key] or {}
      by[key][r.bytes] = by[key][r.bytes] or {}
      by[key][r.bytes][r.backend] = rec
      n = n + 1
    end
    if not ok or n == 0 then
      failed = true
      io.stderr:write(("bench-mq: %d ranks failed:\n%s\n"):format(W, out))
    end
  end
  local function f(v, d) return v and ("%." .. (d or 1) .. "f"):format(v) or "" end
  local function section(op)
    local rows = {}
    for _, W in ipairs(list_of(opts.worlds)) do
      local t = by[op .. " " .. W] or {}
      local sizes = {}
      for b in pairs(t) do sizes[#sizes + 1] = b end
      table.sort(sizes)
      for _, b in ipairs(sizes) do
        local m, s = t[b].mq, t[b].store
        rows[#rows + 1] = {
          tostring(W), bench.human_bytes(b),
          f(m and m.us), f(m and m.p99_us), f(s and s.us), f(s and s.p99_us),
          (m and s) and ("%.1fx"):format(s.us / m.us) or "",
          f(m and m.msgs_per_s, 0), f(s and s.msgs_per_s, 0),
          (m and s) and ("%.1fx"):format(m.msgs_per_s / s.msgs_per_s) or "",
        }
      end
    end
    return bench.table({ "ranks", "size", "mq µs", "mq p99", "store µs", "store p99", "latency gain",
                         "mq msg/s", "store msg/s", "rate gain" }, rows)
  end
  local md = ("# broadcast_object: message queue (shm ring) vs store\n\n"
    .. "Machine `%s`, %s, commit %s. Rank 0 broadcasts to the other ranks of the node. "
    .. "Latency: paced rounds (barrier, 0.5 ms idle, one message), time from the writer's "
    .. "stamp to the slowest reader holding the message, median and p99 in µs. Stream: "
    .. "messages back to back, messages per second until the slowest rank has them all. "
    .. "mq ring: %d chunks of %s. Host: %s CPUs, load average %s at the start (other "
    .. "work on a small host shows up as noise, mostly in p99).\n\n"
    .. "## broadcast_object (weft.serialize on both sides; size = serialized object)\n\n%s\n"
    .. "## broadcast_bytes (transport only: preallocated bytes, no serialization)\n\n%s")
    :format(machine, doc.date, doc.commit, opts.chunks, bench.human_bytes(opts.chunk_bytes), nproc, load,
            section("broadcast_object"), section("broadcast_bytes"))
  local jp, mp, sp = bench.write(opts.out, "mq-broadcast", doc, md)
  io.stdout:write(md, "\n", jp, "\n", mp, "\n", sp and (sp .. "\n") or "")
  os.exit(failed and 1 or 0)
end

driver()
