#!/usr/bin/env luajit
-- bench-nodes.lua — host all-reduce across simulated nodes (scripts/weft-sim-nodes):
-- weft on flat Gloo, weft hierarchical (shm inside a node + Gloo among node
-- leaders), weft's old store path, and Open MPI (TCP BTL, mpirun across the
-- same namespaces through weft-sim-nodes --agent), side by side in one run.
--
--   make bench-nodes     (or: luajit scripts/bench-nodes.lua [options])
--   options: --nodes 2 --per-node 2 --min 1024 --max 67108864 --factor 4
--            --iters 200 --store-iters 10 --store-max BYTES --repeat 3
--            --mpi build/mpi_allreduce --no-mpi --machine NAME --out bench/results
--
-- Method (every side, the same as scripts/bench-host.lua, whose worker runs
-- the weft side): f32 sum in place, fresh random data before every call, a
-- barrier, one timed call; per call the slowest rank's time; median over the
-- calls; results checked against a reference on the first and last call of
-- every size. Each side runs --repeat times, interleaved; per size the lowest
-- median counts. Open MPI: --mca btl tcp,self (every byte over TCP, like
-- flat Gloo), and a second row with its shared-memory BTL inside a node
-- (tcp,vader,self: like weft's hierarchy); --bind-to none and
-- mpi_yield_when_idle, as 4 ranks share 2 CPUs here. Writes
-- bench/results/host-allreduce-nodes-<machine>-<date>.{json,md}.
local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local bench = require("weft.tools.bench")
local opts = bench.parse_args(arg or {}, {
  nodes = 2, per_node = 2, min = 1024, max = 64 * 1048576, factor = 4, iters = 200,
  store_iters = 10, ["repeat"] = 3, mpi = "build/mpi_allreduce", out = "bench/results", warmup = 3,
}, { ["--no-mpi"] = "no_mpi" }, "bench-nodes")
opts.store_max = opts.store_max or opts.max
local sh, parse_lines, human = bench.sh, bench.tagged_records, bench.human_bytes

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local W = opts.nodes * opts.per_node
local sides = {
  { key = "gloo", label = "weft Gloo flat", env = "WEFT_HOST_BACKEND=gloo" },
  { key = "gloo_hier", label = "weft hierarchical", env = "WEFT_HOST_BACKEND=hier" },
  { key = "store", label = "weft store path", env = "WEFT_HOST_BACKEND=store", store = true },
}
if not opts.no_mpi then
  sides[#sides + 1] = { key = "mpi", label = "Open MPI tcp", mpi = "tcp,self" }
  sides[#sides + 1] = { key = "mpi_vader", label = "Open MPI tcp+shm", mpi = "tcp,vader,self" }
end

local function run_side(s)
  local max = s.store and opts.store_max or opts.max
  local iters = s.store and opts.store_iters or opts.iters
  local common = ("--min %d --max %d --factor %d --iters %d --warmup %d"):format(opts.min, max, opts.factor, iters, opts.warmup)
  local cmd
  if s.mpi then
    local shell = ("mpirun --allow-run-as-root --bind-to none --mca mpi_yield_when_idle 1 "
      .. "--host $(echo $WEFT_SIM_HOSTS | sed 's/,/:%d,/g'):%d --mca plm_rsh_agent \"$WEFT_SIM_AGENT\" "
      .. "--mca btl %s --mca btl_tcp_if_include weft0 --mca oob_tcp_if_include weft0 -np %d %s %s")
      :format(opts.per_node, opts.per_node, s.mpi, W, opts.mpi, common)
    cmd = ("cd %s && scripts/weft-sim-nodes -N %d --node0-shell %s"):format(q(root), opts.nodes, q(shell))
  else
    cmd = ("cd %s && env %s WEFT_TIMEOUT_MS=600000 scripts/weft-sim-nodes -N %d -n %d scripts/bench-host.lua --worker %s --bind none")
      :format(q(root), s.env, opts.nodes, opts.per_node, common)
  end
  local out, ok = sh(cmd)
  local recs = parse_lines(out, s.mpi and "mpi" or "weft")
  if not ok or #recs == 0 then io.stderr:write(out) end
  return recs, ok and #recs > 0
end

local function main()
  local machine, nproc = bench.cpu_machine(opts.machine)
  local date = os.date("%Y-%m-%d")
  local commit = os.getenv("WEFT_COMMIT") or (sh("git -C " .. q(root) .. " rev-parse --short HEAD"):gsub("%s+$", ""))
  local best, failed = {}, false   -- best[key][bytes] = record
  for rep = 1, opts["repeat"] do
    for _, s in ipairs(sides) do
      io.stderr:write(("bench-nodes: %s, %d nodes x %d ranks (run %d) ...\n"):format(s.label, opts.nodes, opts.per_node, rep))
      local recs, ok = run_side(s)
      if not ok then failed = true end
      best[s.key] = best[s.key] or {}
      for _, r in ipairs(recs) do
        if r.check ~= "ok" then failed = true end
        local cur = best[s.key][r.bytes]
        if not cur or r.us < cur.us then
          best[s.key][r.bytes] = { op = "all_reduce", backend = s.key, mode = "eager", dtype = "f32", world = W,
            nodes = opts.nodes, bytes = r.bytes, iters = r.iters, us = r.us, min_us = r.min_us,
            busbw_gbs = r.busbw_gbs, check = r.check, picked = r.backend }
        end
      end
    end
  end
  os.execute("mkdir -p " .. q(opts.out))
  local base = ("%s/host-allreduce-nodes-%s-%s"):format(opts.out, machine, date)
  local records = {}
  local sizes, size = {}, opts.min
  while size <= opts.max do sizes[#sizes + 1] = size; size = size * opts.factor end
  local FIELDS = { "op", "backend", "mode", "dtype", "world", "nodes", "bytes", "iters", "us", "min_us", "busbw_gbs", "check" }
  for _, b in ipairs(sizes) do
    for _, s in ipairs(sides) do
      local r = best[s.key] and best[s.key][b]
      if r then
        local rec = {}
        for _, k in ipairs(FIELDS) do rec[k] = r[k] end
        records[#records + 1] = rec
      end
    end
  end
  local f = assert(io.open(base .. ".json", "w"))
  f:write(bench.json({ machine = machine, date = date, commit = commit, cpus = nproc, nodes = opts.nodes,
                       ranks_per_node = opts.per_node, runs = opts["repeat"], records = records }, "  "), "\n")
  f:close()
  local md = {
    ("# Host all-reduce across %d simulated nodes x %d ranks (%s, %s, %d CPUs, commit %s)"):format(
      opts.nodes, opts.per_node, machine, date, nproc, commit), "",
    "Nodes: network namespaces on one machine (scripts/weft-sim-nodes: veth pairs on a bridge, a private",
    "/dev/shm each). f32 sum in place, eager; median µs per call over fresh random data (slowest rank",
    ("per call), lowest median of %d interleaved runs per side; every result checked."):format(opts["repeat"]),
    "Open MPI: mpirun across the same namespaces (--mca plm_rsh_agent \"weft-sim-nodes --agent\"),",
    "`tcp` = --mca btl tcp,self; `tcp+shm` = tcp,vader,self; --bind-to none, mpi_yield_when_idle 1.", "",
  }
  local head, sep = { "| bytes |" }, { "|---|" }
  for _, s in ipairs(sides) do head[#head + 1] = " " .. s.label .. " µs |"; sep[#sep + 1] = "---|" end
  head[#head + 1] = " best weft / MPI tcp | best weft / store |"
  sep[#sep + 1] = "---|---|"
  md[#md + 1] = table.concat(head); md[#md + 1] = table.concat(sep)
  for _, b in ipairs(sizes) do
    local row = { ("| %s |"):format(human(b)) }
    for _, s in ipairs(sides) do
      local r = best[s.key] and best[s.key][b]
      row[#row + 1] = r and (" %.1f |"):format(r.us) or " - |"
    end
    local g, h = best.gloo and best.gloo[b], best.gloo_hier and best.gloo_hier[b]
    local wb = (g and h) and math.min(g.us, h.us) or (g or h) and (g or h).us
    local m, st = best.mpi and best.mpi[b], best.store and best.store[b]
    row[#row + 1] = (wb and m) and (" %.2f |"):format(wb / m.us) or " - |"
    row[#row + 1] = (wb and st) and (" 1/%.1f |"):format(st.us / wb) or " - |"
    md[#md + 1] = table.concat(row)
  end
  bench.finish_results(base, md)
  os.exit(failed and 1 or 0)
end

main()
