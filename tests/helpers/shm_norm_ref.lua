-- Checks weft_host_rmsnorm (src/host/norm_host.c) against an f64 reference written
-- here in Lua. Used by tests/unit/norm_host_spec.lua in-process and, through
-- `luajit tests/helpers/shm_norm_ref.lua` with WEFT_NO_AVX2=1, for the
-- generic (SSE2) kernels in a child process (the kernel choice is made once
-- per process).
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C

local M = {}

local DT = { f32 = C.WEFT_F32, f16 = C.WEFT_F16, bf16 = C.WEFT_BF16 }
-- relative rounding unit of each storage type
local U = { f32 = 2 ^ -24, f16 = 2 ^ -11, bf16 = 2 ^ -8 }
-- half the spacing of subnormals (f16 outputs of tiny rows land there)
local SUB = { f32 = 2 ^ -150, f16 = 2 ^ -25, bf16 = 2 ^ -134 }

local function esize(dt) return dt == "f32" and 4 or 2 end
local function alloc(n, dt) return ffi.new("uint8_t[?]", math.max(1, n * esize(dt))) end
local function f64(p, n, dt)
  local d = ffi.new("double[?]", math.max(1, n))
  assert(C.weft_host_convert(p, DT[dt], d, C.WEFT_F64, n) == 0)
  return d
end
-- values as the storage type holds them (round once from f64)
local function rounded(d, n, dt)
  local tmp = alloc(n, dt)
  assert(C.weft_host_convert(d, C.WEFT_F64, tmp, DT[dt], n) == 0)
  return f64(tmp, n, dt)
end

-- One case; returns nil or a description of the first mismatch.
-- opts: dt, tokens, hidden, residual (bool), keep (residual_out), gemma,
-- inplace (out = x, residual_out = residual), eps, seed, scale.
function M.case(o)
  local dt, T, H = o.dt, o.tokens, o.hidden
  local n = T * H
  local x, r, w = alloc(n, dt), alloc(n, dt), alloc(H, dt)
  assert(C.weft_host_fill_random(x, n, DT[dt], o.seed, 1) == 0)
  assert(C.weft_host_fill_random(r, n, DT[dt], o.seed + 1, 1) == 0)
  assert(C.weft_host_fill_random(w, H, DT[dt], o.seed + 2, 0) == 0)
  if o.scale then -- stretch the range (large and tiny rows)
    local d = f64(x, n, dt)
    for i = 0, n - 1 do d[i] = d[i] * o.scale end
    assert(C.weft_host_convert(d, C.WEFT_F64, x, DT[dt], n) == 0)
  end
  local xd, rd, wd = f64(x, n, dt), f64(r, n, dt), f64(w, H, dt)
  local out = o.inplace and x or alloc(n, dt)
  local rout = o.keep and (o.inplace and r or alloc(n, dt)) or nil
  local rc = C.weft_host_rmsnorm(x, o.residual and r or nil, w, out, rout, T, H, DT[dt], o.eps,
                                 o.gemma and 1 or 0)
  if rc ~= 0 then return "rc " .. rc .. ": " .. wffi.last_error() end
  local got = f64(out, n, dt)
  local gotr = rout and f64(rout, n, dt)
  local v = ffi.new("double[?]", math.max(1, n))
  for i = 0, n - 1 do v[i] = xd[i] + (o.residual and rd[i] or 0) end
  local vr = o.keep and rounded(v, n, dt) or v
  local u = U[dt]
  for t = 0, T - 1 do
    local ss = 0
    for i = t * H, t * H + H - 1 do ss = ss + v[i] * v[i] end
    local rstd = 1 / math.sqrt(ss / H + o.eps)
    for i = t * H, t * H + H - 1 do
      if gotr then
        local e = math.abs(gotr[i] - vr[i])
        if e > math.abs(vr[i]) * u * 2 + SUB[dt] then
          return ("residual_out[%d] = %.9g, want %.9g"):format(i, gotr[i], vr[i])
        end
      end
      local wi = wd[i - t * H] + (o.gemma and 1 or 0)
      local want = vr[i] * rstd * wi
      -- f32 math: the sum of squares (H terms), rstd, two products, then one
      -- rounding to the storage type; plus the ulp of residual rounding
      local tol = math.abs(want) * (u * 2 + H * 2 ^ -24 + 2 ^ -20) + rstd * math.abs(wi) * u * 2
                  * math.abs(vr[i]) + SUB[dt] + 2 ^ -40
      if math.abs(got[i] - want) > tol then
        return ("out[%d] (token %d) = %.9g, want %.9g (x %.6g, residual %.6g, w %.6g)")
               :format(i, t, got[i], want, xd[i], o.residual and rd[i] or 0, wd[i - t * H])
      end
    end
  end
  return nil
end

-- All cases for one dtype; calls report(description, problem) per failure and
-- returns the number of cases run.
function M.run(dt, report)
  local count, seed = 0, 100
  local sweep = require("helpers.spec_util").grid("H", { 1, 7, 16, 33, 4096, 5000 }, "T", { 1, 3 },
                                                  "residual", { true, false }, "keep", { true, false },
                                                  "gemma", { false, true }, "inplace", { false, true })
  for _, c in ipairs(sweep) do
    local o = { dt = dt, tokens = c.T, hidden = c.H, residual = c.residual, keep = c.keep,
                gemma = c.gemma, inplace = c.inplace, eps = 1e-6, seed = seed }
    seed = seed + 3
    local bad = M.case(o)
    count = count + 1
    if bad then
      report(("%s tokens %d hidden %d residual %s keep %s gemma %s inplace %s")
             :format(dt, c.T, c.H, tostring(c.residual), tostring(c.keep), tostring(c.gemma),
                     tostring(c.inplace)), bad)
    end
  end
  for _, scale in ipairs { 1e-3, 100 } do -- f16 stays finite: |x| < 65504 / 2
    local o = { dt = dt, tokens = 2, hidden = 257, residual = true, keep = true, eps = 1e-5,
                seed = seed, scale = scale }
    seed = seed + 3
    local bad = M.case(o)
    count = count + 1
    if bad then report(("%s scale %g"):format(dt, scale), bad) end
  end
  return count
end

-- As a script: run everything, print failures and "OK <cases>".
if arg and arg[0] and arg[0]:match("shm_norm_ref%.lua$") then
  local fails = 0
  local total = 0
  for _, dt in ipairs { "f32", "f16", "bf16" } do
    total = total + M.run(dt, function(what, why)
      fails = fails + 1
      print("FAIL " .. what .. ": " .. why)
    end)
  end
  if fails == 0 then print("OK " .. total) end
  os.exit(fails == 0 and 0 or 1)
end

return M
