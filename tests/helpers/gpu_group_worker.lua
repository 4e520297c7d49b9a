-- One rank of tests/gpu/gpu_group_spec.lua (`scripts/weft-run -n 2 tests/helpers/gpu_group_worker.lua`):
-- every device collective through the GroupCoordinator (policy -> NCCL, the
-- custom all-reduce, the fused kernel, host staging) against the same
-- collective on host tensors (the shm path, tested by group_spec) or an f64
-- reference; captured graphs replayed on refilled inputs; fallbacks; bad
-- input. Prints "PASS <name>" or "FAIL <name>: <why>" per check, "INFO ..."
-- lines with eager latencies; exits 1 when a check failed.
--
-- Inputs are small integers (-16..15) wherever the result must be exact, so
-- sums and products are exact in every dtype and comparisons are equality.
-- Comparisons are soft (recorded, reported at the end of the check) so both
-- ranks still reach every collective of a check after a mismatch; after each
-- check both ranks meet at a barrier.
local ffi = require("ffi")
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local G, weft, T, cuda, policy, db, graph, car = R.G, R.weft, R.T, R.cuda, R.policy, R.db, R.graph, R.car
local N = require("helpers.nan_cases")

local world = weft.init { timeout_ms = 30000 }
local me, W = world.rank, world.world_size
assert(W == 2, "run with 2 ranks")
weft.initialize_model_parallel { tp = 2 }
local tp = weft.tp()
local DEVI = cuda.current_device()
local DEV = "cuda:" .. DEVI
local MIB = 1048576

local S = G.soft_checks()
local want, expect_error, ints = S.want, S.expect_error, G.ints
local check, done = G.checks(world, S, function() policy.set { all_reduce = "default", fused = "default", group = tp } end)

-- exact equality of a device (or host) tensor with a host reference tensor
local function same(got, ref, what)
  if not want(got ~= nil, "%s: no result", what) then return end
  if not want(got.numel == ref.numel, "%s: %d elements, reference %d", what, got.numel, ref.numel) then return end
  if not want(table.concat(got.shape, ",") == table.concat(ref.shape, ","), "%s: shape {%s}, reference {%s}",
              what, table.concat(got.shape, ","), table.concat(ref.shape, ",")) then return end
  if ref.numel == 0 then return end
  local ma = got:compare(ref)
  want(ma == 0, "%s: max abs difference %g", what, ma)
end

local function on_dev(h) return h:clone(DEV) end

-- ---------------------------------------------------------------- set-up
check("setup_lazy", function()
  want(not db.info(tp).setup, "device state exists before any device call")
  local x = T.ones({ 16 }, "f32", DEV)
  tp:all_reduce(x)
  same(x, T.full({ 16 }, 2, "f32"), "first all_reduce")
  local info = db.info(tp)
  want(info.setup and info.nccl, "no NCCL communicator after the first device call: %s", tostring(info.nccl_why))
  want(info.custom_ar == "ready", "custom all-reduce %s: %s", tostring(info.custom_ar), tostring(info.custom_ar_why))
  want(tp.device_group ~= nil and tp.device_group.handle ~= nil, "device_group not set")
  want(info.device == DEVI, "device %s, current %d", tostring(info.device), DEVI)
  print("INFO " .. tostring(info.custom_ar_why))
end)

-- ---------------------------------------------------------------- all_reduce
check("all_reduce_nccl_forced", function()
  policy.set { all_reduce = "nccl", group = tp }
  G.each_case(me, DEV, 100, { 1, 1023, 65539 }, function(h, d, op, label)
    want(policy.select(tp, "all_reduce", d, op) == "nccl", "%s: backend %s", label,
         tostring(policy.select(tp, "all_reduce", d, op)))
    tp:all_reduce(d, op)
    tp:all_reduce(h, op)
    same(d, h, "nccl " .. label)
  end)
end)

