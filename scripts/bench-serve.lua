#!/usr/bin/env luajit
-- bench-serve: throughput and latency of the served demo's POST /v1/layer
-- (scripts/serve/) with wrk, and the cost of weft.async against the
-- blocking call for a small all-reduce.
--
--   luajit scripts/bench-serve.lua [--ranks 2,4] [--duration 5] [--connections 16]
--       [--hidden 256] [--layer linear] [--machine NAME] [--out bench/results]
--       [--iters 2000] [--no-wrk] [--no-overhead]
--
-- Writes bench/results/serve-<machine>-<date>.json (records of the results format, docs/architecture.md#conventions-in-one-place:
-- op "serve_layer" with rps, p50_us, p99_us; op "all_reduce" with backend
-- "shm" and mode "blocking" | "async_wait" | "async_poll", and op
-- "async_nop") and a markdown table beside it. Needs nginx with the Lua
-- module (scripts/serve/ensure-nginx) and wrk (apt-get install wrk).
-- Under weft-run (RANK set) it runs the overhead measurement instead.
local self_path = arg and arg[0] or "scripts/bench-serve.lua"
local root = (self_path:match("^(.*)/scripts/[^/]*$") or ".")
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/scripts/serve/?.lua;"
               .. root .. "/tests/?.lua;" .. package.path

local ffi = require("ffi")
local fmt = string.format

