-- weft.tools.topo_svg: a plan drawn as SVG. The pictures are checked as data:
-- well-formed XML, one cell per (kind, rank) with the colour of its group,
-- every cell inside the frame of its node, labels dropped when cells shrink.
describe("weft.tools.topo_svg", function()
  local topology = require("weft.topology")
  local topo_svg = require("weft.tools.topo_svg")

  -- A small XML well-formedness check (elements nest and close, attributes
  -- are quoted and unique, text has no bare '<' or stray '&'). Returns true
  -- or false and the reason.
  local function well_formed(s)
    local pos, stack, roots = 1, {}, 0
    local function bad(why) return false, ("%s at byte %d"):format(why, pos) end
    local ENT = { amp = true, lt = true, gt = true, quot = true, apos = true }
    local function text_ok(t) -- every '&' starts an entity
      local i = t:find("&", 1, true)
      while i do
        local name = t:match("^&([#%w]+);", i)
        if not (name and (ENT[name] or name:match("^#%d+$") or name:match("^#x%x+$"))) then return false end
        i = t:find("&", i + 1, true)
      end
      return true
    end
    if s:sub(1, 5) == "<?xml" then
      local e = s:find("?>", 1, true)
      if not e then return bad("unclosed declaration") end
      pos = e + 2
    end
    while pos <= #s do
      local lt = s:find("<", pos, true)
      local text = s:sub(pos, (lt or #s + 1) - 1)
      if #stack == 0 and text:find("%S") then return bad("text outside the root") end
      if not text_ok(text) then return bad("bad entity in text") end
      if not lt then break end
      pos = lt
      if s:sub(pos, pos + 3) == "<!--" then
        local e = s:find("-->", pos, true)
        if not e then return bad("unclosed comment") end
        pos = e + 3
      elseif s:sub(pos, pos + 1) == "</" then
        local name, e = s:match("^</([%w:_%-%.]+)%s*>()", pos)
        if not name then return bad("bad end tag") end
        if stack[#stack] ~= name then return bad("</" .. name .. "> closes <" .. tostring(stack[#stack]) .. ">") end
        stack[#stack] = nil
        pos = e
      else
        local name, p = s:match("^<([%a_][%w:_%-%.]*)()", pos)
        if not name then return bad("bad start tag") end
        local seen = {}
        while true do
          local ws, p2 = s:match("^(%s*)()", p)
          p = p2
          if s:sub(p, p + 1) == "/>" then
            p = p + 2
            if #stack == 0 then roots = roots + 1 end
            break
          elseif s:sub(p, p) == ">" then
            p = p + 1
            if #stack == 0 then roots = roots + 1 end
            stack[#stack + 1] = name
            break
          end
          if ws == "" then pos = p; return bad("attributes run together in <" .. name .. ">") end
          local an, q, p3 = s:match("^([%a_][%w:_%-%.]*)%s*=%s*([\"'])()", p)
          if not an then pos = p; return bad("bad attribute in <" .. name .. ">") end
          if seen[an] then pos = p; return bad("attribute " .. an .. " twice") end
          seen[an] = true
          local close = s:find(q, p3, true)
          if not close then pos = p; return bad("unclosed attribute value") end
          local v = s:sub(p3, close - 1)
          if v:find("<", 1, true) or not text_ok(v) then pos = p; return bad("bad attribute value") end
          p = close + 1
        end
        pos = p
      end
    end
    if #stack > 0 then return bad("unclosed <" .. stack[#stack] .. ">") end
    if roots ~= 1 then return bad("expected one root element, got " .. roots) end
    return true
  end

  local xmllint_ok = require("helpers.spec_util").xmllint_ok

  -- each line of the svg with the panel it stands in (the last
  -- <g id="panel-K"> at or before it; nil before the first)
  local function panel_lines(svg)
    local next_line, panel = svg:gmatch("[^\n]+"), nil
    return function()
      local line = next_line()
      if line then panel = line:match('^<g id="panel%-([%w_]+)">') or panel end
      return line, panel
    end
  end

  -- every cell: {kind, rank, node, group, fill, x, y, w}
  local function cells_of(svg)
    local cells = {}
    for line, panel in panel_lines(svg) do
      local x, y, w, fill, rank, node, gname, g =
        line:match('^<rect x="(%d+)" y="(%d+)" width="(%d+)" height="%d+"[^>]*fill="(#%x+)"><title>rank (%d+), '
                   .. 'node (%d+): ([%w_]+)%.(%d+) = ')
      if x then
        cells[#cells + 1] = { kind = panel, rank = tonumber(rank), node = tonumber(node), gname = gname,
                              group = tonumber(g), fill = fill, x = tonumber(x), y = tonumber(y),
                              w = tonumber(w) }
      end
    end
    return cells
  end

  -- node frames per panel: frames[kind][node + 1] = {x, y, w, h}
  local function frames_of(svg)
    local frames = {}
    for line, panel in panel_lines(svg) do
      if panel and not frames[panel] then frames[panel] = {} end
      local x, y, w, h = line:match('^<rect class="n[^"]*" x="(%d+)" y="(%d+)" width="(%d+)" height="(%d+)"')
      if x then
        local f = frames[panel]
        f[#f + 1] = { tonumber(x), tonumber(y), tonumber(w), tonumber(h) }
      end
    end
    return frames
  end

  local function check_plan_drawing(plan, gpn, svg)
    local ok, why = well_formed(svg)
    assert.is_true(ok, why)
    local lint, out = xmllint_ok(svg)
    if lint ~= nil then assert.is_true(lint, out) end
    local idx = topology.index_of(plan)
    local kinds = topology.kinds_of(plan)
    local cells, frames = cells_of(svg), frames_of(svg)
    assert.are.equal(#kinds * plan.world_size, #cells)
    local seen = {}
    for _, c in ipairs(cells) do
      local k = c.kind
      local key = k .. ":" .. c.rank
      assert.is_nil(seen[key], key .. " drawn twice")
      seen[key] = true
      assert.are.equal(math.floor(c.rank / gpn), c.node, key)
      assert.are.equal(idx[k][c.rank + 1], c.group, key)
      assert.are.equal(plan.aliases[k] or k, c.gname, key)
      local single = #plan.groups[k][1] == 1
      assert.are.equal(single and "#d5d9de" or (topo_svg.color(c.group)), c.fill, key)
      local f = frames[k][c.node + 1]
      assert.is_truthy(f, key .. " has no node frame")
      assert.is_true(c.x >= f[1] and c.y >= f[2] and c.x + c.w <= f[1] + f[3] and c.y + c.w <= f[2] + f[4],
                     key .. " lies outside the frame of node " .. c.node)
    end
    -- ranks run node by node, row by row inside a node: within a panel a
    -- rank's cell is right of or below its predecessor in the same node
    return cells
  end

  it("draws tp=4 pp=2 on one node with rank numbers, aliases noted", function()
    local plan = topology.plan { world_size = 8, tp = 4, pp = 2 }
    local svg = topo_svg.render(plan)
    check_plan_drawing(plan, 8, svg)
    assert.matches("weft topology: world 8 = tp 4 x pp 2", svg, 1, true)
    assert.matches("attention: tp 4, cp 1, dp 1  |  MoE: ep 1, tp 4, dp 1  |  dcp 1  |  1 node x 8 GPUs", svg, 1, true)
    -- the aliased kinds: dashed panel, the note, the TP group's names
    for _, k in ipairs({ "attn_tp", "moe_tp" }) do
      local panel = svg:match('<g id="panel%-' .. k .. '">(.-)</g>')
      assert.matches('<rect class="a"', panel, 1, true)
      assert.matches("same as tp (the same group object)", panel, 1, true)
      assert.matches(">tp.0: 0-3</text>", panel, 1, true)
      assert.matches(">tp.1: 4-7</text>", panel, 1, true)
    end
    local pp = svg:match('<g id="panel%-pp">(.-)</g>')
    assert.matches('<rect class="p"', pp, 1, true)
    assert.matches(">pp: 4 groups of 2</text>", pp, 1, true)
    assert.matches(">pp.3: 3,7</text>", pp, 1, true)
    local single = svg:match('<g id="panel%-moe_ep">(.-)</g>')
    assert.matches(">every rank is a group of its own</text>", single, 1, true)
    -- big cells: every rank number is written, 7 kinds x 8 ranks
    local n = 0
    for _ in svg:gmatch('text%-anchor="middle"') do n = n + 1 end
    assert.are.equal(7 * 8, n)
    assert.matches('>node 0</text>', svg, 1, true)
    assert.is_nil(svg:find("<g id=\"panel-dcp\"", 1, true))
  end)

  it("draws 64 ranks on 8 nodes: groups coloured, node frames, tooltips", function()
    local plan = topology.plan { world_size = 64, tp = 8, pp = 8, ep = 4, moe_dp = 2, attn_cp = 2 }
    local svg = topo_svg.render(plan, { gpus_per_node = 8 })
    local cells = check_plan_drawing(plan, 8, svg)
    assert.is_true(#svg < 300 * 1024, "64 ranks: " .. #svg .. " bytes")
    -- 8 frames per panel, labelled
    local frames = frames_of(svg)
    for _, k in ipairs(topology.kinds_of(plan)) do assert.are.equal(8, #frames[k], k) end
    assert.matches(">node 7</text>", svg, 1, true)
    -- TP groups stay inside a node, PP groups cross all 8
    assert.matches("tensor parallel; each group within a node", svg, 1, true)
    assert.matches("pipeline parallel; a group spans up to 8 nodes", svg, 1, true)
    -- the 8 TP groups have 8 different colours
    local fills = {}
    for _, c in ipairs(cells) do
      if c.kind == "tp" then fills[c.fill] = true end
    end
    local n = 0
    for _ in pairs(fills) do n = n + 1 end
    assert.are.equal(8, n)
    assert.matches("<title>rank 13, node 1: tp.1 = 8-15</title>", svg, 1, true)
    assert.matches("<title>rank 13, node 1: pp.5 = 5,13,..,61</title>", svg, 1, true)
    assert.matches("... and 9 more groups (hover a cell)", svg, 1, true)
    assert.is_truthy(svg:find('text-anchor="middle"', 1, true)) -- cells still big enough for numbers
  end)

  it("draws 512 ranks on 64 nodes: small file, small cells, no rank numbers", function()
    local plan = topology.plan { world_size = 512, tp = 16, pp = 32, ep = 8, moe_dp = 2, attn_cp = 2, dcp = 2 }
    local svg = topo_svg.render(plan)
    check_plan_drawing(plan, 8, svg)
    assert.is_true(#svg < 2 * 1024 * 1024, "512 ranks: " .. #svg .. " bytes")
    assert.is_nil(svg:find('text-anchor="middle"', 1, true))
    local w, h = svg:match('<svg [^>]*width="(%d+)" height="(%d+)"')
    assert.is_true(tonumber(w) <= topo_svg.MAX_WIDTH, w)
    assert.is_true(tonumber(h) < 3000, h)
    local cw = svg:match('<g id="panel%-tp">.-<rect x="%d+" y="%d+" width="(%d+)"[^>]*fill="#')
    assert.is_true(tonumber(cw) < 14, cw)
    assert.matches("tensor parallel; a group spans up to 2 nodes", svg, 1, true)
    assert.matches('<g id="panel%-dcp">', svg)
    assert.matches("64 nodes x 8 GPUs", svg, 1, true)
  end)

  it("other node sizes: 4 and 72 GPUs per node, a partial last node", function()
    local plan = topology.plan { world_size = 12, tp = 4, pp = 3 }
    local svg = topo_svg.render(plan, { gpus_per_node = 4 })
    check_plan_drawing(plan, 4, svg)
    plan = topology.plan { world_size = 144, tp = 72, pp = 2, ep = 8 }
    svg = topo_svg.render(plan, { gpus_per_node = 72 })
    check_plan_drawing(plan, 72, svg)
    plan = topology.plan { world_size = 10, tp = 2, pp = 5 }
    svg = topo_svg.render(plan) -- 10 ranks on 8-GPU nodes: node 1 half used
    check_plan_drawing(plan, 8, svg)
    local unused = 0
    for _ in svg:gmatch('<rect class="u"') do unused = unused + 1 end
    assert.are.equal(6 * #topology.kinds_of(plan), unused)
  end)

  it("large worlds drop the tooltips and stay bounded", function()
    local plan = topology.plan { world_size = 4096, tp = 8, pp = 512 }
    local svg = topo_svg.render(plan)
    local ok, why = well_formed(svg)
    assert.is_true(ok, why)
    assert.is_nil(svg:find("<title>", 1, true))
    assert.is_true(#svg < 4 * 1024 * 1024, #svg)
    -- tiny cells: thin node frames, rows named in the gutter, not every node
    assert.is_truthy(svg:find('<rect class="n ns"', 1, true))
    assert.is_truthy(svg:find(">node 0</text>", 1, true))
    assert.is_nil(svg:find(">node 1</text>", 1, true))
    local named = 0
    for _ in svg:match('<g id="panel%-tp">(.-)</g>'):gmatch('<text [^>]*fill="#3b4252"') do named = named + 1 end
    assert.is_true(named > 5 and named < 512 / 4, named)
  end)

  it("the palette keeps many groups apart", function()
    local seen = {}
    for i = 0, 511 do
      local c, ink = topo_svg.color(i)
      assert.matches("^#%x%x%x%x%x%x$", c)
      assert.is_truthy(ink == "#111" or ink == "#fff")
      assert.is_nil(seen[c], "colour " .. c .. " repeats at " .. i)
      seen[c] = true
    end
    -- neighbours differ strongly (sum of channel differences), and so do
    -- groups a Fibonacci step apart, where golden-ratio hues come back
    local function rgb(c) return tonumber(c:sub(2, 3), 16), tonumber(c:sub(4, 5), 16), tonumber(c:sub(6, 7), 16) end
    local function dist(a, b)
      local r1, g1, b1 = rgb(a)
      local r2, g2, b2 = rgb(b)
      return math.abs(r1 - r2) + math.abs(g1 - g2) + math.abs(b1 - b2)
    end
    for i = 0, 63 do
      for _, step in ipairs({ 1, 2, 3, 21, 34, 55 }) do
        assert.is_true(dist((topo_svg.color(i)), (topo_svg.color(i + step))) > 60,
                       ("groups %d and %d look alike"):format(i, i + step))
      end
    end
  end)

  it("the well-formedness check catches broken XML", function()
    assert.is_true(well_formed('<svg a="1"><g><rect/></g>t &amp; u</svg>'))
    assert.is_false((well_formed('<svg><g></svg>')))
    assert.is_false((well_formed('<svg a="1" a="2"/>')))
    assert.is_false((well_formed('<svg a=1/>')))
    assert.is_false((well_formed('<svg>a & b</svg>')))
    assert.is_false((well_formed('<svg><title>x<y</title></svg>')))
    assert.is_false((well_formed('<svg/><svg/>')))
  end)

  it("every text has its own fill and lies inside the canvas and its panel", function()
    -- ImageMagick's renderer drew class-styled text black on dark cells, and
    -- the attn_tp note ran out of its panel at 16 ranks on two nodes
    local check = require("helpers.svg_check")
    local plans = {
      { { world_size = 16, tp = 8, pp = 2 } },
      { { world_size = 8, tp = 4, pp = 2 } },
      { { world_size = 64, tp = 16, pp = 4, attn_dp = 2, ep = 8 } },
      { { world_size = 12, tp = 4, pp = 3 }, { gpus_per_node = 4 } },
      { { world_size = 512, tp = 16, pp = 32, ep = 8, moe_dp = 2, attn_cp = 2, dcp = 2 } },
      { { tp = 2 }, { title = "a much longer title than the canvas of a two-rank plan would otherwise be wide" } },
    }
    for _, c in ipairs(plans) do
      local svg = topo_svg.render(topology.plan(c[1]), c[2])
      assert.is_nil(check.problems(svg), c[1].world_size)
    end
    local svg = topo_svg.render(topology.plan { world_size = 16, tp = 8, pp = 2 })
    assert.is_nil(svg:find("<text class=", 1, true))
    assert.matches('<text x="%d+" y="%d+" font%-size="%d+" text%-anchor="middle" fill="#fff" stroke="none">8</text>', svg)
  end)

  it("escapes text and refuses bad arguments", function()
    local plan = topology.plan { tp = 2 }
    local svg = topo_svg.render(plan, { title = 'a <b> & "c"' })
    assert.matches("a &lt;b&gt; &amp; &quot;c&quot;", svg, 1, true)
    assert.is_true(well_formed(svg))
    local ok, e = pcall(topo_svg.render, plan, { gpus_per_node = 0 })
    assert.is_false(ok)
    assert.matches("weft: topo_svg.render: gpus_per_node must be a positive integer (got 0)", e, 1, true)
    ok, e = pcall(topo_svg.render, { nope = 1 })
    assert.matches("weft: topo_svg.render: argument is not a plan", e, 1, true)
  end)
end)
