-- Ranks of tests/unit/quick_policy_spec.lua on a pretend GPU (WEFT_FAKE_DEVICE=1,
-- 2 ranks; the pretend kernel of the quick all-reduce is its CPU reference):
-- the opt-in switch's agreement (first device call, policy.set with the
-- group, a local change after agreeing), the routing by size from the
-- policy file's quick_min, explain, deterministic mode (every size; rows
-- that would straddle blocks refused before anything is enqueued),
-- weft.async and graph capture through the quick kernel. "PASS <name>" per check.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local fake = require("helpers.fake_device")
fake.install()
local R = require("helpers.gpu_worker")
local G, weft, T, policy, db, async, graph = R.G, R.weft, R.T, R.policy, R.db, R.async, R.graph
local Q = require("weft.quick")

local world = weft.init { timeout_ms = 20000 }
local me, W = world.rank, world.world_size
local DEV = "cuda:" .. require("weft.cuda").current_device()
local S = G.soft_checks()
local want = S.want
local check, done = G.checks(world, S, function()
  policy.set { deterministic = "default", quick = "default", all_reduce = "default" }
end)
local DC = fake.det_calls
local function quick_calls(c) return DC.quick[Q.CODECS[c]] or 0 end
-- calls of the exact kernels (the pretend GPU counts quick calls among all kernel calls too)
local function plain()
  local q = 0
  for _, n in pairs(DC.quick) do q = q + n end
  return DC.ar + DC.ar_plain - q
end

-- a policy file: int8 from 4 KiB, int4 from 64 KiB (bf16, this world)
local pf = os.tmpname()
do
  local f = assert(io.open(pf, "w"))
  f:write(("return { version = 1, quick_min = { [%d] = { bf16 = { int8 = 4096, int4 = 65536, fp8 = 4096 } } } }"):format(W))
  f:close()
end
policy.load_file(pf)

if os.getenv("WEFT_QUICK_ENV_ONLY") == "1" then   -- WEFT_QUICK_ALLREDUCE=int8 on every rank
  check("env", function()
    local v, src = policy.quick(world)
    want(v == "int8" and src == "WEFT_QUICK_ALLREDUCE", "setting %s (%s)", tostring(v), tostring(src))
    local q0 = quick_calls("int8")
    world:all_reduce(T.ones({ 8, 512 }, "bf16", DEV))
    want(world._dev.quick == "int8", "agreed %s", tostring(world._dev.quick))
    want(quick_calls("int8") == q0 + 1, "no quick call")
  end)
  os.remove(pf)
  weft.shutdown()
  done()
  return
end

check("mixed at the first device call: every rank raises, naming both sides", function()
  local gg = weft.create_custom_group({ 0, 1 }, "q_mixed")
  if me == 1 then policy.set { quick = "int8" } end                  -- local: rank 1 only
  local x = T.ones({ 64 }, "bf16", DEV)
  S.expect_error("group q_mixed: the quick all%-reduce setting differs across ranks: off on ranks 0, int8 on ranks 1",
                 gg.all_reduce, gg, x)
  want(gg._dev == nil, "the group kept a device state after the disagreement")
  policy.set { quick = "default" }
  gg:all_reduce(x)
  want(x:compare(T.full({ 64 }, 2, "bf16")) == 0, "all_reduce after agreeing")
  want(gg._dev.quick == "off", "agreed value %s", tostring(gg._dev.quick))
  gg:destroy()
end)

check("policy.set with the group agrees over its cpu group; a mixed set raises on every rank", function()
  local gg = weft.create_custom_group({ 0, 1 }, "q_set")
  gg:all_reduce(T.ones({ 8 }, "f32", DEV))
  policy.set { quick = "int4", group = gg }                          -- collective
  want(gg._dev.quick == "int4", "agreed value %s", tostring(gg._dev.quick))
  S.expect_error("policy.set: group q_set: the quick all%-reduce setting differs across ranks",
                 policy.set, { quick = me == 0 and "int8" or "fp8", group = gg })
  want(policy.quick(gg) == "int4", "a refused policy.set changed the setting to %s", tostring(policy.quick(gg)))
  S.expect_error("quick = int9 is not one of fp8, int4, int8, off", policy.set, { quick = "int9", group = gg })
  gg:destroy()
end)

