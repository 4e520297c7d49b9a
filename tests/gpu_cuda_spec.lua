-- Device runtime: devices, the caching pool, copies, random fill, streams,
-- events, graph capture, and clear errors. #gpu specs are pending without a GPU.
local ffi = require "ffi"
local wffi = require "weft.ffi"
local C = wffi.C

local cuda = require "weft.cuda"
local G = require "helpers.gpu_ranks"
local tensor = require "weft.tensor"
local graph = require "weft.graph"

local function need_gpu() return G.need_gpus(1, pending) end

describe("weft.cuda without a device", function()
  it("loads, reports 0 devices and refuses device calls clearly", function()
    if cuda.available() then
      pending("this machine has a CUDA device")
      return
    end
    assert.are.equal(0, cuda.device_count())
    local ok, err = pcall(cuda.alloc, 1024, 0)
    assert.is_false(ok)
    assert.matches("no CUDA device", err)
    ok, err = pcall(tensor.empty, { 4 }, "f32", "cuda")
    assert.is_false(ok)
    assert.matches("no CUDA device", err)
    ok, err = pcall(graph.capture, function() end)
    assert.is_false(ok)
    assert.matches("no CUDA device", err)
    local n = ffi.new("int[1]")
    assert.are.equal(C.WEFT_ENODEV, C.weft_nccl_version(n))
  end)
end)

