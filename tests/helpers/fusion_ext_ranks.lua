-- Ranks of tests/unit/fusion_ext_spec.lua (host tensors, or a pretend GPU with
-- WEFT_FAKE_DEVICE=1) and tests/gpu/gpu_fusion_ext_spec.lua (the GPU, ranks
-- sharing it under MPS): every pattern of weft.fusion_ext against an f64
-- reference computed here from every rank's inputs (each rank regenerates its
-- peers' data from their seeds), random data, odd token counts, top_k 1/2/8,
-- with and without the shared expert, permutations that are not the
-- identity; every rank's outputs bit-identical; on a device one-shot and
-- two-shot bit-identical, the unfused path within the same bounds, a graph
-- replayed on new data; refusals before anything is enqueued.
-- "PASS <name>" / "FAIL <name>: why" per check, "DONE <n> failed".
-- Env: FX_DEVICE=1 (device tensors), FX_HIDDEN (comma list, default 256),
-- FX_TOKENS (default 1,7,33), FX_DTYPES (default bf16,f16).
-- FX_KILL=r: instead of the checks, rank r never arrives at a fused call
-- (FX_KILL_HOW=leave: it exits; stall: it sleeps past the timeout, then
-- makes the call late) during FX_KILL_OP (moe | rs) calls: every other rank
-- must fail within the timeout naming the group, the operation and rank r,
-- and nothing may hang ("PASS killed" / "FAIL killed", "LEAVING",
-- "STALLING", "PASS stalled").
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local fake = nil
if os.getenv("WEFT_FAKE_DEVICE") == "1" then
  fake = require("helpers.fake_device")
  fake.install()
end
local ffi = require("ffi")
local weft = require("weft")
local G = require("helpers.gpu_ranks")
local policy = require("weft.policy")
local T = weft.tensor

local world = weft.init { timeout_ms = tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 60000 }
local me, W = world.rank, world.world_size
local ON_DEV = os.getenv("FX_DEVICE") == "1"
local DEV = ON_DEV and ("cuda:" .. require("weft.cuda").current_device()) or "cpu"
local S = G.soft_checks()
local want = S.want
local check, done = G.checks(world, S, function() policy.set { fused = "default", deterministic = "default" } end)

