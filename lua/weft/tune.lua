-- weft.tune — the pure half of scripts/weft-tune: what to measure, how
-- measurements become a policy file, and how a before/after comparison is
-- judged. No GPU, no FFI: tested on the CPU (tests/unit/tune_spec.lua).
--
--   tune.ar_sizes(quick) / tune.fused_shapes(quick)      what is measured
--   tune.summarize(samples) -> median, spread             one point's rounds
--   tune.derive(rows, opts) -> entries, choices           crossovers (below)
--   tune.render(doc) -> Lua source of a policy file      (docs/policy.md shape)
--   tune.write_file(path, text)  tune.default_path()     where it goes
--   tune.parse(text) / tune.check_shape(doc)             a file read back
--   tune.pick(entries, bytes) -> backend                 what a file says
--   tune.verdict(builtin_us, tuned_us, noise) -> ok, limit
--
-- Crossovers. A row is one measured size: { bytes = N, times = {backend =
-- us, ...}, builtin = name|nil }. At each row the backends within the tie
-- margin of the fastest (max(rel x best, abs) µs) are "acceptable"; the
-- chosen sequence of backends, one per row, only uses acceptable ones and
-- minimises, in this order: (1) the number of runs (switches + 1) plus the
-- number of rows where it differs from what the built-in policy chose, (2)
-- those differing rows alone, (3) the summed relative excess over the
-- fastest, (4) the preference order (opts.order). So a backend that wins by
-- less than the margin, or wins, loses and wins again in the noise, never
-- causes a switch (switching needs a clear win); a tie keeps the built-in
-- choice (equal choices give equal times); and a correction of the built-in
-- policy is one clean crossover rather than a flip-flop that follows it
-- wherever it is barely acceptable. Exact dynamic programming over rows x
-- backends (tens x a handful). Runs of one backend become `{upto = last
-- bytes of the run, backend = ...}`; the last run has no upto (it serves
-- everything larger).
local M = {}

local huge, fmt, concat = math.huge, string.format, table.concat
local E = require("weft.internal.errors")
local type, pairs, ipairs, tostring, tonumber, next = type, pairs, ipairs, tostring, tonumber, next

