-- kernels/norm.cu (residual add + RMSNorm) against the CPU reference
-- weft_host_rmsnorm, for bf16 / f16 / f32, the vector and generic paths,
-- with and without residual, Gemma weights and in-place outputs.
-- run-tests: one GPU process (its #gpu tests use the GPU from this busted process: no ranks)
local wffi = require("weft.internal.ffi")
local C = wffi.C
local cuda = require("weft.cuda")
local G = require("helpers.gpu_ranks")
local tensor = require("weft.tensor")

local function need_gpu() return G.need_gpus(1, pending) end

-- |out| stays below ~8 (normal inputs, uniform [-1, 1) weights): 2 ulp there
-- (f32: summation order over up to 64 Ki elements).
local TOL = { bf16 = 2 ^ -4, f16 = 2 ^ -7, f32 = 1e-4 }

local function reference(x, res, w, eps, flags)
  local hidden = x.shape[#x.shape]
  local tokens = x.numel / hidden
  local hx, hw = x:clone("cpu"), w:clone("cpu")
  local hr = res and res:clone("cpu")
  local out = tensor.empty(x.shape, x.dtype, "cpu")
  local rout = res and tensor.empty(x.shape, x.dtype, "cpu")
  wffi.check(C.weft_host_rmsnorm(hx.ptr, hr and hr.ptr, hw.ptr, out.ptr, rout and rout.ptr, tokens,
                                 hidden, hx:dtype_code(), eps, flags), "host_rmsnorm")
  return out, rout
end

local SHAPES = {
  { 1, 2048 }, { 7, 4096 }, { 33, 8192 }, { 4, 16384 }, { 3, 32768 }, -- vector path
  { 5, 100 }, { 2, 4100 }, { 2, 65536 },                              -- generic path
  { 0, 4096 },                                                        -- nothing to do
}

describe("weft.cuda rmsnorm #gpu", function()
  for _, dt in ipairs { "bf16", "f16", "f32" } do
    it("matches the host reference for " .. dt .. " at every shape", function()
      if not need_gpu() then return end
      local seed = 1
      for _, sh in ipairs(SHAPES) do
        for _, with_res in ipairs { true, false } do
          for _, flags in ipairs { 0, 1 } do
            seed = seed + 1
            local x = tensor.randn(sh, dt, "cuda", { seed = seed })
            local r = with_res and tensor.randn(sh, dt, "cuda", { seed = seed + 1000 }) or nil
            local w = tensor.rand({ sh[2] }, dt, "cuda", { seed = seed + 2000 })
            local out, rout = cuda.rmsnorm(x, r, w, 1e-6, { gemma = flags == 1 })
            cuda.synchronize()
            local what = ("%s %dx%d res=%s gemma=%d"):format(dt, sh[1], sh[2], tostring(with_res), flags)
            if sh[1] > 0 then
              local ref, rref = reference(x, r, w, 1e-6, flags)
              local ma = out:compare(ref)
              assert.is_true(ma <= TOL[dt], what .. ": out max abs error " .. ma)
              if with_res then
                assert.are.equal(0, (rout:compare(rref)), what .. ": residual_out differs")
              end
            end
            x:free(); w:free(); out:free()
            if r then r:free(); rout:free() end
          end
        end
      end
    end)
  end

  it("works in place (out = x, residual_out = residual)", function()
    if not need_gpu() then return end
    for _, dt in ipairs { "bf16", "f32" } do
      local x = tensor.randn({ 16, 4096 }, dt, "cuda", { seed = 77 })
      local r = tensor.randn({ 16, 4096 }, dt, "cuda", { seed = 78 })
      local w = tensor.rand({ 4096 }, dt, "cuda", { seed = 79 })
      local ref, rref = reference(x, r, w, 1e-5, 0)
      cuda.rmsnorm(x, r, w, 1e-5, { out = x, residual_out = r })
      cuda.synchronize()
      assert.is_true(x:compare(ref) <= TOL[dt])
      assert.are.equal(0, (r:compare(rref)))
    end
  end)

  it("takes the generic path for unaligned rows", function()
    if not need_gpu() then return end
    local tokens, hidden = 6, 2048
    local base = tensor.randn({ tokens * hidden + 1 }, "bf16", "cuda", { seed = 9 })
    local x = base:narrow(0, 1, tokens * hidden):view({ tokens, hidden })  -- 2-byte offset
    local w = tensor.rand({ hidden }, "bf16", "cuda", { seed = 10 })
    local out = cuda.rmsnorm(x, nil, w, 1e-6)
    cuda.synchronize()
    local ref = reference(x, nil, w, 1e-6, 0)
    assert.is_true(out:compare(ref) <= TOL.bf16)
  end)

  it("rejects mismatched shapes and dtypes before launching", function()
    if not need_gpu() then return end
    local x = tensor.randn({ 2, 256 }, "bf16", "cuda", { seed = 1 })
    local w = tensor.rand({ 128 }, "bf16", "cuda", { seed = 2 })
    local ok, err = pcall(cuda.rmsnorm, x, nil, w, 1e-6)
    assert.is_false(ok)
    assert.matches("weight has 128 elements, hidden size is 256", err)
    local w2 = tensor.rand({ 256 }, "f32", "cuda", { seed = 2 })
    ok, err = pcall(cuda.rmsnorm, x, nil, w2, 1e-6)
    assert.is_false(ok)
    assert.matches("weight is f32, input is bf16", err)
    local rc = C.weft_cuda_rmsnorm(x.ptr, nil, nil, x.ptr, nil, 2, 256, 2, 1e-6, 0, nil)
    assert.are.equal(C.WEFT_EINVAL, rc)
    assert.matches("NULL weight", wffi.last_error())
  end)
end)
