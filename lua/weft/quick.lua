-- weft.quick — the quick all-reduce's codecs from Lua (docs/quick-allreduce.md):
-- names, the minimum sizes from which the policy uses them (the policy
-- file's quick_min section, else the seed's table), the CPU reference
-- (weft_qr_reference: the kernel's exact bits) and the per-element error
-- bound the docs state and the tests assert.
--
--   local Q = require("weft.quick")
--   Q.min_bytes("bf16", 2, "int8") -> 8388608, "the seed's table"
--   Q.reference("int8", "bf16", { host_tensor_rank0, ... }) -> host tensor
--   Q.bounds("int8", "bf16", { {x...}, {x...} }) -> { b1, b2, ... }
--   Q.bound_text("int8") -> the bound in words
local ffi = require("ffi")

local type, tostring, error, pairs, ipairs, tonumber = type, tostring, error, pairs, ipairs, tonumber
local abs, max, huge, log10 = math.abs, math.max, math.huge, math.log10
local fmt = string.format

local M = {}

M.CODECS = { fp = 0, int8 = 1, int4 = 2, fp8 = 3 }
M.SETTINGS = { int8 = true, int4 = true, fp8 = true, off = true }   -- policy.set{quick = ...}
M.DTYPES = { bf16 = true, f16 = true }
M.BLOCK = 32                                       -- elements per f32 scale
M.QMAX = { int8 = 127, int4 = 7, fp8 = 448 }
M.WORLDS = { [2] = true, [4] = true, [6] = true, [8] = true }

local MB = 1048576
-- The seed's table (SGLang/vLLM QuickAllReduce._QR_MIN_SIZE, measured on
-- AMD MI300 by its authors; columns FP, INT8, INT6, INT4): the size from
-- which each regime pays off. fp8 moves int8's bytes: int8's column. World 6
-- is not in the seed: the larger of worlds 4 and 8 (conservative). weft-tune
-- writes the H200's own numbers into the policy file's quick_min section.
local SEED = {
  f16 = { [2] = { fp = 1, int8 = 2, int4 = 1 }, [4] = { fp = 1, int8 = 16, int4 = 2 },
          [8] = { fp = 16, int8 = 4, int4 = 2 } },
  bf16 = { [2] = { fp = 2, int8 = 8, int4 = 8 }, [4] = { fp = 8, int8 = 64, int4 = 16 },
           [8] = { fp = 16, int8 = 2048, int4 = 2048 } },
}
M.SEED_MIN = {}
for dt, by in pairs(SEED) do
  M.SEED_MIN[dt] = {}
  for w, t in pairs(by) do
    M.SEED_MIN[dt][w] = { int8 = t.int8 * MB, int4 = t.int4 * MB, fp8 = t.int8 * MB, fp = t.fp * MB }
  end
  local w4, w8 = M.SEED_MIN[dt][4], M.SEED_MIN[dt][8]
  M.SEED_MIN[dt][6] = {}
  for k in pairs(w4) do M.SEED_MIN[dt][6][k] = max(w4[k], w8[k]) end
end

-- min_bytes(dtype, world, codec [, tuned]) -> bytes, source text. tuned: the
-- policy file's table (default weft.policy's).
function M.min_bytes(dtype, world, codec, tuned)
  if tuned == nil then
    local pol = package.loaded["weft.policy"]
    tuned = pol and pol.tuned
  end
  local q = tuned and tuned.quick_min
  if q then
    local by = q[world] or q["*"]
    local wk = q[world] and world or "*"
    local t = by and (by[dtype] or by["*"])
    local dk = by and (by[dtype] and dtype or "*")
    if t and t[codec] then
      local pol = package.loaded["weft.policy"]
      return t[codec], fmt("policy file %s: quick_min[%s].%s.%s", tostring(pol and pol.tuned_path or "(table)"),
                           tostring(wk), tostring(dk), codec)
    end
  end
  local s = M.SEED_MIN[dtype] and M.SEED_MIN[dtype][world]
  if s then return s[codec], "the seed's table (QuickAllReduce, measured on MI300; not yet on this machine)" end
  return huge, "no quick all-reduce for this dtype and world"
end

---------------------------------------------------------------- the reference
local C
local function lib()
  if C == nil then C = require("weft.internal.ffi").C end
  return C
end

