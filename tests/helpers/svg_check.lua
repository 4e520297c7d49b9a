-- Checks on weft's SVG pictures, shared by topo_svg_spec and plot_spec:
-- every <text> carries its own fill and stroke="none" (ImageMagick's renderer
-- strokes and fills text black otherwise), and every text's estimated box
-- lies inside the canvas (and inside its panel, for <g id="panel-..."> groups
-- whose first element is the panel's <rect>).
local M = {}

local function attr(tag, name) return tag:match("%s" .. name .. '="([^"]*)"') end

local function unesc(s)
  return (s:gsub("&lt;", "<"):gsub("&gt;", ">"):gsub("&quot;", '"'):gsub("&amp;", "&"))
end

-- Same estimate as weft.tools.svg.text_w, on purpose independent of it.
local function width_of(s, size, bold) return #s * size * (bold and 0.68 or 0.6) end

-- all texts: {s, x, y, size, fill, stroke, anchor, bold, x0, x1, y0, y1, panel}
function M.texts(svg)
  local out, panel = {}, nil
  local pos = 1
  while true do
    local a, b, tag, body = svg:find("<(text%s[^>]*)>(.-)</text>", pos)
    local g0, g1, gid = svg:find('<g id="panel%-([%w_]+)">', pos)
    local ge = svg:find("</g>", pos, true)
    -- track which panel we are in
    if g0 and (not a or g0 < a) then
      local rx, ry, rw, rh = svg:match('^%s*<rect[^>]-x="([%d.]+)" y="([%d.]+)" width="([%d.]+)" height="([%d.]+)"', g1 + 1)
      panel = { id = gid, x = tonumber(rx), y = tonumber(ry), w = tonumber(rw), h = tonumber(rh) }
      pos = g1 + 1
    elseif ge and panel and (not a or ge < a) then
      panel = nil
      pos = ge + 4
    elseif a then
      local t = { s = unesc(body), x = tonumber(attr(tag, "x")), y = tonumber(attr(tag, "y")),
                  size = tonumber(attr(tag, "font%-size")), fill = attr(tag, "fill"),
                  stroke = attr(tag, "stroke"), anchor = attr(tag, "text%-anchor") or "start",
                  bold = attr(tag, "font%-weight") == "bold", rotate = attr(tag, "transform"),
                  panel = panel, tag = tag }
      local w = width_of(t.s, t.size or 12, t.bold)
      local x0 = t.anchor == "middle" and t.x - w / 2 or t.anchor == "end" and t.x - w or t.x
      if t.rotate then -- rotate(-90 x y): the text runs upwards from (x, y)
        local y0 = t.anchor == "middle" and t.y - w / 2 or t.anchor == "end" and t.y or t.y - w
        t.x0, t.x1, t.y0, t.y1 = t.x - (t.size or 12), t.x, y0, y0 + w
      else
        t.x0, t.x1, t.y0, t.y1 = x0, x0 + w, t.y - (t.size or 12) * 0.8, t.y + (t.size or 12) * 0.25
      end
      out[#out + 1] = t
      pos = b + 1
    else
      break
    end
  end
  return out
end

-- nil when all is well, else a message naming the first offending text.
function M.problems(svg)
  local W, H = svg:match('<svg [^>]*viewBox="0 0 ([%d.]+) ([%d.]+)"')
  W, H = tonumber(W), tonumber(H)
  if not W then return "no viewBox" end
  local texts = M.texts(svg)
  if #texts == 0 then return "no text at all" end
  for _, t in ipairs(texts) do
    if not t.fill or t.fill == "" then return "text without a fill: " .. t.tag end
    if t.stroke ~= "none" then return "text without stroke=\"none\": " .. t.tag end
    if not t.size then return "text without a font-size: " .. t.tag end
    if t.x0 < 0 or t.y0 < 0 or t.x1 > W or t.y1 > H then
      return ("text %q (%.0f..%.0f x %.0f..%.0f) leaves the %gx%g canvas"):format(t.s, t.x0, t.x1, t.y0, t.y1, W, H)
    end
    local p = t.panel
    if p and (t.x0 < p.x or t.x1 > p.x + p.w or t.y0 < p.y or t.y1 > p.y + p.h) then
      return ("text %q (%.0f..%.0f) leaves panel %s (%g..%g)"):format(t.s, t.x0, t.x1, p.id, p.x, p.x + p.w)
    end
  end
  return nil
end

return M
