-- The host kernels' generic copy (no AVX2): on an AVX2 machine every other
-- spec runs the AVX2 + F16C copy (src/host/shm_vec_multi.h picks it), so the
-- reduction specs run here once more with WEFT_NO_AVX2=1, which makes the
-- generic copy run everywhere: tests/faults/fault_reduce_spec.lua (every dtype x op
-- against a Lua reference), tests/unit/shm_spec.lua, tests/unit/norm_host_spec.lua.
local S = require("helpers.spec_util")

local SPECS = "tests/faults/fault_reduce_spec.lua tests/unit/shm_spec.lua tests/unit/norm_host_spec.lua"

describe("host kernels, generic copy (WEFT_NO_AVX2=1) #fault", function()
  it("pass the reduction specs", function()
    local out, rc = S.shell("WEFT_NO_AVX2=1 timeout -s KILL 600 scripts/run-tests " .. SPECS)
    local passed, failed = out:match("(%d+) passed, (%d+) failed, %d+ skipped%s*rc=%d+%s*$")
    assert.are.equal(0, rc, out)
    assert.are.equal("0", failed, out)
    assert.is_true(tonumber(passed) >= 30, out)
  end)
end)