check("a local change after agreeing raises at the next call, enqueuing nothing", function()
  local gg = weft.create_custom_group({ 0, 1 }, "q_late")
  local x = T.ones({ 4096 }, "bf16", DEV)
  gg:all_reduce(x)                                                   -- agreed: off
  policy.set { quick = "int8" }                                      -- local, no collective
  local c0, q0 = plain(), quick_calls("int8")
  S.expect_error("the quick all%-reduce is int8 on this rank %(policy.set%) but group q_late agreed on off",
                 gg.all_reduce, gg, x)
  want(plain() == c0 and quick_calls("int8") == q0, "a kernel ran after the error")
  policy.set { quick = "int8", group = gg }                          -- the collective way
  gg:all_reduce(x)
  want(quick_calls("int8") == q0 + 1, "no quick call after agreeing again")
  policy.set { quick = "default", group = gg }
  gg:destroy()
end)

check("routes by the policy file's minimum size; explain names codec, size and bound", function()
  policy.set { quick = "int8", group = world }
  local small = T.randn({ 2047 }, "bf16", "cpu", { seed = 5 + me }):clone(DEV)   -- 4094 bytes: below
  local big = T.randn({ 8, 512 }, "bf16", "cpu", { seed = 7 + me }):clone(DEV)   -- 8 KiB: quick
  local f32 = T.randn({ 4096 }, "f32", "cpu", { seed = 9 + me }):clone(DEV)      -- not for f32
  want(db.choice(world, "all_reduce", small) ~= "quick_int8", "small: %s", tostring(db.choice(world, "all_reduce", small)))
  want(db.choice(world, "all_reduce", big) == "quick_int8", "big: %s", tostring(db.choice(world, "all_reduce", big)))
  want(db.choice(world, "all_reduce", f32) ~= "quick_int8", "f32: %s", tostring(db.choice(world, "all_reduce", f32)))
  local ins = {}
  for r = 0, W - 1 do ins[r + 1] = T.randn({ 8, 512 }, "bf16", "cpu", { seed = 7 + r }) end
  local ref = Q.reference("int8", "bf16", ins)
  local q0, c0 = quick_calls("int8"), plain()
  world:all_reduce(small); world:all_reduce(big); world:all_reduce(f32)
  want(quick_calls("int8") == q0 + 1 and plain() == c0 + 2, "quick %d, exact %d", quick_calls("int8") - q0, plain() - c0)
  want(big:compare(ref) == 0, "the quick result is not the codec's reference")
  local e = policy.explain(world, big)
  want(e:find("weft quick all-reduce, codec int8", 1, true), "explain: %s", e)
  want(e:find("from 4 KiB", 1, true) and e:find("quick_min", 1, true), "explain names no size or source: %s", e)
  want(e:find("h = block max/127", 1, true), "explain names no bound: %s", e)
  local es = policy.explain(world, small)
  want(es:find("is below: the exact kernels", 1, true), "explain (small): %s", es)
  policy.set { quick = "int4", group = world }
  want(db.choice(world, "all_reduce", big) ~= "quick_int4", "int4 below its 64 KiB minimum")
  policy.set { quick = "off", group = world }
  want(policy.explain(world, big):find("quick all-reduce: off", 1, true), "explain when off")
  if me == 0 then print("INFO explain: " .. e:gsub("\n", " | ")) end
end)

