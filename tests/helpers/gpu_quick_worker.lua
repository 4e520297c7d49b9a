-- One rank of tests/gpu/gpu_quick_spec.lua: the quick all-reduce's kernel at
-- world W (ranks sharing the GPU under MPS: scripts/weft-mps -n W --
-- scripts/weft-run -n W tests/helpers/gpu_quick_worker.lua). Every codec
-- (fp, int8, int4, fp8), bf16 and f16, on normal data, outlier channels,
-- all-zero blocks, subnormals and the range's extremes: the kernel's output
-- equals the CPU reference (weft_qr_reference) bit for bit, lies within the
-- stated bound of the f64 sum element by element, and is the same bits on
-- every rank; NaN/Inf confined to their block; graph replays, weft.async,
-- deterministic mode (row bits independent of the batch), a large call.
-- WEFT_QUICK_KILL=r: rank r leaves during quick calls; the others must fail
-- naming it. WEFT_FAKE_DEVICE=1 rehearses it on the CPU.
-- Prints "PASS <name>" / "FAIL <name>: why" per check; exits 1 on a failure.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local G, weft, T, cuda, policy, db, graph, async = R.G, R.weft, R.T, R.cuda, R.policy, R.db, R.graph, R.async
local Q = require("weft.quick")
local QC = require("helpers.quick_cases")

local world = weft.init { timeout_ms = tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 60000 }
local me, W = world.rank, world.world_size
local g = world
local DEV = "cuda:" .. cuda.current_device()
local S = G.soft_checks()
local want = S.want
local check, done = G.checks(world, S, function()
  policy.set { quick = "default", deterministic = "default", group = g }
end)
local CODECS = { "fp", "int8", "int4", "fp8" }

-- every size takes the quick kernel once the switch is on (a policy file)
local pf = os.tmpname()
do
  local f = assert(io.open(pf, "w"))
  f:write("return { version = 1, quick_min = { ['*'] = { ['*'] = { int8 = 0, int4 = 0, fp8 = 0 } } } }")
  f:close()
end
policy.load_file(pf)

local d = db.ensure_ar(g)
local ar = d.ar
if not ar then
  print("FAIL setup: no custom all-reduce workspace: " .. tostring(d.ar_why))
  weft.shutdown()
  os.exit(1)
end

-- run the quick kernel with `codec` on rank me's host tensor h; returns the host result
local function quick(codec, h)
  local x = h:clone(DEV)
  ar:run(x.ptr, x.ptr, x.numel, x.dtype, Q.algo(codec))
  cuda.synchronize()
  local e = ar:check_error()
  if e then error("quick kernel failed: " .. e, 0) end
  local out = x:clone("cpu")
  x:free()
  return out
end

-- bit-for-bit equal (NaN payloads aside): first differing element or nil
local function differs(a, b, dt)
  local x, y = QC.bits(a), QC.bits(b)
  for i = 1, #x do
    if x[i] ~= y[i] and not (QC.is_nan_bits(x[i], dt) and QC.is_nan_bits(y[i], dt)) then
      return i, x[i], y[i]
    end
  end
end

-- the same bits on every rank: a checksum over the words, all-gathered
local function same_everywhere(h, what)
  local b = QC.bits(h)
  local s1, s2 = 0, 0
  for i = 1, #b do
    local w = b[i]
    if QC.is_nan_bits(w, h.dtype) then w = 0x7fff end
    s1 = (s1 + w) % 65521
    s2 = (s2 + s1) % 65521
  end
  local all = g.cpu_group:allgather(("%d:%d"):format(s1, s2))
  for r = 2, #all do
    if all[r] ~= all[1] then want(false, "%s: rank %d's result differs from rank 0's", what, r - 1); return end
  end
end

