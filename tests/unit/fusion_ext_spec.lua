-- The fusion patterns beyond all-reduce + RMSNorm (weft.fusion_ext,
-- src/coll/fusion_ext.c, src/host/moe_host.c) on the CPU: the local MoE
-- reduction against a Lua reference, the C API's sizes and refusals, and
-- every GroupCoordinator method against an f64 reference on 1-4 ranks with
-- host tensors and on 2 and 4 ranks over a pretend GPU
-- (tests/helpers/fusion_ext_ranks.lua; the GPU itself:
-- tests/gpu/gpu_fusion_ext_spec.lua).
local ffi = require("ffi")
local weft = require("weft")
local wffi = require("weft.internal.ffi")
local spec = require("helpers.spec_util")
local C = wffi.C
local T = weft.tensor

local ROOT = os.getenv("PWD") or "."

describe("weft_host_moe_reduce", function()
  -- exact data: small integers and halves, so every fma is exact
  local function vals(n, seed)
    local v, s = {}, seed
    for i = 1, n do s = (s * 1103515245 + 12345) % 2147483648; v[i] = (s % 9 - 4) / 2 end
    return v
  end

  it("MoE layout: shared + sum_k scales[k][t] * input[k][t], rounded once", function()
    local K, Tn, H = 3, 4, 8
    local xin, sc, sh = vals(K * Tn * H, 1), vals(K * Tn, 2), vals(Tn * H, 3)
    local x = T.from_table(xin, "bf16", { K, Tn, H })
    local s = T.from_table(sc, "f32", { K, Tn })
    local shared = T.from_table(sh, "bf16", { Tn, H })
    local out = T.empty({ Tn, H }, "bf16")
    assert.are.equal(0, C.weft_host_moe_reduce(x.ptr, s.ptr, 0, nil, K * Tn, shared.ptr, out.ptr, Tn, H, K, 2))
    local got = out:to_table()
    for t = 0, Tn - 1 do
      for j = 0, H - 1 do
        local acc = sh[t * H + j + 1]
        for k = 0, K - 1 do acc = acc + sc[k * Tn + t + 1] * xin[(k * Tn + t) * H + j + 1] end
        assert.are.equal(acc, got[t * H + j + 1], ("t %d j %d"):format(t, j))
      end
    end
  end)

  it("finalize layout: rows through the permutation, scales [t][k] in the input dtype", function()
    local K, Tn, H, rows = 2, 3, 8, 7
    local xin, sc = vals(rows * H, 4), vals(Tn * K, 5)
    local perm = { 6, 0, 3, 5, 1, 2 }
    local x = T.from_table(xin, "f16", { rows, H })
    local s = T.from_table(sc, "f16", { Tn, K })
    local p = T.from_table(perm, "i32", { Tn, K })
    local out = T.empty({ Tn, H }, "f16")
    assert.are.equal(0, C.weft_host_moe_reduce(x.ptr, s.ptr, 1, ffi.cast("const int32_t *", p.ptr), rows, nil,
                                               out.ptr, Tn, H, K, 1))
    local got = out:to_table()
    for t = 0, Tn - 1 do
      for j = 0, H - 1 do
        local acc = 0
        for k = 0, K - 1 do acc = acc + sc[t * K + k + 1] * xin[perm[t * K + k + 1] * H + j + 1] end
        assert.are.equal(acc, got[t * H + j + 1])
      end
    end
  end)

  it("refuses a permutation entry out of range before writing anything", function()
    local x = T.zeros({ 4, 8 }, "bf16")
    local s = T.ones({ 2, 2 }, "f32")
    local p = T.from_table({ 0, 1, 2, 4 }, "i32", { 2, 2 })
    local out = T.full({ 2, 8 }, 7, "bf16")
    assert.are.equal(C.WEFT_EINVAL, C.weft_host_moe_reduce(x.ptr, s.ptr, 0, ffi.cast("const int32_t *", p.ptr), 4,
                                                           nil, out.ptr, 2, 8, 2, 2))
    assert.matches("permutation entry %[1%]%[1%] = 4 outside %[0, 4%)", wffi.last_error())
    for _, v in ipairs(out:to_table()) do assert.are.equal(7, v) end
    assert.are.equal(C.WEFT_EINVAL, C.weft_host_moe_reduce(x.ptr, s.ptr, 0, nil, 4, nil, out.ptr, 2, 8, 17, 2))
    assert.matches("top_k 17", wffi.last_error())
    assert.are.equal(C.WEFT_EINVAL, C.weft_host_moe_reduce(x.ptr, s.ptr, 1, nil, 4, nil, out.ptr, 2, 8, 2, 2))
    assert.matches("scales dtype", wffi.last_error())
  end)
end)

