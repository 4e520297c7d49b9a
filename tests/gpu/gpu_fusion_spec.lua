-- The fused all-reduce + residual + RMSNorm (src/coll/fusion.c,
-- kernels/fused_norm.cu) through its C API. Without a GPU: the API is
-- declared, sizes are computed, and misuse fails cleanly before CUDA. With 2
-- GPUs: the harness bench/fused_bench.cu (built by mk/fusion.mk) runs under
-- scripts/weft-run and checks every kernel against an f64 reference (±0,
-- every hidden size, one-/two-shot bit-equality, FP8, PDL, graphs replayed on
-- changing data, refusals, a missing peer, an abort); each of its PASS/FAIL
-- lines becomes a check here.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C
local cuda = require("weft.cuda")
local G = require("helpers.gpu_ranks")

local function opts(max_tokens, hidden, dtype)
  local o = ffi.new("weft_fusion_opts")
  o.max_tokens, o.hidden, o.dtype = max_tokens, hidden, dtype or C.WEFT_BF16
  return o
end

describe("weft fusion C API", function()
  it("declares the API and its constants", function()
    assert.are.equal(2, C.WEFT_FUSION_AR_RMSNORM_FP8)
    assert.are.equal(2, C.WEFT_FUSION_TWOSHOT)
    assert.are.equal(8, C.WEFT_FUSION_TRIGGER_AT_END)
    assert.is_not_nil(C.weft_fusion_run)
    assert.are.equal(0, C.weft_fusion_destroy(nil))
  end)

  it("sizes a workspace: state, flags, two inboxes and three Lamport buffers", function()
    local b = ffi.new("size_t[1]")
    assert.are.equal(0, C.weft_fusion_workspace_bytes(opts(2048, 4096), 2, b))
    local row, lam = 4096 * 2, 2 * 2048 * 4096 * 2
    local inbox = 2 * 1024 * row
    local n = tonumber(b[0])
    assert.is_true(n >= 2 * inbox + 3 * lam and n < 2 * inbox + 3 * lam + 1048576, tostring(n))
    local o = opts(2048, 4096)
    o.oneshot_max_tokens = -1        -- no one-shot: no Lamport buffers
    assert.are.equal(0, C.weft_fusion_workspace_bytes(o, 2, b))
    assert.is_true(tonumber(b[0]) < 2 * inbox + 1048576)
  end)

  it("refuses bad sizes with a clear message", function()
    local b = ffi.new("size_t[1]")
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_workspace_bytes(opts(128, 4092), 2, b))
    assert.matches("hidden 4092 must be a multiple of 8", wffi.last_error())
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_workspace_bytes(opts(128, 32768), 2, b))
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_workspace_bytes(opts(128, 4096, C.WEFT_I32), 2, b))
    assert.matches("dtype i32", wffi.last_error())
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_workspace_bytes(opts(128, 4096), 9, b))
    assert.matches("world size 9", wffi.last_error())
  end)

  it("refuses a group of one before touching CUDA, naming the group", function()
    local s, g = require("helpers.store_util").one_rank_group("fusion_spec_w1")
    local out = ffi.new("weft_fusion *[1]")
    assert.are.equal(C.WEFT_EINVAL, C.weft_fusion_create(g.handle, opts(128, 4096), out))
    assert.matches("fusion_spec_w1", wffi.last_error())
    assert.matches("world size 1 not supported", wffi.last_error())
    assert.is_true(out[0] == nil)
    g:destroy(); s:close()
  end)

  it("preflight answers no (and no error) without a CUDA device", function()
    if cuda.available() then pending("this machine has a CUDA device"); return end
    local ok = ffi.new("int[1]", 7)
    assert.are.equal(0, C.weft_fusion_preflight(opts(128, 4096), 2, ok))
    assert.are.equal(0, ok[0])
  end)
end)

-- ---------------------------------------------------------------- 2 GPUs

local WORLD = 2
local run_once = G.harness_once(WORLD, "WEFT_FUSED_BENCH", "build/fused_bench", "fused-bench",
                                "--quick --no-bench --out %s")

describe("weft fused all-reduce + RMSNorm with 2 ranks #gpu", function()
  G.harness_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = WORLD, run = run_once,
    groups = { "refusal", "after refusals", "matrix", "variant", "pdl", "stress", "graph", "fault" },
    -- the harness prints "<group>: ..." except the PDL lines ("pdl eager ...")
    label = function(name) return name == "pdl" and "pdl " or name .. ":" end,
  })
end)