---------------------------------------------------------------- a leaving rank
local victim = tonumber(os.getenv("WEFT_QUICK_KILL") or "")
if victim then
  local x = T.ones({ 1048576 }, "bf16", DEV)
  ar:run(x.ptr, x.ptr, x.numel, "bf16", "quick_int8"); cuda.synchronize()
  G.leave_and_check(world, me, victim, function()
    ar:run(x.ptr, x.ptr, x.numel, "bf16", "quick_int8")
    cuda.synchronize()
    local e = ar:check_error()
    if e then error(e, 0) end
  end)
end

---------------------------------------------------------------- bounds
local N = 4096 * W * 5 + 77   -- five chunks per owner and a tail
check("bounds", function()
  for _, dt in ipairs { "bf16", "f16" } do
    for _, class in ipairs(QC.CLASSES) do
      local xs, ts = QC.make(class, dt, W, N)
      local ex = QC.exact(xs)
      for _, codec in ipairs(CODECS) do
        local got = quick(codec, ts[me + 1])
        local ref = Q.reference(codec, dt, ts)
        local i, a, b = differs(got, ref, dt)
        want(i == nil, "%s %s %s: element %s is 0x%x, the CPU reference 0x%x", codec, dt, class, tostring(i), a or 0, b or 0)
        local bnd = Q.bounds(codec, dt, xs)
        local j, gv, ev, bv = QC.violation(got:to_table(), ex, bnd)
        want(j == nil, "%s %s %s: element %s = %s, exact %s, bound %s", codec, dt, class, tostring(j), tostring(gv),
             tostring(ev), tostring(bv))
        same_everywhere(got, ("%s %s %s"):format(codec, dt, class))
        if me == 0 and class == "normal" and dt == "bf16" then
          print(("INFO W=%d %s normal bf16: SNR %.1f dB"):format(W, codec, Q.snr_db(ex, got:to_table())))
        end
      end
    end
  end
end)

---------------------------------------------------------------- NaN / Inf
check("nan_inf", function()
  local dt = "bf16"
  local _, ts = QC.make("normal", dt, W, N)
  local vals = ts[me + 1]:to_table()
  local poison = { [0] = { 40, 0 / 0 }, [1] = { 100, math.huge }, [2] = { 101, -math.huge }, [3] = { 200, math.huge } }
  local pts = {}
  for r = 0, W - 1 do
    local v = ts[r + 1]:to_table()
    local p = poison[r % 4]
    v[p[1] + 32 * 4 * math.floor(r / 4)] = p[2]
    pts[r + 1] = T.from_table(v, dt, { N }, "cpu")
  end
  _ = vals
  for _, codec in ipairs(CODECS) do
    local clean = quick(codec, ts[me + 1])
    local got = quick(codec, pts[me + 1])
    local ref = Q.reference(codec, dt, pts)
    local i = differs(got, ref, dt)
    want(i == nil, "%s: element %s differs from the CPU reference", codec, tostring(i))
    local gv = got:to_table()
    local cb, gb = QC.bits(clean), QC.bits(got)
    local bad = {}
    for r = 0, W - 1 do
      local p = poison[r % 4]
      local idx = p[1] + 32 * 4 * math.floor(r / 4)
      bad[math.floor((idx - 1) / 32)] = true
      local v = gv[idx]
      want(v ~= v or v == math.huge or v == -math.huge, "%s: element %d (non-finite input) is %s", codec, idx, tostring(v))
    end
    for k = 1, N do
      if not bad[math.floor((k - 1) / 32)] then
        if cb[k] ~= gb[k] then want(false, "%s: element %d of a clean block changed", codec, k); break end
      elseif codec ~= "fp" and gv[k] == gv[k] then
        want(false, "%s: element %d of a poisoned block is %s, documented NaN", codec, k, tostring(gv[k])); break
      end
    end
    same_everywhere(got, codec .. " nan_inf")
  end
end)

