-- Deterministic mode (docs/policy.md §10) on the CPU: the switch
-- (policy.set{deterministic}, WEFT_DETERMINISTIC), the routing (every float
-- device sum to weft's kernels with their bit-identical variant, errors
-- instead of NCCL, refusals), explain, the agreement across ranks (at the
-- group's first device call and through policy.set with the group, on 2
-- real ranks over a pretend GPU: tests/helpers/determ_ranks.lua), and the
-- GPU worker itself rehearsed on the pretend GPU
-- (tests/helpers/gpu_determ_worker.lua, WEFT_FAKE_DEVICE=1). The bits
-- themselves need the GPU: tests/gpu/gpu_determ_spec.lua.
local weft = require("weft")
local spec = require("helpers.spec_util")
local policy = require("weft.policy")
local db = require("weft.backends.device_backends")
local T = weft.tensor

local ROOT = os.getenv("PWD") or "."
local MIB = 1048576

local dev = spec.dev_standin

local runs = {}
local fake_ar = spec.fake_ar { run = function(_, _, _, _, _, algo) runs[#runs + 1] = algo end }

local function group(o) return spec.group_standin(o, fake_ar) end

local sel = spec.select_backend   -- spec.last: the choice handed with the backend

local function reset()
  spec.reset_policy()
  runs = {}
end

describe("deterministic mode: the switch", function()
  before_each(reset)
  teardown(reset)

  it("is off by default, set per process or per group, validated", function()
    local g = group()
    assert.is_false((policy.deterministic(g)))
    policy.set { deterministic = true }
    local on, src = policy.deterministic(g)
    assert.is_true(on); assert.are.equal("policy.set", src)
    policy.set { deterministic = false, group = "tp.0" }          -- a name: local, no collective
    assert.is_false((policy.deterministic(g)))
    assert.is_true((policy.deterministic(group { name = "tp.1" })))
    policy.set { deterministic = "default", group = "tp.0" }
    assert.is_true((policy.deterministic(g)))
    policy.set { deterministic = "default" }
    assert.is_false((policy.deterministic(g)))
    local ok, err = pcall(policy.set, { deterministic = "yes" })
    assert.is_false(ok)
    assert.matches("deterministic = yes is not true, false or \"default\"", err)
    assert.is_false((policy.deterministic(g)))
    ok, err = pcall(policy.set, { determinstic = true })
    assert.is_false(ok)
    assert.matches("unknown key \"determinstic\"", err)
  end)

  it("reads WEFT_DETERMINISTIC at load, and names a bad value", function()
    local function with(v)
      return spec.luajit("local p = require('weft.policy') print(p.deterministic(nil), p.determ_env_error)",
                         "WEFT_DETERMINISTIC=" .. v)
    end
    assert.matches("^true\tnil", with("1"))
    assert.matches("^false\tnil", with("0"))
    assert.matches("^false\tWEFT_DETERMINISTIC=\"2\" is not 1 or 0", with("2"))
  end)
end)

describe("deterministic mode: routing on a device-state stand-in", function()
  setup(function() db._set_cuda_available(true) end)
  teardown(function() db._set_cuda_available(nil); reset() end)
  before_each(reset)

  it("leaves the default policy as it was", function()
    local g = group()
    assert.are.equal("custom_ar", sel(g, dev({ 8, 4096 })))
    assert.is_false(spec.last.det)
    assert.are.equal("nccl", sel(g, dev({ 64 * MIB })))               -- 128 MiB: above the workspace
    assert.are.equal("nccl", sel(g, dev({ 8, 4096 }), "reduce_scatter"))
    assert.are.equal("nccl", sel(g, dev({ 8, 64 }, "f64")))
    assert.is_nil(policy.explain(g, dev({ 8, 4096 })):find("deterministic", 1, true))
  end)

  it("sends every f32/f16/bf16 device sum to weft's kernels, and what they cannot take raises", function()
    policy.set { deterministic = true }
    local x = dev({ 8, 4096 })
    local g = group()
    assert.are.equal("custom_ar", sel(g, x))
    assert.is_true(spec.last.det); assert.is_nil(spec.last.err)
    local function refused(gg, t, pattern)
      assert.are.equal("custom_ar", sel(gg, t))
      assert.matches(pattern, tostring(spec.last.err))
      assert.matches("^deterministic mode: .*NCCL never sums in this mode", spec.last.err)
    end
    refused(group(), dev({ 64 * MIB }), "cannot take weft's kernels: size: 128 MiB > 64 MiB")
    refused(group { world = 3 }, x, "world size: 3 ranks")
    refused(group { same_node = false }, x, "one node")
    local s = group(); s._dev.shared = "ranks 0 and 1 share cuda:0 on h"
    refused(s, x, "one GPU per rank: ranks 0 and 1 share")
    local f = group(); f._dev.ar_state, f._dev.ar, f._dev.ar_why = "failed", nil, "cuMemCreate failed"
    refused(f, x, "peer access %(workspace%): cuMemCreate failed")
    local flat = dev({ 4097 })
    refused(group(), flat:narrow(0, 1, 4096), "16%-byte aligned")
    -- the seed's per-kind table does not apply: NCCL is no option here
    local pp = group { name = "pp.0" }
    assert.are.equal("custom_ar", sel(pp, x)); assert.is_nil(spec.last.err)
    -- an nccl override conflicts; the kernel overrides are all the same bits
    policy.set { all_reduce = "nccl" }
    refused(group(), x, "all_reduce=nccl")
    policy.set { all_reduce = "twoshot" }
    assert.are.equal("custom_ar", sel(g, x)); assert.is_nil(spec.last.err)
    policy.set { all_reduce = "default" }
    -- exact in any order: as usual
    assert.are.equal("nccl", sel(g, x, nil, "max"))
    assert.are.equal("nccl", sel(g, dev({ 8, 64 }, "i32")))
    assert.are.equal("nccl", sel(g, x, "all_gather"))
    -- float sums the kernels do not serve: refused, never NCCL
    assert.are.equal("determ_refused", sel(g, dev({ 8, 64 }, "f64")))
    assert.are.equal("determ_refused", sel(g, x, nil, "prod"))
    assert.are.equal("determ_refused", sel(g, x, "reduce_scatter"))
    assert.are.equal("nccl", sel(g, dev({ 8, 64 }, "i32"), "reduce_scatter"))
    -- host tensors: every host backend reduces in rank order already
    assert.are.equal("shm", sel(g, T.zeros({ 8 }, "bf16")))
    assert.are.equal("fused", sel(g, x, "fused_allreduce_rmsnorm"))
  end)

  it("takes the store path, not Gloo's ring, for host float sums across nodes", function()
    local saved = package.loaded["weft.backends.host_nodes"]
    package.loaded["weft.backends.host_nodes"] = { built = true }
    local g, h = group { same_node = false }, T.zeros({ 1048576 }, "f32")   -- above the small-call store route
    local ok, err = pcall(function()
      assert.are.equal("gloo", sel(g, h))
      policy.set { deterministic = true }
      assert.are.equal("store", sel(g, h))
      assert.are.equal("store", sel(g, h, "reduce_scatter"))
      assert.are.equal("gloo", sel(g, h, nil, "max"))                  -- exact in any order
      assert.are.equal("gloo", sel(g, T.zeros({ 1048576 }, "i32")))
      assert.are.equal("gloo", sel(g, h, "all_gather"))
      assert.matches("Gloo's ring is not in rank order", policy.explain(g, h))
    end)
    package.loaded["weft.backends.host_nodes"] = saved
    if not ok then error(err, 0) end
  end)

  it("ignores a policy file's nccl entries in the mode", function()
    local path = os.tmpname()
    local fh = io.open(path, "w")
    fh:write([[return { version = 1, all_reduce = { ["*"] = { ["*"] = { { backend = "nccl" } } } } }]])
    fh:close()
    policy.load_file(path)
    local g, x = group(), dev({ 8, 4096 })
    assert.are.equal("nccl", sel(g, x))
    policy.set { deterministic = true }
    assert.are.equal("custom_ar", sel(g, x)); assert.is_nil(spec.last.err)
    os.remove(path)
  end)

  it("passes the deterministic bit to the kernels and never falls back to NCCL", function()
    policy.set { deterministic = true }
    local g, x = group(), dev({ 8, 4096 })
    assert.are.equal("custom_ar", sel(g, x))
    db.custom_ar_backend.all_reduce(g, "all_reduce", x, x.ptr, "sum", 0, spec.last)
    assert.are.equal(512 + 1, runs[1])         -- auto, resolved by the rule (one-shot) | WEFT_AR_DETERMINISTIC
    policy.set { all_reduce = "twoshot" }
    sel(g, x)
    db.custom_ar_backend.all_reduce(g, "all_reduce", x, x.ptr, "sum", 0, spec.last)
    assert.are.equal(512 + 2, runs[2])
    -- an unaligned output: the rule refuses it (its output check), the backend raises the refusal
    local out = dev({ 4097 }):narrow(0, 1, 4096)
    local x1 = x:view({ 8 * 4096 }):narrow(0, 0, 4096)
    assert.are.equal("custom_ar", sel(g, x1, "all_reduce", "sum", out.ptr))
    local ok, err = pcall(db.custom_ar_backend.all_reduce, g, "all_reduce", x1, out.ptr, "sum", 0, spec.last)
    assert.is_false(ok)
    assert.matches("deterministic mode: group tp.0 cannot take weft's kernels for this call: output not 16%-byte aligned", err)
    assert.are.equal(2, #runs)
    policy.set { deterministic = false, all_reduce = "default" }
    sel(g, x)
    db.custom_ar_backend.all_reduce(g, "all_reduce", x, x.ptr, "sum", 0, spec.last)
    assert.are.equal(1, runs[3])                                       -- auto: the one-shot, chosen by the rule
  end)

  it("explains the mode, the rule and the skipped check", function()
    policy.set { deterministic = true }
    local e = policy.explain(group(), dev({ 8, 4096 }))
    assert.matches("deterministic: on %(policy.set%)", e)
    assert.matches("= deterministic mode: weft's kernels at every size", e)
    assert.matches("%- enabled on the group: skipped %(deterministic mode%)", e)
    assert.matches("deterministic %(bit%-identical kernels%)", e)
    e = policy.explain(group(), dev({ 8, 4096 }), "reduce_scatter")
    assert.matches("deterministic mode: yes %-> determ_refused", e)
  end)

  it("raises at the next call when a rank changed the mode after its group agreed", function()
    local g = group { determ = false }                                  -- agreed: off
    policy.set { deterministic = true }                                -- local, later
    assert.are.equal("custom_ar", sel(g, dev({ 8, 4096 })))
    assert.matches("deterministic mode is on on this rank %(policy.set%) but group tp.0 agreed on off", spec.last.err)
    assert.matches("policy.set{deterministic = true, group = g} on every rank", spec.last.err)
    assert.are.equal("determ_refused", sel(g, dev({ 8, 4096 }), "reduce_scatter"))
    assert.matches("x deterministic mode: deterministic mode is on", policy.explain(g, dev({ 8, 4096 })))
    local y = dev({ 8 })
    sel(g, y)                                                          -- the rule's choice: the error
    local ok, err = pcall(db.custom_ar_backend.all_reduce, g, "all_reduce", y, nil, "sum", 0, spec.last)
    assert.is_false(ok); assert.matches("agreed on off", err)
    assert.are.equal(0, #runs)                                         -- nothing launched
  end)
end)

describe("deterministic mode on 2 ranks over a pretend GPU", function()
  local ranks = require("helpers.rank_passes")
  local function run(script, n, env) return ranks.run(ROOT, script, n, "WEFT_FAKE_DEVICE=1 " .. (env or ""), 400) end
  local function passes(out, n, count) ranks.assert_passed(assert, out, n, count, true) end

  it("agrees at the first device call and through policy.set, refuses and routes", function()
    local t0 = os.time()
    local out = run("tests/helpers/determ_ranks.lua", 2, "WEFT_CUSTOM_AR_MAX_BYTES=1048576")
    passes(out, 2, 7)
    assert.is_true(os.time() - t0 < 200, "took " .. (os.time() - t0) .. " s")
  end)

  it("rehearses the GPU worker at world 2", function()
    passes(run("tests/helpers/gpu_determ_worker.lua", 2, "WEFT_DETERM_ROWS=1024"), 2, 12)
  end)

  it("rehearses the GPU worker at world 4 (ranks sharing pretend GPUs)", function()
    passes(run("tests/helpers/gpu_determ_worker.lua", 4,
               "WEFT_DETERM_ROWS=1024 WEFT_ALLOW_SHARED_GPU=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"), 4, 12)
  end)
end)
