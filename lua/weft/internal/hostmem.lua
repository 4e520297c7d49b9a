-- weft.internal.hostmem — host memory copies, fills and strings of any size.
--
-- LuaJIT's ffi.copy and ffi.fill take a 32-bit length: from 2^31 bytes on
-- they silently copy or fill too little (2^31 + 64 bytes copy 2^31; 2^32 + 8
-- copy 8), and ffi.string wraps a 64-bit cdata length. Every host copy or
-- fill in weft whose length is not a small constant goes through here, in
-- pieces of CHUNK bytes, so a tensor of any size is copied whole.
local ffi = require("ffi")

local ffi_copy, ffi_fill, ffi_cast, ffi_string = ffi.copy, ffi.fill, ffi.cast, ffi.string
local tonumber, type, error, fmt = tonumber, type, error, string.format

local M = {}

local CHUNK = 2 ^ 30          -- well inside ffi.copy's 32-bit length
M.CHUNK = CHUNK

-- Tests only: a smaller piece size, so the splitting is checked without GiBs.
function M._set_chunk(n)
  CHUNK = n or 2 ^ 30
  M.CHUNK = CHUNK
end
-- LuaJIT's longest string (LJ_MAX_STR): 2^31 - 256 bytes
M.MAX_STRING = 2 ^ 31 - 256

local u8p, cu8p = ffi.typeof("uint8_t *"), ffi.typeof("const uint8_t *")

-- memcpy(dst, src, n); src may be a Lua string (then n <= #src).
function M.copy(dst, src, n)
  if n <= CHUNK then
    if n > 0 then ffi_copy(dst, src, n) end
    return
  end
  n = tonumber(n)
  local d, s, off = ffi_cast(u8p, dst), ffi_cast(cu8p, src), 0
  while off < n do
    local k = n - off
    if k > CHUNK then k = CHUNK end
    ffi_copy(d + off, s + off, k)
    off = off + k
  end
end

-- memset(dst, byte, n); byte defaults to 0.
function M.fill(dst, n, byte)
  byte = byte or 0
  if n <= CHUNK then
    if n > 0 then ffi_fill(dst, n, byte) end
    return
  end
  n = tonumber(n)
  local d, off = ffi_cast(u8p, dst), 0
  while off < n do
    local k = n - off
    if k > CHUNK then k = CHUNK end
    ffi_fill(d + off, k, byte)
    off = off + k
  end
end

-- A Lua string of n bytes at p; raises "weft: <op>: ..." past what a Lua
-- string holds (instead of a wrapped length, or LuaJIT's bare "string
-- length overflow").
function M.string(p, n, op, level)
  if type(n) ~= "number" then n = tonumber(n) end
  if n > M.MAX_STRING then
    error(fmt("weft: %s: %.0f bytes do not fit in a Lua string (at most %.0f bytes): this "
              .. "route moves data as strings; use a tensor collective on a shm or Gloo route",
              op or "string", n, M.MAX_STRING), (level or 1) + 1)
  end
  return ffi_string(p, n)
end

return M