describe("weft.cuda #gpu", function()
  it("reports devices and the thread's device", function()
    if not need_gpu() then return end
    local n = cuda.device_count()
    assert.is_true(n >= 1)
    local d = cuda.current_device()
    assert.is_true(d >= 0 and d < n)
    assert.is_true(#cuda.device_name(d) > 0)
    cuda.set_device(d)
    assert.are.equal(d, cuda.current_device())
  end)

  it("allocates through the caching pool without new cudaMalloc in steady state", function()
    if not need_gpu() then return end
    local dev = cuda.current_device()
    local p = cuda.alloc(1000000, dev)
    assert.are.equal(dev, cuda.pointer_device(p))
    cuda.free(p, dev)
    local before = cuda.pool_stats(dev)
    for _ = 1, 10 do
      local q = cuda.alloc(1000000, dev)
      cuda.free(q, dev)
    end
    local after = cuda.pool_stats(dev)
    assert.are.equal(before.device_allocs, after.device_allocs)
    assert.are.equal(before.hits + 10, after.hits)
    assert.are.equal(before.in_use_bytes, after.in_use_bytes)
    -- a size class holds what was asked (at most 25 % more)
    local a = cuda.alloc(123457, dev)
    local st = cuda.pool_stats(dev)
    assert.is_true(st.in_use_bytes - after.in_use_bytes >= 123457)
    assert.is_true(st.in_use_bytes - after.in_use_bytes <= 123457 * 1.25 + 512)
    cuda.free(a, dev)
    -- host memory is not a device pointer
    local h = tensor.zeros({ 16 }, "f32")
    assert.is_nil(cuda.pointer_device(h.ptr))
  end)

  it("round-trips host <-> device copies for every dtype", function()
    if not need_gpu() then return end
    for _, dt in ipairs { "f32", "f16", "bf16", "i32", "i64", "u8", "f64" } do
      local h = tensor.rand({ 3, 1001 }, dt, "cpu", { seed = 11 })
      local d = h:clone("cuda")
      assert.is_true(d:is_cuda())
      local d2 = d:clone()                -- device -> device
      local back = d2:clone("cpu")
      local ma = back:compare(h)
      assert.are.equal(0, ma, dt)
      d:free(); d2:free(); back:free()
    end
  end)

  it("fills on device with the host's distributions", function()
    if not need_gpu() then return end
    -- uniform: bit-identical to the host generator
    for _, dt in ipairs { "f32", "f16", "bf16", "f64", "i32", "i64", "u8" } do
      local d = tensor.rand({ 100003 }, dt, "cuda", { seed = 42 })
      local h = tensor.rand({ 100003 }, dt, "cpu", { seed = 42 })
      local ma = d:compare(h)
      assert.are.equal(0, ma, "uniform " .. dt)
    end
    -- normal: same generator, device transcendental functions (a few ulp)
    local d = tensor.randn({ 200000 }, "f32", "cuda", { seed = 5 })
    local h = tensor.randn({ 200000 }, "f32", "cpu", { seed = 5 })
    local ma = d:compare(h)
    assert.is_true(ma < 1e-4, "normal f32 differs by " .. ma)
    local vals = d:to_table()
    local s, s2 = 0, 0
    for i = 1, #vals do s = s + vals[i]; s2 = s2 + vals[i] * vals[i] end
    local mean, var = s / #vals, s2 / #vals - (s / #vals) ^ 2
    assert.is_true(math.abs(mean) < 0.01, "mean " .. mean)
    assert.is_true(math.abs(var - 1) < 0.02, "variance " .. var)
    -- different seeds differ
    local e = tensor.randn({ 1000 }, "bf16", "cuda", { seed = 6 })
    local f = tensor.randn({ 1000 }, "bf16", "cuda", { seed = 7 })
    assert.is_true(e:compare(f) > 0)
  end)

  it("runs memset and async copies on a stream, timed by events", function()
    if not need_gpu() then return end
    local n = 1048576
    local d = tensor.empty({ n }, "u8", "cuda")
    local h = tensor.zeros({ n }, "u8", "cpu")
    local s = cuda.stream()
    local e0, e1 = cuda.event(), cuda.event()
    e0:record(s)
    cuda.memset(d.ptr, 7, n, s)
    e1:record(s)
    s:synchronize()
    assert.is_true(e0:elapsed(e1) >= 0)
    cuda.copy_async(h.ptr, d.ptr, n, s)
    s:synchronize()
    local p = ffi.cast("uint8_t*", h.ptr)
    assert.are.equal(7, p[0])
    assert.are.equal(7, p[n - 1])
    -- the current stream can be switched and restored
    local prev = cuda.current_stream()
    cuda.set_current_stream(s)
    assert.is_true(s.handle == cuda.current_stream().handle)
    cuda.set_current_stream(prev)
    e0:destroy(); e1:destroy(); s:destroy()
    cuda.synchronize()
  end)

  it("refuses bad input with clear errors", function()
    if not need_gpu() then return end
    local ok, err = pcall(cuda.set_device, 99)
    assert.is_false(ok)
    assert.matches("cuda:99 does not exist", err)
    local h = tensor.zeros({ 8 }, "f32", "cpu")
    ok, err = pcall(cuda.free, h.ptr)
    assert.is_false(ok)
    assert.matches("not allocated by weft's pool", err)
    local w = tensor.ones({ 8 }, "f32", "cpu")
    ok, err = pcall(cuda.rmsnorm, h, nil, w, 1e-6)
    assert.is_false(ok)
    assert.matches("device tensor", err)
    local d = tensor.zeros({ 2, 8 }, "f32", "cuda")
    ok, err = pcall(cuda.rmsnorm, d, nil, w, 1e-6)
    assert.is_false(ok)
    assert.matches("weight is on cpu", err)
    local di = tensor.zeros({ 2, 8 }, "i32", "cuda")
    ok, err = pcall(cuda.rmsnorm, di, nil, di, 1e-6)
    assert.is_false(ok)
    assert.matches("not f32, f16 or bf16", err)
    local rc = C.weft_cuda_fill_random(d.ptr, 16, 99, 1, 0, nil)
    assert.are.equal(C.WEFT_EINVAL, rc)
    assert.matches("unknown dtype 99", wffi.last_error())
  end)
end)

describe("weft.graph #gpu", function()
  local function host_norm(x, w, eps)
    local out = tensor.empty(x.shape, x.dtype, "cpu")
    local xs = x:clone("cpu")
    local ws = w:clone("cpu")
    local hidden = x.shape[#x.shape]
    wffi.check(C.weft_host_rmsnorm(xs.ptr, nil, ws.ptr, out.ptr, nil, x.numel / hidden, hidden,
                                   xs:dtype_code(), eps, 0), "host_rmsnorm")
    return out
  end

  it("captures kernels and replays them on refilled inputs", function()
    if not need_gpu() then return end
    local x = tensor.empty({ 4, 2048 }, "bf16", "cuda")
    local y = tensor.empty({ 4, 2048 }, "bf16", "cuda")
    local w = tensor.rand({ 2048 }, "bf16", "cuda", { seed = 3 })
    local seen_capture
    local g = graph.capture(function(ctx)
      seen_capture = cuda.current_stream():capturing() and graph.capturing() and ctx.mode
      cuda.rmsnorm(x, nil, w, 1e-6, { out = y })
    end)
    assert.are.equal("graph", seen_capture)
    assert.is_false(graph.capturing())
    for round = 1, 3 do
      cuda.fill_random(x.ptr, x.numel, x:dtype_code(), 100 + round, 1)
      g:replay()
      cuda.synchronize()
      local ma = y:compare(host_norm(x, w, 1e-6))
      assert.is_true(ma < 0.07, ("round %d: max abs error %g"):format(round, ma))
    end
    g:destroy()
    g:destroy() -- idempotent
    local ok, err = pcall(g.replay, g)
    assert.is_false(ok)
    assert.matches("destroyed", err)
  end)

  it("refuses synchronizing calls inside a capture and still ends it", function()
    if not need_gpu() then return end
    local ok, err = pcall(graph.capture, function() cuda.synchronize() end)
    assert.is_false(ok)
    assert.matches("refused while this thread captures", err)
    assert.is_false(graph.capturing())
    ok, err = pcall(graph.capture, function()
      local t = tensor.zeros({ 4 }, "f32", "cpu")
      t:clone("cuda")   -- a synchronous copy
    end)
    assert.is_false(ok)
    assert.matches("captures", err)
    -- the thread is usable afterwards
    local d = tensor.ones({ 4 }, "f32", "cuda")
    assert.are.same({ 1, 1, 1, 1 }, d:to_table())
  end)

  it("defers device frees requested during a capture", function()
    if not need_gpu() then return end
    local dev = cuda.current_device()
    local before
    local g = graph.capture(function()
      local p = cuda.alloc(4096, dev)
      before = cuda.pool_stats(dev).in_use_bytes
      cuda.free(p, dev)
      assert.are.equal(before, cuda.pool_stats(dev).in_use_bytes)
    end)
    assert.is_true(cuda.pool_stats(dev).in_use_bytes < before)
    g:destroy()
  end)

  it("refuses a capture on the legacy stream", function()
    if not need_gpu() then return end
    local ok, err = pcall(graph.capture, function() end, { stream = cuda.wrap_stream(nil) })
    assert.is_false(ok)
    assert.matches("legacy default stream", err)
  end)
end)
