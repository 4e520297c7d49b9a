-- scripts/weft-tune --quick on 2 GPUs: it runs to the end (every output
-- check passed, the tuned policy nowhere slower than the built-in one beyond
-- noise), writes a policy file that weft's loader accepts with the
-- documented shape, and the results (results format: docs/architecture.md#conventions-in-one-place) with the before/after
-- records. Without 2 GPUs: the script's own refusals.
local G = require("helpers.gpu_ranks")
local tune = require("weft.tune")

local ROOT = os.getenv("PWD") or "."
local U = require("helpers.spec_util")

local sh = U.shell

describe("weft-tune without GPUs", function()
  it("--help lists the options", function()
    local out, rc = sh(ROOT .. "/scripts/weft-tune --help")
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("--quick", 1, true))
    assert.is_truthy(out:find("--out FILE", 1, true))
  end)

  it("refuses an unknown argument", function()
    local out, rc = sh(ROOT .. "/scripts/weft-tune --bogus")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("unknown argument --bogus", 1, true), out)
  end)

  it("refuses to run on fewer than 2 GPUs", function()
    local cuda = require("weft.cuda")
    if cuda.device_count() >= 2 then pending("this machine has 2 GPUs"); return end
    local out, rc = sh(ROOT .. "/scripts/weft-tune --quick")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("needs at least 2 GPUs", 1, true), out)
  end)
end)

describe("weft-tune --quick on 2 GPUs #gpu", function()
  local dir, out, rc
  local function run_once()
    if out then return end
    dir = os.tmpname(); os.remove(dir); os.execute("mkdir -p '" .. dir .. "'")
    out, rc = sh(("cd '%s' && NCCL_NVLS_ENABLE=0 XDG_CONFIG_HOME='%s/xdg' timeout -s KILL 420 scripts/weft-tune "
                  .. "--quick -n 2 --out '%s/policy.lua' --results '%s/results'"):format(ROOT, dir, dir, dir))
  end
  teardown(function() if dir then os.execute("rm -rf '" .. dir .. "'") end end)

  it("runs to the end: outputs checked, tuned never slower beyond noise", function()
    if not G.need_gpus(2, pending) then return end
    run_once()
    assert.are.equal(0, rc, out:sub(-8000))
    assert.is_truthy(out:find("0 slower beyond noise", 1, true), out:sub(-4000))
    assert.is_truthy(out:find("0 check(s) failed", 1, true), out:sub(-4000))
  end)

  it("writes a policy file weft's loader accepts, in the documented shape", function()
    if not G.need_gpus(2, pending) then return end
    run_once()
    local pf = require("weft.internal.policy_file")
    local t = pf.load(dir .. "/policy.lua")
    assert.is_true(tune.check_shape(t))
    assert.are.equal(1, t.version)
    local ar = t.all_reduce[2].bf16
    assert.is_table(ar)
    assert.is_nil(ar[#ar].upto)
    local fz = t.fused[2].bf16
    assert.is_table(fz)
    for _, e in ipairs(fz) do assert.is_truthy(e.backend:match("^fused_")) end
    -- and the policy follows it
    local policy = require("weft.policy")
    policy.load_file(dir .. "/policy.lua")
    assert.are.equal(tune.pick(ar, 4096), (policy.tuned_backend("all_reduce", 2, "bf16", 4096)))
    policy.clear_file()
  end)

  it("writes tune-<machine>-<date>.json with the before/after records, and the .md", function()
    if not G.need_gpus(2, pending) then return end
    run_once()
    local p = io.popen("ls '" .. dir .. "/results'")
    local listing = p:read("*a"); p:close()
    local json = listing:match("(tune%-[^\n]+%.json)")
    assert.is_truthy(json, listing)
    assert.is_truthy(listing:find(json:gsub("%.json$", ".md"), 1, true), listing)
    local f = assert(io.open(dir .. "/results/" .. json))
    local text = f:read("*a"); f:close()
    for _, want in ipairs({ '"backend": "policy_builtin"', '"backend": "policy_tuned"', '"backend": "nccl"',
                            '"backend": "oneshot"', '"backend": "twoshot"', '"backend": "fused_oneshot"',
                            '"op": "fused_ar_rmsnorm"', '"mode": "graph"', '"records": [' }) do
      assert.is_truthy(text:find(want, 1, true), "missing " .. want)
    end
    assert.is_nil(text:find('"check": "FAIL"', 1, true))
  end)
end)
