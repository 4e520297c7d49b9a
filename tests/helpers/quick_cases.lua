-- Input data for the quick all-reduce's error-bound tests, shared by the
-- CPU spec (tests/unit/quick_codec_spec.lua, against the CPU reference) and the
-- GPU worker (tests/helpers/gpu_quick_worker.lua, against the kernel):
-- every rank's values for a data class, deterministic from (class, dtype,
-- world, n), as host tensors of the dtype (so the values are exactly what
-- the dtype holds) and as Lua numbers read back from them.
--   local QC = require("helpers.quick_cases")
--   local xs, ts = QC.make("outliers", "bf16", 4, 4109)   -- xs[r][i], ts[r] (r = 1..W)
local T = require("weft.tensor")

local M = {}

M.CLASSES = { "normal", "outliers", "zero_blocks", "subnormals", "extremes" }
M.MAX = { bf16 = 3.3895313892515355e38, f16 = 65504 }
M.MIN_NORMAL = { bf16 = 2 ^ -126, f16 = 2 ^ -14 }
M.SUB_SCALE = { bf16 = 2 ^ -130, f16 = 2 ^ -18 }   -- randn * this: mostly subnormal

-- a small deterministic generator (xorshift; the same on every machine)
local function rng(seed)
  local s = seed % 2147483647
  if s <= 0 then s = s + 2147483646 end
  return function()
    s = (s * 16807) % 2147483647
    return s / 2147483647
  end
end
M.rng = rng

local function gauss(u)
  local a, b = u(), u()
  return math.sqrt(-2 * math.log(a + 1e-12)) * math.cos(2 * math.pi * b)
end

-- values(class, dtype, W, n, r): rank r's (0-based) values, as numbers
function M.values(class, dtype, W, n, r)
  local u = rng(1000003 * (r + 1) + 7919 * n + 31 * W + #class * 17 + (dtype == "f16" and 5 or 0))
  local v = {}
  local MAXV = M.MAX[dtype]
  for i = 1, n do
    local x = gauss(u)
    local blk = math.floor((i - 1) / 32)
    if class == "outliers" then
      local ch = (i - 1) % 512
      if ch == 7 or ch == 100 or ch == 333 then x = x * (50 + 50 * r / math.max(W - 1, 1)) end
    elseif class == "zero_blocks" then
      if blk % 5 == 0 then x = 0
      elseif blk % 5 == 1 and r == 0 then x = 0
      elseif blk % 5 == 2 then x = (i % 2 == 0) and -0.0 or 0.0 end
    elseif class == "subnormals" then
      if blk % 3 == 0 then x = x * M.SUB_SCALE[dtype]                -- a subnormal block
      elseif blk % 3 == 1 then x = (i % 4 == 0) and x or x * M.SUB_SCALE[dtype] end  -- mixed with normals
    elseif class == "extremes" then
      if blk % 3 == 0 then x = (x < 0 and -1 or 1) * MAXV / (2 * W) * (0.5 + 0.5 * u())  -- near the top
      elseif blk % 3 == 1 then x = (x < 0 and -1 or 1) * M.MIN_NORMAL[dtype] * (1 + u())  -- near the bottom
      else x = (i % 8 == 0) and (x < 0 and -1 or 1) * MAXV / (4 * W) or x * M.MIN_NORMAL[dtype] end
    end
    v[i] = x
  end
  return v
end

-- make(class, dtype, W, n) -> xs (xs[r][i], r = 1..W, exact dtype values), ts (host tensors)
function M.make(class, dtype, W, n)
  local xs, ts = {}, {}
  for r = 1, W do
    local t = T.from_table(M.values(class, dtype, W, n, r - 1), dtype, { n }, "cpu")
    ts[r] = t
    xs[r] = t:to_table()
  end
  return xs, ts
end

-- exact(xs) -> f64 sums per element
function M.exact(xs)
  local s = {}
  for i = 1, #xs[1] do
    local a = 0
    for r = 1, #xs do a = a + xs[r][i] end
    s[i] = a
  end
  return s
end

-- first element whose |got - exact| exceeds bound: i, got, exact, bound (or nil)
function M.violation(got, ex, b)
  for i = 1, #ex do
    local g = got[i]
    if not (math.abs(g - ex[i]) <= b[i]) then return i, g, ex[i], b[i] end
  end
end

-- the raw 16-bit words of a host tensor of bf16/f16
function M.bits(t)
  local ffi = require("ffi")
  local p = ffi.cast("const uint16_t *", t.ptr)
  local out = {}
  for i = 1, t.numel do out[i] = p[i - 1] end
  return out
end

-- is w (16-bit word) a NaN of dtype?
function M.is_nan_bits(w, dtype)
  if dtype == "bf16" then return bit.band(w, 0x7f80) == 0x7f80 and bit.band(w, 0x7f) ~= 0 end
  return bit.band(w, 0x7c00) == 0x7c00 and bit.band(w, 0x3ff) ~= 0
end

return M