local function list(env, default)
  local v, out = os.getenv(env) or default, {}
  for x in v:gmatch("[^,]+") do out[#out + 1] = tonumber(x) or x end
  return out
end
local HIDDEN, TOKENS, DTYPES = list("FX_HIDDEN", "256"), list("FX_TOKENS", "1,7,33"), list("FX_DTYPES", "bf16,f16")
local U = { bf16 = 2 ^ -8, f16 = 2 ^ -11 }
-- half the smallest subnormal: the rounding model's absolute term (fl(v) = v(1+d) + e, |e| <= ETA)
local ETA = { bf16 = 2 ^ -134, f16 = 2 ^ -25 }
local K = 4

---------------------------------------------------------------- data
-- a host tensor of rank r's data for (tag); the device copy when on a device
local function gen(shape, dtype, seed)
  local h = T.randn(shape, dtype, "cpu", { seed = seed })
  return h
end
local function dev(h) if ON_DEV then return h:to(DEV) end return h end
local function f64(h)
  local c = h.device == "cpu" and h or h:to("cpu")
  local d = c:to("f64")
  if c ~= h then c:free() end
  return d, ffi.cast("double *", d.ptr)
end

-- a permutation of rows 0..n-1 (seeded), never the identity
local function perm_of(n, seed)
  local p = {}
  for i = 1, n do p[i] = i - 1 end
  local s = seed
  for i = n, 2, -1 do
    s = (s * 1103515245 + 12345) % 2147483648
    local j = s % i + 1
    p[i], p[j] = p[j], p[i]
  end
  if n > 1 then
    local fixed = true
    for i = 1, n do if p[i] ~= i - 1 then fixed = false end end
    if fixed then p[1], p[2] = p[2], p[1] end
  end
  return p
end

---------------------------------------------------------------- the reference
-- y, E_y (per element, f64 arrays) -> norm reference and bound; checks got
local function check_rows(what, got, ref, bound, n)
  local _, g = f64(got)
  local worst, at = 0, -1
  for i = 0, n - 1 do
    local e = math.abs(g[i] - ref[i])
    if not (e <= bound[i]) then
      local over = e / (bound[i] > 0 and bound[i] or 1e-300)
      if over > worst or g[i] ~= g[i] then worst, at = over, i end
    end
  end
  return want(at < 0, "%s: element %d is %.9g, reference %.9g, bound %.3g", what, at, at >= 0 and g[at] or 0,
              at >= 0 and ref[at] or 0, at >= 0 and bound[at] or 0)
end

-- rstd and the norm with its bound, row by row
local function norm_ref(y, Ey, w, eps, rows, H, u, gemma, eta)
  local n, En = ffi.new("double[?]", rows * H), ffi.new("double[?]", rows * H)
  for r = 0, rows - 1 do
    local ss, cross = 0, 0
    for j = 0, H - 1 do
      local v = y[r * H + j]
      ss = ss + v * v
      cross = cross + math.abs(v) * Ey[r * H + j]
    end
    local rstd = 1 / math.sqrt(ss / H + eps)
    local rel = ss > 0 and cross / ss or 0
    for j = 0, H - 1 do
      local i = r * H + j
      local wj = w[j] + (gemma and 1 or 0)
      n[i] = y[i] * rstd * wj
      En[i] = math.abs(wj) * rstd * Ey[i] * 2 + math.abs(n[i]) * (rel * 2 + K * u) + eta * (1 + 2 * rstd * math.abs(wj))
    end
  end
  return n, En
end

-- case: {pattern, dtype, tokens, hidden, top_k, shared, rows (finalize)}
-- inputs of rank r (host tensors), deterministic in (case seed, r)
local function inputs(cs, r)
  local base = cs.seed * 64 + r * 8
  local t = {}
  local dt, Tn, H, Kk = cs.dtype, cs.tokens, cs.hidden, cs.top_k
  if cs.pattern == "moe" then
    t.x = gen({ Kk, Tn, H }, dt, base + 1)
    t.scales = gen({ Kk, Tn }, cs.scales_dtype, base + 2)
  elseif cs.pattern == "finalize" then
    t.x = gen({ cs.rows, H }, dt, base + 1)
    t.scales = gen({ Tn, Kk }, cs.scales_dtype, base + 2)
    local p = perm_of(cs.rows, base + 3)
    local flat = {}
    for i = 1, Tn * Kk do flat[i] = p[i] end
    t.perm = T.from_table(flat, "i32", { Tn, Kk })
  else
    t.x = gen({ Tn, H }, dt, base + 1)
  end
  if cs.shared then t.shared = gen({ Tn, H }, dt, base + 4) end
  return t
end

-- the reference of a case: y (residual_out) and its bound, norm and its bound
local function reference(cs, residual, weight, weight_pre)
  local Tn, H, u, eta = cs.tokens, cs.hidden, U[cs.dtype], ETA[cs.dtype]
  local n = Tn * H
  local sum, Ssum = ffi.new("double[?]", n), ffi.new("double[?]", n)
  for r = 0, W - 1 do
    local t = inputs(cs, r)
    local xt, x = f64(t.x)
    local st, s = t.scales and f64(t.scales) or nil, nil
    if st then s = ffi.cast("double *", st.ptr) end
    local sht, sh = nil, nil
    if t.shared then sht, sh = f64(t.shared) end
    local p = t.perm and ffi.cast("int32_t *", t.perm.ptr) or nil
    for tk = 0, Tn - 1 do
      for j = 0, H - 1 do
        local c, a
        if cs.pattern == "moe" or cs.pattern == "finalize" then
          c = sh and sh[tk * H + j] or 0
          a = math.abs(c)
          for k = 0, cs.top_k - 1 do
            local sc, row
            if p then sc, row = s[tk * cs.top_k + k], p[tk * cs.top_k + k] else sc, row = s[k * Tn + tk], k * Tn + tk end
            local v = sc * x[row * H + j]
            c = c + v
            a = a + math.abs(v)
          end
        else
          c = x[tk * H + j]
          a = math.abs(c)
        end
        local i = tk * H + j
        sum[i] = sum[i] + c
        Ssum[i] = Ssum[i] + a
      end
    end
    for _, v in ipairs { xt, st, sht, t.x, t.scales, t.shared, t.perm } do v:free() end
  end
  local rows, off = Tn, 0
  if cs.pattern == "rs" then rows = Tn / W; off = me * rows * H end
  local m = rows * H
  local _, res = f64(residual)
  local _, w = f64(weight)
  local y, Ey = ffi.new("double[?]", m), ffi.new("double[?]", m)
  if cs.pattern == "prepost" then
    local s2, Es = ffi.new("double[?]", n), ffi.new("double[?]", n)
    for i = 0, n - 1 do s2[i] = sum[i]; Es[i] = K * u * (math.abs(sum[i]) + Ssum[i] * 2 ^ -16) + 1e-30 end
    local _, wp = f64(weight_pre)
    local pn, Ep = norm_ref(s2, Es, wp, cs.eps_pre, Tn, H, u, cs.gemma, eta)
    for i = 0, m - 1 do
      y[i] = pn[i] + res[i]
      Ey[i] = Ep[i] + K * u * (math.abs(y[i]) + math.abs(pn[i])) + 2 * eta
    end
  else
    for i = 0, m - 1 do
      y[i] = sum[off + i] + res[i]
      Ey[i] = K * u * (math.abs(y[i]) + Ssum[off + i] + math.abs(res[i])) + 2 * eta
    end
  end
  local nr, En = norm_ref(y, Ey, w, cs.eps, rows, H, u, cs.gemma, eta)
  return { y = y, Ey = Ey, n = nr, En = En, m = m, rows = rows }
end

---------------------------------------------------------------- running a case
local function call(cs, t, residual, weight, weight_pre, o)
  o = o or {}
  local opts = { algo = o.algo, gemma = cs.gemma, norm_out = o.norm_out, residual_out = o.residual_out }
  if cs.pattern == "moe" then
    opts.expert_outputs, opts.expert_scales, opts.shared_output = t.x, t.scales, t.shared
    opts.residual, opts.weight, opts.eps = residual, weight, cs.eps
    return world:fused_moe_allreduce_rmsnorm(opts)
  elseif cs.pattern == "finalize" then
    opts.expert_outputs, opts.expanded_idx_to_permuted_idx, opts.expert_scale_factor = t.x, t.perm, t.scales
    opts.shared_expert_output, opts.residual, opts.weight, opts.eps = t.shared, residual, weight, cs.eps
    return world:fused_moe_finalize_allreduce_rmsnorm(opts)
  elseif cs.pattern == "prepost" then
    opts.eps_pre = cs.eps_pre
    return world:fused_allreduce_prepost_rmsnorm(t.x, residual, weight_pre, weight, cs.eps, opts)
  end
  opts.all_gather = not o.no_gather
  opts.gathered_out = o.gathered_out
  return world:fused_reduce_scatter_rmsnorm(t.x, residual, weight, cs.eps, opts)
end

local function on_device(t)
  local d = {}
  for k, v in pairs(t) do d[k] = dev(v) end
  return d
end
local function free_all(t, keep) for k, v in pairs(t) do if v ~= keep[k] then v:free() end end end

-- every rank holds the same bytes of t
local function same_everywhere(t, what)
  local h = t.device == "cpu" and t or t:to("cpu")
  local all = world:all_gather(h:view({ h.numel }), 0)
  local nb = h.nbytes
  local p = ffi.cast("const uint8_t *", all.ptr)
  local okr = true
  for r = 1, W - 1 do
    if ffi.C.memcmp(p, p + r * nb, nb) ~= 0 then okr = false end
  end
  all:free()
  if h ~= t then h:free() end
  return want(okr, "%s differs between ranks", what)
end

local function equal_bytes(a, b, what)
  local ha, hb = a.device == "cpu" and a or a:to("cpu"), b.device == "cpu" and b or b:to("cpu")
  local eq = ffi.C.memcmp(ha.ptr, hb.ptr, ha.nbytes) == 0
  if ha ~= a then ha:free() end
  if hb ~= b then hb:free() end
  return want(eq, "%s: not bit-identical", what)
end
pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")
pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")

local SEED = 1
local function run_case(cs, label)
  SEED = SEED + 1
  cs.seed = SEED
  cs.eps, cs.eps_pre = cs.eps or 1e-6, cs.eps_pre or 1e-5
  cs.scales_dtype = cs.scales_dtype or "f32"
  if cs.pattern == "finalize" then cs.rows = cs.tokens * cs.top_k + 3 end
  local Tn, H = cs.tokens, cs.hidden
  local rows = cs.pattern == "rs" and Tn / W or Tn
  local resid_full = gen({ Tn, H }, cs.dtype, 777 + cs.seed)       -- the same on every rank
  local residual = cs.pattern == "rs" and resid_full:narrow(0, me * rows, rows):contiguous() or resid_full
  local weight = gen({ H }, cs.dtype, 778 + cs.seed)
  local weight_pre = gen({ H }, cs.dtype, 779 + cs.seed)
  local ref = reference(cs, residual, weight, weight_pre)
  local t = on_device(inputs(cs, me))
  local dres, dw, dwp = dev(residual), dev(weight), dev(weight_pre)
  local results = {}
  local algos = ON_DEV and (cs.pattern == "rs" and { "twoshot" } or { "oneshot", "twoshot" }) or { "auto" }
  for _, algo in ipairs(algos) do
    local no, ro, go = call(cs, t, dres, dw, dwp, { algo = algo })
    local path = world:fusion_ext_last()
    if ON_DEV and W > 1 then want(path == "fused", "%s %s: took the %s path", label, algo, tostring(path)) end
    check_rows(label .. " " .. algo .. " residual_out", ro, ref.y, ref.Ey, ref.m)
    check_rows(label .. " " .. algo .. " norm_out", no, ref.n, ref.En, ref.m)
    if go then
      same_everywhere(go, label .. " gathered_out")
      -- this rank's block of the gathered rows is its norm_out
      local mine = go:narrow(0, me * rows, rows):contiguous()
      equal_bytes(mine, no, label .. " gathered_out block")
      mine:free()
    else
      same_everywhere(no, label .. " " .. algo .. " norm_out")
      same_everywhere(ro, label .. " " .. algo .. " residual_out")
    end
    results[#results + 1] = { no, ro, go }
  end
  if #results == 2 then
    equal_bytes(results[1][1], results[2][1], label .. " one-shot vs two-shot norm_out")
    equal_bytes(results[1][2], results[2][2], label .. " one-shot vs two-shot residual_out")
  end
  if ON_DEV then
    -- the unfused path, same bounds
    policy.set { fused = "unfused" }
    local no, ro = call(cs, t, dres, dw, dwp)
    want(world:fusion_ext_last() == "unfused", "%s: override fused=unfused not taken", label)
    check_rows(label .. " unfused residual_out", ro, ref.y, ref.Ey, ref.m)
    check_rows(label .. " unfused norm_out", no, ref.n, ref.En, ref.m)
    policy.set { fused = "default" }
    results[#results + 1] = { no, ro }
  end
  for _, r in ipairs(results) do for _, x in pairs(r) do x:free() end end
  free_all(t, {})
  if dres ~= residual then dres:free() end
  if dw ~= weight then dw:free() end
  if dwp ~= weight_pre then dwp:free() end
  if residual ~= resid_full then residual:free() end
  resid_full:free(); weight:free(); weight_pre:free()
end

---------------------------------------------------------------- a peer that never arrives
local victim = tonumber(os.getenv("FX_KILL") or "")
if victim then
  local op = os.getenv("FX_KILL_OP") or "moe"
  local how = os.getenv("FX_KILL_HOW") or "leave"
  local tmo_s = (tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 60000) / 1000
  local method = op == "rs" and "fused_reduce_scatter_rmsnorm" or "fused_moe_allreduce_rmsnorm"
  local cuda = ON_DEV and require("weft.cuda") or nil
  local dt, H = DTYPES[1], HIDDEN[1]
  local cs = { pattern = op == "rs" and "rs" or "moe", dtype = dt, tokens = op == "rs" and 2 * W or 5, hidden = H,
               top_k = 2, shared = true, eps = 1e-6, scales_dtype = "f32", seed = 31 }
  local rows = op == "rs" and 2 or cs.tokens
  local t = on_device(inputs(cs, me))
  local res, w = dev(gen({ rows, H }, dt, 32)), dev(gen({ H }, dt, 33))
  local no, ro = T.empty({ rows, H }, dt, DEV), T.empty({ rows, H }, dt, DEV)
  local go = op == "rs" and T.empty({ cs.tokens, H }, dt, DEV) or nil
  local function once()
    call(cs, t, res, w, w, { norm_out = no, residual_out = ro, gathered_out = go })
    if cuda then cuda.synchronize() end
  end
  local function say(fmt_, ...)
    print((fmt_):format(...))
    io.stdout:flush()
  end
  local function flat(e) return (tostring(e):gsub("\n", " | ")) end
  once()
  if W > 1 and world:fusion_ext_last() ~= "fused" then say("FAIL killed: the warm-up call took the %s path", tostring(world:fusion_ext_last())) end
  world:barrier()
  if me == victim then
    if how == "leave" then say("LEAVING"); os.exit(0, false) end
    say("STALLING")
    ffi.C.poll(nil, 0, math.floor((tmo_s + 1) * 1000))
    local t0 = weft.now_us()
    local ok, err = pcall(once)
    local s = (weft.now_us() - t0) / 1e6
    -- its late call ends within its own bound, failed or not (its peers gave up)
    if s <= tmo_s + 3 then say("PASS stalled (%.1f s, %s)", s, ok and "completed" or flat(err))
    else say("FAIL stalled: the late call took %.1f s (bound %.0f s): %s", s, tmo_s, ok and "completed" or flat(err)) end
    os.exit(0, false)
  end
  local t0 = weft.now_us()
  local ok, err = pcall(function() for _ = 1, 1000000 do once() end end)
  local s = (weft.now_us() - t0) / 1e6
  local e = flat(err)
  if ok then say("FAIL killed: no error after rank %d %s", victim, how == "leave" and "left" or "stalled")
  elseif not e:find("rank " .. victim .. "[^%d]") and not e:find("rank " .. victim .. "$") then
    say("FAIL killed: the error does not name rank %d (%.1f s): %s", victim, s, e)
  elseif not e:find("world", 1, true) then say("FAIL killed: the error does not name the group (%.1f s): %s", s, e)
  elseif not e:find(method, 1, true) then say("FAIL killed: the error does not name %s (%.1f s): %s", method, s, e)
  elseif s > tmo_s + 3 then say("FAIL killed: %.1f s, past the timeout (%.0f s) + 3 s: %s", s, tmo_s, e)
  else say("PASS killed (%.1f s): %s", s, e) end
  os.exit(0, false)
end

---------------------------------------------------------------- the checks
-- the MoE patterns' cases of one dtype and hidden size: every token count,
-- top_k 1, 2, 8 (the scales in the data's dtype at 2), with and without the
-- shared expert
local function moe_cases(pattern, dt, H)
  return function()
    for _, Tn in ipairs(TOKENS) do
      for _, k in ipairs { 1, 2, 8 } do
        for _, sh in ipairs { false, true } do
          run_case({ pattern = pattern, dtype = dt, tokens = Tn, hidden = H, top_k = k, shared = sh,
                     scales_dtype = k == 2 and dt or "f32" },
                   ("%s %s T%d H%d k%d%s"):format(pattern, dt, Tn, H, k, sh and " shared" or ""))
        end
      end
    end
  end
end

for _, dt in ipairs(DTYPES) do
  for _, H in ipairs(HIDDEN) do
    check(("moe %s hidden %d"):format(dt, H), moe_cases("moe", dt, H))
    check(("moe finalize %s hidden %d"):format(dt, H), moe_cases("finalize", dt, H))
    check(("pre/post norm %s hidden %d"):format(dt, H), function()
      for _, Tn in ipairs(TOKENS) do
        for _, gm in ipairs { false, true } do
          run_case({ pattern = "prepost", dtype = dt, tokens = Tn, hidden = H, gemma = gm },
                   ("prepost %s T%d H%d%s"):format(dt, Tn, H, gm and " gemma" or ""))
        end
      end
    end)
    check(("reduce-scatter norm %s hidden %d"):format(dt, H), function()
      for _, Tn in ipairs(TOKENS) do
        run_case({ pattern = "rs", dtype = dt, tokens = Tn * W, hidden = H },
                 ("rs %s T%d H%d"):format(dt, Tn * W, H))
      end
    end)
  end
end

-- The single-rank kernel (kernels/moe_reduce.cu: the MoE end at world 1)
-- against the fused kernel: rank 0's experts and zeros on every other rank
-- make the fused sum rank 0's partial, so both norms must have the same bits
-- (their sums of squares follow one order). 7 tokens take the single-rank
-- kernel's cluster split (rows over 4 blocks: tokens * 4 <= SMs), 200 its
-- one block per row (at hidden 7168: half a row's threads, two rows per SM).
-- Then on rank 0 the same finalize call at 100, 200 and 2000 tokens (rows of
-- 513-1024 vectors: one block per row, two rows per SM, the ring of bulk
-- copies from 6 rows per SM) must give rows 0-99 the same bits, in bf16,
-- f16 and f32: a row's bits do not depend on how many rows come with it.
if ON_DEV and W >= 2 then
  check("the MoE end on one rank (weft_cuda_moe_reduce) has the fused kernel's bits", function()
    local C = require("weft.internal.ffi").C
    local cuda = require("weft.cuda")
    for _, dt in ipairs(DTYPES) do
      for _, H in ipairs(HIDDEN) do
        for _, pt in ipairs { { "moe", 7 }, { "finalize", 7 }, { "moe", 200 }, { "finalize", 200 } } do
          local pat = pt[1]
          SEED = SEED + 1
          local cs = { pattern = pat, dtype = dt, tokens = pt[2], hidden = H, top_k = 8, shared = true,
                       scales_dtype = "f32", eps = 1e-6, seed = SEED }
          if pat == "finalize" then cs.rows = cs.tokens * cs.top_k + 3 end
          local h = inputs(cs, 0)
          if me ~= 0 then
            local zx, zs = T.zeros(h.x.shape, dt), T.zeros(h.shared.shape, dt)
            h.x:free(); h.shared:free()
            h.x, h.shared = zx, zs
          end
          local t = on_device(h)
          free_all(h, {})
          local res, w = dev(gen({ cs.tokens, H }, dt, 900 + SEED)), dev(gen({ H }, dt, 901 + SEED))
          local no, ro = call(cs, t, res, w, nil, { algo = "oneshot" })
          local label = ("%s %s H%d T%d"):format(pat, dt, H, cs.tokens)
          want(world:fusion_ext_last() == "fused", "%s: took the %s path", label, tostring(world:fusion_ext_last()))
          if me == 0 then
            local lno, lro = T.empty({ cs.tokens, H }, dt, DEV), T.empty({ cs.tokens, H }, dt, DEV)
            local pptr = t.perm and ffi.cast("const int32_t *", t.perm.ptr) or nil
            local rows = pat == "finalize" and cs.rows or cs.top_k * cs.tokens
            local rc = C.weft_cuda_moe_reduce(t.x.ptr, t.scales.ptr, C.WEFT_F32, pptr, rows, t.shared.ptr, nil,
                                              res.ptr, w.ptr, lro.ptr, lno.ptr, cs.tokens, H, cs.top_k,
                                              dt == "bf16" and C.WEFT_BF16 or C.WEFT_F16, cs.eps, 0, nil)
            want(rc == 0, "%s: weft_cuda_moe_reduce returned %d", label, rc)
            cuda.synchronize()
            equal_bytes(lro, ro, label .. " one rank vs fused residual_out")
            equal_bytes(lno, no, label .. " one rank vs fused norm_out")
            lno:free(); lro:free()
          end
          no:free(); ro:free(); res:free(); w:free()
          free_all(t, {})
        end
      end
    end
    -- the same rows at 2000, 200 and 100 tokens (every kernel shape), f32 too
    if me ~= 0 then return end
    for _, dt in ipairs { "bf16", "f16", "f32" } do
      local code = ({ bf16 = C.WEFT_BF16, f16 = C.WEFT_F16, f32 = C.WEFT_F32 })[dt]
      for _, H in ipairs(HIDDEN) do
        local cs = { pattern = "finalize", dtype = dt, tokens = 2000, hidden = H, top_k = 8, shared = true,
                     scales_dtype = "f32", eps = 1e-6, seed = SEED + 1000 }
        cs.rows = cs.tokens * cs.top_k + 3
        local h = inputs(cs, 0)
        local t = on_device(h)
        free_all(h, {})
        local res, w = dev(gen({ cs.tokens, H }, dt, 902 + SEED)), dev(gen({ H }, dt, 903 + SEED))
        local outs = {}
        for i, n in ipairs { 100, 200, 2000 } do
          local no, ro = T.empty({ n, H }, dt, DEV), T.empty({ n, H }, dt, DEV)
          local rc = C.weft_cuda_moe_reduce(t.x.ptr, t.scales.ptr, C.WEFT_F32, ffi.cast("const int32_t *", t.perm.ptr),
                                            cs.rows, t.shared.ptr, nil, res.ptr, w.ptr, ro.ptr, no.ptr, n, H,
                                            cs.top_k, code, cs.eps, 0, nil)
          want(rc == 0, "finalize %s H%d T%d: weft_cuda_moe_reduce returned %d", dt, H, n, rc)
          outs[i] = { n = n, no = no, ro = ro }
        end
        cuda.synchronize()
        for i = 2, 3 do
          local label = ("finalize %s H%d rows 0-99 at %d tokens vs at 100"):format(dt, H, outs[i].n)
          equal_bytes(outs[1].ro, outs[i].ro:narrow(0, 0, 100), label .. ": residual_out")
          equal_bytes(outs[1].no, outs[i].no:narrow(0, 0, 100), label .. ": norm_out")
        end
        for _, o in ipairs(outs) do o.no:free(); o.ro:free() end
        res:free(); w:free()
        free_all(t, {})
      end
    end
  end)
end

check("refusals before anything is enqueued", function()
  local H, dt = HIDDEN[1], DTYPES[1]
  local x = dev(gen({ 2, 5, H }, dt, 5))
  local sc = dev(gen({ 2, 5 }, "f32", 6))
  local r = dev(gen({ 5, H }, dt, 7))
  local w = dev(gen({ H }, dt, 8))
  local before = fake and #fake.fx_runs or 0
  local function E(pat, fn) S.expect_error(pat, fn) end
  E("top_k 17 out of range", function()
    world:fused_moe_allreduce_rmsnorm { expert_outputs = dev(gen({ 17, 5, H }, dt, 9)), expert_scales = dev(gen({ 17, 5 }, "f32", 9)),
                                         residual = r, weight = w } end)
  E("expert_scales has shape {5,2}, expected {2,5}", function()
    world:fused_moe_allreduce_rmsnorm { expert_outputs = x, expert_scales = dev(gen({ 5, 2 }, "f32", 9)), residual = r, weight = w } end)
  E("expert_scales is i32: f32 or the input's dtype", function()
    world:fused_moe_allreduce_rmsnorm { expert_outputs = x, expert_scales = dev(T.zeros({ 2, 5 }, "i32")), residual = r, weight = w } end)
  E("residual is f32, the input is " .. dt, function()
    world:fused_moe_allreduce_rmsnorm { expert_outputs = x, expert_scales = sc, residual = dev(gen({ 5, H }, "f32", 1)), weight = w } end)
  E("weight has shape", function()
    world:fused_moe_allreduce_rmsnorm { expert_outputs = x, expert_scales = sc, residual = r, weight = dev(gen({ H + 8 }, dt, 1)) } end)
  E("expanded_idx_to_permuted_idx must be i32", function()
    world:fused_moe_finalize_allreduce_rmsnorm { expert_outputs = dev(gen({ 12, H }, dt, 1)), expanded_idx_to_permuted_idx = dev(T.zeros({ 5, 2 }, "i64")),
                                                  expert_scale_factor = dev(gen({ 5, 2 }, "f32", 2)), residual = r, weight = w } end)
  if W > 1 then
    E(("%d tokens do not divide among the %d ranks"):format(W * 2 + 1, W), function()
      world:fused_reduce_scatter_rmsnorm(dev(gen({ W * 2 + 1, H }, dt, 1)), dev(gen({ 2, H }, dt, 2)), w, 1e-6) end)
  end
  E("algo oneshot refused", function()
    world:fused_reduce_scatter_rmsnorm(dev(gen({ W * 2, H }, dt, 1)), dev(gen({ 2, H }, dt, 2)), w, 1e-6, { algo = "oneshot" }) end)
  E("norm_out has shape", function()
    world:fused_allreduce_prepost_rmsnorm(r, r, w, w, 1e-6, { norm_out = dev(gen({ 4, H }, dt, 3)) }) end)
  E("exceed the declared maximum", function()
    world:fused_allreduce_prepost_rmsnorm(r, r, w, w, 1e-6, { max_tokens = 4 }) end)
  if ON_DEV then
    E("host and device tensors", function()
      world:fused_allreduce_prepost_rmsnorm(r, gen({ 5, H }, dt, 3), w, w, 1e-6) end)
  else
    -- the host path checks the permutation before the collective
    E("permutation entry %[0%]%[1%] = 99 outside %[0, 12%)", function()
      world:fused_moe_finalize_allreduce_rmsnorm { expert_outputs = gen({ 12, H }, dt, 1),
        expanded_idx_to_permuted_idx = T.from_table({ 0, 99, 1, 2, 3, 4, 5, 6, 7, 8 }, "i32", { 5, 2 }),
        expert_scale_factor = gen({ 5, 2 }, "f32", 2), residual = r, weight = w } end)
  end
  if fake then want(#fake.fx_runs == before, "a refused call reached the kernel") end
end)

if not ON_DEV then
  check("host: norm output and FP8 output from the same call", function()
    local dt, H, Tn = DTYPES[1], HIDDEN[1], 3
    local x, res, w = gen({ Tn, H }, dt, 31 + me), gen({ Tn, H }, dt, 32), gen({ H }, dt, 33)
    local no, ro, q = world:fused_allreduce_rmsnorm(x, res, w, 1e-6, { fp8 = true, scale = 0.5 })
    want(q ~= nil and q.dtype == "f8e4m3", "no quant_out")
    -- quant = e4m3(norm * 2): compare with the conversion of the returned norm
    local h = no:to("f32")
    local p = ffi.cast("float *", h.ptr)
    for i = 0, h.numel - 1 do p[i] = p[i] * 2 end
    local want_q = h:to("f8e4m3")
    equal_bytes(q, want_q, "quant_out")
    same_everywhere(ro, "fp8 call residual_out")
    for _, v in ipairs { x, res, w, no, ro, q, h, want_q } do v:free() end
  end)
end

if ON_DEV and W > 1 then
  check("graph capture: replays on new data, fused", function()
    local dt, H, Tn = DTYPES[1], HIDDEN[1], 6
    local cs = { pattern = "moe", dtype = dt, tokens = Tn, hidden = H, top_k = 2, shared = true, eps = 1e-6,
                 eps_pre = 1e-5, scales_dtype = "f32", seed = 9000 }
    local t = on_device(inputs(cs, me))
    local res, w = dev(gen({ Tn, H }, dt, 9001)), dev(gen({ H }, dt, 9002))
    local no, ro = T.empty({ Tn, H }, dt, DEV), T.empty({ Tn, H }, dt, DEV)
    local graph = require("weft.graph")
    local cap = graph.capture(function()
      world:fused_moe_allreduce_rmsnorm { expert_outputs = t.x, expert_scales = t.scales, shared_output = t.shared,
                                          residual = res, weight = w, eps = 1e-6, norm_out = no, residual_out = ro }
    end, { groups = { world }, fusion = { max_tokens = 64, hidden = H, dtype = dt, ext = true } })
    want(world:fusion_ext_last() == "fused", "captured path: %s", tostring(select(2, world:fusion_ext_last())))
    for it = 1, 3 do
      cs.seed = 9000 + it * 17
      local nt = inputs(cs, me)
      for k, v in pairs(nt) do t[k]:copy_(v); v:free() end
      cap:replay()
      require("weft.cuda").synchronize()
      local ref = reference(cs, res, w, w)
      check_rows("graph replay " .. it .. " norm_out", no, ref.n, ref.En, ref.m)
      check_rows("graph replay " .. it .. " residual_out", ro, ref.y, ref.Ey, ref.m)
    end
    cap:destroy()
  end)

  check("graph capture of every pattern, fused and unfused: replays on new data", function()
    -- the unfused path's intermediates must outlive the call (a graph replays them)
    local dt, H = DTYPES[1], HIDDEN[1]
    local graph = require("weft.graph")
    for _, path in ipairs { "fused", "unfused" } do
      for _, pat in ipairs { "moe", "finalize", "prepost", "rs" } do
        local Tn = pat == "rs" and 2 * W or 5
        local rows = pat == "rs" and 2 or Tn
        local cs = { pattern = pat, dtype = dt, tokens = Tn, hidden = H, top_k = 2, shared = true, eps = 1e-6,
                     eps_pre = 1e-5, scales_dtype = "f32", seed = 7000 }
        if pat == "finalize" then cs.rows = Tn * 2 + 3 end
        local t = on_device(inputs(cs, me))
        local res, w, wp = dev(gen({ rows, H }, dt, 7001)), dev(gen({ H }, dt, 7002)), dev(gen({ H }, dt, 7003))
        local no, ro = T.empty({ rows, H }, dt, DEV), T.empty({ rows, H }, dt, DEV)
        -- ranks sharing a GPU have no NCCL: an all-gather cannot be captured
        -- there (weft's own kernels all-reduce only), so the unfused
        -- reduce-scatter is captured without it
        local shared = world._dev and world._dev.shared ~= nil
        local no_gather = pat == "rs" and path == "unfused" and shared
        local go = (pat == "rs" and not no_gather) and T.empty({ Tn, H }, dt, DEV) or nil
        if path == "unfused" then policy.set { fused = "unfused" } end
        local cap = graph.capture(function()
          call(cs, t, res, w, wp, { norm_out = no, residual_out = ro, gathered_out = go, no_gather = no_gather })
        end, { groups = { world }, fusion = { max_tokens = 64, hidden = H, dtype = dt, ext = true } })
        want(world:fusion_ext_last() == path, "%s %s: captured the %s path", pat, path, tostring(world:fusion_ext_last()))
        -- other allocations between capture and replay must not land in its intermediates
        local junk = {}
        for i = 1, 4 do junk[i] = T.full({ Tn * 4, H }, 1000 + i, dt, DEV) end
        for it = 1, 2 do
          cs.seed = 7000 + it * 31
          if pat == "finalize" then cs.rows = Tn * 2 + 3 end
          local nt = inputs(cs, me)
          for k, v in pairs(nt) do t[k]:copy_(v); v:free() end
          cap:replay()
          require("weft.cuda").synchronize()
          local ref = reference(cs, res, w, wp)
          check_rows(("graph %s %s replay %d norm_out"):format(pat, path, it), no, ref.n, ref.En, ref.m)
          check_rows(("graph %s %s replay %d residual_out"):format(pat, path, it), ro, ref.y, ref.Ey, ref.m)
        end
        cap:destroy()
        policy.set { fused = "default" }
        for _, j in ipairs(junk) do j:free() end
        for _, v in ipairs { res, w, wp, no, ro, go } do v:free() end
        free_all(t, {})
      end
    end
  end)

  check("explain names the checks and the last path", function()
    local x = dev(gen({ 8, HIDDEN[1] }, DTYPES[1], 1))
    local e = policy.explain(world, x, "fused_allreduce_prepost_rmsnorm")
    want(e:find("fused kernel (MoE, pre/post norm, reduce-scatter)", 1, true), "rule missing: %s", e)
    want(e:find("tokens within the workspace", 1, true), "checks missing: %s", e)
    want(e:find("last call: ", 1, true), "last call missing: %s", e)
    policy.set { deterministic = true }
    e = policy.explain(world, x, "fused_reduce_scatter_rmsnorm")
    want(e:find("x not deterministic mode", 1, true), "deterministic check missing: %s", e)
  end)

  check("deterministic mode: the unfused path, the same bits every run", function()
    policy.set { deterministic = true, group = world }   -- collective: the group agrees
    local dt, H = DTYPES[1], HIDDEN[1]
    local cs = { pattern = "prepost", dtype = dt, tokens = 5, hidden = H, eps = 1e-6, eps_pre = 1e-5, seed = 4242 }
    local t = on_device(inputs(cs, me))
    local res, w = dev(gen({ 5, H }, dt, 1)), dev(gen({ H }, dt, 2))
    local n1 = call(cs, t, res, w, w)
    want(world:fusion_ext_last() == "unfused", "deterministic mode took %s", tostring(world:fusion_ext_last()))
    local n2 = call(cs, t, res, w, w)
    equal_bytes(n1, n2, "deterministic reruns")
    local rs = { pattern = "rs", dtype = dt, tokens = 2 * W, hidden = H, eps = 1e-6, seed = 4243 }
    local tr = on_device(inputs(rs, me))
    local rres = dev(gen({ 2, H }, dt, 3))
    local a = call(rs, tr, rres, w, w)
    local b = call(rs, tr, rres, w, w)
    equal_bytes(a, b, "deterministic reduce-scatter reruns")
  end)
end

done()
