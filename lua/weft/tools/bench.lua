-- weft.tools.bench — helpers for benchmarks: CUDA-event timing of graph replays and
-- eager calls, medians, the results file of docs/architecture.md#conventions-in-one-place (JSON + markdown).
local ffi = require("ffi")
local json = require("weft.internal.json")

local M = {}

local fmt, concat = string.format, table.concat

-- A benchmark script's command line into o (its defaults): "--some-key v"
-- sets o.some_key (a number when v reads as one); flags[a] handles the
-- options that take no value: a key (o[key] = true) or a function (flags[a](o));
-- anything else raises "<name>: unknown argument a<hint>".
function M.parse_args(argv, o, flags, name, hint)
  local i = 1
  while i <= #argv do
    local a = argv[i]
    local f = flags[a]
    if type(f) == "string" then o[f] = true
    elseif f then f(o)
    elseif a:match("^%-%-") and argv[i + 1] then
      local k = a:sub(3):gsub("-", "_")
      local v = argv[i + 1]
      o[k] = tonumber(v) or v
      i = i + 1
    else
      error(name .. ": unknown argument " .. a .. (hint or ""), 2)
    end
    i = i + 1
  end
  return o
end

-- Runs a shell command line: its output (stderr too) and whether it exited 0.
function M.sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  local ok, _, code = p:close()
  return out, (ok == true or code == 0)
end