describe("weft fusion_ext C API", function()
  local function opts(max_tokens, hidden, dtype)
    local o = ffi.new("weft_fusion_opts")
    o.max_tokens, o.hidden, o.dtype = max_tokens, hidden, dtype or C.WEFT_BF16
    return o
  end

  it("declares the patterns and flags", function()
    assert.are.equal(1, C.WEFT_FX_MOE_AR_RMSNORM)
    assert.are.equal(4, C.WEFT_FX_RS_RMSNORM)
    assert.are.equal(32, C.WEFT_FX_SCALES_DTYPE)
    assert.are.equal(0, C.weft_fusion_ext_destroy(nil))
  end)

  it("sizes a workspace: flags, one-shot inbox and two-shot inboxes, both parities", function()
    local b = ffi.new("size_t[1]")
    assert.are.equal(0, C.weft_fusion_ext_workspace_bytes(opts(2048, 4096), 2, b))
    local row = 4096 * 2
    local inboxes = 2 * 2 * 2048 * row + 2 * (2 * 2 * 1024 * row)
    local n = tonumber(b[0])
    assert.is_true(n >= inboxes and n < inboxes + 1048576, tostring(n))
  end)

  it("refuses f32 workspaces, bad sizes, a group of one", function()
    local b = ffi.new("size_t[1]")
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_ext_workspace_bytes(opts(128, 4096, C.WEFT_F32), 2, b))
    assert.matches("dtype f32 .* not supported %(bf16, f16%)", wffi.last_error())
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_ext_workspace_bytes(opts(128, 4092), 2, b))
    assert.matches("hidden 4092 must be a multiple of 8", wffi.last_error())
    local s, g = require("helpers.store_util").one_rank_group("fusion_ext_w1")
    local out = ffi.new("weft_fusion_ext *[1]")
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_ext_create(g.handle, opts(128, 4096), out))
    assert.matches("fusion_ext_w1", wffi.last_error())
    assert.is_true(out[0] == nil)
    g:destroy(); s:close()
  end)
end)