---------------------------------------------------------------- graphs
check("graph", function()
  cuda.synchronize()
  policy.set { quick = "int8", group = g }
  local n = 4096 * W + 1000
  local y = T.zeros({ n }, "bf16", DEV)
  want(db.choice(g, "all_reduce", y) == "quick_int8", "policy chose %s", tostring(db.choice(g, "all_reduce", y)))
  local gr = graph.capture(function() g:all_reduce(y) end, { warmup = 1, groups = { g } })
  for round = 1, 3 do
    local ins = {}
    for r = 0, W - 1 do ins[r + 1] = T.randn({ n }, "bf16", "cpu", { seed = 500 + 10 * round + r }) end
    y:copy_(ins[me + 1])
    gr:replay()
    cuda.synchronize()
    local got = y:clone("cpu")
    local i = differs(got, Q.reference("int8", "bf16", ins), "bf16")
    want(i == nil, "replay %d: element %s differs from the reference", round, tostring(i))
  end
  gr:destroy()
end)

---------------------------------------------------------------- weft.async
check("async", function()
  policy.set { quick = "fp8", group = g }
  local n = 4096 * W * 2 + 3
  local ins = {}
  for r = 0, W - 1 do ins[r + 1] = T.randn({ n }, "f16", "cpu", { seed = 900 + r }) end
  local x = ins[me + 1]:clone(DEV)
  async.all_reduce(g, x):wait()
  cuda.synchronize()
  local i = differs(x:clone("cpu"), Q.reference("fp8", "f16", ins), "f16")
  want(i == nil, "weft.async: element %s differs from the reference", tostring(i))
end)

