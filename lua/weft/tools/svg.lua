-- weft.tools.svg — the one small SVG writer of weft's pictures (topology plans,
-- benchmark charts). Pure: builds text, does no I/O.
--
-- Every <text> it writes carries an explicit fill and stroke="none":
-- ImageMagick's own renderer (MSVG, what `convert x.svg x.png` uses on
-- Debian) strokes text in black unless told not to, and ignores fills
-- inherited from a <style> class, so dark-on-dark text appeared in its PNGs.
-- The writer also keeps a rough box of every text it wrote, so a picture can
-- check (and its spec assert) that the canvas contains all of its text.
local M = {}

local fmt, concat, floor, max, min = string.format, table.concat, math.floor, math.max, math.min

M.FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"

function M.esc(s)
  return (tostring(s):gsub("[&<>\"]", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;" }))
end

-- Rough advance width of text in a DejaVu/Helvetica-like sans (0.6 em a
-- character: DejaVu Sans' digits and lower case are 0.55-0.63 em; capitals
-- and bold run wider, so bold counts 0.68).
function M.text_w(s, size, bold)
  return #tostring(s) * size * (bold and 0.68 or 0.6)
end

-- Splits text into lines of at most width px at the given font size.
function M.wrap(text, width, size)
  local per = max(10, floor(width / (size * 0.6)))
  local lines, cur = {}, ""
  for word in tostring(text):gmatch("%S+") do
    if cur ~= "" and #cur + 1 + #word > per then
      lines[#lines + 1] = cur
      cur = word
    else
      cur = cur == "" and word or (cur .. " " .. word)
    end
  end
  if cur ~= "" then lines[#lines + 1] = cur end
  return lines
end

-- A coordinate: integers as integers, others with at most 2 decimals.
local function num(v)
  if v == floor(v) then return fmt("%d", v) end
  return (fmt("%.2f", v):gsub("0+$", ""):gsub("%.$", ""))
end
M.num = num

local Doc = {}
Doc.__index = Doc

-- new(width, height [, {background = "#rrggbb", font = family}]) -> document
function M.new(width, height, opts)
  opts = opts or {}
  local d = setmetatable({ width = width, height = height, out = {}, texts = {} }, Doc)
  d:raw('<?xml version="1.0" encoding="UTF-8"?>\n')
  d:raw(fmt('<svg xmlns="http://www.w3.org/2000/svg" width="%s" height="%s" viewBox="0 0 %s %s" '
            .. 'font-family="%s">\n', num(width), num(height), num(width), num(height), opts.font or M.FONT))
  if opts.background then d:raw(fmt('<rect width="100%%" height="100%%" fill="%s"/>\n', opts.background)) end
  return d
end

function Doc:raw(s) self.out[#self.out + 1] = s end

-- text(x, y, s, {size = 12, fill = "#111", anchor = "start"|"middle"|"end",
--      bold = bool, rotate = degrees})
-- No class attribute: ImageMagick's renderer fails on a few hundred text
-- elements with a class ("vector graphics nested too deeply").
function Doc:text(x, y, s, o)
  o = o or {}
  local size = o.size or 12
  local p = { "<text" }
  p[#p + 1] = fmt(' x="%s" y="%s"', num(x), num(y))
  p[#p + 1] = fmt(' font-size="%s"', num(size))
  if o.bold then p[#p + 1] = ' font-weight="bold"' end
  if o.anchor and o.anchor ~= "start" then p[#p + 1] = fmt(' text-anchor="%s"', o.anchor) end
  if o.rotate then p[#p + 1] = fmt(' transform="rotate(%s %s %s)"', num(o.rotate), num(x), num(y)) end
  p[#p + 1] = fmt(' fill="%s" stroke="none">%s</text>\n', o.fill or "#111", M.esc(s))
  self:raw(concat(p))
  -- the box it covers (unrotated, or turned a quarter for rotate = -90)
  local w = M.text_w(s, size, o.bold)
  local x0 = o.anchor == "middle" and x - w / 2 or o.anchor == "end" and x - w or x
  if o.rotate == -90 then
    local y0 = o.anchor == "middle" and y - w / 2 or o.anchor == "end" and y or y - w
    self.texts[#self.texts + 1] = { s = s, x0 = x - size, x1 = x, y0 = y0, y1 = y0 + w }
  else
    self.texts[#self.texts + 1] = { s = s, x0 = x0, x1 = x0 + w, y0 = y - size * 0.8, y1 = y + size * 0.25 }
  end
end

-- rect(x, y, w, h, attrs): attrs is a string of further attributes
function Doc:rect(x, y, w, h, attrs)
  self:raw(fmt('<rect x="%s" y="%s" width="%s" height="%s"%s/>\n', num(x), num(y), num(w), num(h),
               attrs and (" " .. attrs) or ""))
end

function Doc:line(x1, y1, x2, y2, attrs)
  self:raw(fmt('<line x1="%s" y1="%s" x2="%s" y2="%s" %s/>\n', num(x1), num(y1), num(x2), num(y2), attrs or ""))
end

-- polyline through points {{x, y}, ...}
function Doc:polyline(pts, attrs)
  local t = {}
  for i, p in ipairs(pts) do t[i] = num(p[1]) .. "," .. num(p[2]) end
  self:raw(fmt('<polyline points="%s" fill="none" %s/>\n', concat(t, " "), attrs or ""))
end

function Doc:circle(x, y, r, attrs)
  self:raw(fmt('<circle cx="%s" cy="%s" r="%s" %s/>\n', num(x), num(y), num(r), attrs or ""))
end

-- The texts whose estimated box leaves the canvas (empty when all fit).
function Doc:overflow()
  local bad = {}
  for _, t in ipairs(self.texts) do
    if t.x0 < 0 or t.y0 < 0 or t.x1 > self.width or t.y1 > self.height then bad[#bad + 1] = t end
  end
  return bad
end

function Doc:finish()
  self:raw("</svg>\n")
  return concat(self.out)
end

-- Widest estimated text extent to the right (for sizing a canvas after the fact).
function Doc:max_x()
  local m = 0
  for _, t in ipairs(self.texts) do m = max(m, t.x1) end
  return m
end

return M