-- reference(codec, dtype, inputs) -> host tensor: the quick all-reduce of
-- the host tensors inputs[1..W] (rank order) computed on the CPU with the
-- kernel's operations (weft_qr_reference).
-- the arguments both references share: codec number, dtype code, the
-- inputs' pointers (rank order) and their element count; errors name `fn`
local function ref_args(fn, codec, dtype, inputs)
  local c = M.CODECS[codec]
  if c == nil then error(("weft: quick.%s: unknown codec %s"):format(fn, tostring(codec)), 3) end
  local code = dtype == "bf16" and 2 or dtype == "f16" and 1 or nil
  if code == nil then error(("weft: quick.%s: dtype %s is not bf16 or f16"):format(fn, tostring(dtype)), 3) end
  local n = inputs[1].numel
  local ptrs = ffi.new("const void *[?]", #inputs)
  for i, x in ipairs(inputs) do
    if x.numel ~= n or x.dtype ~= dtype then error(("weft: quick.%s: inputs differ in size or dtype"):format(fn), 3) end
    ptrs[i - 1] = x.ptr
  end
  return c, code, ptrs, n
end

function M.reference(codec, dtype, inputs)
  local T = require("weft.tensor")
  local c, code, ptrs, n = ref_args("reference", codec, dtype, inputs)
  local out = T.empty(inputs[1].shape, dtype, "cpu")
  if lib().weft_qr_reference(c, code, #inputs, ptrs, out.ptr, n) ~= 0 then
    error("weft: quick.reference: " .. ffi.string(lib().weft_last_error()), 2)
  end
  return out
end

-- fused_reference(codec, dtype, inputs, residual, weight, eps [, gemma])
--   -> sum, residual_out, norm_out (host tensors shaped like inputs[1]): the
-- fused quick two-shot (kernels/quick_fused.cu) on the CPU
-- (weft_qr_fused_reference): sum = the all-reduced value, residual_out the
-- kernel's bits, norm_out the f64 norm of residual_out rounded to dtype.
function M.fused_reference(codec, dtype, inputs, residual, weight, eps, gemma)
  local T = require("weft.tensor")
  local c, code, ptrs, n = ref_args("fused_reference", codec, dtype, inputs)
  local sh = inputs[1].shape
  local hidden = sh[#sh]
  local sum, ro, no = T.empty(sh, dtype, "cpu"), T.empty(sh, dtype, "cpu"), T.empty(sh, dtype, "cpu")
  if lib().weft_qr_fused_reference(c, code, #inputs, ptrs, residual.ptr, weight.ptr, eps, gemma and 1 or 0,
                                   n / hidden, hidden, sum.ptr, ro.ptr, no.ptr) ~= 0 then
    error("weft: quick.fused_reference: " .. ffi.string(lib().weft_last_error()), 2)
  end
  return sum, ro, no
end

---------------------------------------------------------------- the bound
-- Unit roundoff and half the smallest subnormal of the output dtype.
local U = { bf16 = 2 ^ -8, f16 = 2 ^ -11 }
local TINY = { bf16 = 2 ^ -134, f16 = 2 ^ -25 }
local SLACK = 1 + 2 ^ -10       -- the f32 roundings inside encode/decode (each 2^-24 relative)
local ABS = 2 ^ -140            -- a scale below f32's normal range: its absolute rounding
M.U, M.TINY = U, TINY

-- one contribution's error bound: element |x|, block max a
local function contrib(codec, x, a)
  if codec == "fp" then return 0 end
  local h = a / M.QMAX[codec]
  if codec == "fp8" then return (2 ^ -4 * abs(x) + 2 ^ -10 * h) * SLACK + ABS end
  return h / 2 * SLACK + ABS
end

-- bounds(codec, dtype, xs [, n]) -> list b: for every element i, a bound on
-- |weft - exact sum| (exact: the f64 sum of the inputs as given). xs[r][i]:
-- rank r's input values (numbers, finite, as the dtype holds them). The
-- bound: every contribution's codec error (int: half a step h = block max /
-- QMAX; fp8: 2^-4 |x| + 2^-10 h), the f32 sum's roundings, the re-encoded
-- sum's codec error (its block max is at most the exact block max plus the
-- errors so far), and the output's rounding (u |y| + half a subnormal).
function M.bounds(codec, dtype, xs, n)
  local W = #xs
  n = n or #xs[1]
  local out = {}
  local B = M.BLOCK
  for b0 = 1, n, B do
    local b1 = math.min(b0 + B - 1, n)
    local amax = {}
    for r = 1, W do
      local a = 0
      for i = b0, b1 do a = max(a, abs(xs[r][i])) end
      amax[r] = a
    end
    local e_in, ex, emax, exmax = {}, {}, 0, 0
    for i = b0, b1 do
      local e, s, sa = 0, 0, 0
      for r = 1, W do
        local x = xs[r][i]
        e = e + contrib(codec, x, amax[r])
        s = s + x
        sa = sa + abs(x) + contrib(codec, x, amax[r])
      end
      e = e + (W - 1) * 2 ^ -24 * sa         -- f32 additions, in rank order
      e_in[i], ex[i] = e, s
      emax, exmax = max(emax, e), max(exmax, abs(s))
    end
    for i = b0, b1 do
      local e = e_in[i]
      if codec ~= "fp" then
        local az = exmax + emax              -- bounds the owner's block max
        local z = abs(ex[i]) + e
        if codec == "fp8" then e = e + (2 ^ -4 * z + 2 ^ -10 * az / 448) * SLACK + ABS
        else e = e + az / M.QMAX[codec] / 2 * SLACK + ABS end
      end
      out[i] = e + U[dtype] * (abs(ex[i]) + e) + TINY[dtype]
    end
  end
  return out
end

-- fused_bounds(codec, dtype, xs, res, w, hidden, eps, gemma, got_res)
--   -> { sum = {...}, res = {...}, norm = {...} }: per element bounds of the
-- fused quick two-shot against the exact f64 computation. xs[r][i], res[i],
-- w[j]: numbers (finite, as the dtype holds them); got_res[i]: the kernel's
-- residual_out (its norm's rstd is computed from it). Per row (blocks from
-- the row's start): sum: M.bounds on the row (b_i); residual_out:
-- b_i (1 + u) + u |S_i + r_i| + tiny (one more rounding); norm: with e_i that
-- bound, rstd' = rstd of got_res, rstd* = rstd of the exact y* = S + r,
-- |n_i - n*_i| <= |w_i| (e_i rstd' + |y*_i| rstd' rstd* rms(e)) (since
-- |sqrt(m + eps) - sqrt(m* + eps)| <= rms(y - y*) <= rms(e)), plus the
-- kernel's f32 arithmetic (2^-18 relative: rsqrtf, the sum of squares) and
-- the output rounding (u |n| + tiny).
function M.fused_bounds(codec, dtype, xs, res, w, hidden, eps, gemma, got_res)
  local W, n = #xs, #res
  local u, tiny = U[dtype], TINY[dtype]
  local out = { sum = {}, res = {}, norm = {} }
  for r0 = 0, n - 1, hidden do
    local rows = {}
    for r = 1, W do
      local t = {}
      for i = 1, hidden do t[i] = xs[r][r0 + i] end
      rows[r] = t
    end
    local b = M.bounds(codec, dtype, rows, hidden)
    local e, ys, ss_e, ss_y, ss_g = {}, {}, 0, 0, 0
    for i = 1, hidden do
      local k = r0 + i
      local S = 0
      for r = 1, W do S = S + xs[r][k] end
      local y = S + res[k]
      out.sum[k] = b[i]
      e[i] = b[i] * (1 + u) + u * abs(y) + tiny
      out.res[k] = e[i]
      ys[i] = y
      ss_e, ss_y, ss_g = ss_e + e[i] * e[i], ss_y + y * y, ss_g + got_res[k] * got_res[k]
    end
    local rstd_x = 1 / math.sqrt(ss_y / hidden + eps)
    local rstd_g = 1 / math.sqrt(ss_g / hidden + eps)
    local rms_e = math.sqrt(ss_e / hidden)
    for i = 1, hidden do
      local wi = w[i] + (gemma and 1 or 0)
      local nx = abs(ys[i] * rstd_x * wi)
      local d = abs(wi) * (e[i] * rstd_g + abs(ys[i]) * rstd_g * rstd_x * rms_e)
      out.norm[r0 + i] = d + 2 ^ -18 * (nx + d) + u * (nx + d) + tiny
    end
  end
  return out
end

-- the bound in words, for explain and the docs
local TEXT = {
  fp = "exact inputs; f32 sum in rank order, one rounding to the dtype",
  int8 = "|err| <= sum over ranks of h_r/2 + h_sum/2 + output rounding, h = block max/127 (32-element blocks)",
  int4 = "|err| <= sum over ranks of h_r/2 + h_sum/2 + output rounding, h = block max/7 (32-element blocks)",
  fp8 = "|err| <= sum over ranks of (2^-4 |x_r| + 2^-10 h_r) + (2^-4 |sum| + 2^-10 h_sum) + output rounding, "
        .. "h = block max/448 (32-element blocks)",
}
function M.bound_text(codec) return TEXT[codec] or "?" end

-- snr_db(ref, got): 10 log10(sum ref^2 / sum (got - ref)^2) over two lists
function M.snr_db(ref, got)
  local s, e = 0, 0
  for i = 1, #ref do
    s = s + ref[i] * ref[i]
    local d = got[i] - ref[i]
    e = e + d * d
  end
  if e == 0 then return huge end
  return 10 * log10(s / e)
end

-- algorithm name of weft.backends.custom_ar for a setting ("int8" -> "quick_int8")
function M.algo(codec) return "quick_" .. codec end

-- validate a setting value; returns it or nil, why
function M.check_setting(v)
  if M.SETTINGS[v] then return v end
  local l = {}
  for k in pairs(M.SETTINGS) do l[#l + 1] = k end
  table.sort(l)
  return nil, fmt("%s is not one of %s", tostring(v), table.concat(l, ", "))
end

M._tonumber = tonumber
return M
