-- serve_json — the served demo's JSON: lua-cjson (Debian's lua-cjson, the
-- module OpenResty ships) with the limits the demo keeps on untrusted input.
--   json.decode(s) -> value    raises "malformed JSON at byte N: why" (or
--                              "body over 4 MiB (over-size tensor)")
--   json.encode(v) -> string   NaN and infinities as null
--   json.null                  decoded null (cjson.null)
-- Limits: at most MAX_BYTES of input (nginx refuses bigger bodies first, with
-- the same words), nesting at most MAX_DEPTH deep, numbers finite and in
-- JSON's forms (no NaN, Infinity, hex or leading zeros; 1e999 refused).
local ok, cjson = pcall(require, "cjson")
if not ok then
  error("serve_json: lua-cjson is missing (install as root: apt-get install lua-cjson; "
        .. "scripts/serve/ensure-nginx installs it with nginx)", 0)
end

local M = {}
M.MAX_BYTES = 4 * 1024 * 1024
M.MAX_DEPTH = 32

-- a private instance: these settings do not leak into other users of cjson
local cj = cjson.new()
cj.decode_max_depth(M.MAX_DEPTH)
cj.decode_invalid_numbers(false)      -- NaN, Infinity, hex, leading zeros
cj.encode_invalid_numbers("null")
cj.encode_sparse_array(true)          -- a table with holes is written as an object
M.null = cj.null

local huge = math.huge

-- what cjson lets through that the limits refuse: an overflowing number
-- (1e999 -> inf). It also takes "1." and raw control characters inside
-- strings (the hand-written reader did not): harmless here, as every
-- element of x is then checked by serve_front.parse_rows.
local function finite(v)
  if type(v) == "number" then return v == v and v ~= huge and v ~= -huge end
  if type(v) ~= "table" then return true end
  for _, x in pairs(v) do
    if not finite(x) then return false end
  end
  return true
end

-- cjson's token names, in words
local TOKEN = { T_END = "the end of the input", T_ARR_BEGIN = "'['", T_ARR_END = "']'",
                T_OBJ_BEGIN = "'{'", T_OBJ_END = "'}'", T_COLON = "':'", T_COMMA = "','",
                T_STRING = "a string", T_NUMBER = "a number", T_BOOLEAN = "a boolean",
                T_NULL = "null" }

-- cjson's "... at character N" becomes "at byte N: ..." (N counts bytes from 1)
local function reason(e)
  e = tostring(e)
  local why, at = e:match("^(.-) at character (%d+)$")
  if not why then return "malformed JSON: " .. e end
  if why:find("^Found too many nested data structures") then why = "nested deeper than " .. M.MAX_DEPTH end
  why = why:gsub("^%u", string.lower):gsub("T_[%u_]+", TOKEN)
  return ("malformed JSON at byte %s: %s"):format(at, why)
end

function M.decode(s)
  if type(s) ~= "string" then error("malformed JSON: expected a string", 2) end
  if #s > M.MAX_BYTES then error("body over 4 MiB (over-size tensor)", 0) end
  local good, v = pcall(cj.decode, s)
  if not good then error(reason(v), 0) end
  if not finite(v) then error("malformed JSON: number out of range (not a finite double)", 0) end
  return v
end

function M.encode(v)
  return cj.encode(v)
end

return M
