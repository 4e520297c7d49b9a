-- The shared host arena (src/host/host_arena.c): large weft host memory lives in a
-- per-process memfd that shm peers can map and read in place.
--  * the C test tests/c/host_arena_test.c (sizes, zeroing on reuse,
--    coalescing, threads, fork, a peer mapping the arena, WEFT_HOST_ARENA=0),
--    built and run with make into a temporary folder;
--  * through the FFI: weft_host_alloc / weft_host_is_shared, and weft.tensor
--    host tensors (from 64 KiB on they are arena memory; wrapped memory is not).
local spec = require("helpers.spec_util")
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C
local T = require("weft.tensor")

local KiB, MiB = 1024, 1024 * 1024
-- WEFT_HOST_ARENA=0 in the environment: everything stays on the heap
local ARENA_ON = os.getenv("WEFT_HOST_ARENA") ~= "0"

local function shared(p, n) return C.weft_host_is_shared(p, n) == 1 end
local function addr(p) return tonumber(ffi.cast("uintptr_t", p)) end

describe("host arena C test (tests/c/host_arena_test.c)", function()
  local run = spec.c_test("host_arena_test", 60)

  it("passes every check", function()
    local o = run()
    spec.assert_c_passed(assert, o, "host_arena", 101)
    assert.is_falsy(o:find("FAIL", 1, true), o)
  end)
  it("exits 0", function() assert.is_truthy(run():match("rc=0%s*$"), run()) end)
end)

describe("host arena through the FFI", function()
  it("small allocations are heap, large ones shared; aligned and zeroed", function()
    for _, c in ipairs {
      { 1, false }, { 4096, false }, { 64 * KiB - 64, false },
      { 64 * KiB, true }, { 100000, true }, { 4 * MiB, true },
    } do
      local n, big = c[1], c[2]
      local p = C.weft_host_alloc(n)
      assert.is_true(p ~= nil, wffi.last_error())
      assert.are.equal(0, addr(p) % 64)
      assert.are.equal(big and ARENA_ON, shared(p, n), "size " .. n)
      local b = ffi.cast("uint8_t *", p)
      assert.are.equal(0, b[0]); assert.are.equal(0, b[n - 1]); assert.are.equal(0, b[n / 2])
      ffi.fill(p, n, 0x5a)
      C.weft_host_free(p)
    end
    assert.is_false(shared(nil, 16))
    local stack = ffi.new("uint8_t[?]", 256 * KiB)
    assert.is_false(shared(stack, 256 * KiB))
  end)

  -- Other specs of this busted process hold arena blocks (and the GC frees
  -- theirs at any time), so addresses are only checked loosely here; the C
  -- test checks exact placement. The GC is stopped so that only our frees
  -- change the arena in between.
  local function no_gc(f)
    collectgarbage("collect"); collectgarbage("stop")
    local ok, err = pcall(f)
    collectgarbage("restart")
    if not ok then error(err, 0) end
  end
  -- first fit: the block freed just before is the lowest one that fits, or
  -- merged with a smaller hole right below it
  local function reuses(old, new, n)
    return new <= old and new + n > old
  end

  it("a freed large block reads as zeros when handed out again", function()
    no_gc(function()
      local n = 1 * MiB
      local p = C.weft_host_alloc(n)
      ffi.fill(p, n, 0xff)
      C.weft_host_free(p)
      local q = C.weft_host_alloc(n)
      local w = ffi.cast("uint64_t *", q)
      local nz = 0
      for i = 0, n / 8 - 1 do if w[i] ~= 0 then nz = nz + 1 end end
      assert.are.equal(0, nz)
      if ARENA_ON then assert.is_true(reuses(addr(p), addr(q), n)) end
      C.weft_host_free(q)
    end)
  end)

  it("host tensors of >= 64 KiB are shared, smaller ones are not", function()
    local big = T.empty({ 128, 128 }, "f32")       -- exactly 64 KiB
    local bigger = T.zeros({ 3, 1000, 100 }, "f64") -- 2.4 MB
    local small = T.ones({ 100 }, "f32")
    assert.are.equal(64 * KiB, big.nbytes)
    assert.are.equal(ARENA_ON, shared(big.ptr, big.nbytes))
    assert.are.equal(ARENA_ON, shared(bigger.ptr, bigger.nbytes))
    assert.is_false(shared(small.ptr, small.nbytes))
    assert.are.equal("host", big._storage.kind)
    -- a view points into the same arena block
    local v = bigger:narrow(0, 1, 2)
    assert.are.equal(ARENA_ON, shared(v.ptr, v.nbytes))
    -- a tensor of >= 64 KiB of another dtype, and from random fills
    local r = T.rand({ 64 * KiB }, "u8", nil, { seed = 3 })
    assert.are.equal(ARENA_ON, shared(r.ptr, r.nbytes))
    big:free(); bigger:free(); small:free(); r:free()
  end)

  it("a tensor reused after free() starts from zeros", function()
    no_gc(function()
      local a = T.full({ 256, 256 }, 7, "f32")
      local pa = addr(a.ptr)
      a:free()
      local b = T.empty({ 256, 256 }, "f32")
      if ARENA_ON then assert.is_true(reuses(pa, addr(b.ptr), b.nbytes)) end
      local f = ffi.cast("float *", b.ptr)
      local nz = 0
      for i = 0, b.numel - 1 do if f[i] ~= 0 then nz = nz + 1 end end
      assert.are.equal(0, nz)
      b:free()
    end)
  end)

  it("a tensor wrapping ffi.new memory is not shared", function()
    local raw = ffi.new("float[?]", 64 * 1024) -- 256 KiB, LuaJIT's allocator
    local t = T.wrap(raw, { 64 * 1024 }, "f32", nil, raw)
    assert.are.equal("wrap", t._storage.kind)
    assert.is_false(shared(t.ptr, t.nbytes))
    t:free()
    -- wrapping arena memory keeps it what it is
    local h = T.empty({ 64 * 1024 }, "f32")
    local w = T.wrap(h.ptr, { 64 * 1024 }, "f32", nil, h)
    assert.are.equal(ARENA_ON, shared(w.ptr, w.nbytes))
    w:free(); h:free()
  end)

  it("many tensors freed out of order, then one of their total size: shared", function()
    local ts, total = {}, 0
    for i = 1, 24 do
      local t = T.empty({ (i % 5 + 1) * 16 * KiB }, "f32") -- 64..320 KiB, whole grains
      ts[i] = t
      total = total + t.nbytes
    end
    for i = 1, 24, 2 do ts[i]:free() end
    for i = 24, 2, -2 do ts[i]:free() end
    local all = T.empty({ total / 4 }, "f32")
    assert.are.equal(ARENA_ON, shared(all.ptr, all.nbytes))
    all:free()
  end)
end)
