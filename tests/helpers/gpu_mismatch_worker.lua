-- One rank of tests/gpu/gpu_mismatch_spec.lua: ranks of one group make device
-- calls that differ, and every rank must raise within a fraction of the
-- timeout (WEFT_TIMEOUT_MS, 20 s in the spec), naming the other call; then
-- weft.recover() and a right all_reduce. Run under MPS on one GPU:
--   scripts/weft-mps -n W -- scripts/weft-run -n W tests/helpers/gpu_mismatch_worker.lua
-- Cases (rank 1 differs from the others): the custom all-reduce's algorithm
-- (one-shot against two-shot), its count, its dtype (the same bytes: the
-- kernels complete, the check at the call's end finds it), the quick
-- all-reduce against the exact two-shot, the fused all-reduce + RMSNorm
-- (one-shot against two-shot; one-shot with and without Gemma's weight),
-- the other fusion patterns (MoE one-shot against two-shot, MoE against the
-- pre/post norm, the reduce-scatter + norm with another token count),
-- and replays of graphs that captured different
-- sizes. Prints "PASS <case> (<ms> ms): <error>" or "FAIL <case>: why" per
-- rank; WEFT_MISMATCH_CASES=a,b runs some only. WEFT_MISMATCH_WARM=1: each
-- case first runs once with every rank making rank 0's call (workspaces
-- made, kernels loaded), so the time is the mismatch's alone.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local weft, T, cuda, policy, db, graph = R.weft, R.T, R.cuda, R.policy, R.db, R.graph

local TIMEOUT = tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 20000
local world = weft.init { timeout_ms = TIMEOUT }
local me, W = world.rank, world.world_size
local DEV = "cuda:" .. cuda.current_device()
local odd = me == 1
local WARM = os.getenv("WEFT_MISMATCH_WARM") == "1"
local failed = 0

local function say(fmt, ...) print(fmt:format(...)); io.stdout:flush() end

-- The clock starts when a case has made its data and meets the other ranks
-- (start(g)): a case's time is its mismatched call's alone (making 2 MiB of
-- random integers in Lua takes 30 ms by itself).
local t_start
local function start(g) g:barrier(); t_start = weft.now_us() end

-- fresh random data (never zeros): small integers, exact in every dtype
local function rnd(n, dt, seed)
  local h = R.G.ints(seed, n, dt)
  local d = h:clone(DEV)
  h:free()
  return d
end

local CASES = {
  { "ar_algo", function(g)
      policy.set { all_reduce = odd and "oneshot" or "twoshot", group = g }
      local x = rnd(65536, "bf16", 10 + me)
      start(g); g:all_reduce(x); cuda.synchronize()
    end },
  { "ar_count", function(g)
      policy.set { all_reduce = "oneshot", group = g }
      local x = rnd(odd and 8192 or 4096, "bf16", 20 + me)
      start(g); g:all_reduce(x); cuda.synchronize()
    end },
  { "ar_dtype", function(g)
      policy.set { all_reduce = "oneshot", group = g }
      local x = rnd(4096, odd and "f16" or "bf16", 30 + me)
      start(g); g:all_reduce(x); cuda.synchronize()
      x:to_table()
    end },
  { "quick", function(g)
      local ar = db.ensure_ar(g).ar
      if not ar then error("no custom all-reduce workspace", 0) end
      local x = rnd(1048576, "bf16", 40 + me)
      start(g); ar:run(x.ptr, x.ptr, x.numel, "bf16", odd and "quick_int8" or "twoshot")
      cuda.synchronize()
      local e = ar:check_error()
      if e then error(e, 0) end
    end },
  { "fused", function(g)
      local x, res = rnd(16 * 4096, "bf16", 50 + me), rnd(16 * 4096, "bf16", 60)
      x, res = x:view { 16, 4096 }, res:view { 16, 4096 }
      local w = rnd(4096, "bf16", 70)
      start(g); g:fused_allreduce_rmsnorm(x, res, w, 1e-6, { algo = odd and "oneshot" or "twoshot" })
      cuda.synchronize()
    end },
  { "fused_gemma", function(g)   -- the same shapes and kernel: only the end-of-call check sees it
      local x, res = rnd(16 * 4096, "bf16", 55 + me), rnd(16 * 4096, "bf16", 65)
      x, res = x:view { 16, 4096 }, res:view { 16, 4096 }
      local w = rnd(4096, "bf16", 75)
      start(g); g:fused_allreduce_rmsnorm(x, res, w, 1e-6, { algo = "oneshot", gemma = odd })
      cuda.synchronize()
    end },
  { "moe_algo", function(g)      -- the MoE pattern, one-shot against two-shot
      local K, Tn, H = 2, 16, 4096
      local x, sc = rnd(K * Tn * H, "bf16", 90 + me):view { K, Tn, H }, rnd(K * Tn, "f32", 91 + me):view { K, Tn }
      local res, w = rnd(Tn * H, "bf16", 92):view { Tn, H }, rnd(H, "bf16", 93)
      start(g)
      g:fused_moe_allreduce_rmsnorm { expert_outputs = x, expert_scales = sc, residual = res, weight = w,
                                      eps = 1e-6, algo = odd and "oneshot" or "twoshot" }
      cuda.synchronize()
    end },
  { "moe_vs_prepost", function(g) -- two patterns over the same shapes: the MoE end against the sandwich norm
      local Tn, H = 16, 4096
      local res, w, wp = rnd(Tn * H, "bf16", 94):view { Tn, H }, rnd(H, "bf16", 95), rnd(H, "bf16", 96)
      local x = rnd(Tn * H, "bf16", 97 + me):view { Tn, H }
      local e, sc = x:view { 1, Tn, H }, rnd(Tn, "f32", 98 + me):view { 1, Tn }
      start(g)
      if odd then
        g:fused_allreduce_prepost_rmsnorm(x, res, wp, w, 1e-6, { algo = "oneshot" })
      else
        g:fused_moe_allreduce_rmsnorm { expert_outputs = e, expert_scales = sc, residual = res, weight = w,
                                        eps = 1e-6, algo = "oneshot" }
      end
      cuda.synchronize()
    end },
  { "rs_tokens", function(g)     -- the reduce-scatter + norm with another token count
      local Tn, H = (odd and 8 or 4) * W, 4096   -- the rows split evenly at every world
      local rows = Tn / W
      local x = rnd(Tn * H, "bf16", 99 + me):view { Tn, H }
      local res, w = rnd(rows * H, "bf16", 100):view { rows, H }, rnd(H, "bf16", 101)
      start(g)
      g:fused_reduce_scatter_rmsnorm(x, res, w, 1e-6, { algo = "twoshot" })
      cuda.synchronize()
    end },
  { "graph_replay", function(g)
      policy.set { all_reduce = "oneshot", group = g }
      local x = rnd(odd and 8192 or 4096, "bf16", 80 + me)
      local gr = graph.capture(function() g:all_reduce(x) end, { warmup = 0, groups = { g } })
      start(g); gr:replay(); cuda.synchronize()
      gr:destroy()
    end },
}

local only = {}
for name in (os.getenv("WEFT_MISMATCH_CASES") or ""):gmatch("[^,]+") do only[name] = true end

for _, c in ipairs(CASES) do
  local name, fn = c[1], c[2]
  if next(only) == nil or only[name] then
    local g = weft.world()
    if WARM then
      odd = false                 -- every rank makes rank 0's call, then rank 1's
      local wok, werr = pcall(fn, g)
      if wok then odd = true; wok, werr = pcall(fn, g) end
      odd = me == 1
      if not wok then
        failed = failed + 1
        say("FAIL %s: the warm-up (every rank the same call): %s", name, tostring(werr):gsub("\n", " | "))
      end
    end
    g:barrier()
    t_start = nil
    local ok, err = pcall(fn, g)
    local ms = t_start and (weft.now_us() - t_start) / 1000 or 0
    err = tostring(err):gsub("\n", " | ")
    local named = err:find("differs between ranks", 1, true) or err:find("gave up its call", 1, true)
                  or err:find("captured different", 1, true) or err:find("different", 1, true)
    if ok then
      failed = failed + 1
      say("FAIL %s: no error (%.1f ms) although rank 1 made another call", name, ms)
    elseif not named then
      failed = failed + 1
      say("FAIL %s: the error (%.1f ms) does not say the calls differ: %s", name, ms, err)
    elseif ms > TIMEOUT / 10 then
      failed = failed + 1
      say("FAIL %s: the error came after %.1f ms (timeout %d ms): %s", name, ms, TIMEOUT, err)
    else
      say("PASS %s (%.1f ms%s): %s", name, ms, WARM and ", warm" or "", err)
    end
    policy.set { all_reduce = "default", group = g }
    local rok, rerr = pcall(weft.recover)
    if not rok then
      failed = failed + 1
      say("FAIL %s: recover: %s", name, tostring(rerr):gsub("\n", " | "))
      break
    end
    local y = T.ones({ 4096 }, "bf16", DEV)
    local aok, aerr = pcall(function() weft.world():all_reduce(y); cuda.synchronize() end)
    local v = aok and y:to_table()[4096]
    if not aok or v ~= W then
      failed = failed + 1
      say("FAIL %s: the all_reduce after recover: %s", name, aok and ("got " .. tostring(v)) or tostring(aerr))
    end
  end
end

weft.shutdown()
os.exit(failed == 0 and 0 or 1)