check("an explicit all_reduce override wins over the quick setting", function()
  policy.set { quick = "int8", group = world }
  policy.set { all_reduce = "twoshot", group = world }
  local big = T.ones({ 8, 512 }, "bf16", DEV)
  want(db.choice(world, "all_reduce", big) == "twoshot", "choice %s", tostring(db.choice(world, "all_reduce", big)))
  want(policy.explain(world, big):find("not used %(override all_reduce=twoshot%)"), "explain")
  policy.set { all_reduce = "default", quick = "off", group = world }
end)

check("deterministic mode: the quick kernel at every size; rows that straddle blocks refused first", function()
  policy.set { deterministic = true, quick = "fp8", group = world }
  local q0, d0 = quick_calls("fp8"), DC.ar
  local one = T.randn({ 1, 256 }, "bf16", "cpu", { seed = 11 + me }):clone(DEV)   -- 512 bytes: below any minimum
  world:all_reduce(one)
  want(quick_calls("fp8") == q0 + 1 and DC.ar == d0 + 1, "quick %d, det %d", quick_calls("fp8") - q0, DC.ar - d0)
  local odd = T.ones({ 3, 100 }, "bf16", DEV)
  S.expect_error("rows of 100 elements are not a multiple of the codec's 32%-element block", world.all_reduce, world, odd)
  want(quick_calls("fp8") == q0 + 1 and DC.ar == d0 + 1, "a kernel ran for the refused call")
  local e = policy.explain(world, one)
  want(e:find("deterministic mode: every size", 1, true), "explain: %s", e)
  -- f32 under deterministic mode: the exact kernels as before
  world:all_reduce(T.ones({ 64 }, "f32", DEV))
  want(DC.ar == d0 + 2 and quick_calls("fp8") == q0 + 1, "f32 in deterministic mode")
  policy.set { deterministic = false, quick = "off", group = world }
end)

local function qf_calls(c) return DC.quick_fused[Q.CODECS[c]] or 0 end

check("fused_allreduce_rmsnorm: the quick two-shot under the same setting and size rule", function()
  policy.set { quick = "int8", group = world }
  local H, TK = 512, 7                                   -- 7 x 512 bf16 = 7 KiB >= int8's 4 KiB
  local ins = {}
  for r = 0, W - 1 do ins[r + 1] = T.randn({ TK, H }, "bf16", "cpu", { seed = 31 + r }) end
  local resh = T.randn({ TK, H }, "bf16", "cpu", { seed = 32 })
  local wh = T.randn({ H }, "bf16", "cpu", { seed = 33 })
  local x, res, w = ins[me + 1]:clone(DEV), resh:clone(DEV), wh:clone(DEV)
  want(db.choice(world, "fused_allreduce_rmsnorm", x) == "fused_quick_int8", "choice %s",
       tostring(db.choice(world, "fused_allreduce_rmsnorm", x)))
  local f0, q0 = qf_calls("int8"), quick_calls("int8")
  local n1, r1 = world:fused_allreduce_rmsnorm(x, res, w, 1e-6)
  want(qf_calls("int8") == f0 + 1 and quick_calls("int8") == q0, "fused quick %d, quick all-reduce %d",
       qf_calls("int8") - f0, quick_calls("int8") - q0)
  local _, rref = Q.fused_reference("int8", "bf16", ins, resh, wh, 1e-6)
  want(r1:compare(rref) == 0, "residual_out differs from weft_qr_fused_reference by %g", r1:compare(rref))
  local e = policy.explain(world, x, "fused_allreduce_rmsnorm")
  want(e:find("fused quick two-shot, codec int8", 1, true), "explain: %s", e)
  -- the unfused path takes the quick all-reduce for the same call: the same bits (rows of 512)
  policy.set { fused = "unfused", group = world }
  local n2, r2 = world:fused_allreduce_rmsnorm(x, res, w, 1e-6)
  want(quick_calls("int8") == q0 + 1 and qf_calls("int8") == f0 + 1, "unfused: quick %d, fused %d",
       quick_calls("int8") - q0, qf_calls("int8") - f0)
  want(r2:compare(r1) == 0 and n2:compare(n1) == 0, "unfused and fused differ")
  policy.set { fused = "default", group = world }
  -- below the codec's minimum (1 x 512 bf16 = 1 KiB < 4 KiB): exact, both paths
  local small = T.randn({ 1, H }, "bf16", "cpu", { seed = 34 + me }):clone(DEV)
  local sres = T.randn({ 1, H }, "bf16", "cpu", { seed = 35 }):clone(DEV)
  world:fused_allreduce_rmsnorm(small, sres, w, 1e-6)
  want(qf_calls("int8") == f0 + 1, "a call below the minimum took the quick two-shot")
  want(db.choice(world, "fused_allreduce_rmsnorm", small) ~= "fused_quick_int8", "choice below the minimum")
  -- an explicit one-shot and the FP8 output pattern keep the exact kernels
  world:fused_allreduce_rmsnorm(x, res, w, 1e-6, { algo = "oneshot" })
  world:fused_allreduce_rmsnorm(x, res, w, 1e-6, { quant_out = T.empty({ TK, H }, "f8e4m3", DEV), scale = 1.0 })
  want(qf_calls("int8") == f0 + 1, "one-shot or FP8 took the quick two-shot")
  -- off: exact again
  policy.set { quick = "off", group = world }
  world:fused_allreduce_rmsnorm(x, res, w, 1e-6)
  want(qf_calls("int8") == f0 + 1, "quick off took the quick two-shot")
end)

