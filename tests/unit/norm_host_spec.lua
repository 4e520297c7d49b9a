-- weft_host_rmsnorm (src/host/norm_host.c): residual add + RMSNorm on the host
-- against an f64 reference (tests/helpers/shm_norm_ref.lua), for f32, f16 and
-- bf16, with and without residual / residual_out, Gemma weights, in place;
-- both kernel builds (AVX2 + F16C here, the generic SSE2 one in a child).
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local ref = require("helpers.shm_norm_ref")

local C = wffi.C

describe("weft_host_rmsnorm", function()
  for _, dt in ipairs { "f32", "f16", "bf16" } do
    it(("matches the f64 reference for %s"):format(dt), function()
      local fails = {}
      local n = ref.run(dt, function(what, why) fails[#fails + 1] = what .. ": " .. why end)
      assert.is_true(n > 100)
      assert.are.same({}, fails)
    end)
  end

  it("the generic (non-AVX2) kernels match too", function()
    local cmd = "WEFT_NO_AVX2=1 LUA_PATH='lua/?.lua;lua/?/init.lua;tests/?.lua;;' "
                .. "luajit tests/helpers/shm_norm_ref.lua 2>&1"
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    assert.is_truthy(out:match("^OK %d+"), out)
  end)

  it("a row of zeros gives zeros (eps keeps it finite)", function()
    local x = ffi.new("float[8]")
    local w = ffi.new("float[8]", { 1, 1, 1, 1, 1, 1, 1, 1 })
    local out = ffi.new("float[8]", { 5, 5, 5, 5, 5, 5, 5, 5 })
    assert.are.equal(0, C.weft_host_rmsnorm(x, nil, w, out, nil, 1, 8, C.WEFT_F32, 1e-6, 0))
    for i = 0, 7 do assert.are.equal(0, out[i]) end
  end)

  it("rejects bad arguments with a message", function()
    local x = ffi.new("float[4]")
    local function bad(...)
      assert.are.equal(C.WEFT_EINVAL, C.weft_host_rmsnorm(...))
      return wffi.last_error()
    end
    assert.is_truthy(bad(x, nil, x, x, nil, 1, 4, C.WEFT_I32, 1e-6, 0):find("want f32, f16 or bf16", 1, true))
    assert.is_truthy(bad(x, nil, x, x, nil, 1, 0, C.WEFT_F32, 1e-6, 0):find("bad shape", 1, true))
    assert.is_truthy(bad(x, nil, x, x, nil, 1, 4, C.WEFT_F32, 1e-6, 2):find("unknown flags", 1, true))
    assert.is_truthy(bad(nil, nil, x, x, nil, 1, 4, C.WEFT_F32, 1e-6, 0):find("NULL", 1, true))
    assert.is_truthy(bad(x, nil, x, x, nil, 1, 4, C.WEFT_F32, -1, 0):find("eps", 1, true))
    -- zero tokens is a no-op, even without buffers
    assert.are.equal(0, C.weft_host_rmsnorm(nil, nil, nil, nil, nil, 0, 4, C.WEFT_F32, 1e-6, 0))
  end)
end)