check("all_reduce_custom_eager", function()
  local seed = 2000
  for _, algo in ipairs { "oneshot", "twoshot", "auto" } do
    policy.set { all_reduce = algo, group = tp }
    for _, dt in ipairs { "bf16", "f16", "f32" } do
      local sizes = dt == "bf16" and { 1, 7, 1023, 4096, 1048579 } or { 7, 4096, 262149 }
      for _, n in ipairs(sizes) do
        seed = seed + 10
        local h = ints(seed + me, n, dt)
        local d = on_dev(h)
        local be, why = db.choice(tp, "all_reduce", d)
        want(be == algo, "%s %s n=%d: policy chose %s (%s)", algo, dt, n, tostring(be), tostring(why))
        tp:all_reduce(d)
        tp:all_reduce(h)
        same(d, h, ("%s %s n=%d"):format(algo, dt, n))
        d:free(); h:free()
      end
    end
  end
  policy.set { all_reduce = "default", group = tp }
  local x = T.zeros({ 8, 4096 }, "bf16", DEV)
  local e = policy.explain(tp, x)
  want(e:find(": custom_ar", 1, true) and e:find("+ peer access", 1, true), "explain: %s", e)
  want(db.info(tp).custom_ar == "ready", "custom all-reduce %s", tostring(db.info(tp).custom_ar))
end)

check("all_reduce_out_of_place", function()
  for _, mode in ipairs { "default", "nccl", "oneshot" } do
    policy.set { all_reduce = mode, group = tp }
    local h = ints(3000 + me, { 8, 1000 }, "bf16")
    local d = on_dev(h)
    local out = T.empty({ 8, 1000 }, "bf16", DEV)
    want(tp:all_reduce(d, "sum", out) == out, "%s: returns out", mode)
    same(d, h, mode .. ": input unchanged")
    local r = h:clone()
    tp:all_reduce(r)
    same(out, r, mode .. ": out-of-place result")
  end
end)

check("all_reduce_fallbacks", function()
  -- dtype the kernels do not reduce
  local h = ints(3100 + me, 4096, "i32")
  local d = on_dev(h)
  want(policy.select(tp, "all_reduce", d) == "nccl", "i32: %s", tostring(policy.select(tp, "all_reduce", d)))
  tp:all_reduce(d); tp:all_reduce(h)
  same(d, h, "i32 via nccl")
  -- max: not a sum
  h = ints(3110 + me, 4096, "bf16"); d = on_dev(h)
  want(policy.select(tp, "all_reduce", d, "max") == "nccl", "max: not nccl")
  tp:all_reduce(d, "max"); tp:all_reduce(h, "max")
  same(d, h, "bf16 max via nccl")
  -- a view 2 bytes into its storage: not 16-byte aligned
  local hb = ints(3120 + me, 4097, "bf16")
  local db_ = on_dev(hb)
  local v = db_:narrow(0, 1, 4096)
  local hv = hb:narrow(0, 1, 4096):contiguous()
  want(policy.select(tp, "all_reduce", v) == "nccl", "misaligned view: %s", tostring(policy.select(tp, "all_reduce", v)))
  want(policy.explain(tp, v):find("x 16-byte aligned", 1, true), "explain misses the alignment")
  tp:all_reduce(v); tp:all_reduce(hv)
  same(v, hv, "misaligned view via nccl")
  -- larger than the workspace
  local n = db.info(tp).custom_ar_max_bytes / 2 + 8
  local big = T.full({ n }, me + 1, "bf16", DEV)
  want(policy.select(tp, "all_reduce", big) == "nccl", "above the workspace: %s", tostring(policy.select(tp, "all_reduce", big)))
  tp:all_reduce(big)
  local bmax = big:compare(T.full({ n }, 3, "bf16"))
  want(bmax == 0, "above the workspace via nccl: max abs %g", bmax)
  big:free()
  -- forced to NCCL: a size the kernels would take
  policy.set { all_reduce = "nccl", group = tp }
  h = ints(3130 + me, 4096, "bf16"); d = on_dev(h)
  want(policy.select(tp, "all_reduce", d) == "nccl", "forced nccl: %s", tostring(policy.select(tp, "all_reduce", d)))
  tp:all_reduce(d); tp:all_reduce(h)
  same(d, h, "forced nccl")
end)

