-- weft.tools.topo_svg — a topology plan (weft.topology.plan) drawn as SVG (pure).
--
-- One panel per group kind, in topology.KINDS order. In every panel each rank
-- is a cell (its global rank written inside when the cell is big enough),
-- ranks laid out node by node (gpus_per_node per node, up to 8 cells a row
-- inside a node, the node outlined and labelled). Cells of one colour form
-- one group of that kind; groups of a single rank are grey. An aliased kind
-- (the seed's `_X = _Y`) is drawn with its target's colours, a dashed frame
-- and the note "same as tp". Cells carry a <title> (a hover tooltip in a
-- browser) naming the rank, its node and its group, for worlds up to
-- TOOLTIP_MAX ranks (beyond it the file would grow past a few MB).
--
-- Sizes shrink with the world: cells from 34 px down to 3 px; rank numbers
-- are dropped below 15 px cells; below 6 px cells only the first node of each
-- row is named (in a gutter on the left).
local topology = require("weft.topology")
local svg = require("weft.tools.svg")

local M = {}

local fmt, concat, floor, ceil, min, max = string.format, table.concat, math.floor, math.ceil,
                                           math.min, math.max

M.TOOLTIP_MAX = 2048
M.MAX_WIDTH = 1400      -- the canvas aims to stay this wide or narrower
local PANEL_W = 400     -- what one panel's cell grid aims to fill
local CELL_MAX, CELL_MIN = 34, 3
local LEGEND_MAX = 8    -- groups listed one by one in a panel's legend
local SINGLE = "#d5d9de" -- groups of one rank

M.DESCR = {
  tp = "tensor parallel", pp = "pipeline parallel", attn_tp = "attention tensor parallel",
  attn_cp = "attention context parallel", moe_ep = "MoE expert parallel",
  moe_tp = "MoE tensor parallel", moe_dp = "MoE data parallel", dcp = "decode context parallel",
}

local text_w, wrap = svg.text_w, svg.wrap

local function hsl_rgb(h, s, l)
  local function f(n)
    local k = (n + h * 12) % 12
    local a = s * min(l, 1 - l)
    return l - a * max(-1, min(k - 3, 9 - k, 1))
  end
  return f(0), f(8), f(4)
end

-- Colour of group i (0-based): hues step by the golden ratio, so any run of
-- consecutive groups stays far apart on the wheel; lightness cycles over
-- four levels, so groups whose hues come close again (i and i + 21, i + 34,
-- i + 55: Fibonacci steps) differ in lightness. (Four levels beat three:
-- minimum CIELAB distance over the first 32 / 64 groups 8.1 / 7.8, not 3.7 / 3.3.)
-- Returns "#rrggbb" and the colour of text drawn on it.
function M.color(i)
  local h = (0.05 + i * 0.6180339887498949) % 1
  local l = 0.40 + 0.38 * (i % 4) / 3
  local r, g, b = hsl_rgb(h, 0.68, l)
  local lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
  return fmt("#%02x%02x%02x", floor(r * 255 + 0.5), floor(g * 255 + 0.5), floor(b * 255 + 0.5)),
         lum > 0.5 and "#111" or "#fff"
end

local function posint(v, what)
  if type(v) ~= "number" or v ~= floor(v) or v < 1 or v == math.huge then
    error(fmt("weft: topo_svg.render: %s must be a positive integer (got %s)", what, tostring(v)), 3)
  end
  return v
end

-- The pixel layout of one panel's node grid with `across` nodes side by
-- side. Big cells: each node labelled above its frame. Small cells (< 6 px):
-- thin frames, no per-node labels, the first node of each row named in a
-- gutter on the left, so frames and labels do not crowd out the cells.
local function layout(world, gpn, across)
  local L = { nnodes = ceil(world / gpn), across = across }
  L.nbw = min(gpn, 8)                    -- cells across a node
  L.nbh = ceil(gpn / L.nbw)              -- cell rows in a node
  L.down = ceil(L.nnodes / across)
  local c = max(CELL_MIN, min(CELL_MAX, floor(PANEL_W / (across * (L.nbw + 1)))))
  L.c = c
  L.small = c < 6
  L.pad = L.small and 1 or max(2, floor(c / 5))
  L.ngap = L.small and 2 or max(4, floor(c / 3))
  L.nfont = min(11, max(7, floor(c * 0.45)))
  L.node_w = L.nbw * c + 2 * L.pad
  L.node_h = L.nbh * c + 2 * L.pad
  L.label_h = L.small and 0 or L.nfont + 3
  L.gutter = L.small and floor(text_w("node " .. (L.nnodes - 1), L.nfont)) + 6 or 0
  -- in the gutter, name every label_every-th row so labels do not touch
  L.label_every = L.small and ceil((L.nfont + 2) / (L.node_h + L.ngap)) or 1
  L.grid_w = L.gutter + across * L.node_w + (across - 1) * L.ngap
  L.grid_h = L.down * (L.label_h + L.node_h) + (L.down - 1) * L.ngap
  return L
end

-- Chooses how many nodes sit side by side: the panel closest to 3:2, full
-- rows preferred.
local function grid(world, gpn)
  local nnodes = ceil(world / gpn)
  local best, best_cost
  for na = 1, nnodes do
    local L = layout(world, gpn, na)
    local cost = math.abs(math.log(L.grid_w / L.grid_h) - math.log(1.5))
    if nnodes % na ~= 0 then cost = cost + 0.08 end
    if not best or cost < best_cost then best, best_cost = L, cost end
    if L.grid_w > 2 * PANEL_W then break end   -- wider only gets worse
  end
  return best
end

-- render(plan [, {gpus_per_node = 8, title = string}]) -> SVG text
function M.render(plan, opts)
  if type(plan) ~= "table" or type(plan.groups) ~= "table" or type(plan.world_size) ~= "number" then
    error("weft: topo_svg.render: argument is not a plan from topology.plan{}", 2)
  end
  opts = opts or {}
  if type(opts) ~= "table" then error("weft: topo_svg.render: options must be a table", 2) end
  local gpn = posint(opts.gpus_per_node or 8, "gpus_per_node")
  local world = plan.world_size
  local kinds = topology.kinds_of(plan)
  local idx = topology.index_of(plan)
  local aliases = plan.aliases or {}
  local G = grid(world, gpn)
  local c, pad, nfont, nlabel_h = G.c, G.pad, G.nfont, G.label_h
  local node_w, node_h, ngap = G.node_w, G.node_h, G.ngap
  local show_rank = c >= 15             -- numbers of at least 6 px
  local rfont = min(13, floor(c * 0.4))
  local tips = world <= M.TOOLTIP_MAX
  local node_label = function(n)
    if G.small then return nil end
    local long = "node " .. n
    if text_w(long, nfont) <= node_w then return long end
    if text_w(tostring(n), nfont) <= node_w then return tostring(n) end
    return nil
  end

  local ppad = 12
  local grid_w, grid_h = G.grid_w, G.grid_h
  -- each panel's heading and note (the note wraps when the panel is narrow)
  local HFONT, NFONT, NLINE = 14, 11, 13
  local heads, notes = {}, {}
  local panel_w = max(grid_w + 2 * ppad, 260)
  for _, k in ipairs(kinds) do
    local list = plan.groups[k]
    heads[k] = fmt("%s: %d group%s of %d", k, #list, #list == 1 and "" or "s", #list[1])
    panel_w = max(panel_w, ceil(text_w(heads[k], HFONT, true)) + 2 * ppad)
  end
  local inner_w = panel_w - 2 * ppad
  local note_lines = 1
  for _, k in ipairs(kinds) do
    local list = plan.groups[k]
    local note = aliases[k] and fmt("same as %s (the same group object)", aliases[k]) or (M.DESCR[k] or k)
    if #list[1] > 1 and G.nnodes > 1 then
      local span = topology.node_span(list, gpn)
      note = note .. (span > 1 and fmt("; a group spans up to %d nodes", span) or "; each group within a node")
    end
    notes[k] = text_w(note, NFONT) <= inner_w and { note } or wrap(note, inner_w, NFONT)
    note_lines = max(note_lines, #notes[k])
  end
  local head_h = 40 + (note_lines - 1) * NLINE

  -- legend entries of each panel, then a common legend height
  local LFONT, LLINE = 11, 16
  local legends = {}
  local legend_lines = 1
  for _, k in ipairs(kinds) do
    local list = plan.groups[k]
    local ent = {}
    if #list[1] == 1 then
      ent[1] = { color = SINGLE, text = "every rank is a group of its own" }
    else
      local shown = #list <= LEGEND_MAX and #list or LEGEND_MAX - 1
      for g = 1, shown do
        ent[#ent + 1] = { color = (M.color(g - 1)),
                          text = fmt("%s.%d: %s", aliases[k] or k, g - 1, topology.ranks_str(list[g])) }
      end
    end
    local more
    if #list[1] > 1 and #list > #ent then
      more = fmt("... and %d more groups%s", #list - #ent, tips and " (hover a cell)" or "")
    end
    local colw = 0
    for _, e in ipairs(ent) do colw = max(colw, text_w(e.text, LFONT) + (e.color and 18 or 0) + 14) end
    local ncol = max(1, min(#ent, floor(inner_w / colw)))
    legends[k] = { ent = ent, ncol = ncol, colw = floor(inner_w / ncol), more = more }
    legend_lines = max(legend_lines, ceil(#ent / ncol) + (more and 1 or 0))
  end
  local panel_h = head_h + grid_h + 12 + legend_lines * LLINE + 8

  -- panels per row: as many as fit MAX_WIDTH, balanced over the rows
  local margin, pgap = 20, 16
  local pc = max(1, min(#kinds, floor((M.MAX_WIDTH - 2 * margin + pgap) / (panel_w + pgap))))
  local prow = ceil(#kinds / pc)
  pc = ceil(#kinds / prow)
  local width = max(2 * margin + pc * panel_w + (pc - 1) * pgap, 680)

  -- title block
  local s = plan.sizes or {}
  local title = opts.title
  if not title then
    title = fmt("weft topology: world %d", world)
    if s.tp_size then title = title .. fmt(" = tp %d x pp %d", s.tp_size, s.pp_size) end
  end
  local sub = {}
  if s.tp_size then
    sub[#sub + 1] = fmt("attention: tp %d, cp %d, dp %d", s.attn_tp_size, s.attn_cp_size, s.attn_dp_size)
    sub[#sub + 1] = fmt("MoE: ep %d, tp %d, dp %d", s.moe_ep_size, s.moe_tp_size, s.moe_dp_size)
    sub[#sub + 1] = fmt("dcp %d", s.dcp_size)
  end
  sub[#sub + 1] = fmt("%d node%s x %d GPUs", G.nnodes, G.nnodes == 1 and "" or "s", gpn)
  local key = "Each cell is one rank" .. (show_rank and " (its global rank inside)" or "")
    .. ", laid out node by node; a dark frame is a node. In a panel, cells of one colour form one group"
    .. " of that kind; grey cells are groups of a single rank; a dashed panel is the same group object"
    .. " as the kind it names." .. (tips and " Hover a cell for its rank and group." or "")
  local subline = concat(sub, "  |  ")
  width = max(width, ceil(text_w(title, 20, true)) + 2 * margin, ceil(text_w(subline, 13)) + 2 * margin)
  local key_lines = wrap(key, width - 2 * margin, 12)
  local top = margin + 26 + 20 + #key_lines * 16 + 10
  local height = top + prow * panel_h + (prow - 1) * pgap + margin

  local D = svg.new(width, height)
  local function w(...) D:raw(fmt(...)) end
  local function text(x, y, str, o) D:text(x, y, str, o) end
  w('<style>.n{fill:#f4f5f7;stroke:#3b4252;stroke-width:1.2}.ns{stroke-width:0.6;stroke:#6b7280}.u{fill:none;stroke:#b8bec8;stroke-dasharray:2 2}'
    .. '.p{fill:#fff;stroke:#c3c8d0}.a{fill:#fff;stroke:#7a8494;stroke-dasharray:6 4}'
    .. '</style>\n')
  w('<rect width="100%%" height="100%%" fill="#fbfbfc"/>\n')
  text(margin, margin + 18, title, { size = 20, bold = true, fill = "#111" })
  text(margin, margin + 40, subline, { size = 13, fill = "#333" })
  for i, line in ipairs(key_lines) do
    text(margin, margin + 42 + i * 16, line, { size = 12, fill = "#555" })
  end

  for pi, k in ipairs(kinds) do
    local list, ik = plan.groups[k], idx[k]
    local single = #list[1] == 1
    local alias = aliases[k]
    local px = margin + ((pi - 1) % pc) * (panel_w + pgap)
    local py = top + floor((pi - 1) / pc) * (panel_h + pgap)
    w('<g id="panel-%s">\n', k)
    w('<rect class="%s" x="%d" y="%d" width="%d" height="%d" rx="6"/>\n', alias and "a" or "p",
      px, py, panel_w, panel_h)
    text(px + ppad, py + 18, heads[k], { size = HFONT, bold = true, fill = "#111" })
    for i, line in ipairs(notes[k]) do
      text(px + ppad, py + 33 + (i - 1) * NLINE, line, { size = NFONT, fill = alias and "#b0321c" or "#555" })
    end

    local gx, gy = px + ppad, py + head_h
    for n = 0, G.nnodes - 1 do
      local nx = gx + G.gutter + (n % G.across) * (node_w + ngap)
      local ny = gy + floor(n / G.across) * (nlabel_h + node_h + ngap)
      local lab = node_label(n)
      if lab then text(nx + 1, ny + nfont, lab, { size = nfont, fill = "#3b4252" }) end
      if G.small and n % (G.across * G.label_every) == 0 then
        text(gx, ny + floor(node_h / 2 + nfont * 0.36 + 0.5), "node " .. n,
             { size = nfont, fill = "#3b4252" })
      end
      ny = ny + nlabel_h
      w('<rect class="%s" x="%d" y="%d" width="%d" height="%d" rx="%d"/>\n', G.small and "n ns" or "n",
        nx, ny, node_w, node_h, G.small and 1 or 3)
      for j = 0, gpn - 1 do
        local rank = n * gpn + j
        local cx = nx + pad + (j % G.nbw) * c
        local cy = ny + pad + floor(j / G.nbw) * c
        local inset = c >= 10 and 1 or 0
        local sz = c - 2 * inset - ((c < 10 and not G.small) and 1 or 0) -- tiny cells touch
        if rank >= world then
          if c >= 6 then
            w('<rect class="u" x="%d" y="%d" width="%d" height="%d"/>\n', cx + inset, cy + inset, sz, sz)
          end
        else
          local g = ik[rank + 1]
          local fill, ink = SINGLE, "#333"
          if not single then fill, ink = M.color(g) end
          local cell = fmt('<rect x="%d" y="%d" width="%d" height="%d"%s fill="%s"', cx + inset, cy + inset,
                           sz, sz, c >= 10 and ' rx="2"' or "", fill)
          if tips then
            w('%s><title>rank %d, node %d: %s.%d = %s</title></rect>\n', cell, rank, n, alias or k, g,
              topology.ranks_str(list[g + 1]))
          else
            w('%s/>\n', cell)
          end
          if show_rank then
            -- baseline placed by hand (digits are ~0.7 em tall): renderers
            -- disagree on dominant-baseline
            text(cx + floor(c / 2), cy + floor(c / 2 + rfont * 0.36 + 0.5), rank,
                 { size = rfont, anchor = "middle", fill = ink })
          end
        end
      end
    end

    local L = legends[k]
    local ly = gy + grid_h + 12
    for e, ent in ipairs(L.ent) do
      local col = (e - 1) % L.ncol
      local row = floor((e - 1) / L.ncol)
      local ex, ey = px + ppad + col * L.colw, ly + row * LLINE
      local tx = ex
      if ent.color then
        w('<rect x="%d" y="%d" width="12" height="12" rx="2" fill="%s" stroke="#888" stroke-width="0.5"/>\n',
          ex, ey, ent.color)
        tx = ex + 17
      end
      text(tx, ey + 10, ent.text, { size = LFONT, fill = "#222" })
    end
    if L.more then
      text(px + ppad, ly + ceil(#L.ent / L.ncol) * LLINE + 10, L.more, { size = LFONT, fill = "#555" })
    end
    w('</g>\n')
  end
  return D:finish()
end

return M