describe("every pattern against f64", function()
  local ranks = require("helpers.rank_passes")
  local function run(n, env)
    return ranks.run(ROOT, "tests/helpers/fusion_ext_ranks.lua", n, env, 300)
  end
  local function passes(out, n, count)
    ranks.assert_passed(assert, out, n, count)
  end
  -- 4 patterns x 2 dtypes, the refusals, and host FP8 (host) or graph/explain/deterministic (device)
  for _, n in ipairs { 1, 2, 3, 4 } do
    it(("host tensors, %d rank%s"):format(n, n > 1 and "s" or ""), function()
      passes(run(n, "FX_TOKENS=1,7,33"), n, 10)
    end)
  end
  it("a pretend GPU, 1 rank: the MoE end in one kernel (weft_cuda_moe_reduce with the norm)", function()
    passes(run(1, "WEFT_FAKE_DEVICE=1 FX_DEVICE=1 FX_TOKENS=1,7"), 1, 9)
  end)
  it("a pretend GPU, 2 ranks: fused (one-shot, two-shot), unfused, the one-rank kernel, graph, explain, deterministic", function()
    passes(run(2, "WEFT_FAKE_DEVICE=1 FX_DEVICE=1 FX_TOKENS=1,7"), 2, 14)
  end)
  it("a pretend GPU, 4 ranks sharing it", function()
    passes(run(4, "WEFT_FAKE_DEVICE=1 FX_DEVICE=1 FX_TOKENS=1,5 WEFT_ALLOW_SHARED_GPU=1 "
                  .. "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"), 4, 14)
  end)
  -- a peer that never arrives at the fused calls (the rehearsal of
  -- tests/gpu/gpu_fusion_ext_spec.lua's fault runs): every other rank fails
  -- within the timeout naming the group, the method and the late rank
  local FAULT_ENV = "WEFT_FAKE_DEVICE=1 FX_DEVICE=1 WEFT_ALLOW_SHARED_GPU=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 "
  local function survivors_named(out, n, victim)
    for r = 0, n - 1 do
      if r ~= victim then
        assert.is_truthy(out:find("[rank" .. r .. "] PASS killed", 1, true), ("rank %d:\n%s"):format(r, out))
      end
    end
    assert.is_nil(out:match("FAIL [^\n]*"), out)
  end
  it("a pretend GPU, 4 ranks: a rank that leaves during fused_moe_allreduce_rmsnorm", function()
    local t0 = os.time()
    local out = run(4, FAULT_ENV .. "WEFT_TIMEOUT_MS=5000 FX_KILL=2 FX_KILL_OP=moe")
    assert.is_truthy(out:find("[rank2] LEAVING", 1, true), out)
    survivors_named(out, 4, 2)
    assert.is_true(os.time() - t0 < 60, "took " .. (os.time() - t0) .. " s")
  end)
  it("a pretend GPU, 4 ranks: a rank that stalls past the timeout during fused_reduce_scatter_rmsnorm", function()
    local out = run(4, FAULT_ENV .. "WEFT_TIMEOUT_MS=5000 FX_KILL=1 FX_KILL_OP=rs FX_KILL_HOW=stall")
    assert.is_truthy(out:find("[rank1] STALLING", 1, true), out)
    survivors_named(out, 4, 1)
    assert.is_truthy(out:find("[rank1] PASS stalled", 1, true), out)
  end)
end)

describe("weft.fusion_ext decision (the policy rule's checks)", function()
  local fx = require("weft.fusion_ext")
  local policy = require("weft.policy")
  local function tensor(dtype, contiguous)
    return { dtype = dtype or "bf16", shape = { 8, 4096 }, device = "cuda:0",
             is_contiguous = function() return contiguous ~= false end }
  end
  local function call(o)
    o = o or {}
    local t = tensor(o.dtype, o.contiguous)
    return { pattern = o.pattern or "moe", dtype = t.dtype, tokens = o.tokens or 8, hidden = o.hidden or 4096,
             x = t, residual = t, weight = t, max_tokens = o.max_tokens, algo = o.algo }
  end
  local function group(o)
    o = o or {}
    return { world_size = o.world or 2, same_node = o.same_node ~= false, unique_name = o.name or "fx_tp" }
  end
  after_each(function() policy.set { fused = "default", deterministic = "default" } end)

  it("fuses bf16/f16 on one node, names the algorithm and why", function()
    local path, why, algo = fx.decision(group(), call())
    assert.are.equal("fused", path)
    assert.are.equal("auto", algo)
    assert.matches("fused kernel, auto", why)
    assert.are.equal("twoshot", select(3, fx.decision(group(), call { pattern = "rs" })))
    assert.are.equal("oneshot", select(3, fx.decision(group(), call { algo = "oneshot" })))
  end)

  it("sends every other case to the unfused path, with the failed check", function()
    local cases = {
      { group { world = 1 }, call(), "more than one rank" },
      { group { same_node = false }, call(), "one node" },
      { group { world = 9 }, call(), "world size <= 8" },
      { group(), call { dtype = "f32" }, "dtype bf16 or f16: f32" },
      { group(), call { hidden = 32768 }, "hidden a multiple of 8" },
      { group(), call { contiguous = false }, "contiguous" },
      { group(), call { tokens = 4096 }, "tokens within the workspace: 4096 tokens > the workspace's 2048" },
    }
    for _, c in ipairs(cases) do
      local path, why = fx.decision(c[1], c[2])
      assert.are.equal("unfused", path, c[3])
      assert.matches(c[3]:gsub("%p", "%%%0"), why)
    end
    policy.set { fused = "unfused" }
    assert.matches("override fused=unfused", select(2, fx.decision(group(), call())))
    policy.set { fused = "default", deterministic = true }
    assert.matches("not deterministic mode: deterministic mode", select(2, fx.decision(group(), call())))
  end)

  it("lists every check for explain", function()
    local _, _, _, lines = fx.decision(group(), call(), true)
    local text = table.concat(lines, "\n")
    for _, name in ipairs { "override", "one GPU per rank", "not deterministic mode", "workspace", "= fused kernel" } do
      assert.is_truthy(text:find(name, 1, true), name)
    end
  end)
end)