-- ---------------------------------------------------------------- other collectives
check("all_gather_dims", function()
  local seed = 4000
  for _, dt in ipairs { "bf16", "f32", "u8" } do
    for _, dim in ipairs { 0, 1, 2, -1 } do
      seed = seed + 10
      local h = ints(seed + me, { 6, 5, 3 }, dt)
      local d = on_dev(h)
      same(tp:all_gather(d, dim), tp:all_gather(h, dim), ("all_gather %s dim %d"):format(dt, dim))
      local oshape = { 6, 5, 3 }
      local k = dim < 0 and 3 + dim or dim
      oshape[k + 1] = oshape[k + 1] * W
      local o = T.empty(oshape, dt, DEV)
      want(tp:all_gather(d, dim, o) == o, "all_gather into a given tensor returns it")
      same(o, tp:all_gather(h, dim), ("all_gather %s dim %d into"):format(dt, dim))
    end
  end
  local h = ints(4500 + me, { 4, 8 }, "f16")
  local o = T.empty({ 8, 8 }, "f16", DEV)
  tp:all_gather_into_tensor(o, on_dev(h))
  same(o, tp:all_gather(h, 0), "all_gather_into_tensor")
end)

check("all_gatherv", function()
  local sizes = { 3, 5 }
  local h = ints(4600 + me, { sizes[me + 1], 4 }, "f16")
  local d = on_dev(h)
  same(tp:all_gatherv(d, sizes), tp:all_gatherv(h, sizes), "all_gatherv")
  local o = T.empty({ 8, 4 }, "f16", DEV)
  tp:all_gatherv(d, sizes, o)
  same(o, tp:all_gatherv(h, sizes), "all_gatherv into")
  local z = { 0, 5 }
  local hz = ints(4610 + me, { z[me + 1], 4 }, "f32")
  same(tp:all_gatherv(on_dev(hz), z), tp:all_gatherv(hz, z), "all_gatherv with an empty share")
end)

check("reduce_scatter_dims", function()
  local seed = 4700
  for _, dt in ipairs { "bf16", "f32" } do
    for _, dim in ipairs { 0, 1, 2, -1 } do
      seed = seed + 10
      local h = ints(seed + me, { 4, 6, 2 }, dt)
      local d = on_dev(h)
      same(tp:reduce_scatter(d, dim), tp:reduce_scatter(h, dim), ("reduce_scatter %s dim %d"):format(dt, dim))
    end
  end
  local h = ints(4800 + me, { 8, 3 }, "f32")
  local o = T.empty({ 4, 3 }, "f32", DEV)
  tp:reduce_scatter_tensor(o, on_dev(h))
  same(o, tp:reduce_scatter(h, 0), "reduce_scatter_tensor")
  same(tp:reduce_scatter(on_dev(h), 0, nil, "max"), tp:reduce_scatter(h, 0, nil, "max"), "reduce_scatter max")
end)

check("reduce_scatterv", function()
  local sizes = { 2, 6 }
  local h = ints(4900 + me, { 8, 3 }, "f32")
  same(tp:reduce_scatterv(on_dev(h), nil, sizes), tp:reduce_scatterv(h, nil, sizes), "reduce_scatterv")
  local o = T.empty({ sizes[me + 1], 3 }, "f32", DEV)
  tp:reduce_scatterv(on_dev(h), o, sizes)
  same(o, tp:reduce_scatterv(h, nil, sizes), "reduce_scatterv into")
end)

-- float max/min propagate NaN (the NaN pass around NCCL; tests/helpers/nan_cases.lua)
check("nan_max_min", function()
  local c = { g = tp, dev = DEV, want = want }
  N.all_reduce(c); N.reduce_scatter(c); N.graph(c); N.explain(c)
  if os.getenv("WEFT_FAKE_DEVICE") ~= "1" then N.cost(c, world) end
end)

check("broadcast_gather", function()
  for src = 0, 1 do
    local h = ints(5000 + 10 * src + me, 1000, "bf16")
    local d = on_dev(h)
    tp:broadcast(d, src); tp:broadcast(h, src)
    same(d, h, "broadcast from " .. src)
  end
  for dst = 0, 1 do
    for _, dim in ipairs { 0, 1 } do
      local h = ints(5100 + 10 * dst + dim + me, { 3, 4 }, "f32")
      local gd = tp:gather(on_dev(h), dst, dim)
      local gh = tp:gather(h, dst, dim)
      if me == dst then same(gd, gh, ("gather to %d dim %d"):format(dst, dim))
      else want(gd == nil and gh == nil, "gather: a result on a non-destination rank") end
    end
  end
end)

