-- Ranks of tests/unit/determ_spec.lua on a pretend GPU (WEFT_FAKE_DEVICE=1, 2
-- ranks, WEFT_CUSTOM_AR_MAX_BYTES=1048576): deterministic mode's agreement
-- (the group's first device call, policy.set with the group object, a local
-- change after agreeing), its routing (the deterministic bit reaches every
-- kernel call, the unfused path uses the deterministic norm kernel) and its
-- refusals, each error before anything is enqueued. "PASS <name>" per check.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local fake = require("helpers.fake_device")
fake.install()
local R = require("helpers.gpu_worker")
local G, weft, T, policy, db, async = R.G, R.weft, R.T, R.policy, R.db, R.async

local world = weft.init { timeout_ms = 20000 }
local me, W = world.rank, world.world_size
local DEV = "cuda:" .. require("weft.cuda").current_device()
local S = G.soft_checks()
local want = S.want
local check, done = G.checks(world, S, function() policy.set { deterministic = "default", fused = "default" } end)
local DC = fake.det_calls

local function snap() local c = {}; for k, v in pairs(DC) do c[k] = v end; return c end
local function delta(c0, k) return DC[k] - c0[k] end

check("mixed at the first device call: every rank raises, naming both sides", function()
  local gg = weft.create_custom_group({ 0, 1 }, "det_mixed")
  if me == 1 then policy.set { deterministic = true } end           -- local: rank 1 only
  local x = T.ones({ 64 }, "bf16", DEV)
  local t0 = weft.now_us()
  S.expect_error("group det_mixed: deterministic mode is on for ranks 1 and off for ranks 0", gg.all_reduce, gg, x)
  want(weft.now_us() - t0 < 5e6, "took %.1f s", (weft.now_us() - t0) / 1e6)
  want(gg._dev == nil, "the group kept a device state after the disagreement")
  policy.set { deterministic = "default" }
  gg:all_reduce(x)                                                  -- agreed now: off
  want(x:compare(T.full({ 64 }, 2, "bf16")) == 0, "all_reduce after agreeing")
  want(gg._dev.determ == false, "agreed value %s", tostring(gg._dev.determ))
  gg:destroy()
end)

check("policy.set with the group agrees over its cpu group", function()
  local gg = weft.create_custom_group({ 0, 1 }, "det_set")
  gg:all_reduce(T.ones({ 8 }, "f32", DEV))                         -- device state made: off
  policy.set { deterministic = true, group = gg }                   -- collective
  want(gg._dev.determ == true, "agreed value %s", tostring(gg._dev.determ))
  local c0 = snap()
  gg:all_reduce(T.ones({ 8 }, "f32", DEV))
  want(delta(c0, "ar") == 1 and delta(c0, "ar_plain") == 0, "kernel calls %d det, %d plain", delta(c0, "ar"), delta(c0, "ar_plain"))
  S.expect_error("policy.set: group det_set: deterministic mode is on for ranks 0 and off for ranks 1",
                 policy.set, { deterministic = me == 0, group = gg })
  want(policy.deterministic(gg) == true, "a refused policy.set changed the setting")
  want(gg._dev.determ == true, "a refused policy.set changed the agreed value")
  gg:destroy()
end)

check("a local change after agreeing raises at the next call, enqueuing nothing", function()
  local gg = weft.create_custom_group({ 0, 1 }, "det_late")
  local x = T.ones({ 8 }, "f32", DEV)
  gg:all_reduce(x)                                                  -- agreed: off
  policy.set { deterministic = true }                               -- local on both ranks, no collective
  local c0 = snap()
  S.expect_error("deterministic mode is on on this rank %(policy.set%) but group det_late agreed on off", gg.all_reduce, gg, x)
  local y = T.ones({ 4, 64 }, "bf16", DEV)
  S.expect_error("agreed on off", gg.fused_allreduce_rmsnorm, gg, y, T.ones({ 4, 64 }, "bf16", DEV),
                 T.ones({ 64 }, "bf16", DEV), 1e-6)
  want(delta(c0, "ar") + delta(c0, "ar_plain") + delta(c0, "fusion") + delta(c0, "fusion_plain") == 0,
       "kernels ran after the error")
  policy.set { deterministic = true, group = gg }                   -- the collective way
  gg:all_reduce(x)
  want(delta(c0, "ar") == 1, "no deterministic kernel call after agreeing again")
  gg:destroy()
end)

