#!/usr/bin/env luajit
-- bench-host.lua — host all-reduce latency and bandwidth: weft (shared memory)
-- against Open MPI's MPI_Allreduce, same sizes, same method, one run.
--
--   make bench-host                 (builds bench/mpi_allreduce.c, then runs this)
--   luajit scripts/bench-host.lua [--worlds 2,4] [--min 1024] [--max 67108864]
--        [--factor 4] [--iters 200] [--repeat 3] [--bind auto|none] [--mpi build/mpi_allreduce] [--no-mpi]
--        [--machine NAME] [--out bench/results] [--merge earlier.json]
--
-- Method (both sides): f32 sum in place; for every call fresh random data,
-- a barrier, one timed call; per call the slowest rank's time counts; the
-- median over the calls is reported (calls per size: about 256 MiB of payload,
-- 10..iters). Results are checked against a reference on the first and last
-- call of every size. Each side runs `--repeat` times (default 3), weft and
-- MPI interleaved; per size the lowest median is kept (noise on a shared
-- machine only adds time). Writes bench/results/host-allreduce-<machine>-<date>.json
-- (results format: docs/architecture.md#conventions-in-one-place) and a .md table beside it.
--
-- Under weft-run (RANK set) this file is the weft worker; otherwise the driver.
local ffi = require "ffi"
local root = (arg[0]:match("^(.*)/scripts/[^/]*$") or ".")
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
local bench = require "weft.bench"

local opts = bench.parse_args(arg or {}, {
  worlds = "2,4", min = 1024, max = 64 * 1048576, factor = 4, iters = 200, warmup = 3, ["repeat"] = 3,
  mpi = "build/mpi_allreduce", out = "bench/results",
}, {
  ["--no-mpi"] = function(o) o.no_mpi = true end,
  ["--worker"] = function(o) o.worker = true end,
}, "bench-host")

local function iters_for(bytes)
  local n = math.floor(256 * 1048576 / bytes)
  if n > opts.iters then n = opts.iters end
  if n < 10 then n = 10 end
  return n
end

---------------------------------------------------------------- worker
local function worker()
  local weft = require "weft"
  local T = weft.tensor
  local C = require("weft.ffi").C
  local now_us = weft.now_us
  local world = weft.init()
  -- like mpirun's default (--bind-to core when ranks <= cores): pin rank r to
  -- CPU r when there is a core per rank, so both sides are measured alike
  local ncpu = tonumber(io.popen("nproc"):read("*l")) or 1
  if opts.bind ~= "none" and world.world_size <= ncpu then
    pcall(ffi.cdef, "int sched_setaffinity(int pid, size_t size, const uint8_t *mask);")
    local mask = ffi.new("uint8_t[128]")
    local cpu = world.local_rank % ncpu
    mask[math.floor(cpu / 8)] = 2 ^ (cpu % 8)
    ffi.C.sched_setaffinity(0, 128, mask)
  end
  local W, me = world.world_size, world.rank_in_group
  local sync = T.zeros({ 1 }, "f32")
  local failed = false
  local bytes = opts.min
  while bytes <= opts.max do
    local n = bytes / 4
    local x = T.empty({ n }, "f32")
    local iters = iters_for(bytes)
    local total = iters + opts.warmup
    local times = T.zeros({ total }, "f64")
    local tp = ffi.cast("double *", times.ptr)
    local lg = math.floor(math.log(bytes) / math.log(2) + 0.5)
    local function seed(r, c) return (r * 1000003 + c) * 64 + lg end
    local bad = false
    for c = 0, total - 1 do
      C.weft_host_fill_random(x.ptr, n, 0, seed(me, c), 0)
      world:all_reduce(sync)                       -- a shared-memory barrier
      local t0 = now_us()
      world:all_reduce(x)
      tp[c] = now_us() - t0
      if (c == opts.warmup or c == total - 1) and not bad then
        local ref = T.zeros({ n }, "f64")
        local rp = ffi.cast("double *", ref.ptr)
        local one = T.empty({ n }, "f32")
        local op = ffi.cast("float *", one.ptr)
        for r = 0, W - 1 do
          C.weft_host_fill_random(one.ptr, n, 0, seed(r, c), 0)
          for i = 0, n - 1 do rp[i] = rp[i] + op[i] end
        end
        local max_abs = x:compare(ref)
        if not (max_abs <= 2e-6 * W) then
          io.stderr:write(("bench-host: rank %d: wrong sum for %d bytes (max abs error %g)\n")
                          :format(me, bytes, max_abs))
          bad = true
        end
        ref:free(); one:free()
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
      print(("weft world=%d bytes=%d iters=%d us=%.3f min_us=%.3f busbw_gbs=%.4f check=%s backend=%s")
            :format(W, bytes, iters, med, list[1], busbw, flag:to_table()[1] == 0 and "ok" or "FAILED",
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

if os.getenv("RANK") and opts.worker then return worker() end

---------------------------------------------------------------- driver
local sh = bench.sh

local parse_lines, json_value, human = bench.tagged_records, bench.json, bench.human_bytes

local function json_record(r)
  local keys = { "op", "backend", "mode", "dtype", "world", "bytes", "iters", "us", "min_us", "busbw_gbs" }
  local parts = {}
  for _, k in ipairs(keys) do
    if r[k] ~= nil then parts[#parts + 1] = ('"%s": %s'):format(k, json_value(r[k])) end
  end
  return "{" .. table.concat(parts, ", ") .. "}"
end

local function driver()
  local worlds = {}
  for w in tostring(opts.worlds):gmatch("%d+") do worlds[#worlds + 1] = tonumber(w) end
  local machine, nproc = bench.cpu_machine(opts.machine)
  local date = os.date("%Y-%m-%d")
  -- WEFT_COMMIT: the tree's commit where the copy's own git is stale (device runs)
  local commit = os.getenv("WEFT_COMMIT") or (sh("git -C " .. root .. " rev-parse --short HEAD"):gsub("%s+$", ""))
  if not commit:match("^%x+$") then commit = "unknown" end
  local common = ("--min %d --max %d --factor %d --iters %d"):format(opts.min, opts.max, opts.factor, opts.iters)
  local records, failed = {}, false
  local by = {}    -- by[world][bytes] = {weft=, mpi=}
  -- each side runs `repeat` times, interleaved; per size the lowest median
  -- counts (a shared machine's noise only ever adds time)
  local function keep(W, kind, r)
    if r.check ~= "ok" then failed = true end
    by[W][r.bytes] = by[W][r.bytes] or {}
    local cur = by[W][r.bytes][kind]
    if not cur or r.us < cur.us then
      by[W][r.bytes][kind] = { op = "all_reduce", backend = kind == "mpi" and "mpi" or (r.backend or "shm"),
        mode = "eager", dtype = "f32", world = W, bytes = r.bytes, iters = r.iters, us = r.us,
        min_us = r.min_us, busbw_gbs = r.busbw_gbs }
    end
  end
  -- --merge FILE.json: earlier runs of this script count as more repeats
  local merged = 0
  if opts.merge then
    local f = assert(io.open(opts.merge, "r"))
    for line in f:read("*a"):gmatch("[^\n]+") do
      if line:match('"op": "all_reduce"') then
        local r = {}
        for k, v in line:gmatch('"([%w_]+)": "?([^",}]+)"?') do r[k] = tonumber(v) or v end
        r.check = "ok"
        local W = r.world
        by[W] = by[W] or {}
        keep(W, r.backend == "mpi" and "mpi" or "weft", r)
      end
    end
    f:close()
    merged = tonumber((io.open(opts.merge):read("*a"):match('"runs": (%d+)'))) or 1
  end
  for _, W in ipairs(worlds) do
    by[W] = by[W] or {}
    for rep = 1, opts["repeat"] or 1 do
      io.stderr:write(("bench-host: weft, %d ranks (run %d) ...\n"):format(W, rep))
      local out, ok = sh(("%s/scripts/weft-run -n %d %s/scripts/bench-host.lua --worker %s --warmup %d --bind %s")
                         :format(root, W, root, common, opts.warmup, opts.bind or "auto"))
      local recs = parse_lines(out, "weft")
      if not ok or #recs == 0 then io.stderr:write(out); failed = true end
      for _, r in ipairs(recs) do keep(W, "weft", r) end
      if not opts.no_mpi then
        io.stderr:write(("bench-host: Open MPI, %d ranks (run %d) ...\n"):format(W, rep))
        local mout, mok = sh(("mpirun --allow-run-as-root --oversubscribe -np %d %s %s --warmup %d")
                             :format(W, opts.mpi, common, opts.warmup))
        local mrecs = parse_lines(mout, "mpi")
        if not mok or #mrecs == 0 then io.stderr:write(mout); failed = true end
        for _, r in ipairs(mrecs) do keep(W, "mpi", r) end
      end
    end
    local b = opts.min
    while b <= opts.max do
      local e = by[W][b] or {}
      if e.weft then records[#records + 1] = e.weft end
      if e.mpi then records[#records + 1] = e.mpi end
      b = b * opts.factor
    end
  end
  os.execute("mkdir -p " .. opts.out)
  local base = ("%s/host-allreduce-%s-%s"):format(opts.out, machine, date)
  local lines = {}
  for i, r in ipairs(records) do lines[i] = "    " .. json_record(r) end
  local f = assert(io.open(base .. ".json", "w"))
  local runs = (opts["repeat"] or 1) + merged
  f:write(('{\n  "machine": %s,\n  "date": "%s",\n  "commit": "%s",\n  "cpus": %d,\n  "runs": %d,\n  "records": [\n%s\n  ]\n}\n')
          :format(json_value(machine), date, commit, nproc, runs, table.concat(lines, ",\n")))
  f:close()
  -- markdown: one row per size, weft / MPI / ratio per world size
  local md = { ("# Host all-reduce, weft shm vs Open MPI (%s, %s, %d CPUs, commit %s)"):format(machine, date, nproc, commit),
               "",
               "f32 sum in place, eager; median µs per call over fresh random data (slowest rank per call),",
               ("lowest median of %d runs per side (weft and MPI interleaved);"):format((opts["repeat"] or 1) + merged),
               "busbw = bytes/time x 2(n-1)/n. ratio = weft / MPI (below 1: weft faster).", "" }
  local head, sep = { "| bytes |" }, { "|---|" }
  for _, W in ipairs(worlds) do
    head[#head + 1] = (" weft %d ranks µs | MPI %d ranks µs | ratio | weft GB/s | MPI GB/s |"):format(W, W)
    sep[#sep + 1] = "---|---|---|---|---|"
  end
  md[#md + 1] = table.concat(head)
  md[#md + 1] = table.concat(sep)
  local b = opts.min
  while b <= opts.max do
    local row = { ("| %s |"):format(human(b)) }
    for _, W in ipairs(worlds) do
      local e = by[W][b] or {}
      local wu, mu = e.weft and e.weft.us, e.mpi and e.mpi.us
      row[#row + 1] = (" %s | %s | %s | %s | %s |"):format(
        wu and ("%.2f"):format(wu) or "-", mu and ("%.2f"):format(mu) or "-",
        (wu and mu) and ("%.2f"):format(wu / mu) or "-",
        e.weft and ("%.2f"):format(e.weft.busbw_gbs) or "-", e.mpi and ("%.2f"):format(e.mpi.busbw_gbs) or "-")
    end
    md[#md + 1] = table.concat(row)
    b = b * opts.factor
  end
  bench.finish_results(base, md)
  os.exit(failed and 1 or 0)
end

driver()