M.AR_BACKENDS = { "nccl", "oneshot", "twoshot", "auto" }
M.FUSED_BACKENDS = { "fused_oneshot", "fused_twoshot" }
M.DTYPES = { "bf16", "f16", "f32" }
M.ESIZE = { bf16 = 2, f16 = 2, f32 = 4 }
M.HIDDEN = { 4096, 8192 }
M.KNOWN_BACKENDS = {
  all_reduce = { nccl = true, oneshot = true, twoshot = true, auto = true },
  fused = { fused_oneshot = true, fused_twoshot = true },
}
-- ties go to the earlier name (after the built-in's choice)
M.ORDER = { "oneshot", "twoshot", "nccl", "auto", "fused_oneshot", "fused_twoshot" }
M.REL, M.ABS = 0.02, 0.1          -- tie margin of the derivation: 2 %, 0.1 µs
M.NOISE_REL, M.NOISE_ABS = 0.03, 0.2 -- before/after: slower only beyond this

-- "weft: tune.<op>: <msg>"; level as weft.internal.errors.fail's (default 1), + 1 for this frame
local function fail(op, msg, level)
  E.fail((level or 1) + 1, "tune." .. op, "%s", msg)
end

---------------------------------------------------------------- what is measured

-- lo, 2 lo, 4 lo, ... up to hi (quick: lo, 4 lo, 16 lo, ...)
local function ladder(quick, lo, hi)
  local t, v = {}, lo
  while v <= hi do
    t[#t + 1] = v
    v = v * (quick and 4 or 2)
  end
  return t
end

-- All-reduce sizes in bytes: 1 KiB .. 256 MiB, powers of 2 (quick: of 4).
function M.ar_sizes(quick, lo, hi)
  return ladder(quick, lo or 2 ^ 10, hi or 2 ^ 28)
end

-- Fused shapes: hidden {4096, 8192} x tokens 1 .. 8192 (powers of 2; quick: of 4).
function M.fused_tokens(quick, hi)
  return ladder(quick, 1, hi or 8192)
end

function M.fused_shapes(quick, hiddens)
  local out = {}
  for _, h in ipairs(hiddens or M.HIDDEN) do
    for _, tk in ipairs(M.fused_tokens(quick)) do out[#out + 1] = { hidden = h, tokens = tk } end
  end
  return out
end

function M.human_bytes(b)
  if b >= 2 ^ 20 and b % 2 ^ 20 == 0 then return fmt("%d MiB", b / 2 ^ 20) end
  if b >= 2 ^ 10 and b % 2 ^ 10 == 0 then return fmt("%d KiB", b / 2 ^ 10) end
  return fmt("%d B", b)
end

---------------------------------------------------------------- one point

-- samples: per-round medians (µs). -> median, spread = (max - min) / median
function M.summarize(samples)
  local t = {}
  for i = 1, #samples do
    local v = samples[i]
    if type(v) == "number" and v == v then t[#t + 1] = v end
  end
  if #t == 0 then return nil, nil end
  table.sort(t)
  local n = #t
  local med = n % 2 == 1 and t[(n + 1) / 2] or 0.5 * (t[n / 2] + t[n / 2 + 1])
  local spread = med > 0 and (t[n] - t[1]) / med or 0
  return med, spread
end

---------------------------------------------------------------- crossovers

local function rank_of(order)
  local r = {}
  for i, name in ipairs(order) do if r[name] == nil then r[name] = i end end
  return r
end

-- cost tuples compare lexicographically; the excess is compared with a
-- small tolerance so float noise in sums never beats the preference order
local function better(a, b)
  if b == nil then return true end
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return a[2] < b[2] end
  if math.abs(a[3] - b[3]) > 1e-9 then return a[3] < b[3] end
  return a[4] < b[4]
end

-- derive(rows [, {rel=, abs=, order=}]) -> entries, choices
--   entries: { {upto=bytes, backend=}, ..., {backend=} }
--   choices: choices[i] = the backend chosen for rows[i]
function M.derive(rows, opts)
  opts = opts or {}
  if type(rows) ~= "table" or #rows == 0 then fail("derive", "no measured rows", 2) end
  local rel, abs = opts.rel or M.REL, opts.abs or M.ABS
  local prefer = rank_of(opts.order or M.ORDER)
  -- the backends, in a fixed order (preference, then name)
  local names, seen = {}, {}
  for i, r in ipairs(rows) do
    if type(r.bytes) ~= "number" then fail("derive", fmt("row %d has no bytes", i), 2) end
    if i > 1 and r.bytes <= rows[i - 1].bytes then
      fail("derive", fmt("rows must be sorted by increasing bytes (row %d: %s after %s)", i,
                         tostring(r.bytes), tostring(rows[i - 1].bytes)), 2)
    end
    for name, us in pairs(r.times or {}) do
      if type(us) == "number" and us == us and us < huge and not seen[name] then
        seen[name] = true
        names[#names + 1] = name
      end
    end
  end
  table.sort(names, function(a, b)
    local ra, rb = prefer[a] or 1000, prefer[b] or 1000
    if ra ~= rb then return ra < rb end
    return a < b
  end)
  local nb = #names
  if nb == 0 then fail("derive", "no backend has a time at any size", 2) end
  -- acceptable[i][k]: relative excess of names[k] at row i, or nil
  local acc = {}
  for i, r in ipairs(rows) do
    local best = huge
    for _, name in ipairs(names) do
      local us = r.times and r.times[name]
      if type(us) == "number" and us == us and us < best then best = us end
    end
    if best == huge then fail("derive", fmt("no backend has a time at %s bytes", tostring(r.bytes)), 2) end
    local limit = best + math.max(rel * best, abs)
    acc[i] = {}
    for k, name in ipairs(names) do
      local us = r.times[name]
      if type(us) == "number" and us == us and us <= limit then
        acc[i][k] = best > 0 and (us / best - 1) or 0
      end
    end
  end
  -- dp[i][k] = best cost of rows 1..i ending with names[k]; from[i][k] = previous k
  local dp, from = {}, {}
  for i = 1, #rows do
    dp[i], from[i] = {}, {}
    local dev_name = rows[i].builtin
    for k = 1, nb do
      local ex = acc[i][k]
      if ex ~= nil then
        local dev = (dev_name ~= nil and dev_name ~= names[k]) and 1 or 0
        local pref = prefer[names[k]] or 1000
        if i == 1 then
          dp[i][k] = { 1 + dev, dev, ex, pref }
        else
          local best, bj
          for j = 1, nb do
            local p = dp[i - 1][j]
            if p then
              local c = { p[1] + (j == k and 0 or 1) + dev, p[2] + dev, p[3] + ex, p[4] + pref }
              if better(c, best) then best, bj = c, j end
            end
          end
          dp[i][k], from[i][k] = best, bj
        end
      end
    end
  end
  local n = #rows
  local best, bk
  for k = 1, nb do
    if dp[n][k] and better(dp[n][k], best) then best, bk = dp[n][k], k end
  end
  local choices = {}
  for i = n, 1, -1 do
    choices[i] = names[bk]
    bk = from[i][bk]
  end
  local entries = {}
  for i = 1, n do
    if i == n or choices[i + 1] ~= choices[i] then
      entries[#entries + 1] = { upto = rows[i].bytes, backend = choices[i] }
    end
  end
  entries[#entries].upto = nil
  return entries, choices
end

-- rows(points, builtin, candidates) -> rows for derive. points: measured
-- points { bytes=, res = { [backend] = {us=, ok=} } } (fused: several shapes
-- share a byte size); builtin[point]: the built-in choice there. One row per
-- size, each backend's times summed over the shapes of that size, counted
-- only where it was correct (ok) at every one of them; the built-in choice
-- kept when all shapes agree. Sizes where no backend qualifies are left out.
function M.rows(points, builtin, candidates)
  builtin = builtin or {}
  local by, order = {}, {}
  for _, pt in ipairs(points) do
    local row = by[pt.bytes]
    if not row then
      row = { bytes = pt.bytes, times = {}, count = {}, n = 0, builtin = builtin[pt] }
      by[pt.bytes] = row
      order[#order + 1] = row
    end
    row.n = row.n + 1
    if row.builtin ~= builtin[pt] then row.builtin = nil end
    for _, b in ipairs(candidates) do
      local m = pt.res and pt.res[b]
      if m and m.ok and type(m.us) == "number" and m.us == m.us then
        row.times[b] = (row.times[b] or 0) + m.us
        row.count[b] = (row.count[b] or 0) + 1
      end
    end
  end
  local rows = {}
  for _, row in ipairs(order) do
    local any = false
    for b in pairs(row.times) do
      if row.count[b] ~= row.n then row.times[b] = nil else any = true end
    end
    if any then rows[#rows + 1] = { bytes = row.bytes, times = row.times, builtin = row.builtin } end
  end
  table.sort(rows, function(a, b) return a.bytes < b.bytes end)
  return rows
end

-- checksum(text) -> 31-bit number (ranks compare what they derived)
function M.checksum(text)
  local h = 0
  for i = 1, #text do h = (h * 31 + text:byte(i)) % 2147483647 end
  return h
end

-- pick(entries, bytes) -> backend: the first entry whose upto >= bytes
-- (an entry without upto serves everything).
function M.pick(entries, bytes)
  for _, e in ipairs(entries) do
    if e.upto == nil or bytes <= e.upto then return e.backend end
  end
  return nil
end

---------------------------------------------------------------- the file

local function sorted_keys(t)
  local k = {}
  for key in pairs(t) do k[#k + 1] = key end
  table.sort(k, function(a, b)
    if type(a) == type(b) then return a < b end
    return type(a) == "number"
  end)
  return k
end

local function quote(s) return fmt("%q", s) end

local function key_str(k)
  if type(k) == "number" then return "[" .. fmt("%d", k) .. "]" end
  if k:match("^[%a_][%w_]*$") then return k end
  return "[" .. quote(k) .. "]"
end

local function empty(t) return next(t) == nil end

-- worlds without any dtype are left out; nil when nothing is left
local function render_section(out, name, sec)
  local worlds = {}
  for _, world in ipairs(sorted_keys(sec)) do
    if type(sec[world]) == "table" and not empty(sec[world]) then worlds[#worlds + 1] = world end
  end
  if #worlds == 0 then return end
  out[#out + 1] = "  " .. name .. " = {"
  for _, world in ipairs(worlds) do
    out[#out + 1] = fmt("    %s = {", key_str(world))
    for _, dtype in ipairs(sorted_keys(sec[world])) do
      out[#out + 1] = fmt("      %s = {", key_str(dtype))
      for _, e in ipairs(sec[world][dtype]) do
        if e.upto then
          out[#out + 1] = fmt("        { upto = %d, backend = %s },  -- %s", e.upto, quote(e.backend),
                              M.human_bytes(e.upto))
        else
          out[#out + 1] = fmt("        { backend = %s },", quote(e.backend))
        end
      end
      out[#out + 1] = "      },"
    end
    out[#out + 1] = "    },"
  end
  out[#out + 1] = "  },"
end

-- The quick all-reduce (docs/quick-allreduce.md): its codecs, measured
-- beside the exact backends with --quick-codecs; quick_min derives from
-- those measurements the size from which each codec serves.
M.QUICK_CODECS = { "int8", "int4", "fp8" }
M.QUICK_NEVER = 2 ^ 50   -- "never faster up to the largest size measured" (an integer the file accepts)

-- quick_min(rows [, {rel=, abs=}]) -> { codec = bytes }: rows sorted by
-- bytes, each { bytes=, exact = the best exact backend's µs, quick = {
-- codec = µs } }. A codec's minimum is the smallest measured size from which
-- it beats the exact backends by the tie margin at that size and at every
-- larger one (a win, a loss, a win: from the last win on); M.QUICK_NEVER
-- when it does not win at the largest size.
function M.quick_min(rows, opts)
  opts = opts or {}
  local rel, abs = opts.rel or M.REL, opts.abs or M.ABS
  local out = {}
  for _, codec in ipairs(M.QUICK_CODECS) do
    local from, measured = nil, false
    for i = #rows, 1, -1 do
      local r = rows[i]
      local q, e = r.quick and r.quick[codec], r.exact
      if type(q) == "number" and type(e) == "number" then
        measured = true
        if q < e - math.max(rel * e, abs) then from = r.bytes else break end
      end
    end
    if measured then out[codec] = from or M.QUICK_NEVER end
  end
  return out
end

local function render_quick_min(out, q)
  local worlds = {}
  for _, world in ipairs(sorted_keys(q)) do
    if type(q[world]) == "table" and not empty(q[world]) then worlds[#worlds + 1] = world end
  end
  if #worlds == 0 then return end
  out[#out + 1] = "  quick_min = {   -- the quick all-reduce: bytes from which each codec serves (docs/quick-allreduce.md)"
  for _, world in ipairs(worlds) do
    out[#out + 1] = fmt("    %s = {", key_str(world))
    for _, dtype in ipairs(sorted_keys(q[world])) do
      local parts = {}
      for _, codec in ipairs(M.QUICK_CODECS) do
        local b = q[world][dtype][codec]
        if b then parts[#parts + 1] = fmt("%s = %d", codec, b) end
      end
      out[#out + 1] = fmt("      %s = { %s },", key_str(dtype), concat(parts, ", "))
    end
    out[#out + 1] = "    },"
  end
  out[#out + 1] = "  },"
end

-- render{machine=, date=, all_reduce=, fused=, quick_min=, comment=} -> Lua source
function M.render(doc)
  local out = {
    "-- weft policy file (docs/policy.md), written by scripts/weft-tune; see docs/tuning.md.",
    "-- Per world size and dtype, the first entry whose upto >= the call's bytes serves it;",
    "-- the entry without upto serves everything larger. Measured on the machine below:",
    "-- CUDA-graph replay, median of the slower rank.",
  }
  if doc.comment then
    for line in tostring(doc.comment):gmatch("[^\n]+") do out[#out + 1] = "-- " .. line end
  end
  out[#out + 1] = "return {"
  out[#out + 1] = "  version = 1,"
  out[#out + 1] = "  machine = " .. quote(doc.machine or "unknown") .. ","
  out[#out + 1] = "  date = " .. quote(doc.date or os.date("!%Y-%m-%d")) .. ","
  if doc.all_reduce then render_section(out, "all_reduce", doc.all_reduce) end
  if doc.fused then render_section(out, "fused", doc.fused) end
  if doc.quick_min then render_quick_min(out, doc.quick_min) end
  out[#out + 1] = "}"
  return concat(out, "\n") .. "\n"
end

-- Loads policy-file text as Lua in an empty environment (no globals, so it
-- cannot run code with effects) -> table, or nil, message.
function M.parse(text, name)
  local chunk, err = loadstring(text, "=" .. (name or "policy file"))
  if not chunk then return nil, err end
  setfenv(chunk, {})
  local ok, v = pcall(chunk)
  if not ok then return nil, tostring(v) end
  if type(v) ~= "table" then return nil, "does not return a table" end
  return v
end

-- check_shape(doc) -> true | nil, message: what the loader takes
-- (weft.internal.policy_file.validate, the one check of a policy file's
-- shape), and what weft-tune writes beyond it: a machine and a date, world
-- sizes (not "*"), known dtypes (not "*"), backends it measures, and every
-- list open-ended last.
function M.check_shape(doc)
  if type(doc) ~= "table" then return nil, "not a table" end
  if doc.version ~= 1 then return nil, "version must be 1, got " .. tostring(doc.version) end
  if type(doc.machine) ~= "string" then return nil, "machine must be a string" end
  if type(doc.date) ~= "string" or not doc.date:match("^%d%d%d%d%-%d%d%-%d%d$") then
    return nil, "date must be YYYY-MM-DD"
  end
  local ok, err = pcall(require("weft.internal.policy_file").validate, doc, "(tuned)")
  if not ok then return nil, tostring(err) end
  for _, sec in ipairs({ "all_reduce", "fused" }) do
    for world, per in pairs(doc[sec] or {}) do
      if type(world) ~= "number" then return nil, fmt("%s: world key %s: weft-tune writes sizes", sec, tostring(world)) end
      for dtype, list in pairs(per) do
        local where = fmt("%s[%d].%s", sec, world, tostring(dtype))
        if not M.ESIZE[dtype] then return nil, where .. ": unknown dtype" end
        for i, e in ipairs(list) do
          if not M.KNOWN_BACKENDS[sec][e.backend] then
            return nil, fmt("%s[%d]: weft-tune measures no backend %s", where, i, tostring(e.backend))
          end
        end
        if list[#list].upto ~= nil then return nil, fmt("%s[%d]: the last entry must have no upto", where, #list) end
      end
    end
  end
  return true
end

-- $XDG_CONFIG_HOME/weft/policy.lua, else ~/.config/weft/policy.lua
function M.default_path()
  local xdg = os.getenv("XDG_CONFIG_HOME")
  if xdg and xdg ~= "" then return xdg .. "/weft/policy.lua" end
  local home = os.getenv("HOME")
  if not home or home == "" then fail("default_path", "neither XDG_CONFIG_HOME nor HOME is set (pass --out FILE)", 2) end
  return home .. "/.config/weft/policy.lua"
end

local function shq(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Writes text to path atomically (temporary file in the same folder, then
-- rename), creating the folder.
function M.write_file(path, text)
  local dir = path:match("^(.*)/[^/]*$")
  if dir and dir ~= "" then os.execute("mkdir -p " .. shq(dir)) end
  local tmp = path .. ".tmp" .. tostring(os.time())
  local f, err = io.open(tmp, "w")
  if not f then fail("write_file", "cannot write " .. path .. ": " .. tostring(err), 2) end
  f:write(text)
  f:close()
  local ok, e2 = os.rename(tmp, path)
  if not ok then
    os.remove(tmp)
    fail("write_file", "cannot rename onto " .. path .. ": " .. tostring(e2), 2)
  end
  return path
end

---------------------------------------------------------------- before / after

-- The tuned time is "slower beyond noise" when it exceeds the built-in's by
-- more than max(noise_rel, noise) relative plus noise_abs µs.
-- -> ok, limit_us
function M.verdict(builtin_us, tuned_us, noise, o)
  o = o or {}
  local rel = math.max(o.rel or M.NOISE_REL, noise or 0)
  local limit = builtin_us * (1 + rel) + (o.abs or M.NOISE_ABS)
  return tuned_us <= limit, limit
end

return M
