-- weft.tensor and the host helpers of src/host/hostops.c (allocation, random fill,
-- conversion, comparison).
-- run-tests: one GPU process (its #gpu tests use the GPU from this busted process: no ranks)
local ffi = require("ffi")

describe("weft.tensor", function()
  local cuda_was_loaded = package.loaded["weft.cuda"] ~= nil
  local wffi = require("weft.internal.ffi")
  local C = wffi.C
  local tensor = require("weft.tensor")

  local DT = { f32 = 0, f16 = 1, bf16 = 2, i32 = 3, i64 = 4, u8 = 5, f64 = 6, f8e4m3 = 7 }
  local ALL = { "f32", "f16", "bf16", "f64", "i32", "i64", "u8", "f8e4m3" }
  local FLOATS = { "f32", "f16", "bf16", "f64", "f8e4m3" }

  local function isnan(x) return x ~= x end

  -- f(...) raises an error whose message holds `text` (plain); returns it
  local function refuses(text, f, ...)
    local ok, err = pcall(f, ...)
    assert.is_false(ok)
    assert.matches(text, err, 1, true)
    return err
  end

  -- Converts one value v through C from dtype `from` (held in a `src_t`) to
  -- dtype `to` (read back from a zeroed `dst_t`).
  local function convert1(v, src_t, from, dst_t, to)
    local src = ffi.new(src_t .. "[1]", v)
    local dst = ffi.new(dst_t .. "[1]", 0)
    assert.are.equal(0, C.weft_host_convert(src, DT[from], dst, DT[to], 1))
    return dst[0]
  end
  -- f64 -> dtype, the raw bits.
  local function bits_of(v, dt) return tonumber(convert1(v, "double", "f64", "uint64_t", dt)) end
  -- f32 -> dtype through the fast path, raw bits.
  local function bits_f32(v, dt) return tonumber(convert1(v, "float", "f32", "uint64_t", dt)) end
  local function value_of(bits, dt) return convert1(bits, "uint64_t", dt, "double", "f64") end

  -- Every bit pattern of the 16-bit dtype `dt` through f32 and back and
  -- through f64 and back: n, the f32 and f64 values, the two round trips.
  local function round_trips16(dt)
    local n = 65536
    local h = ffi.new("uint16_t[?]", n)
    for i = 0, n - 1 do h[i] = i end
    local f = ffi.new("float[?]", n)
    local d = ffi.new("double[?]", n)
    local back = ffi.new("uint16_t[?]", n)
    local back2 = ffi.new("uint16_t[?]", n)
    assert.are.equal(0, C.weft_host_convert(h, DT[dt], f, DT.f32, n))
    assert.are.equal(0, C.weft_host_convert(f, DT.f32, back, DT[dt], n))
    assert.are.equal(0, C.weft_host_convert(h, DT[dt], d, DT.f64, n))
    assert.are.equal(0, C.weft_host_convert(d, DT.f64, back2, DT[dt], n))
    return n, f, d, back, back2
  end
  -- How many of those patterns i fail ok(i, f, d, back, back2).
  local function bad_patterns16(dt, ok)
    local n, f, d, back, back2 = round_trips16(dt)
    local bad = 0
    for i = 0, n - 1 do
      if not ok(i, f, d, back, back2) then bad = bad + 1 end
    end
    return bad
  end

  describe("dtypes", function()
    it("dtype_info gives codes and sizes agreeing with the C library", function()
      for _, name in ipairs(ALL) do
        local info = tensor.dtype_info(name)
        assert.are.equal(name, info.name)
        assert.are.equal(DT[name], info.code)
        assert.are.equal(tonumber(C.weft_dtype_size(info.code)), info.size)
      end
      assert.are.same({ code = 2, size = 2, name = "bf16" }, tensor.dtype_info("bfloat16"))
      assert.are.same({ code = 0, size = 4, name = "f32" }, tensor.dtype_info("float32"))
      assert.are.same({ code = 4, size = 8, name = "i64" }, tensor.dtype_info("int64"))
      assert.are.same({ code = 5, size = 1, name = "u8" }, tensor.dtype_info("uint8"))
      assert.are.same({ code = 1, size = 2, name = "f16" }, tensor.dtype_info("float16"))
    end)

    it("rejects an unknown dtype by name", function()
      assert.has_error(function() tensor.dtype_info("f99") end)
      refuses("weft: tensor.empty: unknown dtype 'f99'", tensor.empty, { 2 }, "f99")
    end)
  end)

  describe("host_alloc", function()
    it("returns zeroed 64-byte aligned memory, also for 0 bytes", function()
      for _, n in ipairs({ 0, 1, 63, 64, 1000, 2 ^ 20 }) do
        local p = C.weft_host_alloc(n)
        assert.is_not_nil(p)
        assert.is_true(p ~= nil)
        assert.are.equal(0, tonumber(ffi.cast("uintptr_t", p)) % 64)
        local b = ffi.cast("uint8_t*", p)
        for i = 0, n - 1, 97 do assert.are.equal(0, b[i]) end
        C.weft_host_free(p)
      end
    end)
  end)

  describe("conversion", function()
    it("f16: every bit pattern survives f16 -> f32 -> f16 and f16 -> f64 -> f16", function()
      -- NaN-ness is checked on bits: this LuaJIT must not read NaN payloads
      assert.are.equal(0, bad_patterns16("f16", function(i, f, d, back, back2)
        if bit.band(i, 0x7c00) == 0x7c00 and bit.band(i, 0x3ff) ~= 0 then
          -- NaN stays NaN (quieted, sign kept); f64 NaNs come out canonical
          local fbits = ffi.cast("uint32_t*", f)[i]
          return bit.band(fbits, 0x7f800000) == 0x7f800000 and bit.band(fbits, 0x7fffff) ~= 0
                 and ffi.cast("uint64_t*", d)[i] == 0x7ff8000000000000ULL and bit.band(back[i], 0x7e00) == 0x7e00
                 and bit.band(back[i], 0x8000) == bit.band(i, 0x8000)
        end
        return back[i] == i and back2[i] == i and f[i] == d[i]
      end))
    end)

    it("bf16: every bit pattern survives bf16 -> f32 -> bf16 and via f64", function()
      assert.are.equal(0, bad_patterns16("bf16", function(i, _, d, back, back2)
        if bit.band(i, 0x7f80) == 0x7f80 and bit.band(i, 0x7f) ~= 0 then
          return ffi.cast("uint64_t*", d)[i] == 0x7ff8000000000000ULL and isnan(value_of(back2[i], "bf16"))
                 and bit.band(back[i], 0x7fc0) == 0x7fc0
        end
        return back[i] == i and back2[i] == i
      end))
    end)

    it("f8e4m3: every code survives f8 -> f32 -> f8 and via f64", function()
      for i = 0, 255 do
        local v = value_of(i, "f8e4m3")
        if bit.band(i, 0x7f) == 0x7f then
          assert.is_true(isnan(v))
          assert.are.equal(0x7f, bit.band(bits_of(v, "f8e4m3"), 0x7f)) -- still NaN
          assert.are.equal(0x7f, bit.band(bits_f32(v, "f8e4m3"), 0x7f))
        else
          assert.are.equal(i, bits_f32(v, "f8e4m3"))
          assert.are.equal(i, bits_of(v, "f8e4m3"))
        end
      end
    end)

    it("f8e4m3 decodes the format's landmarks", function()
      assert.are.equal(448, value_of(0x7e, "f8e4m3"))
      assert.are.equal(-448, value_of(0xfe, "f8e4m3"))
      assert.are.equal(1.0, value_of(0x38, "f8e4m3"))
      assert.are.equal(2 ^ -6, value_of(0x08, "f8e4m3"))  -- min normal
      assert.are.equal(2 ^ -9, value_of(0x01, "f8e4m3"))  -- min subnormal
      assert.are.equal(7 * 2 ^ -9, value_of(0x07, "f8e4m3"))
      assert.are.equal(240, value_of(0x77, "f8e4m3"))
      assert.are.equal(0, value_of(0x00, "f8e4m3"))
      assert.are.equal(-math.huge, 1 / value_of(0x80, "f8e4m3")) -- -0
    end)

    it("f8e4m3 encodes with round-to-nearest-even and saturation", function()
      for _, path in ipairs({ bits_of, bits_f32 }) do
        assert.are.equal(0x7e, path(448, "f8e4m3"))
        assert.are.equal(0x7e, path(464, "f8e4m3"))       -- tie between 448 and (NaN) 480 -> even 448
        assert.are.equal(0x7e, path(1000, "f8e4m3"))      -- saturate
        assert.are.equal(0xfe, path(-1e30, "f8e4m3"))
        assert.are.equal(0x7e, path(math.huge, "f8e4m3")) -- no Inf: saturate
        assert.are.equal(0xfe, path(-math.huge, "f8e4m3"))
        assert.are.equal(0x7f, bit.band(path(0 / 0, "f8e4m3"), 0x7f))
        assert.are.equal(0x38, path(1.0, "f8e4m3"))
        assert.are.equal(0x58, path(16, "f8e4m3"))        -- 2^4: exponent field 11, mantissa 0
        assert.are.equal(0x58, path(17, "f8e4m3"))        -- 17: tie 16|18 -> 16 (even mantissa)
        assert.are.equal(0x59, path(17.5, "f8e4m3"))      -- nearer 18
        assert.are.equal(0x5a, path(19, "f8e4m3"))        -- 19: tie 18|20 -> 20 (even)
        assert.are.equal(0x01, path(2 ^ -9, "f8e4m3"))
        assert.are.equal(0x00, path(2 ^ -10, "f8e4m3"))   -- tie 0|2^-9 -> 0
        assert.are.equal(0x02, path(3 * 2 ^ -10, "f8e4m3")) -- tie 1|2 (x 2^-9) -> 2
        assert.are.equal(0x08, path(2 ^ -6 - 2 ^ -11, "f8e4m3")) -- rounds up into the min normal
        assert.are.equal(0x80, path(-0.0, "f8e4m3"))
        assert.are.equal(0x00, path(0.0, "f8e4m3"))
        assert.are.equal(0x80, path(-2 ^ -11, "f8e4m3")) -- underflow keeps the sign
      end
      assert.are.equal(0x7f, bit.band(bits_of(0 / 0, "f8e4m3"), 0x7f))
      assert.are.equal(0x7f, bit.band(bits_f32(0 / 0, "f8e4m3"), 0x7f))
    end)

    it("f16 encodes ±0, subnormals, ties, overflow, Inf and NaN", function()
      for _, path in ipairs({ bits_of, bits_f32 }) do
        assert.are.equal(0x0000, path(0.0, "f16"))
        assert.are.equal(0x8000, path(-0.0, "f16"))
        assert.are.equal(0x3c00, path(1.0, "f16"))
        assert.are.equal(0x3c00, path(1 + 2 ^ -11, "f16"))     -- tie -> even (1.0)
        assert.are.equal(0x3c02, path(1 + 3 * 2 ^ -11, "f16")) -- tie -> even (1 + 2^-9)
        assert.are.equal(0x7bff, path(65504, "f16"))           -- max
        assert.are.equal(0x7bff, path(65519, "f16"))
        assert.are.equal(0x7c00, path(65520, "f16"))           -- tie at the top -> Inf
        assert.are.equal(0x7c00, path(1e10, "f16"))
        assert.are.equal(0xfc00, path(-math.huge, "f16"))
        assert.are.equal(0x0001, path(2 ^ -24, "f16"))         -- min subnormal
        assert.are.equal(0x0000, path(2 ^ -25, "f16"))         -- tie 0|1 -> 0
        assert.are.equal(0x0002, path(3 * 2 ^ -25, "f16"))     -- tie 1|2 -> 2
        assert.are.equal(0x03ff, path(1023 * 2 ^ -24, "f16"))  -- max subnormal
        assert.are.equal(0x0400, path(2 ^ -14, "f16"))         -- min normal
        assert.are.equal(0x8001, path(-2 ^ -24, "f16"))
      end
      assert.are.equal(0x7e00, bit.band(bits_of(0 / 0, "f16"), 0x7e00))
      assert.is_true(isnan(value_of(bits_f32(0 / 0, "f16"), "f16")))
      assert.are.equal(2 ^ -24, value_of(0x0001, "f16"))
      assert.are.equal(65504, value_of(0x7bff, "f16"))
      assert.are.equal(math.huge, value_of(0x7c00, "f16"))
      assert.are.equal(-math.huge, 1 / value_of(0x8000, "f16"))
    end)

    it("bf16 encodes ±0, subnormals, ties, overflow, Inf and NaN", function()
      for _, path in ipairs({ bits_of, bits_f32 }) do
        assert.are.equal(0x3f80, path(1.0, "bf16"))
        assert.are.equal(0x3f80, path(1 + 2 ^ -8, "bf16"))     -- tie -> even
        assert.are.equal(0x3f82, path(1 + 3 * 2 ^ -8, "bf16")) -- tie -> even
        assert.are.equal(0x8000, path(-0.0, "bf16"))
        assert.are.equal(0x7f80, path(math.huge, "bf16"))
        assert.are.equal(0x7f80, path(3.4028234663852886e38, "bf16")) -- f32 max rounds up to Inf
        assert.are.equal(0x7f7f, path(3.3895313892515355e38, "bf16")) -- bf16 max
        assert.are.equal(0x0001, path(2 ^ -133, "bf16"))        -- min subnormal
        assert.are.equal(0x0000, path(2 ^ -134, "bf16"))        -- tie -> 0
        assert.are.equal(0x0002, path(3 * 2 ^ -134, "bf16"))    -- tie -> 2
        assert.are.equal(0x0080, path(2 ^ -126, "bf16"))        -- min normal
      end
      assert.is_true(isnan(value_of(bits_of(0 / 0, "bf16"), "bf16")))
      assert.is_true(isnan(value_of(bits_f32(0 / 0, "bf16"), "bf16")))
    end)

    it("f64 sources round once (no double rounding through f32)", function()
      -- 1 + 2^-11 + 2^-40 is just above the f16 tie: rounds up from f64;
      -- through f32 it would become exactly the tie and round to even (down).
      assert.are.equal(0x3c01, bits_of(1 + 2 ^ -11 + 2 ^ -40, "f16"))
      assert.are.equal(0x3f81, bits_of(1 + 2 ^ -8 + 2 ^ -40, "bf16"))
      assert.are.equal(0x39, bits_of(1 + 2 ^ -4 + 2 ^ -40, "f8e4m3"))
    end)

    it("fast f32 paths agree bit for bit with the generic f64 path on random f32 patterns", function()
      local n = 2 ^ 18
      local src = ffi.new("uint32_t[?]", n)
      local x = 0x12345678
      for i = 0, n - 1 do -- xorshift32 over every exponent, NaNs and subnormals included
        x = bit.bxor(x, bit.lshift(x, 13)); x = bit.bxor(x, bit.rshift(x, 17)); x = bit.bxor(x, bit.lshift(x, 5))
        src[i] = x
      end
      local d = ffi.new("double[?]", n)
      C.weft_host_convert(src, DT.f32, d, DT.f64, n)
      for _, dt in ipairs({ "f16", "bf16", "f8e4m3" }) do
        local es = dt == "f8e4m3" and 1 or 2
        local ct = es == 1 and "uint8_t[?]" or "uint16_t[?]"
        local a, b = ffi.new(ct, n), ffi.new(ct, n)
        C.weft_host_convert(src, DT.f32, a, DT[dt], n)
        C.weft_host_convert(d, DT.f64, b, DT[dt], n)
        local bad = 0
        for i = 0, n - 1 do
          if a[i] ~= b[i] then
            local va, vb = value_of(a[i], dt), value_of(b[i], dt)
            if not (isnan(va) and isnan(vb)) then bad = bad + 1 end
          end
        end
        assert.are.equal(0, bad, dt)
      end
    end)

    it("converts floats to ints with round-half-even and saturation, NaN -> 0", function()
      local src = ffi.new("double[9]", { 2.5, 3.5, -2.5, 0 / 0, 1e20, -1e20, 300, -5, 7 })
      local i32 = ffi.new("int32_t[9]")
      local u8 = ffi.new("uint8_t[9]")
      C.weft_host_convert(src, DT.f64, i32, DT.i32, 9)
      C.weft_host_convert(src, DT.f64, u8, DT.u8, 9)
      local want32 = { 2, 4, -2, 0, 2147483647, -2147483648, 300, -5, 7 }
      local want8 = { 2, 4, 0, 0, 255, 0, 255, 0, 7 }
      for i = 1, 9 do
        assert.are.equal(want32[i], i32[i - 1])
        assert.are.equal(want8[i], u8[i - 1])
      end
      local i64 = ffi.new("int64_t[2]", { 3000000000, -7 })
      local back = ffi.new("int32_t[2]")
      C.weft_host_convert(i64, DT.i64, back, DT.i32, 2)
      assert.are.equal(2147483647, back[0])
      assert.are.equal(-7, back[1])
      local f = ffi.new("float[2]")
      C.weft_host_convert(i64, DT.i64, f, DT.f32, 2)
      assert.are.equal(3000000000, f[0])
    end)

    it("hands NaNs with any sign and payload to Lua safely (canonical f64 NaN)", function()
      local f = tensor.empty({ 4 }, "f32")
      local fb = ffi.cast("uint32_t*", f.ptr)
      fb[0], fb[1], fb[2], fb[3] = 0xffffffff, 0xffe00000, 0x7f800001, 0xff800000
      local v = f:to_table()
      assert.is_true(isnan(v[1]) and isnan(v[2]) and isnan(v[3]))
      assert.are.equal(-math.huge, v[4])
      local d = tensor.empty({ 2 }, "f64")
      local db = ffi.cast("uint64_t*", d.ptr)
      db[0], db[1] = 0xfffc000000000001ULL, 0xffffffffffffffffULL
      local w = d:to_table()
      assert.is_true(isnan(w[1]) and isnan(w[2]))
      assert.matches("nan", tostring(d):lower(), 1, true)
      local h = tensor.empty({ 1 }, "f16")
      ffi.cast("uint16_t*", h.ptr)[0] = 0xffff
      assert.is_true(isnan(h:to_table()[1]))
    end)

    it("rejects unknown dtypes with a message", function()
      local a = ffi.new("float[1]")
      assert.are.equal(C.WEFT_EINVAL, C.weft_host_convert(a, 42, a, DT.f32, 1))
      assert.matches("host_convert: unknown source dtype 42", wffi.last_error(), 1, true)
      assert.are.equal(C.WEFT_EINVAL, C.weft_host_fill_random(a, 1, DT.f32, 1, 7))
      assert.matches("dist", wffi.last_error(), 1, true)
    end)
  end)

  describe("random fill", function()
    local function stats(t)
      local v = t:to_table()
      local n, s, s2, mn, mx, in1 = #v, 0, 0, math.huge, -math.huge, 0
      for i = 1, n do
        local x = v[i]
        s = s + x; s2 = s2 + x * x
        if x < mn then mn = x end
        if x > mx then mx = x end
        if math.abs(x) < 1 then in1 = in1 + 1 end
      end
      local mean = s / n
      return { mean = mean, var = s2 / n - mean * mean, min = mn, max = mx, within1 = in1 / n, values = v }
    end

    it("is deterministic in the seed and differs across seeds, for every dtype", function()
      for _, dt in ipairs(ALL) do
        for _, fn in ipairs({ tensor.rand, tensor.randn }) do
          local a = fn({ 1001 }, dt, "cpu", { seed = 42 })
          local b = fn({ 1001 }, dt, "cpu", { seed = 42 })
          local c = fn({ 1001 }, dt, "cpu", { seed = 43 })
          assert.are.same(a:to_table(), b:to_table())
          assert.are_not.same(a:to_table(), c:to_table())
        end
      end
    end)

    it("element i depends only on (seed, i): a prefix fill matches, odd counts too", function()
      for _, dt in ipairs(ALL) do
        for dist = 0, 1 do
          local long = tensor.empty({ 3001 }, dt)
          local short = tensor.empty({ 777 }, dt)
          C.weft_host_fill_random(long.ptr, 3001, DT[dt], 9, dist)
          C.weft_host_fill_random(short.ptr, 777, DT[dt], 9, dist)
          local l, s = long:to_table(), short:to_table()
          for i = 1, 777 do
            assert.is_true(l[i] == s[i] or (isnan(l[i]) and isnan(s[i])), dt .. " " .. dist .. " at " .. i)
          end
        end
      end
    end)

    it("uniform floats lie in [-1, 1) with mean 0 and variance 1/3", function()
      for _, dt in ipairs(FLOATS) do
        local s = stats(tensor.rand({ 100000 }, dt, "cpu", { seed = 5 }))
        assert.is_true(s.min >= -1, dt)
        assert.is_true(s.max < 1, dt)
        assert.is_true(s.min < -0.9 and s.max > 0.9, dt)
        assert.is_true(math.abs(s.mean) < 0.02, dt .. " mean " .. s.mean)
        assert.is_true(math.abs(s.var - 1 / 3) < 0.02, dt .. " var " .. s.var)
      end
    end)

    it("normal floats have mean 0, variance 1 and 68% within one sigma", function()
      for _, dt in ipairs({ "f32", "f16", "bf16", "f64" }) do
        local s = stats(tensor.randn({ 100000 }, dt, "cpu", { seed = 11 }))
        assert.is_true(math.abs(s.mean) < 0.02, dt .. " mean " .. s.mean)
        assert.is_true(math.abs(s.var - 1) < 0.04, dt .. " var " .. s.var)
        assert.is_true(math.abs(s.within1 - 0.6827) < 0.01, dt .. " within1 " .. s.within1)
        assert.is_true(s.max > 3 and s.min < -3, dt)
      end
      -- f8 saturates at 448 but normals never get there; variance still ~1
      local s = stats(tensor.randn({ 100000 }, "f8e4m3", "cpu", { seed = 11 }))
      assert.is_true(math.abs(s.var - 1) < 0.06, "f8 var " .. s.var)
    end)

    it("ints are small: uniform in [-16, 15] (u8 in [0, 15]), every value hit", function()
      for _, dt in ipairs({ "i32", "i64", "u8" }) do
        local s = stats(tensor.rand({ 20000 }, dt, "cpu", { seed = 3 }))
        local lo, hi = dt == "u8" and 0 or -16, 15
        assert.are.equal(lo, s.min)
        assert.are.equal(hi, s.max)
        local seen = {}
        for _, v in ipairs(s.values) do
          assert.are.equal(math.floor(v), v)
          seen[v] = true
        end
        for v = lo, hi do assert.is_true(seen[v], dt .. " never drew " .. v) end
        local n = stats(tensor.randn({ 20000 }, dt, "cpu", { seed = 3 }))
        if dt ~= "u8" then assert.is_true(math.abs(n.mean) < 0.2 and n.var > 10 and n.var < 22, dt) end
      end
    end)

    it("fills and converts a 64 MiB buffer", function()
      local n = 16 * 1024 * 1024
      local a = tensor.randn({ n }, "f32", "cpu", { seed = 1 })
      local b = a:to("bf16")
      local c = b:to("f32")
      local ma, mr = c:compare(a)
      assert.is_true(ma > 0 and mr <= 2 ^ -8, "rel " .. mr)
      a:free(); b:free(); c:free()
    end)
  end)

  describe("compare", function()
    it("reports max abs and max rel error", function()
      local a = tensor.from_table({ 1, 2, 3, -4 }, "f32")
      local ma, mr = a:compare({ 1, 2.5, 3, -4 })
      assert.are.equal(0.5, ma)
      assert.are.equal(0.2, mr)
      ma, mr = a:compare(tensor.from_table({ 1, 2, 3, -4 }, "f64"))
      assert.are.equal(0, ma)
      assert.are.equal(0, mr)
    end)

    it("treats NaN in one side as Inf, NaN in both and equal Infs as equal", function()
      local inf, nan = math.huge, 0 / 0
      local a = tensor.from_table({ nan, inf, -inf, 1 }, "f64")
      local ma, mr = a:compare({ nan, inf, -inf, 1 })
      assert.are.equal(0, ma)
      assert.are.equal(0, mr)
      ma, mr = a:compare({ 0, inf, -inf, 1 })
      assert.are.equal(inf, ma)
      assert.are.equal(inf, mr)
      ma = tensor.from_table({ 1, 2 }, "f32"):compare({ 1, nan })
      assert.are.equal(inf, ma)
      ma = tensor.from_table({ inf }, "f32"):compare({ -inf })
      assert.are.equal(inf, ma)
      ma, mr = tensor.from_table({ 5 }, "f32"):compare({ inf })
      assert.are.equal(inf, ma)
      assert.are.equal(inf, mr)
    end)

    it("guards the relative error against a zero reference", function()
      local ma, mr = tensor.from_table({ 1e-6 }, "f64"):compare({ 0 })
      assert.are.equal(1e-6, ma)
      assert.are.equal(1e-6 / 1e-30, mr)
    end)

    it("compares across dtypes: a bf16 tensor against its f32 source", function()
      local src = tensor.randn({ 4096 }, "f32", "cpu", { seed = 2 })
      local b = src:to("bf16")
      local ma, mr = b:compare(src)
      assert.is_true(ma > 0)
      assert.is_true(mr <= 2 ^ -8, "rel " .. mr)
      assert.are.equal(0, (b:compare(b:to("f64"))))
      local h = src:to("f16")
      local _, mr16 = h:compare(src)
      assert.is_true(mr16 <= 2 ^ -11 or mr16 < 1e-3, "f16 rel " .. mr16) -- subnormal f16 values lose more
    end)

    it("the C compare works on every dtype directly", function()
      for _, dt in ipairs(ALL) do
        local a = tensor.rand({ 100 }, dt, "cpu", { seed = 1 })
        local b = a:clone()
        local ma = ffi.new("double[1]", -1)
        local mr = ffi.new("double[1]", -1)
        assert.are.equal(0, C.weft_host_compare(a.ptr, b.ptr, 100, DT[dt], ma, mr))
        assert.are.equal(0, ma[0])
        assert.are.equal(0, mr[0])
      end
    end)

    it("refuses different element counts", function()
      refuses("weft: tensor.compare: element counts differ", function() tensor.zeros({ 3 }):compare({ 1, 2 }) end)
    end)
  end)

  describe("construction and data", function()
    it("empty/zeros/ones/full set shape, strides, sizes and values for every dtype", function()
      for _, dt in ipairs(ALL) do
        local info = tensor.dtype_info(dt)
        local z = tensor.zeros({ 2, 3, 4 }, dt)
        assert.are.same({ 2, 3, 4 }, z.shape)
        assert.are.same({ 12, 4, 1 }, z.strides)
        assert.are.equal(24, z.numel)
        assert.are.equal(24 * info.size, z.nbytes)
        assert.are.equal(dt, z.dtype)
        assert.are.equal("cpu", z.device)
        assert.is_nil(z.device_index)
        assert.are.equal(3, z:dim())
        assert.are.equal(2, z:size(0))
        assert.are.equal(4, z:size(-1))
        assert.are.same({ 2, 3, 4 }, z:size())
        assert.is_true(z:is_contiguous())
        assert.is_false(z:is_cuda())
        assert.are.equal(info.code, z:dtype_code())
        assert.are.equal(info.size, z:elem_size())
        assert.are.equal(0, tonumber(ffi.cast("uintptr_t", z.ptr)) % 64)
        for _, v in ipairs(z:to_table()) do assert.are.equal(0, v) end
        for _, v in ipairs(tensor.ones({ 5 }, dt):to_table()) do assert.are.equal(1, v) end
        for _, v in ipairs(tensor.full({ 3 }, 6, dt):to_table()) do assert.are.equal(6, v) end
      end
      assert.are.same({ 0.10009765625, 0.10009765625 }, tensor.full({ 2 }, 0.1, "bf16"):to_table())
      assert.are.same({ 448 }, tensor.full({ 1 }, 1e6, "f8e4m3"):to_table())
      assert.are.equal("f32", tensor.empty({ 1 }).dtype)
      assert.are.same({ 7 }, tensor.empty(7).shape)
      local scalar = tensor.full({}, 3)
      assert.are.equal(1, scalar.numel)
      assert.are.same({ 3 }, scalar:to_table())
      local empty = tensor.zeros({ 0, 5 })
      assert.are.equal(0, empty.numel)
      assert.are.same({}, empty:to_table())
    end)

    it("round-trips representable values through every dtype", function()
      local vals = {
        f32 = { 0, -0.5, 1.5, 3.25, -2 ^ 100, 2 ^ -140, 3.4028234663852886e38 },
        f64 = { 0, 0.1, -1e300, 2 ^ -1070, 1 / 3 },
        f16 = { 0, -2, 0.5, 65504, 2 ^ -24, -1.5 },
        bf16 = { 0, 1, -3.5, 2 ^ 100, 2 ^ -133, 256 },
        f8e4m3 = { 0, 1, -448, 2 ^ -9, 0.875, 240 },
        i32 = { 0, -2147483648, 2147483647, 17 },
        i64 = { 0, -2 ^ 53, 2 ^ 53, 9007199254740991, -3 },
        u8 = { 0, 255, 128, 7 },
      }
      for dt, v in pairs(vals) do
        local t = tensor.from_table(v, dt)
        assert.are.same(v, t:to_table(), dt)
        assert.are.same({ #v }, t.shape)
      end
      local neg0 = tensor.from_table({ -0.0 }, "bf16"):to_table()[1]
      assert.are.equal(-math.huge, 1 / neg0)
    end)

    it("from_table rounds for narrow dtypes and infers shape from nesting", function()
      assert.are.same({ 1.0, 0.333984375 }, tensor.from_table({ 1 + 2 ^ -9, 1 / 3 }, "bf16"):to_table())
      local t = tensor.from_table({ { 1, 2, 3 }, { 4, 5, 6 } }, "i32")
      assert.are.same({ 2, 3 }, t.shape)
      assert.are.same({ 1, 2, 3, 4, 5, 6 }, t:to_table())
      local r = tensor.from_table({ 1, 2, 3, 4, 5, 6 }, "f32", { 3, 2 })
      assert.are.same({ 3, 2 }, r.shape)
    end)

    it("from_table validates counts, numbers and integer ranges", function()
      local cases = {
        { function() tensor.from_table({ 1, 2, 3 }, "f32", { 2, 2 }) end, "3 values do not fill shape {2, 2}" },
        { function() tensor.from_table({ 1, "x" }, "f32") end, "value 2 is a string" },
        { function() tensor.from_table({ 1.5 }, "i32") end, "not an integer in range for i32" },
        { function() tensor.from_table({ 256 }, "u8") end, "not an integer in range for u8" },
        { function() tensor.from_table({ -1 }, "u8") end, "not an integer in range for u8" },
        { function() tensor.from_table({ { 1, 2 }, { 3 } }, "f32") end, "not rectangular" },
        { function() tensor.from_table(5, "f32") end, "values must be a table" },
      }
      for _, c in ipairs(cases) do assert.matches(c[2], refuses("weft: tensor.from_table: ", c[1]), 1, true) end
    end)

    it("validates shapes and devices with clear errors", function()
      local cases = {
        { function() tensor.empty({ 2, -3 }) end, "weft: tensor.empty: bad shape {2, -3}: size -3 at dim 1 is negative" },
        { function() tensor.zeros({ 2.5 }) end, "size 2.5 at dim 0 is not an integer" },
        { function() tensor.ones("big") end, "shape must be a table" },
        { function() tensor.empty({ 2 }, "f32", "gpu") end, "unknown device gpu" },
        { function() tensor.full({ 2 }, "x") end, "weft: tensor.full: value must be a number" },
        -- named as the call the user made (was tensor.fill_, at a line inside weft)
        { function() tensor.full({ 4 }, 1.5, "i32") end, "weft: tensor.full: 1.5 is not an integer in range for i32" },
        { function() tensor.full({ 4 }, 300, "u8") end, "weft: tensor.full: 300 is not an integer in range for u8" },
        { function() tensor.randn({ 2 }, "f32", "cpu", { seed = -1 }) end, "seed must be a non-negative integer" },
        { function() tensor.zeros({ 2 }, "i32"):fill_(0.5) end, "weft: tensor.fill_: 0.5 is not an integer" },
        { function() tensor.zeros({ 2 }):size(2) end, "weft: tensor.size: dim 2 out of range" },
      }
      for _, c in ipairs(cases) do refuses(c[2], c[1]) end
    end)

    it("refuses shapes whose byte count overflows, naming the op and the shape (issue 37)", function()
      local big = 2 ^ 31
      local cases = {
        { function() tensor.full({ big, big }, 1, "f32") end,
          "weft: tensor.full: shape {2147483648, 2147483648} of f32 is 1.845e+19 bytes: too large" },
        { function() tensor.empty({ big, big }, "f32") end,
          "weft: tensor.empty: shape {2147483648, 2147483648} of f32" },
        { function() tensor.zeros({ 2 ^ 26, 2 ^ 26, 2 ^ 26 }, "u8") end, "weft: tensor.zeros: shape" },
        { function() tensor.randn({ big, big }, "bf16") end, "weft: tensor.randn: shape" },
        { function() tensor.wrap(ffi.cast("void*", 64), { big, big }, "i64") end, "weft: tensor.wrap: shape" },
        -- a zero size keeps numel at 0 but not the strides of the other dims
        { function() tensor.empty({ 0, big, big, big }, "f32") end, "weft: tensor.empty: shape {0, " },
        { function() tensor.empty({ 2 ^ 51 }, "f64") end, "too large (the limit is 2^53 bytes" },
        { function() tensor.zeros({ 0 / 0 }) end, "weft: tensor.zeros: bad shape {nan}: size nan at dim 0 is not an integer" },
        { function() tensor.zeros({ math.huge }) end, "size inf at dim 0 is not an integer" },
        { function() tensor.zeros({ 2, "3" }) end, 'size the string "3" at dim 1 is not an integer' },
        { function() tensor.zeros({ -2 ^ 40 }) end, "is negative" },
      }
      for _, c in ipairs(cases) do refuses(c[2], c[1]) end
      -- views: a shape that only fits the byte limit through a wrapped product
      local t = tensor.zeros({ 4 })
      refuses("weft: tensor.view: shape", t.view, t, { 2 ^ 62, 2 ^ 62, 0 })
      -- narrow: start + length rounds above 2^53, so it is not computed
      refuses("weft: tensor.narrow: start 9.007199254741e+15, length 1 out of range", t.narrow, t, 0, 2 ^ 53, 1)
      -- the largest tensors that fit still work (0 elements or small)
      assert.are.equal(0, tensor.empty({ 0, 2 ^ 40 }, "f32").numel)
      -- C: a count whose byte size wraps is refused, not copied as 0 bytes
      local src, dst = ffi.new("float[1]"), ffi.new("float[1]")
      assert.is_true(C.weft_host_convert(src, DT.f32, dst, DT.f32, 2 ^ 62) < 0)
      assert.matches("host_convert: .* overflows", wffi.last_error())
    end)

    it("copy_ converts dtypes and refuses mismatched counts", function()
      local a = tensor.from_table({ 1.5, -2.25, 3 }, "f32")
      local b = tensor.zeros({ 3 }, "bf16"):copy_(a)
      assert.are.same({ 1.5, -2.25, 3 }, b:to_table())
      local i = tensor.zeros({ 3 }, "i32"):copy_(a)
      assert.are.same({ 2, -2, 3 }, i:to_table())
      refuses("weft: tensor.copy_: element counts differ", function() tensor.zeros({ 4 }):copy_(a) end)
    end)

    it("clone is independent; to() converts dtype or returns self", function()
      local a = tensor.from_table({ 1, 2, 3 }, "f32")
      local b = a:clone()
      b:fill_(9)
      assert.are.same({ 1, 2, 3 }, a:to_table())
      assert.are.same({ 9, 9, 9 }, b:to_table())
      assert.are.equal(a, a:to("cpu"))
      assert.are.equal(a, a:to("float32"))
      local h = a:to("f16")
      assert.are.equal("f16", h.dtype)
      assert.are.same({ 1, 2, 3 }, h:to_table())
    end)

    it("wrap uses foreign memory without owning it", function()
      local buf = ffi.new("float[4]", { 1, 2, 3, 4 })
      local t = tensor.wrap(buf, { 2, 2 }, "f32", "cpu", buf)
      assert.are.same({ 1, 2, 3, 4 }, t:to_table())
      t:fill_(7)
      assert.are.equal(7, buf[3])
      t:free()
      t:free()
      assert.are.equal(7, buf[0]) -- still ours
      local addr = tonumber(ffi.cast("uintptr_t", buf))
      local t2 = tensor.wrap(addr, { 4 }, "i32")
      assert.are.equal(4, t2.numel)
      refuses("weft: tensor.wrap: ptr must be a cdata pointer", tensor.wrap, "nope", { 1 }, "f32")
    end)

    it("free is idempotent and invalidates views", function()
      local a = tensor.zeros({ 4, 4 })
      local v = a:view({ 16 })
      a:free()
      a:free()
      assert.is_nil(a.ptr)
      refuses("storage was freed", function() return v:to_table() end)
      assert.matches("<freed>", tostring(v), 1, true)
    end)

    it("prints dtype, shape, device and the first values", function()
      assert.are.equal("tensor(f32, {2, 3}, cpu)[1, 2, 3, 4, 5, 6]",
                       tostring(tensor.from_table({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32")))
      assert.are.equal("tensor(i64, {10}, cpu)[0, 1, 2, 3, 4, 5, 6, 7, ...]",
                       tostring(tensor.from_table({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 }, "i64")))
      assert.are.equal("tensor(bf16, {0}, cpu)[]", tostring(tensor.zeros({ 0 }, "bf16")))
      local t = tensor.from_table({ { 1, 2 }, { 3, 4 } }, "f16"):transpose(0, 1)
      assert.are.equal("tensor(f16, {2, 2}, cpu, non-contiguous)[1, 3, 2, 4]", tostring(t))
    end)
  end)

  describe("views", function()
    local function iota(shape, dt)
      local n = 1
      for _, s in ipairs(shape) do n = n * s end
      local v = {}
      for i = 1, n do v[i] = i - 1 end
      return tensor.from_table(v, dt or "f32", shape)
    end

    it("view shares storage and infers -1", function()
      local a = iota({ 2, 3, 4 })
      local v = a:view({ 6, -1 })
      assert.are.same({ 6, 4 }, v.shape)
      assert.are.same({ 4, 1 }, v.strides)
      assert.is_true(v.ptr == a.ptr)
      v:fill_(1)
      assert.are.equal(1, a:to_table()[24])
      assert.are.same({ 24 }, a:reshape({ -1 }).shape)
    end)

    it("view refuses size mismatches, two -1 and non-contiguous tensors", function()
      local a = iota({ 4, 6 })
      local cases = {
        { function() a:view({ 5, 5 }) end, "weft: tensor.view: shape {5, 5} has 25 elements, tensor {4, 6} has 24" },
        { function() a:view({ -1, -1 }) end, "-1 appears more than once" },
        { function() a:view({ 5, -1 }) end, "cannot infer -1 in shape {5, -1} for 24 elements" },
        { function() a:narrow(1, 0, 3):view({ 12 }) end, "is not contiguous" },
        { function() a:transpose(0, 1):reshape({ 24 }) end, "is not contiguous" },
      }
      for _, c in ipairs(cases) do refuses(c[2], c[1]) end
    end)

    it("narrow along dim 0 stays contiguous, along a later dim does not", function()
      local a = iota({ 4, 6 })
      local r = a:narrow(0, 1, 2)
      assert.is_true(r:is_contiguous())
      assert.are.same({ 2, 6 }, r.shape)
      assert.are.equal(6 * 4, tonumber(ffi.cast("uintptr_t", r.ptr)) - tonumber(ffi.cast("uintptr_t", a.ptr)))
      assert.are.same({ 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17 }, r:to_table())
      local c = a:narrow(1, 2, 3)
      assert.is_false(c:is_contiguous())
      assert.are.same({ 4, 3 }, c.shape)
      assert.are.same({ 6, 1 }, c.strides)
      assert.are.same({ 2, 3, 4, 8, 9, 10, 14, 15, 16, 20, 21, 22 }, c:to_table())
      assert.is_true(a:narrow(-1, 0, 6):is_contiguous()) -- the full width is still contiguous
      local cc = c:contiguous()
      assert.is_true(cc:is_contiguous())
      assert.are.same(c:to_table(), cc:view({ -1 }):to_table())
    end)

    it("narrow checks its range", function()
      local a = iota({ 4, 6 })
      for _, args in ipairs({ { 1, 4, 3 }, { 0, -1, 2 }, { 1, 0, 7 }, { 0, 0, -1 } }) do
        local err = refuses("weft: tensor.narrow: start", a.narrow, a, args[1], args[2], args[3])
        assert.matches("out of range", err, 1, true)
      end
      refuses("weft: tensor.narrow: dim 2 out of range for a 2-dim tensor {4, 6}", a.narrow, a, 2, 0, 1)
    end)

    it("transpose gives a non-contiguous view in transposed order", function()
      local a = iota({ 2, 3 })
      local t = a:transpose(0, 1)
      assert.is_false(t:is_contiguous())
      assert.are.same({ 3, 2 }, t.shape)
      assert.are.same({ 1, 3 }, t.strides)
      assert.are.same({ 0, 3, 1, 4, 2, 5 }, t:to_table())
      assert.is_true(t:transpose(0, 1):is_contiguous())
      local c = t:clone()
      assert.is_true(c:is_contiguous())
      assert.are.same({ 0, 3, 1, 4, 2, 5 }, c:to_table())
      assert.are.same(t:to_table(), t:to("bf16"):to_table())
      -- 3-d transpose of the outer dims
      local b = iota({ 2, 2, 3 }):transpose(0, 1)
      assert.are.same({ 0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11 }, b:to_table())
    end)

    it("copy_ and fill_ write through non-contiguous views only", function()
      local a = iota({ 3, 4 })
      a:narrow(1, 1, 2):fill_(-1)
      assert.are.same({ 0, -1, -1, 3, 4, -1, -1, 7, 8, -1, -1, 11 }, a:to_table())
      local b = tensor.zeros({ 2, 3 }, "bf16")
      b:transpose(0, 1):copy_(tensor.from_table({ 1, 2, 3, 4, 5, 6 }, "f32", { 3, 2 }))
      assert.are.same({ 1, 3, 5, 2, 4, 6 }, b:to_table())
      local ma = b:transpose(0, 1):compare(tensor.from_table({ 1, 2, 3, 4, 5, 6 }, "f64"))
      assert.are.equal(0, ma)
    end)
  end)

  it("host use never loads weft.cuda", function()
    if cuda_was_loaded then return pending("weft.cuda was loaded before this spec") end
    assert.is_nil(package.loaded["weft.cuda"])
  end)

  describe("device branch (mock weft.cuda backed by host memory)", function()
    local mock, allocs
    before_each(function()
      allocs = { live = 0, calls = {} }
      mock = {
        available = function() return true end,
        device_count = function() return 2 end,
        current_device = function() return 1 end,
        alloc = function(n, dev)
          allocs.live = allocs.live + 1
          allocs.calls[#allocs.calls + 1] = "alloc " .. dev
          return C.weft_host_alloc(n)
        end,
        free = function(p, dev)
          allocs.live = allocs.live - 1
          allocs.calls[#allocs.calls + 1] = "free " .. dev
          C.weft_host_free(p)
        end,
        copy = function(dst, src, n) allocs.calls[#allocs.calls + 1] = "copy"; ffi.copy(dst, src, n) end,
        fill_random = function(p, n, code, seed, dist, dev)
          allocs.calls[#allocs.calls + 1] = "fill_random " .. dev
          assert(C.weft_host_fill_random(p, n, code, seed, dist) == 0)
        end,
      }
      package.loaded["weft.cuda"] = mock
    end)
    after_each(function() package.loaded["weft.cuda"] = nil end)

    it("allocates on the named or current device and moves data through copy", function()
      local d = tensor.from_table({ 1, 2, 3, 4 }, "bf16", { 2, 2 }, "cuda:0")
      assert.are.equal("cuda:0", d.device)
      assert.are.equal(0, d.device_index)
      assert.is_true(d:is_cuda())
      assert.are.same({ 1, 2, 3, 4 }, d:to_table())
      local cur = tensor.zeros({ 3 }, "f32", "cuda")
      assert.are.equal("cuda:1", cur.device)
      assert.are.same({ 0, 0, 0 }, cur:to_table())
      local h = d:to("cpu")
      assert.are.equal("cpu", h.device)
      assert.are.same({ 1, 2, 3, 4 }, h:to_table())
      local back = h:clone("cuda:1")
      assert.are.equal("cuda:1", back.device)
      assert.are.same({ 1, 3, 2, 4 }, back:transpose(0, 1):to_table())
      assert.are.equal(0, (back:compare(h)))
      assert.matches("tensor(bf16, {2, 2}, cuda:0)[1, 2, 3, 4]", tostring(d), 1, true)
    end)

    it("random fills go to cuda.fill_random with the dtype code and seed", function()
      local d = tensor.randn({ 100 }, "bf16", "cuda:1", { seed = 7 })
      assert.are.equal("fill_random 1", allocs.calls[#allocs.calls])
      local h = tensor.randn({ 100 }, "bf16", "cpu", { seed = 7 })
      assert.are.same(h:to_table(), d:to_table()) -- the mock uses the host generator
    end)

    it("writes non-contiguous device views through a staged span", function()
      local d = tensor.from_table({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 }, "f32", { 3, 4 }, "cuda:0")
      d:narrow(1, 1, 2):fill_(-1)
      assert.are.same({ 0, -1, -1, 3, 4, -1, -1, 7, 8, -1, -1, 11 }, d:to_table())
      d:narrow(0, 1, 2):narrow(1, 0, 1):copy_(tensor.from_table({ 40, 80 }, "f64"))
      assert.are.same({ 0, -1, -1, 3, 40, -1, -1, 7, 80, -1, -1, 11 }, d:to_table())
    end)

    it("frees device storage explicitly once, and through the finalizer", function()
      local d = tensor.empty({ 16 }, "f32", "cuda:0")
      local before = allocs.live
      d:free()
      d:free()
      assert.are.equal(before - 1, allocs.live)
      do tensor.empty({ 16 }, "f32", "cuda:0") end
      local live = allocs.live
      collectgarbage(); collectgarbage()
      assert.is_true(allocs.live < live)
    end)

    it("reports a missing device cleanly", function()
      mock.available = function() return false end
      refuses("weft: tensor.zeros: no CUDA device", tensor.zeros, { 2 }, "f32", "cuda")
    end)
  end)

  describe("#gpu real device", function()
    it("round-trips, fills and compares on the GPU", function()
      local ok, cuda = pcall(require, "weft.cuda")
      if not (ok and pcall(cuda.available) and cuda.available()) then
        package.loaded["weft.cuda"] = nil
        return pending("no CUDA device")
      end
      local h = tensor.randn({ 1000, 64 }, "f32", "cpu", { seed = 4 })
      local d = h:to("cuda")
      assert.is_true(d:is_cuda())
      assert.are.equal(0, (d:compare(h)))
      local b = tensor.zeros({ 1000, 64 }, "bf16", "cuda"):copy_(d)
      local _, mr = b:compare(h)
      assert.is_true(mr <= 2 ^ -8)
      local r1 = tensor.randn({ 4096 }, "bf16", "cuda", { seed = 9 })
      local r2 = tensor.randn({ 4096 }, "bf16", "cuda", { seed = 9 })
      assert.are.equal(0, (r1:compare(r2)))
      for _, dt in ipairs({ "f32", "bf16", "f16", "f64", "i32" }) do
        -- the device generator is the host one: uniform fills agree bit for bit
        local hu = tensor.rand({ 1001 }, dt, "cpu", { seed = 5 })
        local du = tensor.rand({ 1001 }, dt, "cuda", { seed = 5 })
        assert.are.equal(0, (du:compare(hu)), dt)
        local hn = tensor.randn({ 1001 }, dt, "cpu", { seed = 5 })
        local dn = tensor.randn({ 1001 }, dt, "cuda", { seed = 5 })
        -- a few f32 ulp apart before rounding: at most one ulp of the dtype
        -- near |z| ~ 5, e.g. 2^-5 for bf16
        local tol = ({ f32 = 1e-4, bf16 = 0.07, f16 = 0.01, f64 = 1e-9, i32 = 1 })[dt]
        local ma = dn:compare(hn)
        assert.is_true(ma <= tol, dt .. " normal max abs " .. ma)
      end
      local s = 0
      for _, v in ipairs(r1:to_table()) do s = s + v * v end
      assert.is_true(math.abs(s / 4096 - 1) < 0.15)
      assert.are.same({ 3, 3 }, tensor.full({ 2 }, 3, "f16", "cuda"):to_table())
      d:narrow(1, 0, 8):fill_(0)
      assert.are.equal(0, d:to_table()[1])
    end)
  end)
end)
