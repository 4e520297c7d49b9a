#!/usr/bin/env luajit
-- bench-host.lua — host all-reduce latency and bandwidth: weft (shared memory)
-- against Open MPI's MPI_Allreduce, same sizes, same method, one run, quiet
-- and with a competing busy process.
--
--   make bench-host                 (builds bench/mpi_allreduce.c, then runs this)
--   luajit scripts/bench-host.lua [--worlds 2,4] [--dtypes f32,bf16] [--load none,busy]
--        [--min 1024] [--max 67108864] [--load-max 1048576] [--bf16-max 1048576]
--        [--factor 4] [--iters 1000] [--repeat 2] [--bind auto|none|rank]
--        [--mpi build/mpi_allreduce] [--no-mpi] [--no-callpath] [--settle] [--machine NAME]
--        [--out bench/results] [--merge earlier.json] [--line-probe build/vcpu_pingpong] [-q]
--
-- Method (both sides): sum in place; for every call fresh random data, a
-- barrier, one timed call; per call the slowest rank's time counts; the
-- median and the 99th percentile over the calls are reported (calls per
-- size: about 256 MiB of payload, 10..iters). Results are checked against a
-- reference on the first and last call of every size. f32 runs --min..--max,
-- bf16 up to --bf16-max (MPI: a 2-byte type with a user-defined sum).
-- --load busy: the same runs (up to --load-max) with one busy process per 2
-- CPUs pinned to CPUs 0, 2, ... (a competing process, as on a serving host),
-- started before and stopped after each run; it also exits by itself when
-- this driver is gone. Each side runs `--repeat` times, weft and MPI
-- interleaved, a side's quiet and busy runs back to back (on a VM the cost
-- of a cache line between two vCPUs changes by up to 5x from one second to
-- the next: --line-probe records it before each run); per case the run with the lowest median is kept, with its
-- p99 (noise on a shared machine only adds time). Last, the Lua call path:
-- group:all_reduce on a 1 KiB host tensor against its C call, and the Lua
-- heap's growth over 10^6 calls (--no-callpath skips it).
-- --settle (both sides): an untimed barrier after every timed call. When
-- ranks outnumber CPUs, the ranks sharing a CPU return from a call one at a
-- time, and each goes on to fill its next input before the scheduler runs
-- the next: without it the last rank's time holds its CPU-mates' fills
-- (traced, 4 ranks on 2 CPUs, 1 MiB f32: 264-275 µs per fill; with a busy
-- process the scheduler puts all 4 ranks on the other CPU, so 3 fills:
-- bench/results/host-allreduce-vm-2cpu-w4-trace-2026-12-03.md).
-- With it, a call's time is the collective's alone, CPU sharing included.
-- Writes bench/results/host-allreduce-<machine>-<date>.json (results format: docs/architecture.md#conventions-in-one-place)
-- and a .md table beside it. Progress on stderr (weft.internal.progress: what runs,
-- step k of n, the time left): one line rewritten on a terminal, a line per
-- step when piped, nothing with -q.
--
-- Under weft-run (RANK set) this file is the weft worker; otherwise the driver.
local ffi = require("ffi")
local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local bench = require("weft.tools.bench")

local opts = bench.parse_args(arg or {}, {
  worlds = "2,4", dtypes = "f32,bf16", load = "none,busy", min = 1024, max = 64 * 1048576,
  load_max = 1048576, bf16_max = 1048576, factor = 4, iters = 1000, warmup = 3, ["repeat"] = 2,
  mpi = "build/mpi_allreduce", out = "bench/results", dtype = "f32", line_probe = false,
}, {
  ["--no-mpi"] = "no_mpi", ["--worker"] = "worker", ["--callpath"] = "callpath",
  ["--no-callpath"] = "no_callpath", ["--settle"] = "settle", ["-q"] = "quiet", ["--quiet"] = "quiet",
}, "bench-host")

local function iters_for(bytes)
  local n = math.floor(256 * 1048576 / bytes)
  if n > opts.iters then n = opts.iters end
  if n < 10 then n = 10 end
  return n
end

-- nearest-rank percentile of a sorted list
local function pct(list, p)
  local k = math.floor(#list * p + 0.5)
  if k < 1 then k = 1 end
  if k > #list then k = #list end
  return list[k]
end

---------------------------------------------------------------- worker
local function worker()
  local weft = require("weft")
  local T = weft.tensor
  local C = require("weft.internal.ffi").C
  local now_us = weft.now_us
  local world = weft.init()
  -- like mpirun's default (--bind-to core when ranks <= cores): pin rank r to
  -- CPU r when there is a core per rank, so both sides are measured alike
  -- (--bind rank: by global rank, for simulated nodes whose ranks are all
  -- local rank 0 but share this machine's CPUs)
  local ncpu = tonumber(io.popen("nproc"):read("*l")) or 1
  if opts.bind ~= "none" and world.world_size <= ncpu then
    pcall(ffi.cdef, "int sched_setaffinity(int pid, size_t size, const uint8_t *mask);")
    local mask = ffi.new("uint8_t[128]")
    local cpu = (opts.bind == "rank" and world.rank or world.local_rank) % ncpu
    mask[math.floor(cpu / 8)] = 2 ^ (cpu % 8)
    ffi.C.sched_setaffinity(0, 128, mask)
  end
  local W, me = world.world_size, world.rank_in_group
  local dt = opts.dtype
  local es = dt == "bf16" and 2 or 4
  -- bf16 keeps 8 significant bits; the sum is rounded once from f32
  local tol = dt == "bf16" and 2 ^ -7 * W or 2e-6 * W
  local sync = T.zeros({ 1 }, "f32")
  local failed = false
  local bytes = opts.min
  while bytes <= opts.max do
    local n = bytes / es
    local x = T.empty({ n }, dt)
    local code = x:dtype_code()
    local iters = iters_for(bytes)
    local total = iters + opts.warmup
    local times = T.zeros({ total }, "f64")
    local tp = ffi.cast("double *", times.ptr)
    local lg = math.floor(math.log(bytes) / math.log(2) + 0.5)
    local function seed(r, c) return (r * 1000003 + c) * 64 + lg end
    local bad = false
    for c = 0, total - 1 do
      C.weft_host_fill_random(x.ptr, n, code, seed(me, c), 0)
      world:all_reduce(sync)                       -- a shared-memory barrier
      local t0 = now_us()
      world:all_reduce(x)
      tp[c] = now_us() - t0
      if opts.settle then world:all_reduce(sync) end -- untimed: see --settle
      if (c == opts.warmup or c == total - 1) and not bad then
        local ref = T.zeros({ n }, "f64")
        local rp = ffi.cast("double *", ref.ptr)
        local one = T.empty({ n }, dt)
        local one64 = T.empty({ n }, "f64")
        local op = ffi.cast("double *", one64.ptr)
        for r = 0, W - 1 do
          C.weft_host_fill_random(one.ptr, n, code, seed(r, c), 0)
          C.weft_host_convert(one.ptr, code, one64.ptr, one64:dtype_code(), n)
          for i = 0, n - 1 do rp[i] = rp[i] + op[i] end
        end
        local max_abs = x:compare(ref)
        if not (max_abs <= tol) then
          io.stderr:write(("bench-host: rank %d: wrong %s sum for %d bytes (max abs error %g)\n")
                          :format(me, dt, bytes, max_abs))
          bad = true
        end
        ref:free(); one:free(); one64:free()
      end
    end
    world:all_reduce(times, "max")
    local flag = T.full({ 1 }, bad and 1 or 0, "i32")
    world:all_reduce(flag, "max")
    if me == 0 then
      local list = {}
      for c = opts.warmup, total - 1 do list[#list + 1] = tp[c] end
      table.sort(list)
      local med = (#list % 2 == 1) and list[(#list + 1) / 2] or 0.5 * (list[#list / 2] + list[#list / 2 + 1])
      local busbw = bytes / (med * 1e-6) * 2 * (W - 1) / W / 1e9
      print(("weft world=%d bytes=%d iters=%d us=%.3f p99_us=%.3f min_us=%.3f busbw_gbs=%.4f dtype=%s check=%s backend=%s")
            :format(W, bytes, iters, med, pct(list, 0.99), list[1], busbw, dt,
                    flag:to_table()[1] == 0 and "ok" or "FAILED",
                    (weft.policy.select(world, "all_reduce", x))))
      io.stdout:flush()
    end
    if flag:to_table()[1] ~= 0 then failed = true end
    x:free(); times:free()
    bytes = bytes * opts.factor
  end
  weft.shutdown()
  os.exit(failed and 1 or 0)
end

-- The Lua call path: group:all_reduce on a 1 KiB host tensor against the C
-- call it makes (weft_shm_all_reduce on the group's communicator), back to
-- back at 2 ranks, in batches of 1000 (a C batch after every 4th Lua one);
-- per call the fastest batch of each (the machine's noise only adds time),
-- and the KiB the Lua heap grew per 10^6 group:all_reduce calls (f32: over
-- 10^6 calls; bf16: over 2 * 10^5, scaled).
local function callpath_worker()
  local weft = require("weft")
  local C = require("weft.internal.ffi").C
  local world = weft.init()
  local now = weft.now_us
  for _, dt in ipairs({ "f32", "bf16" }) do
    local x = weft.tensor.full({ 1024 / (dt == "f32" and 4 or 2) }, 1, dt)
    world:all_reduce(x)
    local h, n, code = world._shm.handle, x.numel, x:dtype_code()
    local B = 1000
    local function cb() for _ = 1, B do C.weft_shm_all_reduce(h, x.ptr, x.ptr, n, code, 0) end end
    local function lb() for _ = 1, B do world:all_reduce(x) end end
    cb(); lb()
    local mc, ml = math.huge, math.huge
    collectgarbage("collect")
    collectgarbage("stop")
    local k0 = collectgarbage("count")
    -- f32: 10^6 group:all_reduce calls (the allocation figure), bf16: 2 * 10^5
    local rounds = dt == "f32" and 1000 or 200
    for r = 1, rounds do
      local t0 = now(); lb(); local t1 = now()
      if t1 - t0 < ml then ml = t1 - t0 end
      if r % 4 == 0 then cb(); local t2 = now(); if t2 - t1 < mc then mc = t2 - t1 end end
    end
    local grew = collectgarbage("count") - k0
    collectgarbage("restart")
    if world.rank_in_group == 0 then
      print(("callpath world=%d dtype=%s bytes=1024 lua_us=%.3f c_us=%.3f diff_us=%.3f alloc_kib_per_1e6=%.1f")
            :format(world.world_size, dt, ml / B, mc / B, (ml - mc) / B, grew * 1000 / rounds))
      io.stdout:flush()
    end
  end
  weft.shutdown()
  os.exit(0)
end

if os.getenv("RANK") and opts.worker then return opts.callpath and callpath_worker() or worker() end

---------------------------------------------------------------- driver
local sh = bench.sh

local parse_lines, human = bench.tagged_records, bench.human_bytes

local function list_of(s, numbers)
  local t = {}
  for w in tostring(s):gmatch("[%w_]+") do t[#t + 1] = numbers and tonumber(w) or w end
  return t
end

-- The competing load: one busy shell loop per 2 CPUs, pinned to CPUs 0, 2,
-- ...; each checks that this driver still exists on every turn (kill -0 is
-- a builtin: the loop stays busy), so none outlives an interrupted run.
ffi.cdef "int getpid(void);"
local hog_pids = {}
local function load_start(nproc)
  local me = ffi.C.getpid()
  for cpu = 0, math.max(nproc, 2) - 1, 2 do
    local out = sh(("taskset -c %d sh -c 'while kill -0 %d 2>/dev/null; do :; done' >/dev/null 2>&1 & echo $!")
                   :format(cpu % math.max(nproc, 1), me))
    local pid = tonumber(out:match("(%d+)"))
    if pid then hog_pids[#hog_pids + 1] = pid end
  end
  sh("sleep 0.2") -- let the scheduler see it running
end
local function load_stop()
  for _, pid in ipairs(hog_pids) do sh(("kill %d 2>/dev/null"):format(pid)) end
  hog_pids = {}
end

local function driver()
  local worlds = list_of(opts.worlds, true)
  local dtypes = list_of(opts.dtypes)
  local loads = list_of(opts.load)
  local machine, nproc = bench.cpu_machine(opts.machine)
  local date = os.date("%Y-%m-%d")
  -- WEFT_COMMIT: the tree's commit where the copy's own git is stale (device runs)
  local commit = os.getenv("WEFT_COMMIT") or (sh("git -C " .. root .. " rev-parse --short HEAD"):gsub("%s+$", ""))
  if not commit:match("^%x+$") then commit = "unknown" end
  local failed = false
  local by = {}    -- by[load][dtype][world][bytes] = {weft=, mpi=}
  local function slot(load, dt, W, b)
    by[load] = by[load] or {}
    by[load][dt] = by[load][dt] or {}
    by[load][dt][W] = by[load][dt][W] or {}
    by[load][dt][W][b] = by[load][dt][W][b] or {}
    return by[load][dt][W][b]
  end
  -- per case the run with the lowest median counts, with its own p99 (a
  -- shared machine's noise only ever adds time)
  local function keep(load, W, kind, r)
    if r.check ~= "ok" then failed = true end
    local e = slot(load, r.dtype or "f32", W, r.bytes)
    local cur = e[kind]
    if not cur or r.us < cur.us then
      e[kind] = { op = "all_reduce", backend = kind == "mpi" and "mpi" or (r.backend or "shm"),
        mode = (load == "none" and "eager" or "eager+" .. load) .. (opts.settle and "+settle" or ""), load = load, dtype = r.dtype or "f32",
        world = W, bytes = r.bytes, iters = r.iters, us = r.us, p99_us = r.p99_us,
        min_us = r.min_us, busbw_gbs = r.busbw_gbs, line_rt_ns = r.line_rt_ns }
    end
  end
  -- --merge FILE.json: earlier runs of this script count as more repeats
  local merged = 0
  if opts.merge then
    local f = assert(io.open(opts.merge, "r"))
    local doc = bench.json_decode(f:read("*a"))
    f:close()
    for _, r in ipairs(doc.records or {}) do
      if r.op == "all_reduce" then
        r.check = "ok"
        keep(r.load or "none", r.world, r.backend == "mpi" and "mpi" or "weft", r)
      end
    end
    merged = tonumber(doc.runs) or 1
  end
  local nsteps = (opts["repeat"] or 1) * #loads * #dtypes * #worlds * (opts.no_mpi and 1 or 2)
                 + (opts.no_callpath and 0 or 1)
  local P = require("weft.internal.progress").new { name = "bench-host", steps = nsteps, quiet = opts.quiet }
  -- the machine's cost of a cache line between CPUs 0 and 1 (--line-probe:
  -- bench/vcpu_pingpong.c, ns per round trip), taken before each run
  local function line_rt()
    if not opts.line_probe then return nil end
    return tonumber((sh(opts.line_probe .. " 50000"):match("([%d.]+)")))
  end
  -- a side's quiet and busy runs back to back (a VM's cache-line cost can
  -- change between runs seconds apart: bench/results/host-busy-trace-*)
  for rep = 1, opts["repeat"] or 1 do
    for _, dt in ipairs(dtypes) do
      for _, W in ipairs(worlds) do
        for _, side in ipairs(opts.no_mpi and { "weft" } or { "weft", "mpi" }) do
          for _, load in ipairs(loads) do
            local max = dt == "bf16" and math.min(opts.max, opts.bf16_max) or opts.max
            if load ~= "none" then max = math.min(max, opts.load_max) end
            local common = ("--min %d --max %d --factor %d --iters %d --warmup %d --dtype %s%s")
                           :format(opts.min, max, opts.factor, opts.iters, opts.warmup, dt,
                                   opts.settle and " --settle" or "")
            local rt = line_rt()
            if load == "busy" then load_start(nproc) end
            local out, ok
            if side == "weft" then
              P:step(("weft, %d ranks, %s, load %s, run %d"):format(W, dt, load, rep))
              out, ok = sh(("%s/scripts/weft-run -n %d %s/scripts/bench-host.lua --worker %s --bind %s")
                           :format(root, W, root, common, opts.bind or "auto"))
            else
              P:step(("Open MPI, %d ranks, %s, load %s, run %d"):format(W, dt, load, rep))
              out, ok = sh(("mpirun --allow-run-as-root --oversubscribe -np %d %s %s"):format(W, opts.mpi, common))
            end
            load_stop()
            local recs = parse_lines(out, side)
            if not ok or #recs == 0 then P:clear(); io.stderr:write(out); failed = true end
            for _, r in ipairs(recs) do r.line_rt_ns = rt; keep(load, W, side, r) end
          end
        end
      end
    end
  end
  local callpath = {}
  if not opts.no_callpath then
    P:step("the Lua call path, 2 ranks")
    local out, ok = sh(("%s/scripts/weft-run -n 2 %s/scripts/bench-host.lua --worker --callpath --bind %s")
                       :format(root, root, opts.bind or "auto"))
    callpath = parse_lines(out, "callpath")
    if not ok or #callpath == 0 then P:clear(); io.stderr:write(out); failed = true end
  end
  local loadavg = (sh("cat /proc/loadavg"):gsub("%s+$", ""))
  P:finish(("%d steps"):format(nsteps))
  -- records in a stable order: load, dtype, world, size, weft then MPI
  local records = {}
  local sizes = {}
  do local b = opts.min; while b <= opts.max do sizes[#sizes + 1] = b; b = b * opts.factor end end
  for _, load in ipairs(loads) do
    for _, dt in ipairs(dtypes) do
      for _, W in ipairs(worlds) do
        for _, b in ipairs(sizes) do
          local e = by[load] and by[load][dt] and by[load][dt][W] and by[load][dt][W][b] or {}
          if e.weft then records[#records + 1] = e.weft end
          if e.mpi then records[#records + 1] = e.mpi end
        end
      end
    end
  end
  os.execute("mkdir -p " .. opts.out)
  local base = ("%s/host-allreduce-%s-%s"):format(opts.out, machine, date)
  local runs = (opts["repeat"] or 1) + merged
  local cp = {}
  for i, r in ipairs(callpath) do
    cp[i] = { op = "callpath", world = r.world, dtype = r.dtype, bytes = 1024, lua_us = r.lua_us, c_us = r.c_us,
              alloc_kib_per_1e6 = r.alloc_kib_per_1e6 }
  end
  local f = assert(io.open(base .. ".json", "w"))
  f:write(bench.json({ machine = machine, date = date, commit = commit, cpus = nproc, runs = runs,
                       loadavg_after = loadavg, callpath = cp, records = records }, "  "), "\n")
  f:close()
  -- markdown: a table per (load, dtype); per world weft and MPI median, p99, ratio
  local md = { ("# Host all-reduce, weft shm vs Open MPI (%s, %s, %d CPUs, commit %s)"):format(machine, date, nproc, commit),
               "",
               "Sum in place, eager; µs per call over fresh random data (slowest rank per call): median and 99th",
               ("percentile of the run with the lowest median of %d runs per side (weft and MPI interleaved)."):format(runs),
               "ratio = weft / MPI median (below 1: weft faster). busy: one busy process per 2 CPUs pinned to CPU 0, 2, ...",
               "(started before and stopped after every run). /proc/loadavg after the runs: " .. loadavg .. ".",
               "A side's quiet and busy runs back to back." .. (opts.line_probe and " line RT: the cost of a cache line between CPUs 0"
                 .. " and 1 (ns per round trip, bench/vcpu_pingpong.c) just before the kept run." or ""), "" }
  if opts.settle then
    table.insert(md, #md, "--settle: an untimed barrier after every timed call (both sides), so a call's time holds")
    table.insert(md, #md, "no CPU-mate's fill of its next input (scripts/bench-host.lua).")
  end
  for _, load in ipairs(loads) do
    for _, dt in ipairs(dtypes) do
      if by[load] and by[load][dt] then
        md[#md + 1] = ("## %s, load: %s"):format(dt, load == "none" and "none (quiet)" or load)
        md[#md + 1] = ""
        local head, sep = { "| bytes |" }, { "|---|" }
        for _, W in ipairs(worlds) do
          head[#head + 1] = (" weft %d med | weft %d p99 | MPI %d med | MPI %d p99 | ratio |"):format(W, W, W, W)
          sep[#sep + 1] = "---|---|---|---|---|"
          if opts.line_probe then
            head[#head + 1] = " line RT ns, weft / MPI |"
            sep[#sep + 1] = "---|"
          end
        end
        md[#md + 1] = table.concat(head)
        md[#md + 1] = table.concat(sep)
        for _, b in ipairs(sizes) do
          local row, any = { ("| %s |"):format(human(b)) }, false
          for _, W in ipairs(worlds) do
            local e = by[load][dt][W] and by[load][dt][W][b] or {}
            local wv, mv = e.weft, e.mpi
            any = any or wv ~= nil or mv ~= nil
            local function f2(v) return v and ("%.2f"):format(v) or "-" end
            row[#row + 1] = (" %s | %s | %s | %s | %s |"):format(f2(wv and wv.us), f2(wv and wv.p99_us),
              f2(mv and mv.us), f2(mv and mv.p99_us), (wv and mv) and ("%.2f"):format(wv.us / mv.us) or "-")
            if opts.line_probe then
              local function f0(v) return v and ("%.0f"):format(v) or "-" end
              row[#row + 1] = (" %s / %s |"):format(f0(wv and wv.line_rt_ns), f0(mv and mv.line_rt_ns))
            end
          end
          if any then md[#md + 1] = table.concat(row) end
        end
        md[#md + 1] = ""
      end
    end
  end
  if #callpath > 0 then
    md[#md + 1] = "## The Lua call path (1 KiB, 2 ranks, back to back)"
    md[#md + 1] = ""
    md[#md + 1] = "Per call, fastest batch of 1000 of each, batches interleaved: `group:all_reduce(t)` against the"
    md[#md + 1] = "`weft_shm_all_reduce` call it makes; the Lua heap's growth per 10^6 `group:all_reduce` calls"
    md[#md + 1] = "(f32: measured over 10^6 calls; bf16: over 2 * 10^5, scaled, so a fixed cost shows 5x)."
    md[#md + 1] = ""
    md[#md + 1] = "| dtype | group:all_reduce µs | C call µs | difference µs | KiB allocated per 10^6 calls |"
    md[#md + 1] = "|---|---|---|---|---|"
    for _, r in ipairs(callpath) do
      md[#md + 1] = ("| %s | %.3f | %.3f | %.3f | %.1f |"):format(r.dtype, r.lua_us, r.c_us, r.diff_us, r.alloc_kib_per_1e6)
    end
    md[#md + 1] = ""
  end
  bench.finish_results(base, md)
  os.exit(failed and 1 or 0)
end

driver()
