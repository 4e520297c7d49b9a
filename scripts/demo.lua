-- weft demo: `make demo` runs it as `scripts/weft-run -n 4 scripts/demo.lua`
-- (2 ranks work too: TP=2, PP=1).
--
-- TP=2 x PP=2 over 4 ranks: prints the plan, runs all_reduce and the fused
-- all-reduce + residual + RMSNorm on random data in each TP group, checks both
-- against a reference computed in f64, hands the result to the next pipeline
-- stage, and prints median latencies of every rank. Host tensors through
-- shared memory; with CUDA and a GPU per rank, device tensors: the TP
-- all_reduce through weft's custom all-reduce (or NCCL, as weft.policy
-- decides) and the fused kernel (weft.backends.device_backends), the pipeline
-- hand-over through NCCL.
local weft = require("weft")
local ffi = require("ffi")
local T = weft.tensor

local TOKENS, HIDDEN, DTYPE, EPS = 8, 4096, "bf16", 1e-6
local CALLS = tonumber(os.getenv("WEFT_DEMO_CALLS")) or 200

local world = weft.init()
weft.initialize_model_parallel { tp = 2, pp = world.world_size >= 4 and 2 or 1 }
local plan = weft.plan()
local tp, pp = weft.tp(), weft.pp()
local me = world.rank

if me == 0 then
  print(("weft demo: %d ranks, TP=%d x PP=%d"):format(world.world_size, tp.world_size, pp.world_size))
  plan:show()
end

-- device when a device backend serves all_reduce on it and every rank of
-- this node has its own GPU (ranks sharing one would time-slice spinning
-- kernels), else host
local dev = "cpu"
if weft.cuda_available() then
  local probe = T.zeros({ 1 }, DTYPE, "cuda")
  local lws = tonumber(os.getenv("LOCAL_WORLD_SIZE") or "") or world.world_size
  if weft.policy.select(tp, "all_reduce", probe) ~= "no_device_backend" and weft.cuda.device_count() >= lws then
    dev = "cuda"
  end
  probe:free()
  if dev == "cpu" and me == 0 then
    print(("CUDA found, but %d ranks for %d GPUs on this node: host tensors"):format(lws, weft.cuda.device_count()))
  end
end

local function seed_of(rank, what) return 1000 * rank + what end

-- data of global rank r, regenerated identically on any rank (host, f64)
local function data64(r, what)
  return T.randn({ TOKENS, HIDDEN }, DTYPE, "cpu", { seed = seed_of(r, what) }):to("f64")
end

local function close_enough(got, ref, atol, rtol, what)
  local g = ffi.cast("double *", got:to("cpu"):to("f64").ptr)
  local r = ffi.cast("double *", ref.ptr)
  local worst, at = 0, 0
  for i = 0, ref.numel - 1 do
    local excess = math.abs(g[i] - r[i]) - (atol + rtol * math.abs(r[i]))
    if excess > worst then worst, at = excess, i end
  end
  if worst > 0 then
    error(("demo: rank %d: %s differs from the f64 reference at element %d: got %g, want %g")
          :format(me, what, at, g[at], r[at]))
  end
  local max_abs = got:compare(ref)
  return max_abs
end

-- 1. all_reduce in the TP group
local x = T.randn({ TOKENS, HIDDEN }, DTYPE, "cpu", { seed = seed_of(me, 1) }):to(dev)
if me == 0 then print(weft.policy.explain(tp, x)) end
tp:all_reduce(x)
local ref = T.zeros({ TOKENS, HIDDEN }, "f64")
local rp = ffi.cast("double *", ref.ptr)
for _, r in ipairs(tp.ranks) do
  local d = data64(r, 1)
  local dp = ffi.cast("double *", d.ptr)
  for i = 0, ref.numel - 1 do rp[i] = rp[i] + dp[i] end
  d:free()
end
local ar_err = close_enough(x, ref, 1e-2, 1e-2, "all_reduce")

-- 2. fused all-reduce + residual add + RMSNorm
local xin = T.randn({ TOKENS, HIDDEN }, DTYPE, "cpu", { seed = seed_of(me, 2) }):to(dev)
local res = T.randn({ TOKENS, HIDDEN }, DTYPE, "cpu", { seed = 7 }):to(dev)
local gamma = T.rand({ HIDDEN }, DTYPE, "cpu", { seed = 8 }):to(dev)
local y, res_out = tp:fused_allreduce_rmsnorm(xin, res, gamma, EPS)
if me == 0 and dev == "cuda" then
  print(weft.policy.explain(tp, xin, "fused_allreduce_rmsnorm"))