check("send_recv", function()
  for src = 0, 1 do
    local dst = 1 - src
    local h = ints(5200 + src, { 5, 7 }, "f32")
    if me == src then
      tp:send(on_dev(h), dst)
    else
      local r = T.empty({ 5, 7 }, "f32", DEV)
      want(tp:recv(r, src) == r, "recv returns its tensor")
      same(r, h, "recv from " .. src)
    end
  end
end)

check("all_to_all_single", function()
  local h = ints(5300 + me, { 4, 3 }, "bf16")
  local o, ho = T.empty({ 4, 3 }, "bf16", DEV), T.empty({ 4, 3 }, "bf16")
  tp:all_to_all_single(o, on_dev(h))
  tp:all_to_all_single(ho, h)
  same(o, ho, "all_to_all_single equal")
  local splits = me == 0 and { 1, 3 } or { 2, 2 }
  local rows = me == 0 and 3 or 5
  local o2, ho2 = T.empty({ rows, 3 }, "bf16", DEV), T.empty({ rows, 3 }, "bf16")
  tp:all_to_all_single(o2, on_dev(h), splits)
  tp:all_to_all_single(ho2, h, splits)
  same(o2, ho2, "all_to_all_single uneven")
  local outs = me == 0 and { 1, 2 } or { 3, 2 }
  local o3 = T.empty({ rows, 3 }, "bf16", DEV)
  tp:all_to_all_single(o3, on_dev(h), { input = splits, output = outs })
  same(o3, ho2, "all_to_all_single with output splits")
  -- split tables that do not add up (rank 0's output a row short): both
  -- ranks fail naming it, before a row moves; the group works afterwards
  local short = T.empty({ me == 0 and 2 or rows, 3 }, "bf16", DEV)
  expect_error("split tables do not match.*rank 0 receives 3 rows, its output has 2",
               tp.all_to_all_single, tp, short, on_dev(h), splits)
  tp:all_to_all_single(o2, on_dev(h), splits)
  same(o2, ho2, "all_to_all_single after a refused one")
end)

check("tensor_dicts", function()
  local h = ints(5400, { 6, 2 }, "bf16")
  local got = tp:broadcast_tensor_dict(me == 0 and { a = on_dev(h), n = 5 } or nil, 0)
  want(got.n == 5, "value lost")
  want(got.a:is_cuda(), "received tensor is on %s", tostring(got.a.device))
  same(got.a, h, "broadcast_tensor_dict tensor")
  if me == 0 then
    tp:send_tensor_dict({ t = on_dev(h), tag = "x" }, 1)
  else
    local r = tp:recv_tensor_dict(0)
    want(r.tag == "x" and r.t:is_cuda(), "recv_tensor_dict: %s on %s", tostring(r.tag), tostring(r.t and r.t.device))
    same(r.t, h, "recv_tensor_dict tensor")
  end
end)

-- ---------------------------------------------------------------- graphs
check("graph_capture_replay", function()
  cuda.synchronize()
  local n = 32771
  local bufs = {}
  for _, k in ipairs { "a", "b", "c", "d" } do bufs[k] = T.zeros({ n }, "bf16", DEV) end
  bufs.e, bufs.f = T.zeros({ 4, 6 }, "f32", DEV), T.zeros({ 4, 6 }, "f32", DEV)
  local eo, fo = T.empty({ 4, 12 }, "f32", DEV), T.empty({ 4, 3 }, "f32", DEV)
  local picks = {}
  local function step()
    local plan = { { "a", "oneshot" }, { "b", "twoshot" }, { "c", "default" }, { "d", "nccl" } }
    for _, p in ipairs(plan) do
      policy.set { all_reduce = p[2], group = tp }
      picks[#picks + 1] = policy.mode() .. ":" .. tostring(db.choice(tp, "all_reduce", bufs[p[1]]))
      tp:all_reduce(bufs[p[1]])
    end
    policy.set { all_reduce = "default", group = tp }
    tp:all_gather(bufs.e, 1, eo)
    tp:reduce_scatter(bufs.f, 1, fo)
  end
  local gr = graph.capture(step, { warmup = 1, groups = { tp } })
  local want_picks = "eager:oneshot eager:twoshot eager:auto eager:nccl graph:oneshot graph:twoshot graph:auto graph:nccl"
  want(table.concat(picks, " ") == want_picks, "choices %s, want %s", table.concat(picks, " "), want_picks)
  for round = 1, 3 do
    local hs = {}
    for i, k in ipairs { "a", "b", "c", "d" } do
      hs[k] = ints(6000 + 100 * round + 10 * i + me, n, "bf16")
      bufs[k]:copy_(hs[k])
    end
    local he = ints(6050 + 100 * round + me, { 4, 6 }, "f32")
    local hf = ints(6060 + 100 * round + me, { 4, 6 }, "f32")
    bufs.e:copy_(he); bufs.f:copy_(hf)
    gr:replay()
    for _, k in ipairs { "a", "b", "c", "d" } do
      tp:all_reduce(hs[k])
      same(bufs[k], hs[k], ("replay %d all_reduce %s"):format(round, k))
    end
    same(eo, tp:all_gather(he, 1), ("replay %d all_gather dim 1"):format(round))
    same(fo, tp:reduce_scatter(hf, 1), ("replay %d reduce_scatter dim 1"):format(round))
  end
  -- many replays back to back, then one check
  local hs = ints(6900 + me, n, "bf16")
  for _ = 1, 50 do bufs.a:copy_(hs); gr:replay() end
  tp:all_reduce(hs)
  same(bufs.a, hs, "after 50 replays")
  gr:destroy()
end)

-- ---------------------------------------------------------------- fused
local f64 = G.f64
local fused_ref = G.fused_ref
local function close(got, ref, dt, what) return G.close(want, got, ref, dt, what) end

-- one fused call on device data; checks against the reference and the path taken
local function fused_case(name, tokens, hidden, dt, opts, want_path, ranks, grp)
  grp = grp or tp
  opts = opts or {}
  local shape = { tokens, hidden }
  local xseed = 7000 + tokens * 7 + hidden + (opts.gemma and 3 or 0)
  local hx = T.randn(shape, dt, "cpu", { seed = xseed + me })
  local x = on_dev(hx)
  local hres = T.randn(shape, dt, "cpu", { seed = 77 })
  local hw = T.rand({ hidden }, dt, "cpu", { seed = 78 })
  local res, w = on_dev(hres), on_dev(hw)
  if opts.noncontig_residual then
    local tr = T.empty({ hidden, tokens }, dt, DEV)
    res = tr:transpose(0, 1)
    res:copy_(hres)
    opts.noncontig_residual = nil
  end
  local eps = 1e-6
  local y, ro, q = grp:fused_allreduce_rmsnorm(x, res, w, eps, opts)
  local rref, nref = fused_ref(xseed, shape, dt, hres, hw, eps, opts.gemma, ranks or { 0, 1 })
  same(x, hx, name .. ": input unchanged")
  close(ro, rref, dt, name .. " residual_out")
  close(y, nref, dt, name .. " norm_out")
  local info = db.info(grp)
  if want_path then
    want(info.last_fused and info.last_fused.path == want_path, "%s: path %s (%s), want %s", name,
         tostring(info.last_fused and info.last_fused.path), tostring(info.last_fused and info.last_fused.why), want_path)
  end
  if q then
    -- e4m3 of norm / scale: within half a step (1/16 relative) of the reference, plus the norm's error
    local s = opts.scale
    s = type(s) == "number" and s or s:to_table()[1]
    local qv = q:to_table()
    local np = ffi.cast("double *", nref.ptr)
    local bad, first = 0, nil
    for i = 1, #qv do
      local r = np[i - 1] / s
      if r > 448 then r = 448 elseif r < -448 then r = -448 end
      if not (math.abs(qv[i] - r) <= 0.075 * math.abs(r) + 0.02 / s + 2 ^ -9) then
        bad = bad + 1
        first = first or ("[%d] = %g, want %g"):format(i - 1, qv[i], r)
      end
    end
    want(bad == 0, "%s fp8: %d codes off, first %s", name, bad, tostring(first))
  end
  x:free(); res:free(); w:free()
  return y, ro
end

check("fused_kernel", function()
  for _, hidden in ipairs { 4096, 2048 } do
    for _, tokens in ipairs { 1, 3, 77, 128 } do
      fused_case(("bf16 %dx%d"):format(tokens, hidden), tokens, hidden, "bf16", {}, "fused")
    end
  end
  fused_case("f32 77x2048", 77, 2048, "f32", {}, "fused")
  fused_case("f16 3x4096", 3, 4096, "f16", {}, "fused")
  fused_case("bf16 oneshot", 32, 4096, "bf16", { algo = "oneshot" }, "fused")
  fused_case("bf16 twoshot", 32, 4096, "bf16", { algo = "twoshot" }, "fused")
  fused_case("bf16 gemma", 8, 4096, "bf16", { gemma = true }, "fused")
  fused_case("bf16 no pdl", 8, 4096, "bf16", { pdl = false, trigger_completion_at_end = true }, "fused")
  local scale = T.full({ 1 }, 0.5, "f32", DEV)
  fused_case("bf16 fp8", 16, 4096, "bf16", { fp8 = true, scale = scale }, "fused")
  fused_case("bf16 fp8 numeric scale", 16, 4096, "bf16", { fp8 = true, scale = 0.25 }, "fused")
  fused_case("bf16 max_tokens declared", 100, 4096, "bf16", { max_tokens = 512 }, "fused")
  local e = policy.explain(tp, T.zeros({ 8, 4096 }, "bf16", DEV), "fused_allreduce_rmsnorm")
  want(e:find("last call: fused", 1, true), "explain: %s", e)
  local info = db.info(tp)
  want(info.fusion and info.fusion.initialized and not info.fusion.disabled, "fusion workspace: %s",
       tostring(info.fusion and info.fusion.reason))
end)

check("fused_fallbacks", function()
  policy.set { fused = "unfused", group = tp }
  fused_case("override unfused", 77, 4096, "bf16", {}, "unfused")
  fused_case("override unfused fp8", 16, 4096, "bf16", { fp8 = true, scale = 0.5 }, "unfused")
  policy.set { fused = "default", group = tp }
  local saved = db.config.fused_max_tokens
  db.config.fused_max_tokens = 64
  fused_case("tokens above the workspace", 77, 4096, "bf16", {}, "unfused")
  db.config.fused_max_tokens = saved
  fused_case("non-contiguous residual", 8, 4096, "bf16", { noncontig_residual = true }, "unfused")
  fused_case("f32 5x2048", 5, 2048, "f32", {}, "fused")
  local solo = weft.create_custom_group({ me }, "solo" .. me)
  fused_case("one rank", 9, 4096, "bf16", {}, "unfused", { me }, solo)
  local e = policy.explain(solo, T.zeros({ 9, 4096 }, "bf16", DEV), "fused_allreduce_rmsnorm")
  want(e:find("one rank", 1, true), "explain (one rank): %s", e)
  solo:destroy()
end)

check("fused_graph_replay", function()
  cuda.synchronize()
  local tokens, hidden = 64, 4096
  local shape = { tokens, hidden }
  local x, res = T.zeros(shape, "bf16", DEV), T.zeros(shape, "bf16", DEV)
  local x2, res2 = T.zeros(shape, "bf16", DEV), T.zeros(shape, "bf16", DEV)
  local hw = T.rand({ hidden }, "bf16", "cpu", { seed = 78 })
  local w = on_dev(hw)
  local y, ro = T.empty(shape, "bf16", DEV), T.empty(shape, "bf16", DEV)
  local y2, ro2 = T.empty(shape, "bf16", DEV), T.empty(shape, "bf16", DEV)
  local paths = {}
  local gr = graph.capture(function()
    tp:fused_allreduce_rmsnorm(x, res, w, 1e-6, { norm_out = y, residual_out = ro })
    paths[#paths + 1] = policy.mode() .. ":" .. tostring(db.info(tp).last_fused.path)
    policy.set { fused = "unfused", group = tp }
    tp:fused_allreduce_rmsnorm(x2, res2, w, 1e-6, { norm_out = y2, residual_out = ro2 })
    paths[#paths + 1] = policy.mode() .. ":" .. tostring(db.info(tp).last_fused.path)
    policy.set { fused = "default", group = tp }
  end, { warmup = 1, groups = { tp }, fusion = { max_tokens = 128, hidden = 4096, dtype = "bf16" } })
  want(table.concat(paths, " ") == "eager:fused eager:unfused graph:fused graph:unfused", "paths %s",
       table.concat(paths, " "))
  for round = 1, 3 do
    local xseed = 8000 + 100 * round
    local hx = T.randn(shape, "bf16", "cpu", { seed = xseed + me })
    local hres = T.randn(shape, "bf16", "cpu", { seed = xseed + 50 })
    x:copy_(hx); res:copy_(hres); x2:copy_(hx); res2:copy_(hres)
    gr:replay()
    local rref, nref = fused_ref(xseed, shape, "bf16", hres, hw, 1e-6, false)
    close(ro, rref, "bf16", ("replay %d fused residual_out"):format(round))
    close(y, nref, "bf16", ("replay %d fused norm_out"):format(round))
    close(ro2, rref, "bf16", ("replay %d unfused residual_out"):format(round))
    close(y2, nref, "bf16", ("replay %d unfused norm_out"):format(round))
  end
  gr:destroy()
end)

-- ---------------------------------------------------------------- bad input
check("bad_inputs", function()
  local d = T.ones({ 8 }, "f32", DEV)
  if cuda.device_count() >= 2 then
    local other = T.ones({ 8 }, "f32", "cuda:" .. (1 - DEVI % 2))
    expect_error("is on cuda:%d but group tp%.0 runs on cuda:" .. DEVI, tp.all_reduce, tp, other)
    policy.set { all_reduce = "nccl", group = tp }
    expect_error("is on cuda:%d but group tp%.0 runs on cuda:" .. DEVI, tp.all_reduce, tp, other)
    policy.set { all_reduce = "default", group = tp }
    expect_error("runs on cuda:" .. DEVI, tp.all_gather, tp, other, 0)
    local o = T.ones({ 8, 8 }, "bf16", "cuda:" .. (1 - DEVI % 2))
    expect_error("runs on cuda:" .. DEVI, tp.fused_allreduce_rmsnorm, tp, o, o, T.ones({ 8 }, "bf16", "cuda:" .. (1 - DEVI % 2)), 1e-6)
  end
  expect_error("input is on cuda:%d and output on cpu: host and device tensors", tp.all_gather, tp, d, 0, T.zeros({ 16 }, "f32"))
  expect_error("input is on cpu and output on cuda", tp.reduce_scatter, tp, T.zeros({ 8 }, "f32"), 0, T.zeros({ 4 }, "f32", DEV))
  -- fused: refused before launch, workspace unchanged
  local before = db.info(tp).fusion.creates
  local x, r, w = T.zeros({ 8, 4096 }, "bf16", DEV), T.zeros({ 8, 4096 }, "bf16", DEV), T.ones({ 4096 }, "bf16", DEV)
  expect_error("residual shape {8,2048} differs", tp.fused_allreduce_rmsnorm, tp, x, T.zeros({ 8, 2048 }, "bf16", DEV), w, 1e-6)
  expect_error("weight shape {4095} must be {4096}", tp.fused_allreduce_rmsnorm, tp, x, r, T.ones({ 4095 }, "bf16", DEV), 1e-6)
  expect_error("hidden 4092 must be a multiple of 8", tp.fused_allreduce_rmsnorm, tp, T.zeros({ 8, 4092 }, "bf16", DEV),
               T.zeros({ 8, 4092 }, "bf16", DEV), T.ones({ 4092 }, "bf16", DEV), 1e-6)
  expect_error("dtypes differ", tp.fused_allreduce_rmsnorm, tp, x, T.zeros({ 8, 4096 }, "f16", DEV), w, 1e-6)
  expect_error("8 tokens exceed the declared maximum 4", tp.fused_allreduce_rmsnorm, tp, x, r, w, 1e-6, { max_tokens = 4 })
  expect_error("residual is on cpu and the input on cuda", tp.fused_allreduce_rmsnorm, tp, x, T.zeros({ 8, 4096 }, "bf16"), w, 1e-6)
  want(db.info(tp).fusion.creates == before, "fusion workspace re-created by a refused call")
  -- an override the call cannot use: the size is above the workspace
  policy.set { all_reduce = "oneshot", group = "tp.0" }
  local big = T.zeros({ db.info(tp).custom_ar_max_bytes / 2 + 8 }, "bf16", DEV)
  expect_error("all_reduce=oneshot .* cannot be served on group tp%.0: size", tp.all_reduce, tp, big)
  big:free()
  policy.set { all_reduce = "default", group = "tp.0" }
  -- a destroyed group, a group this rank is not in
  local doomed = weft.create_custom_group({ 0, 1 }, "doomed")
  doomed:destroy()
  expect_error("group doomed is destroyed", doomed.all_reduce, doomed, d)
  local only0 = weft.create_custom_group({ 0 }, "only0")
  if me == 1 then
    expect_error("rank 1 is not in group only0", only0.all_reduce, only0, d)
    expect_error("rank 1 is not in group only0", only0.fused_allreduce_rmsnorm, only0, x, r, w, 1e-6)
  else
    same(only0:all_reduce(T.ones({ 8 }, "f32", DEV)), T.ones({ 8 }, "f32"), "group of one")
  end
  -- the group still works
  tp:all_reduce(d)
  same(d, T.full({ 8 }, 2, "f32"), "all_reduce after refusals")
end)

-- ---------------------------------------------------------------- host staging
check("host_staging", function()
  local g = weft.create_custom_group({ 0, 1 }, "staged")
  g.use_nccl, g.use_custom_allreduce = false, false
  local h = ints(9000 + me, { 4, 6 }, "f32")
  local d = on_dev(h)
  want(policy.select(g, "all_reduce", d) == "nccl", "before set-up: %s", tostring(policy.select(g, "all_reduce", d)))
  g:all_reduce(d); g:all_reduce(h)
  same(d, h, "staged all_reduce")
  want(policy.select(g, "all_reduce", d) == "device_host", "after set-up: %s", tostring(policy.select(g, "all_reduce", d)))
  want(policy.explain(g, d):find("g.use_nccl = false", 1, true), "explain misses the reason")
  h = ints(9010 + me, { 4, 6 }, "f32")
  same(g:all_gather(on_dev(h), 1), g:all_gather(h, 1), "staged all_gather")
  same(g:reduce_scatter(on_dev(h), 1), g:reduce_scatter(h, 1), "staged reduce_scatter")
  local b = on_dev(h)
  g:broadcast(b, 1)
  same(b, g:broadcast(h:clone(), 1), "staged broadcast")
  local gd, gh = g:gather(on_dev(h), 0, 0), g:gather(h, 0, 0)
  if me == 0 then same(gd, gh, "staged gather") end
  if me == 0 then g:send(on_dev(h), 1) else
    local r = T.empty({ 4, 6 }, "f32", DEV); g:recv(r, 0)
    same(r, ints(9010, { 4, 6 }, "f32"), "staged send/recv")
  end
  local o, ho = T.empty({ 4, 6 }, "f32", DEV), T.empty({ 4, 6 }, "f32")
  g:all_to_all_single(o, on_dev(h)); g:all_to_all_single(ho, h)
  same(o, ho, "staged all_to_all_single")
  same(g:all_gatherv(on_dev(h), { 4, 4 }), g:all_gatherv(h, { 4, 4 }), "staged all_gatherv")
  same(g:reduce_scatterv(on_dev(h), nil, { 1, 3 }), g:reduce_scatterv(h, nil, { 1, 3 }), "staged reduce_scatterv")
  -- the staging path is eager only: a capture refuses it clearly on both ranks
  cuda.synchronize()
  local ok, err = pcall(graph.capture, function() g:all_reduce(d) end, { groups = { g } })
  want(not ok and tostring(err):find("host staging path is eager only", 1, true), "capture: %s", tostring(err))
  g:destroy()
  want(not db.info(g).setup, "device state left after destroy")
end)

-- ---------------------------------------------------------------- latency (information)
check("eager_latency", function()
  local x = T.zeros({ 32768 }, "bf16", DEV)      -- 64 KiB
  local function per_call(mode)
    policy.set { all_reduce = mode, group = tp }
    for _ = 1, 20 do tp:all_reduce(x) end
    cuda.synchronize()
    world:barrier()
    local t0 = weft.now_us()
    for _ = 1, 500 do tp:all_reduce(x) end
    cuda.synchronize()
    return (weft.now_us() - t0) / 500
  end
  local ca, nc = per_call("default"), per_call("nccl")
  print(("INFO eager all_reduce 64 KiB bf16 through tp:all_reduce (Lua dispatch included): custom %.2f us, nccl %.2f us")
        :format(ca, nc))
end)

check("destroy", function()
  weft.destroy_model_parallel()
  want(not db.info(tp).setup, "tp device state left after destroy_model_parallel")
  want(tp.device_group == nil, "device_group left")
end)

weft.shutdown()
done()