check("routes all_reduce, fused and unfused through the deterministic kernels", function()
  policy.set { deterministic = true, group = world }
  local c0 = snap()
  local x = T.randn({ 16, 256 }, "bf16", "cpu", { seed = 3 + me }):clone(DEV)
  local res = T.randn({ 16, 256 }, "bf16", "cpu", { seed = 9 }):clone(DEV)
  local w = T.rand({ 256 }, "bf16", "cpu", { seed = 10 }):clone(DEV)
  world:all_reduce(T.ones({ 4096 }, "bf16", DEV))
  want(delta(c0, "ar") == 1, "all_reduce: %d det kernel calls", delta(c0, "ar"))
  world:fused_allreduce_rmsnorm(x, res, w, 1e-6)
  want(delta(c0, "fusion") == 1 and delta(c0, "fusion_plain") == 0, "fused: %d det, %d plain", delta(c0, "fusion"),
       delta(c0, "fusion_plain"))
  policy.set { fused = "unfused", group = world }
  world:fused_allreduce_rmsnorm(x, res, w, 1e-6)
  want(delta(c0, "rmsnorm") == 1 and delta(c0, "rmsnorm_plain") == 0, "unfused norm: %d det, %d plain",
       delta(c0, "rmsnorm"), delta(c0, "rmsnorm_plain"))
  want(delta(c0, "ar") == 2, "unfused all_reduce: %d det kernel calls", delta(c0, "ar"))
  policy.set { fused = "default", group = world }
  local one = weft.create_custom_group({ me }, "det_one_" .. me)    -- one rank: the norm kernel alone
  policy.set { deterministic = true, group = one }
  one:fused_allreduce_rmsnorm(x, res, w, 1e-6)
  want(delta(c0, "rmsnorm") == 2, "one-rank group: %d det norm calls", delta(c0, "rmsnorm"))
  one:destroy()
  local e = policy.explain(world, x, "fused_allreduce_rmsnorm")
  want(e:find("deterministic: on (policy.set{group=...})", 1, true), "explain: %s", e)
end)

check("refuses what it cannot make deterministic, before anything runs", function()
  local c0 = snap()
  local x = T.ones({ 16, 256 }, "bf16", DEV)
  S.expect_error("deterministic mode: .*size: 2 MiB > 1 MiB", world.all_reduce, world, T.ones({ 1048576 }, "bf16", DEV))
  S.expect_error("deterministic mode: device reduce_scatter of bf16 sum on group world has no deterministic path",
                 world.reduce_scatter, world, x, 0)
  S.expect_error("deterministic mode: device all_reduce of f64 sum", world.all_reduce, world, T.ones({ 8 }, "f64", DEV))
  S.expect_error("deterministic mode needs f32 accumulation", world.fused_allreduce_rmsnorm, world, x, x,
                 T.ones({ 256 }, "bf16", DEV), 1e-6, { fp32_acc = false })
  S.expect_error("deterministic mode does not cover FP8", world.fused_allreduce_rmsnorm, world, x, x,
                 T.ones({ 256 }, "bf16", DEV), 1e-6, { fp8 = true, scale = 1 })
  local c1 = snap()
  async.all_reduce(world, T.ones({ 64 }, "bf16", DEV)):wait()        -- the group's deterministic path
  want(delta(c1, "ar") == 1, "weft.async all_reduce: %d det kernel calls", delta(c1, "ar"))
  S.expect_error("deterministic mode: device reduce_scatter", function() async.reduce_scatter(world, x, 0):wait() end)
  S.expect_error("all_reduce=nccl %(policy.set{group=...}%) on group world", function()
    policy.set { all_reduce = "nccl", group = world }
    world:all_reduce(x)
  end)
  policy.set { all_reduce = "default", group = world }
  want(delta(c0, "ar") + delta(c0, "fusion") + delta(c0, "rmsnorm") == 1, "kernels ran for refused calls (only the async all_reduce may)")
end)

check("exact reductions and host tensors go on as usual", function()
  local i = T.ones({ 64 }, "i32", DEV)
  world:all_reduce(i)
  want(i:compare(T.full({ 64 }, W, "i32")) == 0, "i32 device sum")
  local m = T.full({ 64 }, me, "bf16", DEV)
  world:all_reduce(m, "max")
  want(m:compare(T.full({ 64 }, W - 1, "bf16")) == 0, "bf16 device max")
  local h = T.full({ 1000 }, 0.1, "f32")
  world:all_reduce(h)
  want(h:compare(T.full({ 1000 }, 0.1 + 0.1, "f32")) < 1e-7, "host sum")
end)

check("off again: the default routing", function()
  policy.set { deterministic = false, group = world }
  local c0 = snap()
  world:all_reduce(T.ones({ 4096 }, "bf16", DEV))
  want(delta(c0, "ar_plain") == 1 and delta(c0, "ar") == 0, "default all_reduce: %d plain, %d det",
       delta(c0, "ar_plain"), delta(c0, "ar"))
  local big = T.ones({ 1048576 }, "bf16", DEV)                      -- above the workspace: NCCL, as before
  world:all_reduce(big)
  want(big:compare(T.full({ 1048576 }, W, "bf16")) == 0, "large default all_reduce")
  want(db.choice(world, "all_reduce", big) == "nccl", "large default all_reduce took %s", tostring(db.choice(world, "all_reduce", big)))
  local x = T.ones({ 4, 64 }, "bf16", DEV)
  world:reduce_scatter(x, 0)
  world:fused_allreduce_rmsnorm(x, x, T.ones({ 64 }, "bf16", DEV), 1e-6)
  want(delta(c0, "fusion_plain") == 1 and delta(c0, "fusion") == 0, "default fused: %d plain", delta(c0, "fusion_plain"))
end)

weft.shutdown()
done()