---------------------------------------------------------------- deterministic mode
-- rows of 4096 (a multiple of the block): a row's bits do not depend on the batch
check("determinism", function()
  policy.set { deterministic = true, quick = "int8", group = g }
  local H = 4096
  local function rows(b, r)   -- b rows of rank r: row k's data depends on (k, r) only
    local parts = {}
    for k = 0, b - 1 do parts[#parts + 1] = T.randn({ H }, "bf16", "cpu", { seed = 7000 + 97 * k + r }):to_table() end
    local flat = {}
    for _, p in ipairs(parts) do for _, v in ipairs(p) do flat[#flat + 1] = v end end
    return T.from_table(flat, "bf16", { b, H }, "cpu")
  end
  local first
  for _, b in ipairs { 1, 7, 64 } do
    local x = rows(b, me):clone(DEV)
    want(db.choice(g, "all_reduce", x) == "quick_int8", "batch %d: %s", b, tostring(db.choice(g, "all_reduce", x)))
    g:all_reduce(x)
    cuda.synchronize()
    local row0 = QC.bits(x:clone("cpu"))
    local r0 = {}
    for k = 1, H do r0[k] = row0[k] end
    if first == nil then first = r0
    else
      for k = 1, H do
        if r0[k] ~= first[k] then want(false, "batch %d: row 0 element %d differs from batch 1", b, k); break end
      end
    end
  end
  S.expect_error("rows of 100 elements are not a multiple", g.all_reduce, g, T.ones({ 3, 100 }, "bf16", DEV))
end)

---------------------------------------------------------------- large
check("large", function()
  local n = 12 * 1048576 + 5   -- 24 MiB of bf16
  local ins = {}
  for r = 0, W - 1 do ins[r + 1] = T.randn({ n }, "bf16", "cpu", { seed = 3300 + r }) end
  for _, codec in ipairs { "int8", "int4" } do
    local got = quick(codec, ins[me + 1])
    local ref = Q.reference(codec, "bf16", ins)
    want(got:compare(ref) == 0, "%s: max abs difference %g from the CPU reference", codec, got:compare(ref))
    got:free(); ref:free()
  end
end)

---------------------------------------------------------------- fused
-- fused_allreduce_rmsnorm under the quick setting (kernels/quick_fused.cu):
-- residual_out equals weft_qr_fused_reference bit for bit, residual_out and
-- norm_out lie within the stated bounds of the f64 computation element by
-- element, norm_out equals the norm kernel (deterministic: the fused
-- kernels' arithmetic) on the reference's all-reduced value + residual bit for
-- bit, the same bits on every rank. Odd token counts, fewer tokens than
-- ranks, rows that are not a multiple of the block.
local SHAPES = { { 2 * W + 3, 512 }, { 5, 200 }, { W - 1, 4096 } }
local function fused_case(codec, dt, class, tk, h, seed)
  local n = tk * h
  local xs, ins = {}, {}
  for r = 0, W - 1 do
    local v = QC.values(class, dt, W, n, r)
    ins[r + 1] = T.from_table(v, dt, { tk, h }, "cpu")
    xs[r + 1] = ins[r + 1]:to_table()
  end
  local resh = T.randn({ tk, h }, dt, "cpu", { seed = seed })
  local wv = {}
  local u = QC.rng(seed + 1)
  for j = 1, h do wv[j] = 0.5 + u() end
  local wh = T.from_table(wv, dt, { h }, "cpu")
  return xs, ins, resh, wh
end
local function run_fused(x, res, w, eps)
  local n, r = g:fused_allreduce_rmsnorm(x, res, w, eps)
  cuda.synchronize()
  return n:clone("cpu"), r:clone("cpu")
end
check("fused", function()
  policy.set { quick = "default", deterministic = "default", group = g }
  local eps = 1e-5
  for _, codec in ipairs { "int8", "int4", "fp8" } do
    policy.set { quick = codec, group = g }
    for _, dt in ipairs { "bf16", "f16" } do
      for si, shp in ipairs(SHAPES) do
        for _, class in ipairs { "normal", "outliers" } do
          local tk, h = shp[1], shp[2]
          local what = ("%s %s %s %dx%d"):format(codec, dt, class, tk, h)
          local xs, ins, resh, wh = fused_case(codec, dt, class, tk, h, 4000 + 10 * si)
          local x, res, w = ins[me + 1]:clone(DEV), resh:clone(DEV), wh:clone(DEV)
          local ch = db.choice(g, "fused_allreduce_rmsnorm", x)
          want(ch == "fused_quick_" .. codec, "%s: choice %s", what, tostring(ch))
          local ng, rg = run_fused(x, res, w, eps)
          want(g._fused_path == "fused", "%s: path %s (%s)", what, tostring(g._fused_path), tostring(g._fused_why))
          local sref, rref = Q.fused_reference(codec, dt, ins, resh, wh, eps)
          local i, a, b = differs(rg, rref, dt)
          want(i == nil, "%s: residual_out element %s is 0x%x, the CPU reference 0x%x", what, tostring(i), a or 0, b or 0)
          -- the norm kernel (the fused kernels' arithmetic) on the reference's sum + residual
          local sd = sref:clone(DEV)
          local nk = cuda.rmsnorm(sd, res, w, eps, { deterministic = true })
          cuda.synchronize()
          local j = differs(ng, nk:clone("cpu"), dt)
          want(j == nil, "%s: norm_out element %s differs from the norm kernel's", what, tostring(j))
          local bnd = Q.fused_bounds(codec, dt, xs, resh:to_table(), wh:to_table(), h, eps, false, rg:to_table())
          local ex, exn = {}, {}
          local rv, wv2 = resh:to_table(), wh:to_table()
          for t0 = 0, tk - 1 do
            local ss = 0
            for k = 1, h do
              local e = rv[t0 * h + k]
              for r = 1, W do e = e + xs[r][t0 * h + k] end
              ex[t0 * h + k] = e
              ss = ss + e * e
            end
            local rs = 1 / math.sqrt(ss / h + eps)
            for k = 1, h do exn[t0 * h + k] = ex[t0 * h + k] * rs * wv2[k] end
          end
          local k1, gv, ev, bv = QC.violation(rg:to_table(), ex, bnd.res)
          want(k1 == nil, "%s: residual_out element %s = %s, exact %s, bound %s", what, tostring(k1), tostring(gv),
               tostring(ev), tostring(bv))
          local k2, gn, en, bn = QC.violation(ng:to_table(), exn, bnd.norm)
          want(k2 == nil, "%s: norm_out element %s = %s, exact %s, bound %s", what, tostring(k2), tostring(gn),
               tostring(en), tostring(bn))
          same_everywhere(rg, what .. " residual_out")
          same_everywhere(ng, what .. " norm_out")
          if me == 0 and class == "normal" and dt == "bf16" and si == 1 then
            local sn = Q.snr_db(exn, ng:to_table())
            print(("INFO W=%d fused %s normal bf16 %dx%d: norm_out SNR %.1f dB"):format(W, codec, tk, h, sn))
          end
          for _, t in ipairs { x, res, w, sd, nk } do t:free() end
        end
      end
    end
  end
  -- graph replay: the quick two-shot captured, replayed on new data
  policy.set { quick = "int8", group = g }
  local tk, h = 2 * W + 1, 1024
  local x = T.zeros({ tk, h }, "bf16", DEV)
  local res = T.randn({ tk, h }, "bf16", "cpu", { seed = 77 }):clone(DEV)
  local w = T.ones({ h }, "bf16", DEV)
  local nout, rout = T.zeros({ tk, h }, "bf16", DEV), T.zeros({ tk, h }, "bf16", DEV)
  local gr = graph.capture(function()
    g:fused_allreduce_rmsnorm(x, res, w, 1e-6, { norm_out = nout, residual_out = rout })
  end, { warmup = 1, groups = { g }, fusion = { max_tokens = 64, hidden = h, dtype = "bf16" } })
  want(g._fused_path == "fused" and tostring(g._fused_why):find("quick", 1, true),
       "graph: path %s (%s)", tostring(g._fused_path), tostring(g._fused_why))
  for round = 1, 3 do
    local ins = {}
    for r = 0, W - 1 do ins[r + 1] = T.randn({ tk, h }, "bf16", "cpu", { seed = 600 + 10 * round + r }) end
    x:copy_(ins[me + 1])
    gr:replay()
    cuda.synchronize()
    local _, rref = Q.fused_reference("int8", "bf16", ins, res:clone("cpu"), w:clone("cpu"), 1e-6)
    local i = differs(rout:clone("cpu"), rref, "bf16")
    want(i == nil, "graph replay %d: residual_out element %s differs from the reference", round, tostring(i))
  end
  gr:destroy()
  -- deterministic mode: a row's bits do not depend on the batch (rows of 4096)
  policy.set { deterministic = true, quick = "int4", group = g }
  local H = 4096
  local first
  for _, b in ipairs { 1, 5, 2 * W + 1 } do
    local parts = {}
    for k = 0, b - 1 do
      for _, v in ipairs(T.randn({ H }, "bf16", "cpu", { seed = 8100 + 97 * k + me }):to_table()) do parts[#parts + 1] = v end
    end
    local xb = T.from_table(parts, "bf16", { b, H }, "cpu"):clone(DEV)
    local rb = T.zeros({ b, H }, "bf16", DEV)
    local n1 = g:fused_allreduce_rmsnorm(xb, rb, T.ones({ H }, "bf16", DEV), 1e-6)
    cuda.synchronize()
    want(tostring(g._fused_why):find("quick", 1, true), "determinism batch %d: %s", b, tostring(g._fused_why))
    local row0 = QC.bits(n1:clone("cpu"))
    if first == nil then
      first = {}
      for k = 1, H do first[k] = row0[k] end
    else
      for k = 1, H do
        if row0[k] ~= first[k] then want(false, "determinism: batch %d row 0 element %d differs from batch 1", b, k); break end
      end
    end
  end
  policy.set { deterministic = "default", quick = "default", group = g }
end)

os.remove(pf)
policy.clear_file()
weft.shutdown()
done()
