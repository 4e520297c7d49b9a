-- weft.serialize — a safe binary serializer for Lua values (object collectives).
--
-- Encodes nil, booleans, numbers (integers compactly; inf, nan and -0 exactly),
-- strings with any bytes, nested tables (cycles refused, shared sub-tables
-- copied), 64-bit cdata integers, and weft tensors by value (dtype, shape,
-- bytes). The decoder only interprets the format: it never loads code, checks
-- every length against the bytes that remain, bounds nesting depth, and raises
-- "weft: decode: ..." naming the offset on anything malformed.
--
-- Format (little-endian): "WFS" 0x01, then one value:
--   0x00 nil   0x01 false   0x02 true   0x80+n integer 0..127
--   0x03 double (8 bytes)   0x04 integer >= 0 (varint)   0x05 integer < 0 (varint of -x)
--   0x06 string: varint len, bytes
--   0x07 table: varint narr, varint nhash, narr values, nhash (key, value)
--   0x08 int64 cdata (8 bytes)   0x09 uint64 cdata (8 bytes)
--   0x0A tensor: varint dtype len, dtype, varint ndim, ndim varints, varint nbytes, bytes
-- Integers here are numbers with no fraction and |x| <= 2^53.
local ffi = require("ffi")

local M = {}

local floor = math.floor
local type, next, tostring = type, next, tostring
local ffi_string, ffi_cast, ffi_istype = ffi.string, ffi.cast, ffi.istype
local copy_bytes = require("weft.internal.hostmem").copy -- any size (ffi.copy stops at 2^31)
local E = require("weft.internal.errors")

if not ffi.abi("le") then
  error("weft: serialize: big-endian hosts are not supported", 0)
end

M.MAGIC = "WFS\1"
M.MAX_DEPTH = 100
local MAX_INT = 2 ^ 53

local T_NIL, T_FALSE, T_TRUE, T_DOUBLE, T_UINT, T_NINT = 0, 1, 2, 3, 4, 5
local T_STRING, T_TABLE, T_I64, T_U64, T_TENSOR = 6, 7, 8, 9, 10
local T_FIXINT = 0x80

local ok_tnew, table_new = pcall(require, "table.new")
if not ok_tnew then table_new = function() return {} end end

local cu8p = ffi.typeof("const uint8_t *")
local dbox = ffi.new("double[1]")
local i64box = ffi.new("int64_t[1]")
local u64box = ffi.new("uint64_t[1]")
local i64t, u64t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")

local TENSOR_DTYPES = { f32 = 4, f16 = 2, bf16 = 2, i32 = 4, i64 = 8, u8 = 1, f8e4m3 = 1, f64 = 8 }

---------------------------------------------------------------- encoder
-- A growable byte buffer; one per encode call (encoding is not re-entrant
-- through user code, but keeping it local avoids any shared state).
local function new_buf()
  local cap = 256
  return { p = ffi.new("uint8_t[?]", cap), cap = cap, n = 0 }
end

local function ensure(b, extra)
  local need = b.n + extra
  if need <= b.cap then return end
  local cap = b.cap
  while cap < need do cap = cap * 2 end
  local p = ffi.new("uint8_t[?]", cap)
  copy_bytes(p, b.p, b.n)
  b.p, b.cap = p, cap
end

local function put_u8(b, v)
  ensure(b, 1)
  b.p[b.n] = v
  b.n = b.n + 1
end

-- Unsigned LEB128 of a non-negative integral Lua number (<= 2^53).
local function put_varint(b, v)
  ensure(b, 10)
  local p, n = b.p, b.n
  while v >= 128 do
    local lo = v % 128
    p[n] = lo + 128
    n = n + 1
    v = (v - lo) / 128
  end
  p[n] = v
  b.n = n + 1
end

local function put_raw(b, src, len)
  ensure(b, len)
  copy_bytes(b.p + b.n, src, len)
  b.n = b.n + len
end

local function put_string(b, s)
  local len = #s
  put_varint(b, len)
  put_raw(b, s, len)
end

local function tensor_module()
  return package.loaded["weft.tensor"]
end

local function describe_path(path)
  return path == "" and "value" or ("value" .. path)
end

