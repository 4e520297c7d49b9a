-- The quick all-reduce's policy on the CPU (docs/quick-allreduce.md): the
-- opt-in switch (policy.set{quick}, WEFT_QUICK_ALLREDUCE), its validation,
-- the policy file's quick_min section, the routing and explain on a
-- device-state stand-in, and on 2 real ranks over a pretend GPU
-- (tests/helpers/quick_ranks.lua): agreement, refusals, deterministic mode,
-- weft.async and graphs; then the GPU worker rehearsed on the pretend GPU.
-- The kernel itself needs the GPU: tests/gpu/gpu_quick_spec.lua.
local weft = require("weft")
local spec = require("helpers.spec_util")
local policy = require("weft.policy")
local db = require("weft.backends.device_backends")
local pf = require("weft.internal.policy_file")
local _ = weft

local ROOT = os.getenv("PWD") or "."
local MIB = 1048576
local dev = spec.dev_standin

local fake_ar = spec.fake_ar { run = function() end }
local function group(o) return spec.group_standin(o, fake_ar) end
local sel = spec.select_backend   -- spec.last: the choice handed with the backend

local reset = spec.reset_policy

describe("quick all-reduce: the switch", function()
  before_each(reset)
  teardown(reset)

  it("is off by default, set per process or per group, validated", function()
    local g = group()
    assert.are.equal("off", (policy.quick(g)))
    policy.set { quick = "int8" }
    local v, src = policy.quick(g)
    assert.are.equal("int8", v); assert.are.equal("policy.set", src)
    policy.set { quick = "int4", group = "tp.0" }
    assert.are.equal("int4", (policy.quick(g)))
    assert.are.equal("int8", (policy.quick(group { name = "tp.1" })))
    policy.set { quick = "default", group = "tp.0" }
    assert.are.equal("int8", (policy.quick(g)))
    policy.set { quick = "default" }
    assert.are.equal("off", (policy.quick(g)))
    local ok, err = pcall(policy.set, { quick = "int6" })
    assert.is_false(ok)
    assert.matches("quick = int6 is not one of fp8, int4, int8, off", err)
  end)

  it("weft.quick is there after require \"weft\" (docs/quick-allreduce.md: weft.quick.reference)", function()
    local out = spec.luajit("local w = require('weft') print(type(w.quick), type(w.quick.reference), type(w.settings))")
    assert.matches("^table\tfunction\ttable", out)
  end)

  it("reads WEFT_QUICK_ALLREDUCE at load, and names a bad value", function()
    local function with(v)
      return spec.luajit("local p = require('weft.policy') local v, s = p.quick(nil) print(v, s, p.quick_env_error)",
                         "WEFT_QUICK_ALLREDUCE=" .. v)
    end
    assert.matches("^fp8\tWEFT_QUICK_ALLREDUCE\tnil", with("fp8"))
    assert.matches("^off\tWEFT_QUICK_ALLREDUCE\tnil", with("off"))
    assert.matches("^off\tdefault\tWEFT_QUICK_ALLREDUCE=\"INT8\" is not one of", with("INT8"))
  end)

  it("the policy file's quick_min section is validated, naming the entry", function()
    local t = pf.parse("return { version = 1, quick_min = { [2] = { bf16 = { int8 = 4096 } }, ['*'] = { ['*'] = { fp8 = 0 } } } }")
    assert.are.equal(4096, t.quick_min[2].bf16.int8)
    local function bad(text, pattern)
      local ok, err = pcall(pf.parse, text, "p.lua")
      assert.is_false(ok)
      assert.matches(pattern, err)
    end
    bad("return { version = 1, quick_min = { [2] = { bf16 = { int6 = 1 } } } }", "quick_min%[2%]%.bf16%.int6: unknown codec")
    bad("return { version = 1, quick_min = { [2] = { f32 = { int8 = 1 } } } }", "quick_min%[2%]%.f32: unknown dtype")
    bad("return { version = 1, quick_min = { [2] = { bf16 = { int8 = -1 } } } }", "int8: must be an integer byte count")
    bad("return { version = 1, quick_min = { [1] = { bf16 = { int8 = 1 } } } }", "world size must be")
  end)
end)

describe("quick all-reduce: routing on a device-state stand-in", function()
  setup(function() db._set_cuda_available(true) end)
  teardown(function() db._set_cuda_available(nil); reset() end)
  before_each(reset)

  it("off: nothing changes; on: bf16/f16 from the seed's minimum, f32 never", function()
    local g = group()
    local x16 = dev({ 8 * MIB })            -- bf16 16 MiB: above the seed's 8 MiB (int8, 2 ranks)
    assert.are.equal("custom_ar", sel(g, x16))
    assert.is_true((spec.last.pick or 0) < 4)
    policy.set { quick = "int8" }
    assert.are.equal("custom_ar", sel(g, x16))
    assert.are.equal(5, spec.last.pick)        -- WEFT_AR_QUICK_INT8
    assert.are.equal("quick_int8", (db.choice(g, "all_reduce", x16)))
    sel(g, dev({ 2 * MIB }))                -- 4 MiB: below 8 MiB
    assert.is_true(spec.last.pick < 4)
    sel(g, dev({ 4 * MIB }, "f32"))
    assert.is_true(spec.last.pick < 4)
    policy.set { quick = "int4" }
    sel(g, dev({ 4 * MIB }, "f16"))         -- f16, 2 ranks: int4 from 1 MiB
    assert.are.equal(6, spec.last.pick)
    local e = policy.explain(g, dev({ 4 * MIB }, "f16"))
    assert.matches("weft quick all%-reduce, codec int4 %(policy.set%), from 1 MiB %(the seed's table", e)
    assert.matches("h = block max/7", e)
    assert.matches("quick all%-reduce: int4 %(policy.set%)", e)
  end)

  it("deterministic mode: every size, and rows straddling blocks are an error", function()
    policy.set { quick = "fp8", deterministic = true }
    local g = group()
    sel(g, dev({ 1, 64 }))
    assert.are.equal(7, spec.last.pick); assert.is_true(spec.last.det); assert.is_nil(spec.last.err)
    sel(g, dev({ 4, 48 }))
    assert.matches("rows of 48 elements are not a multiple of the codec's 32%-element block", tostring(spec.last.err))
  end)
end)

describe("quick all-reduce on 2 ranks over a pretend GPU", function()
  local ranks = require("helpers.rank_passes")
  local function run(script, n, env) return ranks.run(ROOT, script, n, "WEFT_FAKE_DEVICE=1 " .. (env or ""), 400) end
  local function passes(out, n, count) ranks.assert_passed(assert, out, n, count, true) end

  it("agrees, routes, explains, refuses; async and graphs take the quick kernel", function()
    passes(run("tests/helpers/quick_ranks.lua", 2), 2, 9)
  end)

  it("WEFT_QUICK_ALLREDUCE on every rank is the group's setting", function()
    local out = run("tests/helpers/quick_ranks.lua", 2, "WEFT_QUICK_ALLREDUCE=int8 WEFT_QUICK_ENV_ONLY=1")
    assert.matches("%[rank0%] PASS env", out)
    assert.matches("%[rank1%] PASS env", out)
  end)

  it("rehearses the GPU worker at worlds 2 and 4", function()
    passes(run("tests/helpers/gpu_quick_worker.lua", 2), 2, 7)
    passes(run("tests/helpers/gpu_quick_worker.lua", 4,
               "WEFT_ALLOW_SHARED_GPU=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"), 4, 7)
  end)
end)
