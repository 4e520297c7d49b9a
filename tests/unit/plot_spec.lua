-- weft.tools.plot and scripts/weft-plot: results JSON (docs/architecture.md) -> SVG charts.
-- Checked as data: the sample's series are all there, the axes are log
-- scales with evenly spaced power ticks, every text has its own fill and
-- fits the canvas, the SVG is well-formed XML (xmllint where installed).
describe("weft.tools.plot", function()
  local plot = require("weft.tools.plot")
  local bench = require("weft.tools.bench")
  local check = require("helpers.svg_check")
  local S = require("helpers.spec_util")

  local SAMPLE = [[
{
  "machine": "nvidia-h200-x2",
  "date": "2026-11-30",
  "commit": "abc1234",
  "records": [
    {"op": "all_reduce", "backend": "nccl", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1024, "us": 5.8, "busbw_gbs": 0.18},
    {"op": "all_reduce", "backend": "nccl", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 65536, "us": 6.9, "busbw_gbs": 9.5},
    {"op": "all_reduce", "backend": "nccl", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1048576, "us": 13.6, "busbw_gbs": 77.1},
    {"op": "all_reduce", "backend": "nccl", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 16777216, "us": 76.5, "busbw_gbs": 219.3},
    {"op": "all_reduce", "backend": "auto", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1024, "us": 2.3, "busbw_gbs": 0.45},
    {"op": "all_reduce", "backend": "auto", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 65536, "us": 2.5, "busbw_gbs": 26.2},
    {"op": "all_reduce", "backend": "auto", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1048576, "us": 5.4, "busbw_gbs": 194.2},
    {"op": "all_reduce", "backend": "auto", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 16777216, "us": 53.2, "busbw_gbs": 315.4},
    {"op": "all_reduce", "backend": "sweep:t32", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1024, "us": 2.9},
    {"op": "fused_ar_rmsnorm", "backend": "fused_oneshot", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 8192, "tokens": 1, "hidden": 4096, "us": 3.48},
    {"op": "fused_ar_rmsnorm", "backend": "fused_oneshot", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1048576, "tokens": 128, "hidden": 4096, "us": 6.65},
    {"op": "fused_ar_rmsnorm", "backend": "fused_oneshot", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 16777216, "tokens": 2048, "hidden": 4096, "us": 58.1},
    {"op": "fused_ar_rmsnorm", "backend": "unfused", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 8192, "tokens": 1, "hidden": 4096, "us": 8.4},
    {"op": "fused_ar_rmsnorm", "backend": "unfused", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 1048576, "tokens": 128, "hidden": 4096, "us": 16.0},
    {"op": "fused_ar_rmsnorm", "backend": "unfused", "mode": "graph", "dtype": "bf16", "world": 2, "bytes": 16777216, "tokens": 2048, "hidden": 4096, "us": 94.1},
    {"op": "serve_layer", "backend": "shm", "requests": 10, "rps": 600}
  ]
}
]]

  local function xml_ok(s)
    local r = os.execute("command -v xmllint >/dev/null 2>&1")
    if r ~= 0 and r ~= true then
      -- no xmllint: at least one root, balanced <g> groups
      local open, close = 0, 0
      for _ in s:gmatch("<g[ >]") do open = open + 1 end
      for _ in s:gmatch("</g>") do close = close + 1 end
      return s:find("^<%?xml") ~= nil and s:find("</svg>\n$") ~= nil and open == close, "balance"
    end
    local f = os.tmpname()
    local h = io.open(f, "w"); h:write(s); h:close()
    local out, rc = S.shell("xmllint --noout " .. f)
    os.remove(f)
    return rc == 0, out
  end

  local function series_names(c)
    local t = {}
    for i, s in ipairs(c.series) do t[i] = s.name end
    return t
  end

  it("reads the results JSON (bench.json_decode)", function()
    local doc = bench.json_decode(SAMPLE)
    assert.are.equal("nvidia-h200-x2", doc.machine)
    assert.are.equal(16, #doc.records)
    assert.are.equal(16777216, doc.records[4].bytes)
    assert.are.same({ a = { 1, -2500, 'q"\194\181\n', true }, b = {} },
                    bench.json_decode([[ {"a": [1, -2.5e3, "q\"\u00b5\n", true], "b": {}} ]]))
    -- what bench.json writes, json_decode reads back
    local v = { machine = "m", records = { { op = "x", us = 1.25, bytes = 4096 } } }
    assert.are.same(v, bench.json_decode(bench.json(v, "  ")))
    for _, bad in ipairs { "{", '{"a":1,}', "[1 2]", '"open', "{} x", "" } do
      assert.matches("^weft: bench.json_decode: ", S.err_of(bench.json_decode, bad))
    end
  end)

  it("finds the charts and their series: latency and busbw by size, fused by tokens with FlashInfer", function()
    local charts = plot.charts(bench.json_decode(SAMPLE))
    assert.are.equal(3, #charts)
    assert.are.equal("latency vs size: all_reduce, graph, world 2, bf16", charts[1].title)
    assert.are.same({ "nccl", "auto" }, series_names(charts[1]))   -- the one-point sweep is not a line
    assert.is_true(charts[1].xlog and charts[1].ylog)
    assert.are.equal("bus bandwidth vs size: all_reduce, graph, world 2, bf16", charts[2].title)
    assert.is_false(charts[2].ylog)
    assert.are.equal("latency by tokens: fused_ar_rmsnorm, graph, world 2, bf16, hidden 4096", charts[3].title)
    assert.are.same({ "fused_oneshot", "unfused", "FlashInfer fused one-shot (reference)",
                      "FlashInfer fused two-shot (reference)" }, series_names(charts[3]))
    assert.are.same({ 1, 4.47 }, charts[3].series[3].points[1])
    -- another machine: no FlashInfer lines (they were measured on H200 x2)
    local doc = bench.json_decode(SAMPLE)
    doc.machine = "vm-2cpu"
    assert.are.same({ "fused_oneshot", "unfused" }, series_names(plot.charts(doc)[3]))
  end)

  it("keeps the main sweep and counts the side experiments", function()
    local recs = {}
    local function add(backend, sizes)
      for _, b in ipairs(sizes) do
        recs[#recs + 1] = { op = "all_reduce", backend = backend, mode = "graph", world = 2, bytes = b, us = b / 1000 + 1 }
      end
    end
    local full = { 1024, 4096, 16384, 65536, 262144 }
    add("nccl", full); add("oneshot", full); add("twoshot", { 4096, 16384, 65536, 262144 })
    add("shape-a", { 1024, 4096 }); add("shape-b", full) -- measured after the main sweep
    local c = plot.charts { machine = "m", records = recs }[1]
    assert.are.same({ "nccl", "oneshot", "twoshot" }, series_names(c))
    assert.are.equal(2, c.left_out)
    local svg = plot.render { machine = "m", records = recs }
    assert.matches("+ 2 more series in the JSON (fewer sizes)", svg, 1, true)
  end)

  it("draws well-formed SVG with log axes, every series, texts filled and inside", function()
    local svg, n = plot.render(bench.json_decode(SAMPLE))
    assert.are.equal(3, n)
    local ok, why = xml_ok(svg)
    assert.is_true(ok, why)
    assert.is_nil(check.problems(svg))
    for _, name in ipairs { "nccl", "auto", "fused_oneshot", "unfused", "FlashInfer fused one-shot (reference)" } do
      assert.truthy(svg:find('<g data-series="' .. name .. '">', 1, true), name)
    end
    assert.is_nil(svg:find("sweep:t32", 1, true))
    -- the first chart's ticks: powers of two in bytes along x, 1-2-5 steps
    -- of time along y (two decades), placed on a log scale
    local chart1 = svg:match('<g id="chart%-1">(.-)\n</g>\n<g id="chart%-2">')
    local texts = check.texts(chart1)
    local xs, ys = {}, {}
    for _, t in ipairs(texts) do
      if t.anchor == "middle" and t.s:match("^%d+ [KMG]?i?B$") then xs[#xs + 1] = t end
      if t.anchor == "end" and t.s:match("^%d+ [^ ]*s$") then ys[#ys + 1] = t end
    end
    local xl = {}
    for i, t in ipairs(xs) do xl[i] = t.s end
    assert.are.same({ "1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB" }, xl)
    local yl = {}
    for i, t in ipairs(ys) do yl[i] = t.s end
    assert.are.same({ "1 µs", "2 µs", "5 µs", "10 µs", "20 µs", "50 µs", "100 µs", "200 µs", "500 µs" }, yl)
    for i = 3, #xs do assert.near(xs[2].x - xs[1].x, xs[i].x - xs[i - 1].x, 0.02) end
    assert.near(ys[1].y - ys[4].y, ys[4].y - ys[7].y, 0.02)          -- decades evenly spaced
    assert.near((ys[1].y - ys[4].y) * math.log10(2), ys[1].y - ys[2].y, 0.02)
    -- the points sit where the log scale puts them: 1 KiB on its tick
    local x1k = xs[1].x
    local first = chart1:match('<g data%-series="nccl">\n<polyline points="([%d.]+),')
    assert.near(x1k, tonumber(first), 0.01)
    -- nothing to draw: nil
    assert.is_nil((plot.render { machine = "m", records = { { op = "x", rps = 5 } } }))
    assert.matches("weft: plot.charts: argument is not a results document", S.err_of(plot.render, { 1 }), 1, true)
  end)

  it("weft-plot writes the SVG beside each JSON; bench.write draws it too", function()
    local dir = os.tmpname()
    os.remove(dir)
    local made, mrc = S.shell("mkdir -p '" .. dir .. "'")
    assert.are.equal(0, mrc, made)
    local f = io.open(dir .. "/ar-m-2026-11-30.json", "w"); f:write(SAMPLE); f:close()
    f = io.open(dir .. "/empty.json", "w"); f:write('{"machine":"m","records":[]}'); f:close()
    f = io.open(dir .. "/bad.json", "w"); f:write('{"machine":'); f:close()
    local out, rc = S.shell(("scripts/weft-plot %s/ar-m-2026-11-30.json %s/empty.json"):format(dir, dir))
    assert.are.equal(0, rc, out)
    assert.matches("weft-plot: wrote " .. dir .. "/ar-m-2026-11-30.svg (3 charts)", out, 1, true)
    assert.matches("empty.json: nothing to draw", out, 1, true)
    local h = io.open(dir .. "/ar-m-2026-11-30.svg"); local svg = h:read("*a"); h:close()
    assert.is_true((xml_ok(svg)))
    out, rc = S.shell(("scripts/weft-plot %s/bad.json"):format(dir))
    assert.are.equal(2, rc)
    assert.matches("bad.json is not JSON: ", out, 1, true)
    out, rc = S.shell("scripts/weft-plot " .. dir .. "/missing.json")
    assert.are.equal(2, rc)
    assert.matches("cannot read", out, 1, true)
    -- the benchmark scripts' writer puts the chart beside its JSON and .md
    local doc = bench.json_decode(SAMPLE)
    local j, m, s = bench.write(dir, "bench", doc, "# md\n")
    assert.are.equal(dir .. "/bench-nvidia-h200-x2-2026-11-30.svg", s)
    assert.truthy(io.open(s)):close()
    assert.are.equal(dir .. "/bench-nvidia-h200-x2-2026-11-30.json", j)
    assert.are.equal(dir .. "/bench-nvidia-h200-x2-2026-11-30.md", m)
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)