local median = require("weft.tools.bench").median
local function pct(xs, p)
  local t = {}
  for i = 1, #xs do t[i] = xs[i] end
  table.sort(t)
  return t[math.max(1, math.ceil(#t * p / 100))]
end

---------------------------------------------------------------- overhead (ranks)
if os.getenv("RANK") then
  local weft = require("weft")
  local async = require("weft.async")
  local group = require("weft.group")
  async.install(group.GroupCoordinator, group)
  local iters = tonumber(os.getenv("BENCH_ITERS") or "2000")
  local g = weft.init()
  async.prepare(g)
  local T = weft.tensor
  local now = weft.now_us
  local out = {}
  -- modes interleaved in rounds, so a change of the machine's load hits all alike
  for _, count in ipairs({ 16, 1024 }) do
    local t = T.ones({ count }, "f32")
    local modes = {
      { "blocking", function() g:all_reduce(t) end },
      { "async_wait", function() async.all_reduce(g, t):wait() end },
      { "async_poll", function()
          local h = async.all_reduce(g, t)
          while not h:test() do end
        end },
    }
    local xs = {}
    for _, m in ipairs(modes) do xs[m[1]] = {}; for _ = 1, 50 do m[2]() end end
    local rounds = 10
    for _ = 1, rounds do
      for _, m in ipairs(modes) do
        g:barrier()
        local list, fn = xs[m[1]], m[2]
        for _ = 1, math.ceil(iters / rounds) do
          local t0 = now()
          fn()
          list[#list + 1] = now() - t0
        end
      end
    end
    for _, m in ipairs(modes) do
      out[#out + 1] = { mode = m[1], count = count, us = median(xs[m[1]]), p99 = pct(xs[m[1]], 99) }
    end
  end
  -- the queue's own round trip (no peers): submit + wait of a no-op
  local solo = { unique_name = "nop", timeout_ms = 10000 }
  local xs = {}
  for _ = 1, 100 do async.nop(solo):wait() end
  for i = 1, iters do
    local t0 = now()
    async.nop(solo):wait()
    xs[i] = now() - t0
  end
  out[#out + 1] = { mode = "nop_wait", count = 0, us = median(xs), p99 = pct(xs, 99) }
  if g.rank == 0 then
    for _, r in ipairs(out) do
      io.stdout:write(fmt("BENCH %s %d %.2f %.2f %d\n", r.mode, r.count, r.us, r.p99, g.world_size))
    end
    io.stdout:flush()
  end
  weft.shutdown()
  os.exit(0)
end

---------------------------------------------------------------- driver
local opts = { ranks = "2,4", duration = 5, connections = 16, hidden = 256, layer = "linear",
               out = root .. "/bench/results", iters = 2000 }
local i = 1
while i <= #arg do
  local a = arg[i]
  local k = a:match("^%-%-(.+)$")
  if k == "no-wrk" then opts.no_wrk = true
  elseif k == "no-overhead" then opts.no_overhead = true
  elseif k == "help" then io.stdout:write(io.open(self_path):read("*a"):match("^(.-)\nlocal"), "\n"); os.exit(0)
  elseif k and arg[i + 1] then opts[k:gsub("-", "_")] = arg[i + 1]; i = i + 1
  else io.stderr:write("bench-serve: bad argument " .. a .. "\n"); os.exit(2) end
  i = i + 1
end

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local s = p:read("*a")
  p:close()
  return s
end

local nproc = tonumber(sh("nproc"):match("%d+")) or 0
local machine = opts.machine or os.getenv("WEFT_MACHINE")
if not machine then
  machine = (sh("hostname -s"):gsub("%s+$", ""))
  if machine == "" or machine:find("[^%w%-_.]") then machine = "host" end
  machine = fmt("%s-%dcpu", machine, nproc)
end
local date = os.date("%Y-%m-%d")
local commit = (sh("git -C " .. root .. " rev-parse --short HEAD"):gsub("%s+$", ""))
if not commit:match("^%x+$") then commit = "unknown" end

local records, md = {}, {}
local http = require("helpers.serve_http")
local json = require("serve_json")
local model = require("serve_model")
pcall(ffi.cdef, "int kill(int pid, int sig); int poll(void *fds, unsigned long n, int timeout);")

local function start_server(n)
  local port = assert(require("weft.tools.launcher").free_port("127.0.0.1"))
  local prefix = sh("mktemp -d /tmp/weft-bench-serve.XXXXXX"):match("^(%S+)")
  local log = prefix .. ".log"
  local cmd = fmt("setsid %s/scripts/serve/start -n %d --port %d --prefix %s --hidden %d --log-level warn > %s 2>&1 < /dev/null & echo $!",
                  root, n, port, prefix, opts.hidden, log)
  local pid = tonumber(sh(cmd):match("(%d+)"))
  local ok = http.wait_up(port, "/health", 60000, function(st, b) return st == 200 and b:find('"status":"ok"', 1, true) end)
  local srv = { pid = pid, port = port, prefix = prefix, log = log }
  if not ok then
    io.stderr:write(sh("cat " .. log))
    error("bench-serve: the server did not come up")
  end
  return srv
end

local function stop_server(srv)
  ffi.C.kill(-srv.pid, 15)
  for _ = 1, 300 do
    if ffi.C.kill(srv.pid, 0) ~= 0 then break end
    ffi.C.poll(nil, 0, 50)
  end
  if ffi.C.kill(srv.pid, 0) == 0 then ffi.C.kill(-srv.pid, 9) end
  sh(fmt("rm -rf %s %s", srv.prefix, srv.log))
end

local function input()
  local x = {}
  for k = 1, tonumber(opts.hidden) do x[k] = ((k * 7) % 23 - 11) / 8 end
  return x
end

local wrk_script = [[
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("BENCH_BODY")
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRK %d %d %d %d %d %d %.1f\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
]]

if not opts.no_wrk then
  assert(sh("command -v wrk"):find("wrk"), "bench-serve: wrk is missing (apt-get install wrk)")
  local wpath = os.tmpname()
  local f = assert(io.open(wpath, "w")); f:write(wrk_script); f:close()
  local x = input()
  local body = json.encode({ x = x, layer = opts.layer })
  local ref = model.reference(model.layers(tonumber(opts.hidden))[opts.layer], x)
  for n in tostring(opts.ranks):gmatch("%d+") do
    n = tonumber(n)
    local srv = start_server(n)
    -- a correct answer first
    local st, b = http.request(srv.port, "POST", "/v1/layer", body, 30000)
    local r = json.decode(b)
    assert(st == 200, "bench-serve: " .. b)
    for k = 1, #ref do assert(math.abs(r.y[k] - ref[k]) < 1e-4 * (1 + math.abs(ref[k])), "wrong answer") end
    for _, c in ipairs({ 1, tonumber(opts.connections) }) do
      local out = sh(fmt("BENCH_BODY='%s' wrk -t1 -c%d -d%ds --timeout 30s -s %s http://127.0.0.1:%d/v1/layer",
                         body, c, opts.duration, wpath, srv.port))
      local reqs, dur, errs, serr, p50, p99, mean = out:match("WRK (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) ([%d.]+)")
      if not reqs then error("bench-serve: wrk failed:\n" .. out) end
      local rps = tonumber(reqs) / (tonumber(dur) / 1e6)
      local rec = { op = "serve_layer", backend = "shm", mode = "eager", dtype = "f32", world = n,
                    bytes = tonumber(opts.hidden) * 4, hidden = tonumber(opts.hidden), layer = opts.layer,
                    connections = c, requests = tonumber(reqs), errors = tonumber(errs) + tonumber(serr),
                    us = tonumber(p50), rps = rps, p50_us = tonumber(p50), p99_us = tonumber(p99),
                    mean_us = tonumber(mean) }
      records[#records + 1] = rec
      io.stderr:write(fmt("serve_layer world %d, %d connection(s): %.0f req/s, p50 %d us, p99 %d us, %d errors\n",
                          n, c, rps, rec.p50_us, rec.p99_us, rec.errors))
    end
    local _, hb = http.request(srv.port, "GET", "/health", nil, 10000)
    local h = json.decode(hb)
    records[#records].steps, records[#records].served = h.steps, h.served
    stop_server(srv)
  end
  os.remove(wpath)
end

if not opts.no_overhead then
  for _, n in ipairs({ 2 }) do
    local out = sh(fmt("BENCH_ITERS=%d %s/scripts/weft-run -n %d --timeout 300 %s/scripts/bench-serve.lua",
                       tonumber(opts.iters), root, n, root))
    local any = false
    for mode, count, us, p99, world in out:gmatch("BENCH (%S+) (%d+) ([%d.]+) ([%d.]+) (%d+)") do
      any = true
      local rec
      if mode == "nop_wait" then
        rec = { op = "async_nop", backend = "queue", mode = "async_wait", world = 1, us = tonumber(us), p99_us = tonumber(p99) }
      else
        rec = { op = "all_reduce", backend = "shm", mode = mode, dtype = "f32", world = tonumber(world),
                bytes = tonumber(count) * 4, us = tonumber(us), p99_us = tonumber(p99) }
      end
      records[#records + 1] = rec
      io.stderr:write(fmt("%s %s %d B world %s: median %.2f us, p99 %.2f us\n", rec.op, mode,
                          rec.bytes or 0, tostring(rec.world), rec.us, rec.p99_us))
    end
    if not any then error("bench-serve: overhead run failed:\n" .. out) end
  end
end

---------------------------------------------------------------- results
sh("mkdir -p " .. opts.out)
local base = fmt("%s/serve-%s-%s", opts.out, machine, date)
local f = assert(io.open(base .. ".json", "w"))
f:write(require("weft.tools.bench").json({ machine = machine, date = date, commit = commit, cpus = nproc,
                                     records = records }, "  "), "\n")
f:close()

md[#md + 1] = fmt("# Served demo and async overhead (%s, %s, %d CPUs, commit %s)\n", machine, date, nproc, commit)
md[#md + 1] = fmt("POST /v1/layer (%s, hidden %s, f32, host tensors, shm all-reduce), wrk %s s per point;", opts.layer, opts.hidden, opts.duration)
md[#md + 1] = "nginx's worker is rank 0; every rank shares this machine's CPUs with wrk.\n"
md[#md + 1] = "| ranks | connections | req/s | p50 µs | p99 µs | errors |"
md[#md + 1] = "|---|---|---|---|---|---|"
for _, r in ipairs(records) do
  if r.op == "serve_layer" then
    md[#md + 1] = fmt("| %d | %d | %.0f | %d | %d | %d |", r.world, r.connections, r.rps, r.p50_us, r.p99_us, r.errors)
  end
end
md[#md + 1] = "\nSmall all-reduce on 2 ranks (shm), median µs per call: the blocking call, the async"
md[#md + 1] = "form waited on its condvar (`h:wait()`), and the async form polled with `h:test()`.\n"
md[#md + 1] = "| bytes | blocking | async wait | async poll |"
md[#md + 1] = "|---|---|---|---|"
local by = {}
for _, r in ipairs(records) do
  if r.op == "all_reduce" then by[r.bytes] = by[r.bytes] or {}; by[r.bytes][r.mode] = r.us end
end
local sizes = {}
for b in pairs(by) do sizes[#sizes + 1] = b end
table.sort(sizes)
for _, b in ipairs(sizes) do
  local m = by[b]
  md[#md + 1] = fmt("| %d | %.1f | %.1f | %.1f |", b, m.blocking or 0, m.async_wait or 0, m.async_poll or 0)
end
for _, r in ipairs(records) do
  if r.op == "async_nop" then
    md[#md + 1] = fmt("\nThe queue's own round trip (submit + wait of a no-op, one process): %.1f µs median.", r.us)
  end
end
f = assert(io.open(base .. ".md", "w"))
f:write(table.concat(md, "\n"), "\n")
f:close()
local svg = require("weft.tools.bench").plot(base .. ".json")
io.stderr:write("bench-serve: wrote " .. base .. ".json and .md" .. (svg and " and .svg" or "") .. "\n")
