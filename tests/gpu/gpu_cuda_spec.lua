-- Device runtime: devices, the caching pool, copies, random fill, streams,
-- events, graph capture, and clear errors. #gpu specs are pending without a GPU.
-- run-tests: one GPU process (its #gpu tests use the GPU from this busted process: no ranks)
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C

local cuda = require("weft.cuda")
local G = require("helpers.gpu_ranks")
local tensor = require("weft.tensor")
local graph = require("weft.graph")

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
    local h = tensor.zeros({ 4 }, "f32")
    assert.are.equal(C.WEFT_ENODEV, C.weft_cuda_nan_mask(h.ptr, h.ptr, 4, 0, nil))
    assert.are.equal(C.WEFT_ENODEV, C.weft_cuda_nan_fixup(h.ptr, h.ptr, 4, 0, nil))
    assert.matches("no CUDA device", wffi.last_error())
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

-- The NaN pass of device max/min (kernels/devops.cu): the mask and fix-up
-- kernels alone against a host reference on the bits, every float dtype,
-- odd sizes (vector body + scalar tail), aligned and unaligned buffers.
describe("NaN mask and fix-up kernels #gpu", function()
  local CODE = { f32 = 0, f16 = 1, bf16 = 2, f64 = 6 }
  -- word type, |x| mask, +inf bits, canonical quiet NaN (f64 as uint64 cdata)
  local BITS = {
    f32 = { "uint32_t *", 0x7fffffff, 0x7f800000, 0x7fc00000 },
    f64 = { "uint64_t *", 0x7fffffffffffffffULL, 0x7ff0000000000000ULL, 0x7ff8000000000000ULL },
    f16 = { "uint16_t *", 0x7fff, 0x7c00, 0x7e00 },
    bf16 = { "uint16_t *", 0x7fff, 0x7f80, 0x7fc0 },
  }
  -- specials: ±0, ±inf, quiet / signalling / negative NaN with payloads, the
  -- largest finite, the smallest subnormal
  local SPECIAL = {
    f32 = { 0x0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffc00123, 0x7f7fffff, 0x1 },
    f64 = { 0x0ULL, 0x8000000000000000ULL, 0x7ff0000000000000ULL, 0xfff0000000000000ULL, 0x7ff8000000000000ULL,
            0x7ff0000000000001ULL, 0xfff8000000000abcULL, 0x7fefffffffffffffULL, 0x1ULL },
    f16 = { 0x0, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe55, 0x7bff, 0x1 },
    bf16 = { 0x0, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffc5, 0x7f7f, 0x1 },
  }
  -- every third element a special, the rest random bits
  local function fill_bits(t, dt, seed)
    local p = ffi.cast(BITS[dt][1], t.ptr)
    local sp = SPECIAL[dt]
    local x = ffi.cast("uint64_t", seed)
    for i = 0, t.numel - 1 do
      x = x * 6364136223846793005ULL + 1442695040888963407ULL
      if i % 3 == 0 then p[i] = sp[(i / 3) % #sp + 1]
      elseif dt == "f64" then p[i] = x
      elseif dt == "f32" then p[i] = tonumber(x / 4294967296ULL)
      else p[i] = tonumber(x / 281474976710656ULL) end
    end
  end
  local function is_nan(w, dt) local b = BITS[dt]; return bit.band(w, b[2]) > b[3] end
  local function word_eq(a, b) return a == b end   -- numbers, or uint64 cdata on both sides

  it("mask = isnan and fix-up writes the quiet NaN, every float dtype and odd size", function()
    if not need_gpu() then return end
    for _, dt in ipairs { "f32", "f64", "f16", "bf16" } do
      local b = BITS[dt]
      for _, n in ipairs { 1, 2, 3, 7, 8, 9, 15, 17, 1023, 65537, 1048583 } do
        -- off 0: 16-byte aligned data and mask (the vector body); off 1: neither (scalar)
        for _, off in ipairs { 0, 1 } do
          local what = ("%s n=%d offset %d"):format(dt, n, off)
          local h = tensor.zeros({ n + off + 1 }, dt, "cpu")
          fill_bits(h, dt, 1000003 * n + off)
          local hp = ffi.cast(b[1], h.ptr)
          local d = h:clone("cuda")
          local v = d:narrow(0, off, n)
          local moff = 16 + off                   -- sentinel bytes on both sides of the mask
          local mbuf = tensor.full({ n + 32 }, 0xab, "u8", "cuda")
          cuda.nan_mask(v.ptr, ffi.cast("uint8_t *", mbuf.ptr) + moff, n, CODE[dt])
          local mh = mbuf:clone("cpu")
          local m = ffi.cast("const uint8_t *", mh.ptr)
          local bad, first = 0, nil
          for i = 0, n - 1 do
            local want = is_nan(hp[off + i], dt) and 1 or 0
            if m[moff + i] ~= want then bad = bad + 1; first = first or i end
          end
          assert.are.equal(0, bad, what .. ": mask wrong, first at " .. tostring(first))
          assert.are.equal(0xab, m[moff - 1], what .. ": wrote before the mask")
          assert.are.equal(0xab, m[moff + n], what .. ": wrote past the mask")
          -- fix-up from a mask with any nonzero byte (not only 1), on NaN and
          -- non-NaN elements alike; elements outside the view untouched
          local fm = tensor.zeros({ n + 32 }, "u8", "cpu")
          local fp = ffi.cast("uint8_t *", fm.ptr)
          for i = 0, n - 1 do fp[moff + i] = (i % 5 == 1) and 1 or ((i % 7 == 3) and 0x80 or 0) end
          local fmd = fm:clone("cuda")
          cuda.nan_fixup(v.ptr, ffi.cast("uint8_t *", fmd.ptr) + moff, n, CODE[dt])
          local back = d:clone("cpu")
          local bp = ffi.cast(b[1], back.ptr)
          bad, first = 0, nil
          for i = 0, n + off do
            local set = i >= off and i < off + n and fp[moff + i - off] ~= 0
            if not word_eq(bp[i], set and b[4] or hp[i]) then bad = bad + 1; first = first or i end
          end
          assert.are.equal(0, bad, what .. ": fix-up wrong, first at element " .. tostring(first))
          for _, t in ipairs { h, d, mbuf, mh, fm, fmd, back } do t:free() end
        end
      end
    end
  end)

  it("runs on a given stream and inside a captured graph", function()
    if not need_gpu() then return end
    local n = 4099
    local x = tensor.zeros({ n }, "bf16", "cuda")
    local m = tensor.zeros({ n }, "u8", "cuda")
    local gr = graph.capture(function()
      cuda.nan_mask(x.ptr, m.ptr, n, CODE.bf16)
      cuda.nan_fixup(x.ptr, m.ptr, n, CODE.bf16)
    end)
    for round = 1, 3 do
      local h = tensor.zeros({ n }, "bf16", "cpu")
      local p = ffi.cast("uint16_t *", h.ptr)
      for i = 0, n - 1 do p[i] = ((i + round) % 17 == 0) and 0xffc1 or 0x3f80 end
      x:copy_(h)
      gr:replay()
      local got = x:clone("cpu")
      local g = ffi.cast("const uint16_t *", got.ptr)
      for i = 0, n - 1 do
        assert.are.equal(((i + round) % 17 == 0) and 0x7fc0 or 0x3f80, g[i], "round " .. round .. " element " .. i)
      end
      h:free(); got:free()
    end
    gr:destroy()
    local s = cuda.stream()
    cuda.nan_mask(x.ptr, m.ptr, n, CODE.bf16, s)
    s:synchronize()
    s:destroy()
  end)

  it("refuses non-float dtypes and NULL buffers", function()
    if not need_gpu() then return end
    local x = tensor.zeros({ 8 }, "i32", "cuda")
    local ok, err = pcall(cuda.nan_mask, x.ptr, x.ptr, 8, 3)
    assert.is_false(ok)
    assert.matches("nan_mask: dtype 3 is not a float dtype", err)
    ok, err = pcall(cuda.nan_fixup, x.ptr, nil, 8, 0)
    assert.is_false(ok)
    assert.matches("nan_fixup: NULL mask", err)
    assert.has_no.errors(function() cuda.nan_fixup(nil, nil, 0, 0) end)   -- nothing to do
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