check("fused_allreduce_rmsnorm, deterministic mode: quick at every size; rows that straddle blocks refused", function()
  policy.set { deterministic = true, quick = "int4", group = world }
  local w = T.ones({ 512 }, "bf16", DEV)
  local f0 = qf_calls("int4")
  local x = T.randn({ 1, 512 }, "bf16", "cpu", { seed = 41 + me }):clone(DEV)   -- 1 KiB: below int4's 64 KiB
  world:fused_allreduce_rmsnorm(x, T.zeros({ 1, 512 }, "bf16", DEV), w, 1e-6)
  want(qf_calls("int4") == f0 + 1, "deterministic mode: the small call took %d quick two-shots", qf_calls("int4") - f0)
  local odd = T.ones({ 3, 104 }, "bf16", DEV)
  S.expect_error("rows of 104 elements are not a multiple of the codec's 32%-element block", world.fused_allreduce_rmsnorm,
                 world, odd, T.ones({ 3, 104 }, "bf16", DEV), T.ones({ 104 }, "bf16", DEV), 1e-6)
  want(qf_calls("int4") == f0 + 1, "a kernel ran for the refused call")
  policy.set { deterministic = false, quick = "off", group = world }
end)

check("weft.async and graph capture take the quick kernel", function()
  policy.set { quick = "int8", group = world }
  local x = T.randn({ 8, 512 }, "bf16", "cpu", { seed = 21 + me }):clone(DEV)
  local ins = {}
  for r = 0, W - 1 do ins[r + 1] = T.randn({ 8, 512 }, "bf16", "cpu", { seed = 21 + r }) end
  local ref = Q.reference("int8", "bf16", ins)
  local q0 = quick_calls("int8")
  async.all_reduce(world, x):wait()
  want(quick_calls("int8") == q0 + 1, "weft.async: %d quick calls", quick_calls("int8") - q0)
  want(x:compare(ref) == 0, "weft.async result")
  local y = T.zeros({ 8, 512 }, "bf16", DEV)
  local gr = graph.capture(function() world:all_reduce(y) end, { warmup = 0, groups = { world } })
  local q1 = quick_calls("int8")
  y:copy_(ins[me + 1])
  gr:replay()
  want(y:compare(ref) == 0, "graph replay result")
  want(quick_calls("int8") >= q1, "graph")
  gr:destroy()
  policy.set { quick = "off", group = world }
end)

os.remove(pf)
policy.clear_file()
weft.shutdown()
done()