local function key_path(path, k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") then return path .. "." .. k end
  return path .. "[" .. tostring(k) .. "]"
end

local encode_value

local function encode_tensor(b, t, path)
  if t.ptr == nil and t.numel > 0 then
    error("weft: encode: " .. describe_path(path) .. " is a tensor whose storage was freed", 0)
  end
  local T = tensor_module()
  local pop, pgroup = T.pinned_by(t)
  if pop then
    error(("weft: encode: %s is a tensor in use by a pending %s on group %s (wait for its handle first)")
          :format(describe_path(path), pop, tostring(pgroup)), 0)
  end
  local host = t
  if t.is_cuda and t:is_cuda() then host = t:to("cpu") end
  if not host:is_contiguous() then host = host:clone() end
  if not host:is_contiguous() then
    error("weft: encode: tensor is not contiguous and could not be made so", 0)
  end
  put_u8(b, T_TENSOR)
  put_string(b, host.dtype)
  local shape = host.shape
  put_varint(b, #shape)
  for i = 1, #shape do put_varint(b, shape[i]) end
  local nbytes = tonumber(host.nbytes)
  put_varint(b, nbytes)
  if nbytes > 0 then put_raw(b, host.ptr, nbytes) end
end

local function encode_table(b, t, depth, visiting, path, max_depth)
  if visiting[t] then
    error("weft: encode: " .. describe_path(path) .. " contains a cycle (a table that contains itself)", 0)
  end
  if depth > max_depth then
    error(("weft: encode: %s nests deeper than %d levels"):format(describe_path(path), max_depth), 0)
  end
  visiting[t] = true
  local narr = 0
  -- raw reads: a metatable's __index (a default value) would answer forever
  while rawget(t, narr + 1) ~= nil do narr = narr + 1 end
  local nhash = 0
  for k in next, t do
    if not (type(k) == "number" and k >= 1 and k <= narr and k == floor(k)) then
      nhash = nhash + 1
    end
  end
  put_u8(b, T_TABLE)
  put_varint(b, narr)
  put_varint(b, nhash)
  for i = 1, narr do
    encode_value(b, rawget(t, i), depth + 1, visiting, path, max_depth, i)
  end
  if nhash > 0 then
    for k, v in next, t do
      if not (type(k) == "number" and k >= 1 and k <= narr and k == floor(k)) then
        encode_value(b, k, depth + 1, visiting, path, max_depth, nil, true)
        encode_value(b, v, depth + 1, visiting, key_path(path, k), max_depth)
      end
    end
  end
  visiting[t] = nil
end

function encode_value(b, v, depth, visiting, path, max_depth, index, is_key)
  if index then path = path .. "[" .. index .. "]" end
  local tv = type(v)
  if tv == "nil" then
    put_u8(b, T_NIL)
  elseif tv == "boolean" then
    put_u8(b, v and T_TRUE or T_FALSE)
  elseif tv == "number" then
    if v == floor(v) and v <= MAX_INT and v >= -MAX_INT and (v ~= 0 or 1 / v > 0) then
      if v >= 0 then
        if v < 128 then put_u8(b, T_FIXINT + v)
        else put_u8(b, T_UINT); put_varint(b, v) end
      else
        put_u8(b, T_NINT); put_varint(b, -v)
      end
    else
      put_u8(b, T_DOUBLE)
      dbox[0] = v
      put_raw(b, dbox, 8)
    end
  elseif tv == "string" then
    put_u8(b, T_STRING)
    put_string(b, v)
  elseif tv == "table" then
    local T = tensor_module()
    if T and T.is_tensor(v) then
      encode_tensor(b, v, path)
    else
      encode_table(b, v, depth, visiting, path, max_depth)
    end
  elseif tv == "cdata" then
    if ffi_istype(i64t, v) then
      put_u8(b, T_I64); i64box[0] = v; put_raw(b, i64box, 8)
    elseif ffi_istype(u64t, v) then
      put_u8(b, T_U64); u64box[0] = v; put_raw(b, u64box, 8)
    else
      local T = tensor_module()
      if T and T.is_tensor(v) then
        encode_tensor(b, v, path)
      else
        error(("weft: encode: cannot serialize %s at %s (only 64-bit integer cdata and weft tensors)")
              :format(tostring(ffi.typeof(v)), describe_path(path)), 0)
      end
    end
  else
    error(("weft: encode: cannot serialize a %s at %s%s"):format(
      tv, describe_path(path), is_key and " (table key)" or ""), 0)
  end
end

-- A total order over table keys of mixed types (by type name, then value;
-- other types by their text): the same key order on every rank, for
-- tensor dicts and for the REPL's listings.
function M.key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta < tb end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

-- encode(value [, {max_depth=}]) -> string
function M.encode(v, opts)
  local max_depth = opts and opts.max_depth or M.MAX_DEPTH
  local b = new_buf()
  put_raw(b, M.MAGIC, 4)
  encode_value(b, v, 1, {}, "", max_depth)
  return ffi_string(b.p, b.n)
end

---------------------------------------------------------------- decoder
local function derr(st, fmt, ...)
  E.fail(0, "decode", "%s (at byte %d of %d)", fmt:format(...), st.pos, st.len)
end

local function need(st, n, what)
  if n > st.len - st.pos then
    error(("weft: decode: truncated input: %s needs %d bytes, %d left (at byte %d of %d)")
          :format(what, n, st.len - st.pos, st.pos, st.len), 0)
  end
end

local function get_u8(st, what)
  need(st, 1, what)
  local v = st.p[st.pos]
  st.pos = st.pos + 1
  return v
end

-- 8 raw bytes through box (a one-element double, int64 or uint64 array)
local function get8(st, box, what)
  need(st, 8, what)
  copy_bytes(box, st.p + st.pos, 8)
  st.pos = st.pos + 8
  return box[0]
end

local function get_varint(st, what, max)
  local v, mul = 0, 1
  for _ = 1, 8 do   -- 8 * 7 = 56 bits cover 2^53
    local byte = get_u8(st, what)
    if byte < 128 then
      v = v + byte * mul
      if v > max then
        error(("weft: decode: %s %.0f exceeds the limit %.0f (at byte %d of %d)")
              :format(what, v, max, st.pos, st.len), 0)
      end
      return v
    end
    v = v + (byte - 128) * mul
    mul = mul * 128
  end
  error(("weft: decode: %s: varint longer than 8 bytes (at byte %d of %d)"):format(what, st.pos, st.len), 0)
end

local decode_value

local function decode_tensor(st)
  local dlen = get_varint(st, "tensor dtype length", 16)
  need(st, dlen, "tensor dtype")
  local dtype = ffi_string(st.p + st.pos, dlen)
  st.pos = st.pos + dlen
  local esize = TENSOR_DTYPES[dtype]
  if not esize then
    error(("weft: decode: unknown tensor dtype %q (at byte %d of %d)"):format(dtype, st.pos, st.len), 0)
  end
  local ndim = get_varint(st, "tensor rank", 16)
  local shape, numel = {}, 1
  for i = 1, ndim do
    shape[i] = get_varint(st, "tensor dimension", MAX_INT)
    numel = numel * shape[i]
  end
  local nbytes = get_varint(st, "tensor byte count", MAX_INT)
  if nbytes ~= numel * esize then
    error(("weft: decode: tensor of shape {%s} %s needs %.0f bytes, frame says %.0f (at byte %d of %d)")
          :format(table.concat(shape, ","), dtype, numel * esize, nbytes, st.pos, st.len), 0)
  end
  need(st, nbytes, "tensor data")
  local T = require("weft.tensor")
  local t = T.empty(shape, dtype)
  if nbytes > 0 then copy_bytes(t.ptr, st.p + st.pos, nbytes) end
  st.pos = st.pos + nbytes
  return t
end

local function decode_table(st, depth)
  if depth > st.max_depth then derr(st, "nesting deeper than %d levels", st.max_depth) end
  local left = st.len - st.pos
  local narr = get_varint(st, "array length", left)
  local nhash = get_varint(st, "hash length", left)
  -- every element takes at least one byte, every hash entry two
  if narr + 2 * nhash > st.len - st.pos then
    derr(st, "table claims %d+%d entries, more than the bytes left", narr, nhash)
  end
  local t = table_new(narr, nhash)
  for i = 1, narr do
    local v = decode_value(st, depth + 1)
    if v == nil then derr(st, "nil in the array part of a table at index %d", i) end
    t[i] = v
  end
  for _ = 1, nhash do
    local k = decode_value(st, depth + 1)
    if k == nil then derr(st, "%s", "nil table key") end
    if k ~= k then derr(st, "%s", "NaN table key") end
    local v = decode_value(st, depth + 1)
    if v == nil then derr(st, "%s", "nil table value") end
    if t[k] ~= nil then derr(st, "duplicate table key %s", tostring(k)) end
    t[k] = v
  end
  return t
end

function decode_value(st, depth)
  local tag = get_u8(st, "value tag")
  if tag >= T_FIXINT then return tag - T_FIXINT end
  if tag == T_NIL then return nil
  elseif tag == T_FALSE then return false
  elseif tag == T_TRUE then return true
  elseif tag == T_UINT then return get_varint(st, "integer", MAX_INT)
  elseif tag == T_NINT then return -get_varint(st, "integer", MAX_INT)
  elseif tag == T_DOUBLE then return get8(st, dbox, "double")
  elseif tag == T_STRING then
    local len = get_varint(st, "string length", MAX_INT)
    need(st, len, "string")
    local s = ffi_string(st.p + st.pos, len)
    st.pos = st.pos + len
    return s
  elseif tag == T_TABLE then
    return decode_table(st, depth)
  elseif tag == T_I64 then return get8(st, i64box, "int64")
  elseif tag == T_U64 then return get8(st, u64box, "uint64")
  elseif tag == T_TENSOR then
    return decode_tensor(st)
  end
  st.pos = st.pos - 1
  derr(st, "unknown value tag 0x%02x", tag)
end

-- decode(string [, {max_depth=}]) -> value. Raises on anything malformed,
-- including trailing bytes after the value.
function M.decode(s, opts)
  if type(s) ~= "string" then
    error("weft: decode: expected a string of bytes, got a " .. type(s), 2)
  end
  local len = #s
  if len < 5 or s:sub(1, 4) ~= M.MAGIC then
    error(("weft: decode: not weft-serialized data (bad header, %d bytes)"):format(len), 2)
  end
  local st = { p = ffi_cast(cu8p, s), pos = 4, len = len, s = s,
               max_depth = opts and opts.max_depth or M.MAX_DEPTH }
  local v = decode_value(st, 1)
  if st.pos ~= len then
    error(("weft: decode: %d trailing bytes after the value (at byte %d of %d)")
          :format(len - st.pos, st.pos, len), 2)
  end
  return v
end

M.dumps, M.loads = M.encode, M.decode

return M
