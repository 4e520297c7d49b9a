-- weft.tools.plot — benchmark results (the JSON of docs/architecture.md) drawn as SVG charts.
-- Pure apart from write_for (reads the JSON, writes the SVG beside it).
--
-- From the records of one results file:
--   * latency vs size (log-log): records with bytes and us and no tokens, one
--     chart per (op, mode, world, dtype), one line per backend: weft's
--     backends and the peers measured in the same run (NCCL, MPI, ...) side
--     by side;
--   * bus bandwidth vs size (log x): the same groups, where records carry
--     busbw_gbs;
--   * latency by token count (log-log): records with tokens, one chart per
--     (op, mode, world, dtype, hidden): fused vs unfused, with FlashInfer's
--     reference figures as dashed lines where the file comes
--     from the machine kind they were measured on.
-- A line needs two points; a chart needs a line of three. Only the main sweep
-- is drawn (the leading lines missing at most one of the chart's sizes,
-- MAX_SERIES of them); the rest is counted in a note. Lines are coloured by backend name,
-- the same colour in every chart of a file.
local svg = require("weft.tools.svg")
local json = require("weft.internal.json")

local M = {}

local fmt, floor, ceil, log, max, min = string.format, math.floor, math.ceil, math.log, math.max, math.min
local concat, sort = table.concat, table.sort

