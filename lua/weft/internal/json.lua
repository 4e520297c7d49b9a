-- weft.internal.json — JSON for weft's tools: the results files (weft.tools.bench), weft-topo
-- --json and the topology (weft.topology.to_json), weft-plot. lua-cjson
-- underneath (Debian's lua-cjson, the served demo's JSON too): it parses, and
-- it escapes strings. What cjson leaves to its caller is here, in a small
-- writer over it: keys in a fixed order (listed first, the others sorted),
-- the results files' layout (the top object and its values one entry a
-- line, anything deeper on one line), and numbers as the results files write
-- them (integers exactly, others to 6 significant digits, NaN and infinities
-- as null).
--
-- lua-cjson is loaded on the first call that needs it: `require("weft")` and
-- the collectives never do, and a tool that needs it says how to install it.
--
--   json.encode(v [, {indent = "  ", order = {"machine", "date", ...}}]) -> text
--     without indent: compact, no spaces ({"a":1,"b":[1,2]}); with it: the
--     layout above ("key": value, ", " between the fields of a line)
--   json.decode(text [, who]) -> value (null -> nil; errors "weft: <who>:
--     malformed JSON at byte N: <why>", who defaulting to "json.decode")
--   json.object(t) / json.array(t) -> t, marked (an empty table is an array
--     unless marked)
local floor, fmt, concat, sort = math.floor, string.format, table.concat, table.sort

local M = {}

local cj   -- a private cjson instance: its settings never reach another user of cjson

local function lib(who)
  if cj then return cj end
  local ok, cjson = pcall(require, "cjson")
  if not ok then
    error(fmt("weft: %s: lua-cjson is missing (Debian: apt-get install lua-cjson, as root; "
              .. "scripts/ensure-deps installs it)", who), 0)
  end
  cj = cjson.new()
  cj.decode_invalid_numbers(false)   -- JSON's numbers only: no NaN, Infinity or hex
  M.null = cjson.null
  return cj
end

local OBJECT = { __jsontype = "object" }
local ARRAY = { __jsontype = "array" }
function M.object(t) return setmetatable(t or {}, OBJECT) end
function M.array(t) return setmetatable(t or {}, ARRAY) end

local function is_array(v)
  local mt = getmetatable(v)
  local kind = type(mt) == "table" and mt.__jsontype
  if kind then return kind == "array" end
  return #v > 0 or next(v) == nil
end

local function number(v)
  if v ~= v or v == math.huge or v == -math.huge then return "null" end
  if v == floor(v) and math.abs(v) < 2 ^ 53 then return fmt("%d", v) end
  return fmt("%.6g", v)
end

-- cjson escapes "/" as "\/" (valid, and needless): written plain. A "\/" in
-- its output is always that escape (a backslash of the text is "\\").
local function string_(c, s) return (c.encode(s):gsub("\\/", "/")) end

-- keys: those of `order` first, in its order, then the others sorted
local function keys_of(v, rank)
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = tostring(k) end
  sort(keys, function(a, b)
    local ra, rb = rank[a], rank[b]
    if ra and rb then return ra < rb end
    if ra or rb then return ra ~= nil end
    return a < b
  end)
  return keys
end

-- expand: how many more levels put one entry a line (0: this value on one line)
local function encode(c, v, st, depth, expand)
  local t = type(v)
  if t == "nil" or v == M.null then return "null" end
  if t == "boolean" then return tostring(v) end
  if t == "number" then return number(v) end
  if t == "string" then return string_(c, v) end
  if t ~= "table" then error(fmt("weft: json.encode: cannot encode a %s", t), 0) end
  if depth > 100 then error("weft: json.encode: nested more than 100 levels (a cycle?)", 0) end
  local pad, close, sep, colon = "", "", st.sep, st.colon
  if expand > 0 then
    pad = "\n" .. st.indent:rep(depth + 1)
    close = "\n" .. st.indent:rep(depth)
    sep = ","
  end
  local parts = {}
  if is_array(v) then
    for i = 1, #v do parts[i] = pad .. encode(c, v[i], st, depth + 1, expand - 1) end
    return "[" .. concat(parts, sep) .. (#v > 0 and close or "") .. "]"
  end
  local keys = keys_of(v, st.rank)
  for i, k in ipairs(keys) do
    parts[i] = pad .. string_(c, k) .. colon .. encode(c, v[k], st, depth + 1, expand - 1)
  end
  return "{" .. concat(parts, sep) .. (#keys > 0 and close or "") .. "}"
end

function M.encode(v, opts)
  local c = lib("json.encode")
  opts = opts or {}
  local rank = {}
  for i, k in ipairs(opts.order or {}) do rank[k] = rank[k] or i end
  local st = { rank = rank, indent = opts.indent }
  if opts.indent then
    st.sep, st.colon = ", ", ": "
    return encode(c, v, st, 0, 2)
  end
  st.sep, st.colon = ",", ":"
  return encode(c, v, st, 0, 0)
end

-- cjson's null (a light userdata) as nil, as Lua has it
local function denull(v, null)
  if v == null then return nil end
  if type(v) == "table" then
    for k, x in pairs(v) do v[k] = denull(x, null) end
  end
  return v
end

function M.decode(text, who)
  who = who or "json.decode"
  local c = lib(who)
  if type(text) ~= "string" then error(fmt("weft: %s: argument must be a string", who), 2) end
  local ok, v = pcall(c.decode, text)
  if not ok then
    -- cjson: "Expected value but found invalid token at character 3"
    local msg = tostring(v):gsub("^.-:%d+: ", "")
    local at = msg:match(" at character (%d+)$")
    if at then msg = fmt("at byte %s: %s", at, msg:gsub(" at character %d+$", "")) end
    error(fmt("weft: %s: malformed JSON %s", who, msg), 0)
  end
  return denull(v, M.null)
end

return M
