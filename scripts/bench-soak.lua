#!/usr/bin/env luajit
-- bench-soak.lua — the soak of issue 13: many host all-reduces on 4 ranks,
-- every result checked exactly, memory and descriptors watched.
--
--   luajit scripts/bench-soak.lua [--ranks 4] [--small 200000] [--big 2000]
--        [--small-bytes 1024] [--big-bytes 4194304] [--samples 20]
--        [--machine NAME] [--out bench/results] [--quick] [-q]
--   --quick: 20000 small + 200 big (a try-out; writes soak-quick-...)
--   -q: no progress (otherwise on stderr, from rank 0's samples: the phase,
--       its calls so far, the time left; one line rewritten on a terminal,
--       a line per step and per 10 % when piped)
--
-- Each rank runs two phases on the world group (shm backend, i32 sum, in
-- place): `small` calls on one reused tensor, then `big` calls each on a
-- freshly allocated tensor that is freed after its check (the allocator and
-- the zero-copy arena are soaked too). Rank r contributes base(i, call) + r,
-- so every element of every result must equal W * base + W(W-1)/2: a stale
-- slot, a mixed-up rank or a torn copy shows as a wrong integer. RSS
-- (/proc/self/statm) and open descriptors (/proc/self/fd) are sampled
-- `--samples` times per phase; growth is measured from the first sample
-- (taken after 5 % of the calls, once caches and arenas are warm) to the
-- last. Writes bench/results/soak-<machine>-<date>.json (results format: docs/architecture.md#conventions-in-one-place) and
-- .md. Under weft-run (RANK set) this file is the rank.
local ffi = require("ffi")
local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local bench = require("weft.tools.bench")

local opts = bench.parse_args(arg or {}, {
  ranks = 4, small = 200000, big = 2000, small_bytes = 1024, big_bytes = 4 * 1048576, samples = 20,
  out = "bench/results",
}, { ["--quick"] = "quick", ["-q"] = "quiet", ["--quiet"] = "quiet" }, "bench-soak",
   " (see the header of scripts/bench-soak.lua)")
if opts.quick then opts.small, opts.big = math.min(opts.small, 20000), math.min(opts.big, 200) end

---------------------------------------------------------------- rank
pcall(ffi.cdef, "long sysconf(int name);")
if not pcall(ffi.typeof, "weft_soak_dirent") then
  ffi.cdef [[
  typedef struct { uint64_t d_ino; int64_t d_off; unsigned short d_reclen; unsigned char d_type;
                   char d_name[256]; } weft_soak_dirent;
  ]]
end
pcall(ffi.cdef, "void *opendir(const char *name);")
pcall(ffi.cdef, "int closedir(void *dir);")
pcall(ffi.cdef, "weft_soak_dirent *weft_soak_readdir(void *dir) __asm__(\"readdir\");")

local PAGE = tonumber(ffi.C.sysconf(30))   -- _SC_PAGESIZE

local function rss_kb()
  local f = io.open("/proc/self/statm")
  local s = f:read("*l")
  f:close()
  return tonumber(s:match("^%d+%s+(%d+)")) * PAGE / 1024
end

local function open_fds()
  local d = ffi.C.opendir("/proc/self/fd")
  local n = 0
  while ffi.C.weft_soak_readdir(d) ~= nil do n = n + 1 end
  ffi.C.closedir(d)
  return n - 3   -- ".", ".." and the directory's own descriptor
end

local function rank_main()
  local weft = require("weft")
  local T = weft.tensor
  local now_us = weft.now_us or function() return require("weft.internal.clock").now_ms() * 1000 end
  local world = weft.init()
  local W, r = world.world_size, world.rank
  local offset = W * (W - 1) / 2
  local bad = 0
  local first_bad

  -- base(i, call) in [-1000, 1000]; rank r adds r
  local function fill(p, n, call)
    local c = (call * 7) % 2001
    for i = 0, n - 1 do p[i] = (i * 31 + c) % 2001 - 1000 + r end
  end
  local function check(p, n, call, phase)
    local c = (call * 7) % 2001
    local errs = 0
    for i = 0, n - 1 do
      if p[i] ~= W * ((i * 31 + c) % 2001 - 1000) + offset then errs = errs + 1 end
    end
    if errs > 0 then
      bad = bad + errs
      first_bad = first_bad or ("%s call %d: %d wrong elements"):format(phase, call, errs)
    end
  end

  local function phase(name, calls, bytes, fresh)
    local n = math.floor(bytes / 4)
    local times = ffi.new("double[?]", calls)   -- preallocated: no growth while sampling
    local every = math.max(1, math.floor(calls / opts.samples))
    local warm = math.max(1, math.floor(calls * 0.05))
    local keep = not fresh and T.empty({ n }, "i32") or nil
    local keep_p = keep and ffi.cast("int32_t *", keep.ptr)   -- no garbage of ours per call
    for call = 1, calls do
      local t = keep or T.empty({ n }, "i32")
      local p = keep_p or ffi.cast("int32_t *", t.ptr)
      fill(p, n, call)
      local t0 = now_us()
      world:all_reduce(t)
      times[call - 1] = now_us() - t0
      check(p, n, call, name)
      if fresh then t:free() end
      if call == warm or (call > warm and (call - warm) % every == 0) or call == calls then
        io.write(("SAMPLE phase=%s call=%d rss_kb=%d fds=%d\n"):format(name, call, rss_kb(), open_fds()))
        io.flush()   -- the driver's progress follows rank 0's samples
      end
    end
    if keep then keep:free() end
    local t = {}
    for i = 0, calls - 1 do t[i + 1] = times[i] end
    table.sort(t)
    io.write(("PHASE phase=%s calls=%d bytes=%d median_us=%.2f p99_us=%.2f\n")
      :format(name, calls, n * 4, t[math.floor(calls / 2) + 1], t[math.floor(calls * 0.99) + 1]))
    io.flush()
  end

  world:barrier()
  local t0 = now_us()
  phase("small", opts.small, opts.small_bytes, false)
  phase("big", opts.big, opts.big_bytes, true)
  io.write(("DONE wrong=%d seconds=%.1f first=%s\n"):format(bad, (now_us() - t0) / 1e6, first_bad or "-"))
  world:barrier()
  weft.shutdown()
  if bad > 0 then os.exit(1) end
end

---------------------------------------------------------------- driver

local function driver()
  local machine, nproc = bench.cpu_machine(opts.machine)
  local args = { "--small", opts.small, "--big", opts.big, "--small-bytes", opts.small_bytes,
                 "--big-bytes", opts.big_bytes, "--samples", opts.samples }
  local cmd = ("cd %s && %s/scripts/weft-run -n %d scripts/bench-soak.lua %s 2>&1; echo \"rc=$?\"")
    :format(root, root, opts.ranks, table.concat(args, " "))
  -- the phases' relative cost, a guess: a call's fixed cost about that of 16 KiB moved
  local P = require("weft.internal.progress").new { name = "bench-soak", quiet = opts.quiet,
    weights = { opts.small * (opts.small_bytes + 16384), opts.big * (opts.big_bytes + 16384) } }
  P:note(("%d ranks, %d x %d B + %d x %d B all-reduces (i32 sum, checked)")
    :format(opts.ranks, opts.small, opts.small_bytes, opts.big, opts.big_bytes))
  local t0 = os.time()
  -- rank 0's samples, as they come: the progress
  local outs, phase_now = {}, nil
  local function phase_step(ph)
    phase_now = ph
    P:step(("%s phase: %d x %s"):format(ph, ph == "small" and opts.small or opts.big,
                                        bench.human_bytes(ph == "small" and opts.small_bytes or opts.big_bytes)))
  end
  phase_step("small")
  local pipe = io.popen(cmd)
  for line in pipe:lines() do
    outs[#outs + 1] = line
    local ph, call = line:match("^%[rank0%] SAMPLE phase=(%a+) call=(%d+)")
    if ph then
      if ph ~= phase_now then phase_step(ph) end
      P:update(tonumber(call), ph == "small" and opts.small or opts.big, "calls")
    end
  end
  pipe:close()
  local out = table.concat(outs, "\n") .. "\n"
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  local per = {}   -- per[rank] = { samples = {phase = {...}}, phases = {}, done = {} }
  for line in out:gmatch("[^\n]+") do
    local rk, rest = line:match("^%[rank(%d+)%] (.*)$")
    rk = tonumber(rk)
    if rk then
      local p = per[rk] or { samples = { small = {}, big = {} }, phases = {} }
      per[rk] = p
      local ph, call, rss, fds = rest:match("^SAMPLE phase=(%a+) call=(%d+) rss_kb=(%d+) fds=(%d+)")
      if ph then
        table.insert(p.samples[ph], { call = tonumber(call), rss = tonumber(rss), fds = tonumber(fds) })
      end
      local ph2, calls, bytes, med, p99 = rest:match("^PHASE phase=(%a+) calls=(%d+) bytes=(%d+) median_us=([%d.]+) p99_us=([%d.]+)")
      if ph2 then p.phases[ph2] = { calls = tonumber(calls), bytes = tonumber(bytes), med = tonumber(med), p99 = tonumber(p99) } end
      local wrong, secs = rest:match("^DONE wrong=(%d+) seconds=([%d.]+)")
      if wrong then p.done = { wrong = tonumber(wrong), seconds = tonumber(secs) } end
    end
  end
  local complete = rc == 0
  for rk = 0, opts.ranks - 1 do
    if not (per[rk] and per[rk].done and per[rk].phases.small and per[rk].phases.big) then complete = false end
  end
  if not complete then
    P:clear()
    io.stderr:write("bench-soak: the run failed (status " .. tostring(rc) .. "):\n" .. out)
    os.exit(1)
  end

  local records, rows = {}, {}
  local flat = true
  for _, ph in ipairs { "small", "big" } do
    local meds, p99s, growth, fd_delta, wrong = {}, {}, 0, 0, 0
    local rss_first, rss_last, fds_first, fds_last = 0, 0, 0, 0
    for rk = 0, opts.ranks - 1 do
      local p = per[rk]
      local s = p.samples[ph]
      meds[#meds + 1], p99s[#p99s + 1] = p.phases[ph].med, p.phases[ph].p99
      local g = s[#s].rss - s[1].rss
      local d = s[#s].fds - s[1].fds
      -- the first rank always counts: a phase where every rank shrank
      -- still reports real figures (not 0 -> 0)
      if rk == 0 or g > growth then growth, rss_first, rss_last = g, s[1].rss, s[#s].rss end
      if math.abs(d) >= math.abs(fd_delta) then fd_delta, fds_first, fds_last = d, s[1].fds, s[#s].fds end
      wrong = wrong + p.done.wrong
    end
    -- the series, max over ranks at each sample (the same calls on every rank)
    local rss_series, fd_series = {}, {}
    for k = 1, #per[0].samples[ph] do
      local mr, mf = 0, 0
      for rk = 0, opts.ranks - 1 do
        local smp = per[rk].samples[ph][k]
        if smp then mr, mf = math.max(mr, smp.rss), math.max(mf, smp.fds) end
      end
      rss_series[k], fd_series[k] = mr, mf
    end
    local ph_flat = fd_delta == 0 and growth <= math.max(1024, rss_first * 0.01)
    flat = flat and ph_flat
    local pr = per[0].phases[ph]
    records[#records + 1] = {
      op = "all_reduce", backend = "shm", mode = "eager", dtype = "i32", world = opts.ranks,
      bytes = pr.bytes, calls = pr.calls, us = bench.median(meds), p99_us = bench.median(p99s),
      wrong_elements = wrong, rss_kb_first = rss_first, rss_kb_last = rss_last, rss_growth_kb = growth,
      fds_first = fds_first, fds_last = fds_last, fd_delta = fd_delta, flat = ph_flat,
      samples = #per[0].samples[ph], fresh_tensor_per_call = ph == "big",
      rss_kb_series = rss_series, fds_max_series = fd_series,
    }
    rows[#rows + 1] = { ph, bench.human_bytes(pr.bytes), tostring(pr.calls), ("%.1f"):format(bench.median(meds)),
                        ("%.1f"):format(bench.median(p99s)), tostring(wrong),
                        ("%d → %d (%+d)"):format(rss_first, rss_last, growth),
                        ("%d → %d"):format(fds_first, fds_last), ph_flat and "yes" or "**no**" }
  end
  local date = os.date("!%Y-%m-%d")
  local seconds = os.time() - t0
  local doc = { machine = machine, date = date, commit = bench.commit(), cpus = nproc,
                seconds = seconds, quick = opts.quick or nil, records = records }
  local name = opts.quick and "soak-quick" or "soak"
  local md = table.concat({
    ("# Soak: host all-reduce on %d ranks, every result checked (%s, %s, %d CPUs, commit %s)"):format(
      opts.ranks, machine, date, nproc, doc.commit), "",
    ("`luajit scripts/bench-soak.lua%s`: i32 sum in place on the world group (shm), rank r adds r to "
     .. "a pattern that changes every call, every element compared with the exact sum. The big "
     .. "phase allocates and frees a fresh tensor per call. RSS and open descriptors (of the "
     .. "rank that changed most; the JSON has every sample, max over ranks) from the sample after 5 %% of the calls to the last; flat = no descriptor "
     .. "change and RSS growth within max(1 MiB, 1 %%). %d s in all. Times are eager per-call "
     .. "medians on a shared machine (ranks outnumber cores): a soak, not a latency benchmark."):format(
      opts.quick and " --quick" or "", seconds), "",
    bench.table({ "phase", "bytes", "calls", "median µs", "p99 µs", "wrong elements", "RSS KiB", "fds", "flat" }, rows),
    ("Verdict: %s."):format(flat and "RSS and descriptors flat, no wrong element" or "NOT flat (see the table)"), "",
  }, "\n")
  local jp, mp = bench.write(opts.out:sub(1, 1) == "/" and opts.out or (root .. "/" .. opts.out), name, doc, md)
  P:finish("wrote " .. jp .. " and " .. mp)
  io.write(md)
  if not flat then os.exit(2) end
end

if os.getenv("RANK") then rank_main() else driver() end