-- FlashInfer's TensorRT-LLM-derived kernels (the ones SGLang's fusion calls),
-- measured 2026-11-30 on nvidia-h200-x2, world 2, bf16, CUDA-graph replay,
-- median µs, output checked (the "FlashInfer" rows of the fused results' .md). Keyed by hidden, then tokens.
local TOKENS = { 1, 8, 32, 128, 512, 2048, 8192 }
local FLASHINFER = {
  fused_ar_rmsnorm = {
    [4096] = { ["FlashInfer fused one-shot"] = { 4.47, 4.97, 5.84, 7.32, 19.5, 85.5, 333 },
               ["FlashInfer fused two-shot"] = { false, 38.3, 17.2, 15.0, 26.1, 94.6, 354 } },
    [8192] = { ["FlashInfer fused one-shot"] = { 5.10, 5.79, 6.86, 11.2, 38.0, 154, 601 },
               ["FlashInfer fused two-shot"] = { false, 24.5, 17.5, 19.5, 47.4, 164, 618 } },
  },
  all_reduce = {
    [4096] = { ["FlashInfer AR one-shot"] = { 2.53, 2.54, 3.15, 5.67, 16.8, 71.8, 283 },
               ["FlashInfer AR two-shot"] = { false, 35.0, 14.0, 12.0, 23.8, 75.8, 297 } },
    [8192] = { ["FlashInfer AR one-shot"] = { 2.54, 2.78, 4.02, 9.95, 33.6, 136, 534 },
               ["FlashInfer AR two-shot"] = { false, 20.2, 13.5, 16.7, 39.0, 141, 537 } },
  },
}
M.REFERENCE_MACHINE = "nvidia-h200-x2"
M.MAX_SERIES = 6   -- measured lines a chart draws (references come on top)

-- Tableau 10, then darker variants; peers get fixed greys/blacks.
local PALETTE = { "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                  "#ff9da7", "#9c755f", "#2f4b7c", "#a05195", "#d45087", "#665191", "#003f5c" }
local FIXED = { nccl = "#222222", mpi = "#7f7f7f", store = "#7f7f7f" }
local REF_COLOR = "#6b6b6b"

local function human_bytes(b)
  if b >= 1024 ^ 3 then return fmt("%g GiB", b / 1024 ^ 3) end
  if b >= 1024 ^ 2 then return fmt("%g MiB", b / 1024 ^ 2) end
  if b >= 1024 then return fmt("%g KiB", b / 1024) end
  return fmt("%g B", b)
end

local function human_us(v)
  if v >= 1e6 then return fmt("%g s", v / 1e6) end
  if v >= 1e3 then return fmt("%g ms", v / 1e3) end
  return fmt("%g µs", v)
end

local function keyof(...) return concat({ ... }, "\0") end

-- charts(doc) -> list of {title, xlabel, ylabel, xlog, ylog, xfmt, yfmt,
--                         series = {{name, points = {{x, y}...}, ref = bool}}}
function M.charts(doc)
  if type(doc) ~= "table" or type(doc.records) ~= "table" then
    error("weft: plot.charts: argument is not a results document ({machine, date, records = {...}}, docs/architecture.md)", 2)
  end
  local groups, order = {}, {}
  local function add(kind, key, title, r, x, y)
    local gk = keyof(kind, key)
    local g = groups[gk]
    if not g then
      g = { kind = kind, title = title, by = {}, names = {}, op = r.op, hidden = r.hidden, mode = r.mode,
            world = r.world, dtype = r.dtype }
      groups[gk] = g
      order[#order + 1] = gk
    end
    local b = tostring(r.backend or "?")
    if not g.by[b] then g.by[b] = {}; g.names[#g.names + 1] = b end
    local pts = g.by[b]
    pts[#pts + 1] = { x, y }
  end
  for _, r in ipairs(doc.records) do
    if type(r) == "table" and type(r.us) == "number" and r.us > 0 then
      local parts = { tostring(r.op or "?") }
      if r.mode then parts[#parts + 1] = tostring(r.mode) end
      if r.world then parts[#parts + 1] = "world " .. tostring(r.world) end
      if r.dtype then parts[#parts + 1] = tostring(r.dtype) end
      local what = concat(parts, ", ")
      if type(r.tokens) == "number" and r.tokens > 0 then
        local hid = r.hidden and (", hidden " .. r.hidden) or ""
        add("tokens", keyof(r.op, r.mode, r.world, r.dtype, r.hidden), what .. hid, r, r.tokens, r.us)
      elseif type(r.bytes) == "number" and r.bytes > 0 then
        local k = keyof(r.op, r.mode, r.world, r.dtype)
        add("latency", k, what, r, r.bytes, r.us)
        if type(r.busbw_gbs) == "number" and r.busbw_gbs > 0 then add("busbw", k, what, r, r.bytes, r.busbw_gbs) end
      end
    end
  end
  local out = {}
  local ref = doc.machine == M.REFERENCE_MACHINE
  for _, gk in ipairs(order) do
    local g = groups[gk]
    local series = {}
    for _, name in ipairs(g.names) do
      local pts = g.by[name]
      sort(pts, function(a, b) return a[1] < b[1] end)
      -- a size measured twice in one file (a sweep, a rerun): the first record counts
      local uniq = {}
      for _, p in ipairs(pts) do
        if not uniq[#uniq] or uniq[#uniq][1] ~= p[1] then uniq[#uniq + 1] = p end
      end
      if #uniq >= 2 then series[#series + 1] = { name = name, points = uniq } end
    end
    -- the main sweep: the leading run, in the file's order, of lines with
    -- (nearly) every size of the chart, at most MAX_SERIES; the side
    -- experiments measured after it (launch shapes at a few sizes) stay in
    -- the JSON and are counted in a note
    local most = 0
    for _, se in ipairs(series) do most = max(most, #se.points) end
    local kept, left, run = {}, 0, true
    for _, se in ipairs(series) do
      run = run and #se.points >= most - 1 and #kept < M.MAX_SERIES
      if run then kept[#kept + 1] = se else left = left + 1 end
    end
    series = most >= 3 and kept or {}
    if g.kind == "tokens" and ref and g.world == 2 and g.dtype == "bf16" and (g.mode or "graph") == "graph" then
      local refs = FLASHINFER[g.op] and FLASHINFER[g.op][g.hidden]
      if refs and #series > 0 then
        local names = {}
        for n in pairs(refs) do names[#names + 1] = n end
        sort(names)
        for _, n in ipairs(names) do
          local pts = {}
          for i, t in ipairs(TOKENS) do if refs[n][i] then pts[#pts + 1] = { t, refs[n][i] } end end
          series[#series + 1] = { name = n .. " (reference)", points = pts, ref = true,
                                  dash = n:find("two%-shot") and "2 3" or "6 3" }
        end
      end
    end
    if #series > 0 then
      local c = { kind = g.kind, series = series, xlog = true, left_out = left }
      if g.kind == "latency" then
        c.title = "latency vs size: " .. g.title
        c.xlabel, c.ylabel, c.ylog, c.xfmt, c.yfmt = "bytes", "median time per call", true, human_bytes, human_us
      elseif g.kind == "busbw" then
        c.title = "bus bandwidth vs size: " .. g.title
        c.xlabel, c.ylabel, c.ylog, c.xfmt = "bytes", "bus bandwidth (GB/s)", false, human_bytes
        c.yfmt = function(v) return fmt("%g", v) end
      else
        c.title = "latency by tokens: " .. g.title
        c.xlabel, c.ylabel, c.ylog, c.yfmt = "tokens", "median time per call", true, human_us
        c.xfmt = function(v) return fmt("%g", v) end
      end
      out[#out + 1] = c
    end
  end
  return out
end

-- Tick values for a log axis over [lo, hi]: powers of 2 (bytes, tokens) or
-- 1-2-5 decades (time), thinned to at most `most` labels.
local function log_ticks(lo, hi, base2, most)
  local t = {}
  if base2 then
    local a, b = floor(log(lo) / log(2) + 1e-9), ceil(log(hi) / log(2) - 1e-9)
    local step = 1
    while (b - a) / step + 1 > most do step = step * 2 end
    for e = a, b + step - 1, step do t[#t + 1] = 2 ^ e end
  else
    local a, b = floor(log(lo) / log(10) + 1e-9), ceil(log(hi) / log(10) - 1e-9)
    local mult = (b - a) <= 2 and { 1, 2, 5 } or { 1 }
    for e = a, b do
      for _, m in ipairs(mult) do t[#t + 1] = m * 10 ^ e end
    end
  end
  return t
end
M.log_ticks = log_ticks

local function lin_ticks(hi)
  if hi <= 0 then return { 0, 1 } end
  local raw = hi / 5
  local p = 10 ^ floor(log(raw) / log(10))
  local step = raw / p <= 1 and p or raw / p <= 2 and 2 * p or raw / p <= 5 and 5 * p or 10 * p
  local t = {}
  for v = 0, hi + step * 0.999, step do t[#t + 1] = v end
  return t
end

local PW, PH = 600, 400              -- one chart's panel
local ML, MR, MT, MB = 70, 28, 44, 44 -- plot area inside the panel
local LEG_LINE, LEG_FONT = 15, 11

local function legend_layout(series, inner)
  local colw = 0
  for _, s in ipairs(series) do colw = max(colw, svg.text_w(s.name, LEG_FONT) + 30) end
  local ncol = max(1, min(#series, floor(inner / colw)))
  return ncol, ceil(#series / ncol), floor(inner / ncol)
end

-- render(doc [, {title = string}]) -> SVG text, number of charts; nil, 0 when
-- the file has nothing to draw.
function M.render(doc, opts)
  opts = opts or {}
  local charts = M.charts(doc)
  if #charts == 0 then return nil, 0 end
  -- colours by backend name, in order of first appearance
  local colors, ncolor = {}, 0
  for _, c in ipairs(charts) do
    for _, s in ipairs(c.series) do
      if not colors[s.name] then
        if s.ref then colors[s.name] = REF_COLOR
        elseif FIXED[s.name] then colors[s.name] = FIXED[s.name]
        else ncolor = ncolor + 1; colors[s.name] = PALETTE[(ncolor - 1) % #PALETTE + 1] end
      end
    end
  end
  local leg_rows = 0
  for _, c in ipairs(charts) do
    local _, rows = legend_layout(c.series, PW - ML - MR)
    leg_rows = max(leg_rows, rows)
  end
  local ph = PH + leg_rows * LEG_LINE + 8
  local cols = #charts == 1 and 1 or 2
  local rows = ceil(#charts / cols)
  local margin, gap = 20, 16
  local title = opts.title or fmt("weft benchmark: %s, %s%s", tostring(doc.machine or "?"), tostring(doc.date or "?"),
                                  doc.commit and (", commit " .. tostring(doc.commit)) or "")
  local width = max(2 * margin + cols * PW + (cols - 1) * gap, ceil(svg.text_w(title, 18, true)) + 2 * margin)
  local top = margin + 34
  local height = top + rows * ph + (rows - 1) * gap + margin
  local D = svg.new(width, height, { background = "#ffffff" })
  D:text(margin, margin + 16, title, { size = 18, bold = true, fill = "#111" })

  for ci, c in ipairs(charts) do
    local px = margin + ((ci - 1) % cols) * (PW + gap)
    local py = top + floor((ci - 1) / cols) * (ph + gap)
    local x0, y0, x1, y1 = px + ML, py + MT, px + PW - MR, py + PH - MB  -- plot area
    D:raw(fmt('<g id="chart-%d">\n', ci))
    D:rect(px, py, PW, ph, 'fill="#fbfbfc" stroke="#c3c8d0" rx="6"')
    local t = c.title
    local tsize = 13
    while svg.text_w(t, tsize, true) > PW - 24 and tsize > 9 do tsize = tsize - 1 end
    D:text(px + 12, py + 22, t, { size = tsize, bold = true, fill = "#111" })
    -- ranges
    local xlo, xhi, ylo, yhi = math.huge, 0, math.huge, 0
    for _, s in ipairs(c.series) do
      for _, p in ipairs(s.points) do
        xlo, xhi, ylo, yhi = min(xlo, p[1]), max(xhi, p[1]), min(ylo, p[2]), max(yhi, p[2])
      end
    end
    local xt = log_ticks(xlo, xhi, true, 8)
    local yt = c.ylog and log_ticks(ylo, yhi, false) or lin_ticks(yhi * 1.05)
    local xa, xb = log(xt[1]), log(max(xt[#xt], xt[1] * 2))
    local ya, yb
    if c.ylog then ya, yb = log(yt[1]), log(max(yt[#yt], yt[1] * 10)) else ya, yb = 0, yt[#yt] end
    local function X(v) return x0 + (log(v) - xa) / (xb - xa) * (x1 - x0) end
    local function Y(v)
      local u = c.ylog and log(v) or v
      return y1 - (u - ya) / (yb - ya) * (y1 - y0)
    end
    D:rect(x0, y0, x1 - x0, y1 - y0, 'fill="#ffffff" stroke="#9aa1ab"')
    for _, v in ipairs(xt) do
      local x = X(v)
      D:line(x, y0, x, y1, 'stroke="#e3e6ea" stroke-width="1"')
      D:text(x, y1 + 15, c.xfmt(v), { size = 10, anchor = "middle", fill = "#333" })
    end
    for _, v in ipairs(yt) do
      local y = Y(v)
      D:line(x0, y, x1, y, 'stroke="#e3e6ea" stroke-width="1"')
      D:text(x0 - 5, y + 3.5, c.yfmt(v), { size = 10, anchor = "end", fill = "#333" })
    end
    D:text((x0 + x1) / 2, y1 + 32, c.xlabel .. " (log scale)", { size = 11, anchor = "middle", fill = "#444" })
    D:text(px + 14, (y0 + y1) / 2, c.ylabel .. (c.ylog and " (log scale)" or ""),
           { size = 11, anchor = "middle", fill = "#444", rotate = -90 })
    for _, s in ipairs(c.series) do
      local pts = {}
      for i, p in ipairs(s.points) do pts[i] = { X(p[1]), Y(p[2]) } end
      local col = colors[s.name]
      D:raw(fmt('<g data-series="%s">\n', svg.esc(s.name)))
      D:polyline(pts, fmt('stroke="%s" stroke-width="%s"%s', col, s.ref and "1.6" or "2",
                          s.dash and (' stroke-dasharray="' .. s.dash .. '"') or ""))
      for i, p in ipairs(pts) do
        D:raw(fmt('<circle cx="%s" cy="%s" r="2.6" fill="%s"><title>%s: %s, %s</title></circle>\n',
                  svg.num(p[1]), svg.num(p[2]), col, svg.esc(s.name), svg.esc(c.xfmt(s.points[i][1])),
                  svg.esc(c.kind == "busbw" and fmt("%.3g GB/s", s.points[i][2]) or human_us(s.points[i][2]))))
      end
      D:raw("</g>\n")
    end
    -- legend below the axes
    local ncol, _, colw = legend_layout(c.series, PW - ML - MR)
    for i, s in ipairs(c.series) do
      local lx = x0 + ((i - 1) % ncol) * colw
      local ly = py + PH + floor((i - 1) / ncol) * LEG_LINE
      D:line(lx, ly - 4, lx + 20, ly - 4, fmt('stroke="%s" stroke-width="2"%s', colors[s.name],
                                                s.dash and (' stroke-dasharray="' .. s.dash .. '"') or ""))
      D:text(lx + 25, ly, s.name, { size = LEG_FONT, fill = "#222" })
    end
    if c.left_out > 0 then
      D:text(x1, y0 - 6, fmt("+ %d more series in the JSON (fewer sizes)", c.left_out),
             { size = 10, anchor = "end", fill = "#666" })
    end
    D:raw("</g>\n")
  end
  return D:finish(), #charts
end

-- write_for(json_path [, doc]) -> svg path, number of charts (nil, 0 when
-- there is nothing to draw). The SVG goes beside the JSON: x.json -> x.svg.
function M.write_for(path, doc)
  if not doc then
    local f, err = io.open(path, "r")
    if not f then error("weft: plot: cannot read " .. tostring(err), 2) end
    local text = f:read("*a")
    f:close()
    local ok, d = pcall(json.decode, text, "plot")
    if not ok then error(fmt("weft: plot: %s is not JSON: %s", path, tostring(d)), 2) end
    doc = d
  end
  local text, n = M.render(doc)
  if not text then return nil, 0 end
  local out = path:gsub("%.json$", "") .. ".svg"
  local f = assert(io.open(out, "w"))
  f:write(text)
  f:close()
  return out, n
end

return M
