-- Runs under scripts/weft-run -n 2 with one GPU per rank
-- (tests/gpu/gpu_graph_runner_spec.lua): weft.graph_runner over a TP group's
-- device all_reduce and fused all-reduce + residual + RMSNorm, batch sizes
-- {1, 2, 4, 8, 16}: replays against eager runs (padded sizes too), a
-- divergent capture detected on both ranks, and the group usable afterwards.
-- Prints "OK <name>" per check; a failed check raises (non-zero exit).
local weft = require("weft")
local runner_mod = require("weft.graph_runner")
local tensor = require("weft.tensor")
local cuda = require("weft.cuda")

local world = weft.init()
local rank = world.rank
weft.initialize_model_parallel { tp = 2 }
local tp = weft.tp()

local W = require("helpers.rank_util")
local ok, check = W.ok, W.must

local H, SIZES = 4096, { 1, 2, 4, 8, 16 }

local function alloc(m)
  return {
    x = tensor.empty({ m, H }, "bf16", "cuda"),
    h = tensor.empty({ m, H }, "bf16", "cuda"),
    res = tensor.empty({ m, H }, "bf16", "cuda"),
    norm = tensor.empty({ m, H }, "bf16", "cuda"),
    rout = tensor.empty({ m, H }, "bf16", "cuda"),
    w = tensor.rand({ H }, "bf16", "cuda", { seed = 3 }),   -- the same on every rank
  }
end

-- h = all_reduce(x); norm, rout = fused(h, res, w): both device paths
local function step_with(extra)
  return function(bs, b, ctx)
    local x, h = b.x:narrow(0, 0, bs), b.h:narrow(0, 0, bs)
    tp:all_reduce(x, "sum", h)
    if extra then extra(bs, b, ctx) end
    local n, r = tp:fused_allreduce_rmsnorm(h, b.res:narrow(0, 0, bs), b.w, 1e-6,
      { norm_out = b.norm:narrow(0, 0, bs), residual_out = b.rout:narrow(0, 0, bs), max_tokens = SIZES[#SIZES] })
    return { h, n, r }
  end
end

local function new_runner(extra)
  return runner_mod.new {
    sizes = SIZES, groups = { tp }, alloc = alloc, step = step_with(extra),
    fusion = { hidden = H, dtype = "bf16" },
  }
end

-- 1. capture, replay, verify
local r = new_runner()
check(#r.order == 5 and r.order[1] == 16 and r.order[5] == 1, "captured largest first")
check(r.summaries[16].n == 2, "two collectives per capture, got " .. tostring(r.summaries[16].n))
local info = require("weft.backends.device_backends").info(tp)
check(info.custom_ar == "ready", "custom all-reduce ready: " .. tostring(info.custom_ar_why))
check(info.fusion and info.fusion.initialized, "fusion workspace pre-initialized")
ok("captured 5 sizes over all_reduce and the fused path")

local rep = r:verify()
-- sizes 16, 8, 4, 2, 1 and the padded 15, 7, 3: three outputs each
check(rep.ok and rep.checked == 3 * 8, "verify checked " .. tostring(rep.checked))
io.stdout:write(("verify: %d outputs, worst abs error %g\n"):format(rep.checked, rep.worst))
ok("replays match eager runs, padded sizes included")

-- 2. run pads: 3 rows -> the graph of 4, the padded row is zero in, sum 0 out
local out, padded = r:run(3, function(b, bs)
  cuda.fill_random(b.x.ptr, bs * H, b.x:dtype_code(), 77 + rank, 0)
end)
check(padded == 4 and out[1].shape[1] == 3, "run(3) used the graph of 4 and sliced to 3 rows")
local h4 = r.bufs.h:narrow(0, 3, 1):to_table()
local zero = true
for i = 1, #h4 do if h4[i] ~= 0 then zero = false; break end end
check(zero, "the padded row reduced zeros")
check(not pcall(r.run, r, 17), "batch size 17 refused")
ok("run pads to the next captured size")
r:destroy()

-- 3. rank 1 captures one more collective at batch size 8: detected, nothing kept
local good, err = pcall(new_runner, function(bs, b, ctx)
  if rank == 1 and bs == 8 and ctx.mode == "graph" then tp:all_reduce(b.h:narrow(0, 0, bs)) end
end)
check(not good, "divergent capture must fail")
err = tostring(err)
for _, want in ipairs({ "ranks captured different work at batch size 8", "rank 1 differs from rank 0",
                        "rank 1 captured 3 collective(s)", "rank 0 captured 2 collective(s)" }) do
  check(err:find(want, 1, true) ~= nil, ("error %q lacks %q"):format(err, want))
end
ok("divergent capture detected on every rank")

-- 4. the group still works, eagerly and in a new runner
local t = tensor.ones({ 1024 }, "bf16", "cuda")
tp:all_reduce(t)
check(t:to_table()[1] == 2, "eager all_reduce after the refused capture")
local r2 = new_runner()
r2:verify(3)
r2:destroy()
ok("the group is usable after a refused capture")

weft.shutdown()
