-- Shared-GPU test mode (WEFT_ALLOW_SHARED_GPU=1, lua/weft/backends/device_backends/setup.lua)
-- decided on the pretend GPU (every rank on device 0): off by default, one
-- switch for the whole group, weft's kernels only with an MPS slice per rank,
-- never NCCL. The kernels themselves run in tests/gpu/gpu_shared_spec.lua.
local spec = require("helpers.spec_util")

local function run(n, env)
  local out, rc = spec.shell(("%s WEFT_FAKE_DEVICE=1 WEFT_DEVICE=0 timeout 120 scripts/weft-run -n %d "
                              .. "tests/helpers/shared_gpu_fake.lua 2>&1"):format(env, n))
  return out, rc
end

local function ranks_say(out, n, pattern)
  for r = 0, n - 1 do
    local line = out:match("%[rank" .. r .. "%] ([^\n]*" .. pattern .. "[^\n]*)")
    assert.is_truthy(line, ("rank %d never printed %q:\n%s"):format(r, pattern, out))
  end
end

describe("shared-GPU test mode", function()
  it("is off by default: ranks sharing a GPU get neither NCCL nor weft's kernels", function()
    local out = run(2, "")
    ranks_say(out, 2, "INFO sum=2")
    ranks_say(out, 2, "custom_ar=off %(ranks 0 and 1 share cuda:0")
    ranks_say(out, 2, "shared_mode=nil")
  end)

  it("with an MPS slice per rank runs weft's kernels, never NCCL, and explain says so", function()
    local out = run(4, "SHARED_ALLOW_RANKS=0,1,2,3 SHARED_PCT=25")
    ranks_say(out, 4, "INFO sum=4")
    ranks_say(out, 4, "nccl=false")
    ranks_say(out, 4, "custom_ar=ready")
    ranks_say(out, 4, "shared%-GPU test mode %(WEFT_ALLOW_SHARED_GPU=1%): up to 4 ranks per GPU")
    ranks_say(out, 4, "one GPU per rank: shared%-GPU test mode")
  end)

  it("without an MPS slice (or a slice too large) keeps the kernels off and says why", function()
    for _, env in ipairs { "SHARED_ALLOW_RANKS=0,1", "SHARED_ALLOW_RANKS=0,1 SHARED_PCT=80" } do
      local out = run(2, env)
      ranks_say(out, 2, "INFO sum=2")
      ranks_say(out, 2, "custom_ar=off .*no MPS slice of at most 50 %%")
    end
  end)

  it("is one switch for the group: set on some ranks only, every rank fails at once naming them", function()
    local t0 = os.time()
    local out = run(3, "SHARED_ALLOW_RANKS=1 SHARED_PCT=33")
    ranks_say(out, 3, "ERROR .*WEFT_ALLOW_SHARED_GPU=1 on ranks 1 but not on ranks 0,2")
    assert.is_true(os.time() - t0 < 15, "took " .. (os.time() - t0) .. " s")
  end)
end)
