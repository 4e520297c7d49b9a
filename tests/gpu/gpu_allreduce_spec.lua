-- weft's own all-reduce (src/cuda/vmm.c, src/coll/allreduce.c, kernels/allreduce.cu)
-- through its C API. Without a GPU: the calls fail cleanly. With 2 GPUs:
-- the harness bench/ar_bench.cu validates every algorithm (f64 reference,
-- NCCL, graphs, bursts, bad input), a dead peer, an abort and leaks, under
-- scripts/weft-run; each of its PASS/FAIL lines becomes a check here.
local spec = require("helpers.spec_util")
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C
local cuda = require("weft.cuda")
local G = require("helpers.gpu_ranks")

local one_rank_group = require("helpers.store_util").one_rank_group

describe("weft all-reduce C API", function()
  it("declares the API (vmm, allreduce) and its constants", function()
    assert.are.equal(0, C.WEFT_AR_AUTO)
    assert.are.equal(2, C.WEFT_AR_TWOSHOT)
    assert.are.equal(1, C.WEFT_VMM_FABRIC)
    assert.is_not_nil(C.weft_ar_run)
    assert.is_not_nil(C.weft_ar_set_param)
    assert.is_not_nil(C.weft_ar_shape)
    assert.is_not_nil(C.weft_vmm_create)
  end)

  it("destroy(NULL) is a no-op", function()
    assert.are.equal(0, C.weft_ar_destroy(nil))
    assert.are.equal(0, C.weft_vmm_destroy(nil))
  end)

  it("refuses a world size it has no kernels for, before touching CUDA", function()
    local s, g = one_rank_group("ar_spec_w1")
    local out = ffi.new("weft_ar *[1]")
    local rc = C.weft_ar_create(g.handle, 1048576, out)
    assert.are.equal(C.WEFT_EINVAL, rc)
    assert.matches("world size 1 not supported", wffi.last_error())
    assert.matches("ar_spec_w1", wffi.last_error())
    g:destroy(); s:close()
  end)

  it("vmm create without a CUDA device fails cleanly", function()
    if cuda.available() then pending("this machine has a CUDA device"); return end
    local s, g = one_rank_group("ar_spec_vmm")
    local out = ffi.new("weft_vmm *[1]")
    local rc = C.weft_vmm_create(g.handle, 1048576, 0, out)
    assert.are_not.equal(0, rc)
    assert.is_true(out[0] == nil)
    assert.matches("CUDA", wffi.last_error())
    local live = ffi.new("int64_t[1]")
    assert.are.equal(0, C.weft_vmm_stats(live, nil, nil))
    assert.are.equal(0, tonumber(live[0]))
    g:destroy(); s:close()
  end)
end)

-- The descriptor exchange under the VMM workspaces (src/cuda/vmm_fdx.c), with
-- real processes and memfds: runs everywhere.
describe("vmm descriptor exchange (tests/c/ar_fdx_test.c)", function()
  local run = spec.c_test("ar_fdx_test", 120)
  for _, name in ipairs {
    "exchange among 2 processes", "exchange among 4 processes", "exchange among 8 processes",
    "an intruder with a wrong nonce is dropped", "a peer that never sends: timeout names it",
    "300 exchanges leak no descriptor",
  } do
    it(name, function()
      local o = run()
      assert.is_truthy(o:find("PASS " .. name .. "\n", 1, true), o)
    end)
  end
  it("exits 0", function() assert.is_truthy(run():match("rc=0%s*$"), run()) end)
end)

-- ---------------------------------------------------------------- 2 GPUs

local WORLD = 2
local run_once = G.harness_once(WORLD, "WEFT_AR_BENCH", "build/ar_bench", "ar-bench",
                                ("--validate --dead-peer --leak 200 --quick --max-bytes %d --out %%s")
                                :format(16 * 1048576))

describe("weft all-reduce with 2 ranks #gpu", function()
  G.harness_checks({ it = it, assert = assert, pending = function(why) pending(why) end }, {
    world = WORLD, run = run_once,
    groups = {
      "eager", "shape", "set_param rejects bad values", "size", "burst", "graph replay",
      "graph 7 replays", "eager-after-graph",
      "bad input rejected", "dead peer reported", "failed handle refuses", "abort ends",
      "vmm 200 create/destroy cycles leak nothing", "allreduce 20 create/run/destroy",
    },
  })
end)