-- The records a benchmark's ranks print as "<tag> world=<n> key=value ...":
-- one table a line, numbers as numbers.
function M.tagged_records(out, tag)
  local recs = {}
  for line in out:gmatch("[^\n]+") do
    local body = line:match(tag .. " (world=.*)$")
    if body then
      local r = {}
      for k, v in body:gmatch("([%w_]+)=(%S+)") do r[k] = tonumber(v) or v end
      recs[#recs + 1] = r
    end
  end
  return recs
end

-- The name of a CPU-only machine for a results file, and its CPU count:
-- `name` (a --machine option), else WEFT_MACHINE, else "<hostname>-<n>cpu".
function M.cpu_machine(name)
  local nproc = tonumber((M.sh("nproc"))) or 0
  local machine = name or os.getenv("WEFT_MACHINE")
  if not machine or machine == "" then
    machine = (M.sh("hostname -s"):gsub("%s+$", ""))
    if machine == "" or machine:find("[^%w%-_.]") then machine = "host" end
    machine = fmt("%s-%dcpu", machine, nproc)
  end
  return machine, nproc
end

function M.median(xs)
  local t = {}
  for i = 1, #xs do t[i] = xs[i] end
  table.sort(t)
  local n = #t
  if n == 0 then return 0 / 0 end
  if n % 2 == 1 then return t[(n + 1) / 2] end
  return 0.5 * (t[n / 2] + t[n / 2 + 1])
end

-- Per-call device times (µs) of `n` back-to-back runs of fn on `stream`:
-- an event between consecutive runs, all queued before one wait, so each
-- delta is the GPU time of one run including any gap the host left.
function M.time_runs(cuda, stream, n, fn)
  local ev = {}
  for i = 1, n + 1 do ev[i] = cuda.event() end
  ev[1]:record(stream)
  for i = 1, n do
    fn()
    ev[i + 1]:record(stream)
  end
  ev[n + 1]:synchronize()
  local us = {}
  for i = 1, n do us[i] = ev[i]:elapsed(ev[i + 1]) * 1000 end
  for i = 1, n + 1 do ev[i]:destroy() end
  return us
end

-- Wall-clock nanoseconds (CLOCK_MONOTONIC).
M.now_ns = require("weft.internal.clock").now_ns

function M.human_bytes(b)
  if b >= 1024 ^ 3 and b % 1024 ^ 3 == 0 then return fmt("%d GiB", b / 1024 ^ 3) end
  if b >= 1024 ^ 2 and b % 1024 ^ 2 == 0 then return fmt("%d MiB", b / 1024 ^ 2) end
  if b >= 1024 and b % 1024 == 0 then return fmt("%d KiB", b / 1024) end
  return fmt("%d B", b)
end

-- ---------------------------------------------------------------- JSON
-- weft.internal.json (lua-cjson with the results files' writer over it).

-- The order of a results file's keys: the run, then its records, then a
-- record's fields as docs/architecture.md lists them; others sorted after.
M.KEY_ORDER = { "machine", "date", "commit", "cpus", "nodes", "ranks_per_node", "runs", "loadavg_after",
  "checks", "callpath", "records",
  "op", "backend", "mode", "load", "dtype", "world", "bytes", "tokens", "hidden", "iters",
  "us", "p99_us", "min_us", "busbw_gbs" }

-- The text of a results file (indent: its layout, one record a line) or,
-- without indent, compact JSON.
function M.json(v, indent)
  return json.encode(v, { indent = indent, order = indent and M.KEY_ORDER or nil })
end

-- json_decode(text) -> value: a results file (null -> nil). Raises
-- "weft: bench.json_decode: malformed JSON at byte N: <why>".
function M.json_decode(s) return json.decode(s, "bench.json_decode") end

-- ---------------------------------------------------------------- results file

-- The GPU part of a results file's name, from the device name CUDA reports:
-- the first two words, lower case, the second cut at its first "-" (memory
-- size and form factor are not the GPU), then "-xN" for N > 1 devices.
-- "NVIDIA H100 80GB HBM3", 1 -> "nvidia-h100"; "NVIDIA H200", 2 ->
-- "nvidia-h200-x2"; "NVIDIA A100-SXM4-80GB" -> "nvidia-a100". The C
-- harnesses use the same rule (bench/machine_tag.h). Pure: no CUDA, no env.
function M.device_tag(device_name, ndev)
  local words = {}
  for w in tostring(device_name or ""):gmatch("%S+") do
    if #words == 1 then w = w:match("^[^-]*") end
    words[#words + 1] = w:lower():gsub("[^%w]", "-")
    if #words == 2 then break end
  end
  local s = table.concat(words, "-")
  if s == "" or s == "-" then s = "unknown" end
  if ndev and ndev > 1 then s = s .. "-x" .. ndev end
  return s
end

-- "NVIDIA H200" + 2 devices -> "nvidia-h200-x2" (WEFT_MACHINE overrides)
function M.machine_name(device_name, ndev)
  local env = os.getenv("WEFT_MACHINE")
  if env and env ~= "" then return env end
  return M.device_tag(device_name, ndev)
end

function M.commit()
  local env = os.getenv("WEFT_COMMIT")
  if env and env ~= "" then return env end
  local p = io.popen("git rev-parse --short HEAD 2>/dev/null")
  local c = p and p:read("*l")
  if p then p:close() end
  return (c and c ~= "") and c or "unknown"
end

-- Draws the charts of a results file beside it (x.json -> x.svg, weft.tools.plot);
-- returns the SVG's path, or nil when there is nothing to draw. A plotting
-- failure never loses the results: it is reported on stderr.
function M.plot(json_path, doc)
  local ok, svg_path = pcall(function() return require("weft.tools.plot").write_for(json_path, doc) end)
  if not ok then
    io.stderr:write("weft: bench: no chart for ", json_path, ": ", tostring(svg_path), "\n")
    return nil
  end
  return svg_path
end

-- Writes <dir>/<name>-<machine>-<date>.json, .md and (where it has something
-- to draw) .svg; returns the three paths.
function M.write(dir, name, doc, markdown)
  os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'")
  local base = fmt("%s/%s-%s-%s", dir, name, doc.machine, doc.date)
  local f = assert(io.open(base .. ".json", "w"))
  f:write(M.json(doc, "  "), "\n")
  f:close()
  f = assert(io.open(base .. ".md", "w"))
  f:write(markdown)
  f:close()
  return base .. ".json", base .. ".md", M.plot(base .. ".json", doc)
end

-- Beside <base>.json (written by the caller): <base>.md from an array of
-- markdown lines, shown too, and the charts (<base>.svg) where there is
-- something to draw; says what it wrote.
function M.finish_results(base, md_lines)
  local text = concat(md_lines, "\n") .. "\n"
  local f = assert(io.open(base .. ".md", "w"))
  f:write(text)
  f:close()
  io.write(text)
  local svg = M.plot(base .. ".json")
  print("wrote " .. base .. ".json and .md" .. (svg and " and .svg" or ""))
end

-- Markdown table from a header array and rows of strings.
function M.table(header, rows)
  local out = { "| " .. concat(header, " | ") .. " |" }
  local sep = {}
  for i = 1, #header do sep[i] = "---" end
  out[#out + 1] = "|" .. concat(sep, "|") .. "|"
  for _, r in ipairs(rows) do out[#out + 1] = "| " .. concat(r, " | ") .. " |" end
  return concat(out, "\n") .. "\n"
end

return M
