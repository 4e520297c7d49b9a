-- One rank of tests/gpu/gpu_shared_spec.lua: weft's own kernels at world W with
-- ranks sharing GPUs (shared-GPU test mode: WEFT_ALLOW_SHARED_GPU=1 under
-- MPS, one SM slice per rank; scripts/weft-mps -n W -- scripts/weft-run -n W
-- tests/helpers/gpu_shared_worker.lua). Checks the kernels' logic at every
-- world size, not their speed: one-shot, two-shot, flag one-shot and auto
-- all-reduce (1 element to 64 MiB, odd tails, bf16/f16/f32) against the host
-- (shm) all-reduce of the same small integers, eager and replayed graphs on
-- new data; fused AR + residual + RMSNorm (one-shot, two-shot, Gemma, FP8)
-- against an f64 reference; the fusion workspace growing across token
-- counts; the policy's explanation. WEFT_SHARED_KILL=r: rank r leaves in the
-- middle of one-shot all-reduces and the others must fail naming it.
-- Prints "PASS <name>" / "FAIL <name>: why" per check; exits 1 on a failure.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local G, weft, T, cuda, policy, db, graph = R.G, R.weft, R.T, R.cuda, R.policy, R.db, R.graph

local world = weft.init { timeout_ms = tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 60000 }
local me, W = world.rank, world.world_size
local g = world
local DEV = "cuda:" .. cuda.current_device()
local KERNELS = W == 2 or W == 4 or W == 6 or W == 8
local MIB = 1048576
local ALL = {}
for r = 0, W - 1 do ALL[#ALL + 1] = r end

local S = G.soft_checks()
local want, ints = S.want, G.ints
local check, done = G.checks(world, S, function() policy.set { all_reduce = "default", fused = "default", group = g } end)

local function same(got, ref, what)
  local ma = got:compare(ref)
  want(ma == 0, "%s: max abs difference %g", what, ma)
end

-- ---------------------------------------------------------------- a leaving rank
local victim = tonumber(os.getenv("WEFT_SHARED_KILL") or "")
if victim then
  policy.set { all_reduce = KERNELS and "oneshot" or "default", group = g }
  local x = T.ones({ 4096 }, "bf16", DEV)
  g:all_reduce(x); cuda.synchronize()
  G.leave_and_check(world, me, victim, function() g:all_reduce(x); x:to_table() end)
end

-- ---------------------------------------------------------------- set-up
check("setup", function()
  local x = T.ones({ 16 }, "f32", DEV)
  g:all_reduce(x)
  same(x, T.full({ 16 }, W, "f32"), "first all_reduce")
  local info = db.info(g)
  if cuda.device_count() < W then
    want(info.shared_mode ~= nil, "not in shared-GPU mode: %s", tostring(info.shared))
    want(not info.nccl, "NCCL was created for ranks sharing a GPU")
  end
  if KERNELS then
    want(info.custom_ar == "ready", "custom all-reduce %s: %s", tostring(info.custom_ar), tostring(info.custom_ar_why))
  else
    want(info.custom_ar ~= "ready", "world %d: custom all-reduce %s", W, tostring(info.custom_ar))
    want(db.choice(g, "all_reduce", x) == "device_host", "world %d: all_reduce served by %s", W,
         tostring(db.choice(g, "all_reduce", x)))
  end
  local e = policy.explain(g, T.zeros({ 8, 4096 }, "bf16", DEV))
  if me == 0 then print("INFO explain: " .. e:gsub("\n", " | ")) end
  if KERNELS then want(e:find(": custom_ar", 1, true), "explain: %s", e)
  else want(e:find("kernels exist for 2, 4, 6, 8", 1, true), "explain: %s", e) end
end)

-- the automatic choice at this world size, as explain states it: one-shot
-- up to the workspace's one-shot limit, two-shot above it
check("policy_crossover", function()
  if not KERNELS then return end
  local lim = tostring(db.info(g).custom_ar_why):match("one%-shot up to (%d+ %a+)")
  want(lim ~= nil, "no one-shot limit in %s", tostring(db.info(g).custom_ar_why))
  local kernels = {}
  for _, n in ipairs { 512, 32 * MIB / 2 } do
    local x = T.zeros({ n }, "bf16", DEV)
    local e = policy.explain(g, x)
    kernels[#kernels + 1] = e:match("%-> (%w+) kernel") or "?"
    x:free()
  end
  if me == 0 then print(("INFO world %d auto: 1 KiB -> %s, 32 MiB -> %s (one-shot up to %s)")
                        :format(W, kernels[1], kernels[2], tostring(lim))) end
  want(kernels[1] == "oneshot", "1 KiB: %s", kernels[1])
  want(kernels[2] == "twoshot", "32 MiB: %s", kernels[2])
end)

-- ---------------------------------------------------------------- all_reduce
local ALGOS = KERNELS and { "oneshot", "twoshot", "oneshot_flag", "auto" } or { "default" }
local SIZES = { 1, 7, 1023, 4097, 65537, 1048579 }

check("all_reduce_eager", function()
  local seed = 1000
  for _, algo in ipairs(ALGOS) do
    policy.set { all_reduce = algo, group = g }
    for _, dt in ipairs { "bf16", "f16", "f32" } do
      for _, n in ipairs(SIZES) do
        seed = seed + 10
        local h = ints(seed + me, n, dt)
        local d = h:clone(DEV)
        local be, why = db.choice(g, "all_reduce", d)
        if KERNELS then want(be == algo, "%s %s n=%d: policy chose %s (%s)", algo, dt, n, tostring(be), tostring(why)) end
        g:all_reduce(d)
        g:all_reduce(h)
        same(d, h, ("%s %s n=%d"):format(algo, dt, n))
        d:free(); h:free()
      end
    end
  end
end)

-- the largest calls: up to the workspace (64 MiB by default), odd tails
check("all_reduce_large", function()
  local max = KERNELS and db.info(g).custom_ar_max_bytes or 64 * MIB
  local cases = { { "bf16", max / 2 - 3 }, { "f32", 16 * MIB / 4 + 5 }, { "f16", 4 * MIB / 2 - 1 } }
  local seed = 3000
  for _, algo in ipairs(KERNELS and { "twoshot", "auto" } or { "default" }) do
    policy.set { all_reduce = algo, group = g }
    for _, c in ipairs(cases) do
      seed = seed + 10
      local h = ints(seed + me, c[2], c[1])
      local d = h:clone(DEV)
      g:all_reduce(d)
      g:all_reduce(h)
      same(d, h, ("%s %s n=%d"):format(algo, c[1], c[2]))
      d:free(); h:free()
    end
  end
end)

check("all_reduce_graph", function()
  cuda.synchronize()
  if not KERNELS then   -- no kernels, no NCCL: host staging, which a capture refuses clearly
    local y = T.zeros({ 64 }, "bf16", DEV)
    S.expect_error("host staging path is eager only", graph.capture, function() g:all_reduce(y) end, { groups = { g } })
    return
  end
  local n = 32771
  local bufs, picks = {}, {}
  for i = 1, #ALGOS do bufs[i] = T.zeros({ n }, "bf16", DEV) end
  local gr = graph.capture(function()
    for i, algo in ipairs(ALGOS) do
      policy.set { all_reduce = algo, group = g }
      picks[#picks + 1] = tostring(db.choice(g, "all_reduce", bufs[i]))
      g:all_reduce(bufs[i])
    end
    policy.set { all_reduce = "default", group = g }
  end, { warmup = 1, groups = { g } })
  for round = 1, 3 do
    local hs = {}
    for i = 1, #ALGOS do
      hs[i] = ints(5000 + 100 * round + 10 * i + me, n, "bf16")
      bufs[i]:copy_(hs[i])
    end
    gr:replay()
    for i, algo in ipairs(ALGOS) do
      g:all_reduce(hs[i])
      same(bufs[i], hs[i], ("replay %d %s"):format(round, algo))
    end
  end
  local hs = ints(5900 + me, n, "bf16")
  for _ = 1, 30 do bufs[1]:copy_(hs); gr:replay() end
  g:all_reduce(hs)
  same(bufs[1], hs, "after 30 replays")
  gr:destroy()
  if me == 0 then print("INFO graph picks: " .. table.concat(picks, " ")) end
end)

-- ---------------------------------------------------------------- fused
local function fused_case(name, tokens, hidden, dt, opts, want_path)
  opts = opts or {}
  local shape = { tokens, hidden }
  local xseed = 7000 + tokens * 7 + hidden + (opts.gemma and 3 or 0)
  local hx = T.randn(shape, dt, "cpu", { seed = xseed + me })
  local x = hx:clone(DEV)
  local hres = T.randn(shape, dt, "cpu", { seed = 77 })
  local hw = T.rand({ hidden }, dt, "cpu", { seed = 78 })
  local res, w = hres:clone(DEV), hw:clone(DEV)
  local y, ro, q = g:fused_allreduce_rmsnorm(x, res, w, 1e-6, opts)
  local rref, nref = G.fused_ref(xseed, shape, dt, hres, hw, 1e-6, opts.gemma, ALL)
  G.close(want, ro, rref, dt, name .. " residual_out")
  if opts.fp8 then
    want(q ~= nil, "%s: no fp8 output", name)
  else
    G.close(want, y, nref, dt, name .. " norm_out")
  end
  local info = db.info(g)
  want(info.last_fused and info.last_fused.path == want_path, "%s: path %s (%s), want %s", name,
       tostring(info.last_fused and info.last_fused.path), tostring(info.last_fused and info.last_fused.why), want_path)
  x:free(); res:free(); w:free(); hx:free(); hres:free(); hw:free()
end

local FUSED = W <= 8 and "fused" or "unfused"

check("fusion_workspace_grows", function()
  local before = db.info(g).fusion
  local c0 = before and before.creates or 0
  for _, tokens in ipairs { 2, 300, 1500, 2048 } do
    fused_case(("grow %d"):format(tokens), tokens, 4096, "bf16", { max_tokens = tokens }, FUSED)
  end
  local after = db.info(g).fusion
  if FUSED == "fused" then
    want(after and after.creates > c0, "the workspace did not grow: %s -> %s creates", tostring(c0),
         tostring(after and after.creates))
  end
  fused_case("after growth, small", 3, 4096, "bf16", {}, FUSED)
  local e = policy.explain(g, T.zeros({ 8, 4096 }, "bf16", DEV), "fused_allreduce_rmsnorm")
  if me == 0 then print("INFO fused explain: " .. e:gsub("\n", " | ")) end
end)

check("fused", function()
  for _, algo in ipairs { "oneshot", "twoshot" } do
    for _, hidden in ipairs { 4096, 8192 } do
      for _, tokens in ipairs { 1, 7, 128, 1000 } do
        fused_case(("%s bf16 %dx%d"):format(algo, tokens, hidden), tokens, hidden, "bf16", { algo = algo }, FUSED)
      end
    end
    fused_case(algo .. " f16 7x4096", 7, 4096, "f16", { algo = algo }, FUSED)
    fused_case(algo .. " f32 33x2048", 33, 2048, "f32", { algo = algo }, FUSED)
    fused_case(algo .. " gemma 8x4096", 8, 4096, "bf16", { algo = algo, gemma = true }, FUSED)
    fused_case(algo .. " fp8 16x4096", 16, 4096, "bf16", { algo = algo, fp8 = true, scale = 0.5 }, FUSED)
  end
end)

check("destroy", function()
  local gg = weft.create_custom_group(ALL, "shared_again")
  local x = T.ones({ 4096 }, "bf16", DEV)
  gg:all_reduce(x)
  same(x, T.full({ 4096 }, W, "bf16"), "a second group")
  gg:destroy()
end)

weft.shutdown()
done()
