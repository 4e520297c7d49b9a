-- weft.internal.clock — the one monotonic clock of the Lua layer (CLOCK_MONOTONIC).
-- Declared once under a private symbol name, so no other module's cdef of
-- clock_gettime (with another struct type) can clash with it. Needs only libc.
local ffi = require("ffi")

local M = {}

if not pcall(function() return ffi.C.weft_clock_monotonic_ end) then
  ffi.cdef [[ int weft_clock_monotonic_(int clk, long *ts) __asm__("clock_gettime"); ]]
end

local C, ts, tonumber = ffi.C, ffi.new("long[2]"), tonumber
local CLOCK_MONOTONIC = 1

function M.now_ns()
  C.weft_clock_monotonic_(CLOCK_MONOTONIC, ts)
  return tonumber(ts[0]) * 1e9 + tonumber(ts[1])
end

function M.now_us()
  C.weft_clock_monotonic_(CLOCK_MONOTONIC, ts)
  return tonumber(ts[0]) * 1e6 + tonumber(ts[1]) * 1e-3
end

function M.now_ms()
  C.weft_clock_monotonic_(CLOCK_MONOTONIC, ts)
  return tonumber(ts[0]) * 1e3 + tonumber(ts[1]) * 1e-6
end

return M
