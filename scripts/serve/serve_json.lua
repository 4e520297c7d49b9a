-- serve_json — a strict, bounded JSON reader and a small writer for the
-- served demo (no dependency beyond LuaJIT; nginx's Lua has no cjson here).
--   json.decode(s [, {max_depth=32}]) -> value   raises "at byte N: why"
--   json.encode(v) -> string        arrays: tables with [1] or json.array(t)
--   json.null                       decoded null (a unique sentinel)
local byte, sub, find, char, fmt, concat = string.byte, string.sub, string.find, string.char, string.format, table.concat
local tonumber, type, error, pairs, floor = tonumber, type, error, pairs, math.floor

local M = {}

M.null = setmetatable({}, { __tostring = function() return "null" end })
local ARRAY = {}
function M.array(t) return setmetatable(t or {}, ARRAY) end

---------------------------------------------------------------- decode
local function fail(pos, why) error({ json = true, msg = fmt("at byte %d: %s", pos, why) }, 0) end

local function skip(s, i)
  local _, e = find(s, "^[ \t\r\n]*", i)
  return e + 1
end

local function utf8(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return char(0xF0 + floor(cp / 262144), 0x80 + floor(cp / 4096) % 64, 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
end

local ESC = { [34] = '"', [92] = "\\", [47] = "/", [98] = "\b", [102] = "\f", [110] = "\n", [114] = "\r", [116] = "\t" }

local function read_string(s, i)   -- s[i] == '"'
  local parts, n = {}, 0
  local j = i + 1
  while true do
    local a, b = find(s, '^[^"\\%z\1-\31]+', j)
    if a then n = n + 1; parts[n] = sub(s, a, b); j = b + 1 end
    local c = byte(s, j)
    if c == nil then fail(i, "unterminated string") end
    if c == 34 then return concat(parts), j + 1 end
    if c < 32 then fail(j, "control character in a string") end
    -- backslash
    local e = byte(s, j + 1)
    if e == 117 then
      local h = sub(s, j + 2, j + 5)
      if not find(h, "^%x%x%x%x$") then fail(j, "bad \\u escape") end
      local cp = tonumber(h, 16)
      j = j + 6
      if cp >= 0xD800 and cp <= 0xDBFF then
        local h2 = find(s, "^\\u%x%x%x%x", j) and tonumber(sub(s, j + 2, j + 5), 16)
        if not h2 or h2 < 0xDC00 or h2 > 0xDFFF then fail(j, "unpaired surrogate") end
        cp = 0x10000 + (cp - 0xD800) * 1024 + (h2 - 0xDC00)
        j = j + 6
      elseif cp >= 0xDC00 and cp <= 0xDFFF then
        fail(j, "unpaired surrogate")
      end
      n = n + 1; parts[n] = utf8(cp)
    else
      local r = e and ESC[e]
      if not r then fail(j, "bad escape") end
      n = n + 1; parts[n] = r
      j = j + 2
    end
  end
end

local function read_number(s, i)
  local a, b = find(s, "^-?%d+", i)
  if not a then fail(i, "unexpected character " .. fmt("%q", sub(s, i, i))) end
  local int = sub(s, a, b)
  if find(int, "^-?0%d") then fail(i, "leading zero in a number") end
  local _, b2 = find(s, "^%.%d+", b + 1)
  if b2 then b = b2 elseif byte(s, b + 1) == 46 then fail(b + 1, "digits expected after '.'") end
  local _, b3 = find(s, "^[eE][-+]?%d+", b + 1)
  if b3 then b = b3 elseif find(s, "^[eE]", b + 1) then fail(b + 1, "digits expected in the exponent") end
  local v = tonumber(sub(s, i, b))
  if v == nil or v ~= v or v == math.huge or v == -math.huge then fail(i, "number out of range") end
  return v, b + 1
end

local read_value

local function read_array(s, i, depth, maxd)
  local t, n = M.array({}), 0
  local j = skip(s, i + 1)
  if byte(s, j) == 93 then return t, j + 1 end
  while true do
    local v
    v, j = read_value(s, j, depth + 1, maxd)
    n = n + 1
    t[n] = v
    j = skip(s, j)
    local c = byte(s, j)
    if c == 93 then return t, j + 1 end
    if c ~= 44 then fail(j, "',' or ']' expected in an array") end
    j = skip(s, j + 1)
  end
end

local function read_object(s, i, depth, maxd)
  local t = {}
  local j = skip(s, i + 1)
  if byte(s, j) == 125 then return t, j + 1 end
  while true do
    if byte(s, j) ~= 34 then fail(j, "a string key expected in an object") end
    local k
    k, j = read_string(s, j)
    j = skip(s, j)
    if byte(s, j) ~= 58 then fail(j, "':' expected after an object key") end
    local v
    v, j = read_value(s, skip(s, j + 1), depth + 1, maxd)
    t[k] = v
    j = skip(s, j)
    local c = byte(s, j)
    if c == 125 then return t, j + 1 end
    if c ~= 44 then fail(j, "',' or '}' expected in an object") end
    j = skip(s, j + 1)
  end
end

read_value = function(s, i, depth, maxd)
  if depth > maxd then fail(i, "nested deeper than " .. maxd) end
  local c = byte(s, i)
  if c == 123 then return read_object(s, i, depth, maxd) end
  if c == 91 then return read_array(s, i, depth, maxd) end
  if c == 34 then return read_string(s, i) end
  if c == 116 and sub(s, i, i + 3) == "true" then return true, i + 4 end
  if c == 102 and sub(s, i, i + 4) == "false" then return false, i + 5 end
  if c == 110 and sub(s, i, i + 3) == "null" then return M.null, i + 4 end
  if c == nil then fail(i, "unexpected end of input") end
  return read_number(s, i)
end

-- Raises a string "malformed JSON at byte N: why".
function M.decode(s, opts)
  if type(s) ~= "string" then error("malformed JSON: expected a string", 2) end
  local ok, v, j = pcall(read_value, s, skip(s, 1), 1, (opts and opts.max_depth) or 32)
  if ok then
    j = skip(s, j)
    if j <= #s then ok, v = false, { json = true, msg = fmt("at byte %d: trailing characters", j) } end
  end
  if not ok then
    if type(v) == "table" and v.json then error("malformed JSON " .. v.msg, 0) end
    error(v, 0)
  end
  return v
end

---------------------------------------------------------------- encode
local function esc(str)
  return (str:gsub('[%c"\\]', function(c)
    local b = byte(c)
    if c == '"' then return '\\"' elseif c == "\\" then return "\\\\"
    elseif c == "\n" then return "\\n" elseif c == "\t" then return "\\t" end
    return fmt("\\u%04x", b)
  end))
end

local function num(v)
  if v ~= v or v == math.huge or v == -math.huge then return "null" end
  if v == floor(v) and v > -1e15 and v < 1e15 then return fmt("%d", v) end
  return fmt("%.9g", v)
end
M.number = num

local function enc(v, out, n)
  local t = type(v)
  if t == "number" then n = n + 1; out[n] = num(v)
  elseif t == "string" then n = n + 1; out[n] = '"' .. esc(v) .. '"'
  elseif t == "boolean" then n = n + 1; out[n] = v and "true" or "false"
  elseif v == nil or v == M.null then n = n + 1; out[n] = "null"
  elseif t == "table" then
    if getmetatable(v) == ARRAY or v[1] ~= nil then
      n = n + 1; out[n] = "["
      for i = 1, #v do
        if i > 1 then n = n + 1; out[n] = "," end
        n = enc(v[i], out, n)
      end
      n = n + 1; out[n] = "]"
    else
      local keys = {}
      for k in pairs(v) do keys[#keys + 1] = tostring(k) end
      table.sort(keys)
      n = n + 1; out[n] = "{"
      for i, k in ipairs(keys) do
        if i > 1 then n = n + 1; out[n] = "," end
        n = n + 1; out[n] = '"' .. esc(k) .. '":'
        local val = v[k]
        if val == nil then val = v[tonumber(k)] end
        n = enc(val, out, n)
      end
      n = n + 1; out[n] = "}"
    end
  else
    n = n + 1; out[n] = '"' .. esc(tostring(v)) .. '"'
  end
  return n
end

function M.encode(v)
  local out = {}
  local n = enc(v, out, 0)
  return concat(out, "", 1, n)
end

return M