end
-- f64 reference of the fused op for the TP group made of `ranks`
local r64 = res:to("cpu"):to("f64")
local g64 = gamma:to("cpu"):to("f64")
local function fused_reference(ranks)
  local sum = T.zeros({ TOKENS, HIDDEN }, "f64")
  local sp = ffi.cast("double *", sum.ptr)
  for _, r in ipairs(ranks) do
    local d = data64(r, 2)
    local dp = ffi.cast("double *", d.ptr)
    for i = 0, sum.numel - 1 do sp[i] = sp[i] + dp[i] end
    d:free()
  end
  -- the all-reduced input is rounded to bf16 before the residual add, as on a GPU
  sum = sum:to(DTYPE):to("f64")
  sp = ffi.cast("double *", sum.ptr)
  local rp, gp = ffi.cast("double *", r64.ptr), ffi.cast("double *", g64.ptr)
  local ref_res, ref_y = T.zeros({ TOKENS, HIDDEN }, "f64"), T.zeros({ TOKENS, HIDDEN }, "f64")
  local rr, ry = ffi.cast("double *", ref_res.ptr), ffi.cast("double *", ref_y.ptr)
  for t = 0, TOKENS - 1 do
    local ss = 0
    for h = 0, HIDDEN - 1 do
      local i = t * HIDDEN + h
      rr[i] = sp[i] + rp[i]
      ss = ss + rr[i] * rr[i]
    end
    local inv = 1 / math.sqrt(ss / HIDDEN + EPS)
    for h = 0, HIDDEN - 1 do
      local i = t * HIDDEN + h
      ry[i] = rr[i] * inv * gp[h]
    end
  end
  return ref_res, ref_y
end
local ref_res, ref_y = fused_reference(tp.ranks)
local res_err = close_enough(res_out, ref_res, 2e-2, 1e-2, "fused residual_out")
local y_err = close_enough(y, ref_y, 2e-2, 2e-2, "fused norm_out")

-- 3. pipeline: stage 0 hands its normalized activations to stage 1, which
-- checks them against the reference of the sender's TP group
local pp_ok = "-"
if pp.world_size == 1 then
  pp_ok = "(one stage)"
elseif pp.is_first_rank then
  pp:send(y, pp.rank_in_group + 1)
else
  local got = pp:recv(T.empty({ TOKENS, HIDDEN }, DTYPE, dev), pp.rank_in_group - 1)   -- same place as the sender's
  local sender = pp.ranks[pp.rank_in_group]          -- global rank of the previous stage
  local sender_tp = {}
  for _, grp in ipairs(plan.groups.tp) do
    for _, r in ipairs(grp) do if r == sender then sender_tp = grp end end
  end
  local _, want = fused_reference(sender_tp)
  pp_ok = ("%.2g"):format(close_enough(got, want, 2e-2, 2e-2, "activations received from the previous stage"))
  got:free()
end

-- 4. latencies: median over many calls
local function median_us(fn)
  local list = {}
  for i = 1, CALLS + 5 do
    local t0 = weft.now_us()
    fn()
    if i > 5 then list[#list + 1] = weft.now_us() - t0 end
  end
  table.sort(list)
  return list[math.floor(#list / 2) + 1]
end
local bench_x = T.randn({ TOKENS, HIDDEN }, DTYPE, "cpu", { seed = seed_of(me, 3) }):to(dev)
tp:barrier()
local ar_us = median_us(function() tp:all_reduce(bench_x) end)
tp:barrier()
local fused_us = median_us(function() tp:fused_allreduce_rmsnorm(xin, res, gamma, EPS, { norm_out = y, residual_out = res_out }) end)
local backend = weft.policy.select(tp, "all_reduce", bench_x)

local rows = world:all_gather_object { rank = me, tp = tp.unique_name, pp = pp.unique_name, stage = pp.rank_in_group, ar_us = ar_us, fused_us = fused_us,
                                       ar_err = ar_err, y_err = y_err, res_err = res_err, backend = backend,
                                       pp_ok = pp_ok }
if me == 0 then
  print(("%d x %d %s (%d KiB) on %s, median of %d calls:"):format(TOKENS, HIDDEN, DTYPE,
        TOKENS * HIDDEN * 2 / 1024, dev, CALLS))
  print("| rank | TP group | PP group (stage) | backend | all_reduce µs | fused AR+res+RMSNorm µs | max err AR | max err norm | max err of activations from prev stage |")
  print("|---|---|---|---|---|---|---|---|---|")
  for _, r in ipairs(rows) do
    print(("| %d | %s | %s (%d) | %s | %.1f | %.1f | %.2g | %.2g | %s |"):format(r.rank, r.tp, r.pp, r.stage,
          r.backend, r.ar_us, r.fused_us, r.ar_err, r.y_err, r.pp_ok))
  end
  print("all results match the f64 reference")
end

weft.destroy_model_parallel()
weft.shutdown()
