-- weft.serialize: round trips of every supported value, refusal of what it
-- cannot carry, and a decoder that rejects garbage without ever running it.
describe("weft.serialize", function()
  local S = require("weft.serialize")
  local ffi = require("ffi")

  local function rt(v) return S.decode(S.encode(v)) end

  local function deep_equal(a, b, seen)
    if type(a) ~= type(b) then return false end
    if type(a) == "number" then
      if a ~= a then return b ~= b end
      return a == b and (a ~= 0 or 1 / a == 1 / b)
    end
    if type(a) ~= "table" then return a == b end
    seen = seen or {}
    if seen[a] then return true end
    seen[a] = true
    for k, v in pairs(a) do if not deep_equal(v, b[k], seen) then return false end end
    for k in pairs(b) do if a[k] == nil then return false end end
    return true
  end

  it("round-trips nil, booleans and strings with any bytes", function()
    assert.is_nil(rt(nil))
    assert.are.equal(true, rt(true))
    assert.are.equal(false, rt(false))
    assert.are.equal("", rt(""))
    local all = {}
    for i = 0, 255 do all[#all + 1] = string.char(i) end
    local s = table.concat(all):rep(300)
    assert.are.equal(s, rt(s))
  end)

  it("round-trips numbers exactly: integers, fractions, inf, nan, -0", function()
    local nums = { 0, 1, 127, 128, 255, 16383, 16384, -1, -128, 2 ^ 31, -2 ^ 31, 2 ^ 53, -2 ^ 53,
                   2 ^ 53 + 2, 2 ^ 63, 0.5, -0.1, 1e308, 5e-324, math.pi, 1 / 0, -1 / 0 }
    for _, n in ipairs(nums) do assert.are.equal(n, rt(n)) end
    local z = rt(-0.0)
    assert.are.equal(0, z)
    assert.are.equal(-1 / 0, 1 / z)
    local nan = rt(0 / 0)
    assert.is_true(nan ~= nan)
  end)

  it("encodes small integers compactly", function()
    assert.are.equal(5, #S.encode(7))          -- header + one byte
    assert.are.equal(7, #S.encode(300))        -- tag + 2-byte varint
    assert.are.equal(13, #S.encode(0.5))       -- tag + 8-byte double
  end)

  it("round-trips 64-bit cdata integers", function()
    local a = rt(-9223372036854775807LL - 1)
    assert.is_true(ffi.istype("int64_t", a))
    assert.are.equal(-9223372036854775807LL - 1, a)
    local b = rt(18446744073709551615ULL)
    assert.is_true(ffi.istype("uint64_t", b))
    assert.are.equal(18446744073709551615ULL, b)
  end)

  it("encodes a table's own contents: a metatable's __index default is never asked (it answers forever)", function()
    local t = setmetatable({ 1, 2, x = 3 }, { __index = function() return 0 end })
    local back = rt(t)
    assert.are.same({ 1, 2, x = 3 }, back)
    assert.are.same({}, rt(setmetatable({}, { __index = function() return 0 end })))
  end)

  it("refuses a freed tensor, naming where it sits (never reads freed memory)", function()
    local T = require("weft.tensor")
    local t = T.ones({ 3 })
    local v = t:narrow(0, 0, 2)
    t:free()
    local ok, err = pcall(S.encode, { a = { t } })
    assert.is_false(ok)
    assert.matches("value.a%[1%] is a tensor whose storage was freed", err)
    ok, err = pcall(S.encode, { x = v })
    assert.is_false(ok)
    assert.matches("value.x is a tensor whose storage was freed", err)
  end)

  it("round-trips nested tables with holes, mixed keys and shared sub-tables", function()
    local shared = { 1, 2 }
    local v = { 1, 2, nil, 4, x = { y = { z = { "deep" } } }, [true] = "t", [0.25] = -0.0,
                [-3] = { shared, shared }, [100] = false, [{ "tablekey" }] = 1 }
    local d = rt(v)
    assert.are.equal(1, d[1]); assert.are.equal(2, d[2]); assert.is_nil(d[3]); assert.are.equal(4, d[4])
    assert.are.equal("deep", d.x.y.z[1])
    assert.are.equal("t", d[true])
    assert.are.equal(-1 / 0, 1 / d[0.25])
    assert.are.same({ 1, 2 }, d[-3][1])
    assert.are.same({ 1, 2 }, d[-3][2])
    assert.are.equal(false, d[100])
    local found
    for k, val in pairs(d) do if type(k) == "table" then found = k[1] .. val end end
    assert.are.equal("tablekey1", found)
    local big = {}
    for i = 1, 10000 do big[i] = { i, tostring(i), i + 0.5 } end
    assert.is_true(deep_equal(big, rt(big)))
  end)

  it("refuses cycles, functions, userdata, threads and other cdata, naming where", function()
    local c = { a = { b = {} } }
    c.a.b.back = c
    assert.has_error(function() S.encode(c) end,
      "weft: encode: value.a.b.back contains a cycle (a table that contains itself)")
    local ok, err = pcall(S.encode, { f = function() end })
    assert.is_false(ok); assert.matches("cannot serialize a function at value.f", err)
    ok, err = pcall(S.encode, { io.stdout })
    assert.is_false(ok); assert.matches("userdata at value%[1%]", err)
    ok, err = pcall(S.encode, coroutine.create(function() end))
    assert.is_false(ok); assert.matches("thread", err)
    ok, err = pcall(S.encode, ffi.new("int[2]"))
    assert.is_false(ok); assert.matches("cannot serialize ctype<int %[2%]>", err)
    ok, err = pcall(S.encode, { [print] = 1 })
    assert.is_false(ok); assert.matches("table key", err)
  end)

  it("bounds nesting depth on both sides", function()
    local v = {}
    local cur = v
    for _ = 1, 150 do cur[1] = {}; cur = cur[1] end
    local ok, err = pcall(S.encode, v)
    assert.is_false(ok); assert.matches("nests deeper than 100 levels", err)
    local s = S.encode(v, { max_depth = 200 })
    ok, err = pcall(S.decode, s)
    assert.is_false(ok); assert.matches("nesting deeper than 100 levels", err)
    assert.is_true(deep_equal(v, S.decode(s, { max_depth = 200 })))
    -- a hand-made frame nesting 100000 levels deep fails fast, no stack overflow
    local frame = "WFS\1" .. ("\7\1\0"):rep(100000) .. "\0"
    ok, err = pcall(S.decode, frame)
    assert.is_false(ok); assert.matches("nesting deeper", err)
  end)

  it("rejects garbage, truncation and lies about lengths with clear errors", function()
    local cases = {
      { "", "bad header" },
      { "hello world", "bad header" },
      { "WFS\1", "bad header" },
      { "WFS\1\99", "unknown value tag 0x63" },
      { "WFS\1\6\10abc", "truncated input: string needs 10 bytes, 3 left" },
      { "WFS\1\3\0\0", "truncated input: double needs 8 bytes" },
      { "WFS\1\7\255\255\255\255\15\0", "array length" },
      { "WFS\1\7\0\200\1", "hash length" },
      { "WFS\1\7\2\0\129", "table claims 2+0 entries" },
      { "WFS\1\7\2\0\6\0", "truncated input: value tag" },
      { "WFS\1\7\1\0\0", "nil in the array part" },
      { "WFS\1\7\0\1\0\129", "nil table key" },
      { "WFS\1\7\0\1\3\0\0\0\0\0\0\248\127\129", "NaN table key" },
      { "WFS\1\7\0\2\129\129\129\130", "duplicate table key 1" },
      { "WFS\1\4\255\255\255\255\255\255\255\255\1", "varint longer than 8 bytes" },
      { "WFS\1\4\255\255\255\255\255\255\255\127", "exceeds the limit" },
      { "WFS\1\129\129", "1 trailing bytes" },
      { "WFS\1\8\1\2", "truncated input: int64" },
      { "WFS\1\10\3abc\0\0", "unknown tensor dtype \"abc\"" },
      { "WFS\1\10\3f32\1\2\9", "needs 8 bytes, frame says 9" },
      { "WFS\1\10\3f32\1\2\8\1", "truncated input: tensor data" },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(S.decode, c[1])
      assert.is_false(ok, "accepted: " .. c[2])
      assert.is_truthy(err:find(c[2], 1, true), ("expected %q in %q"):format(c[2], tostring(err)))
      assert.is_truthy(err:match("^weft: decode: "), err)
    end
    assert.has_error(function() S.decode(42) end, "weft: decode: expected a string of bytes, got a number")
  end)

  it("never executes received bytes (Lua source and bytecode are just garbage)", function()
    _G.__weft_pwned = nil
    local payloads = { "_G.__weft_pwned = true", string.dump(function() _G.__weft_pwned = true end),
                       "WFS\1" .. string.dump(function() _G.__weft_pwned = true end) }
    for _, p in ipairs(payloads) do
      local ok = pcall(S.decode, p)
      assert.is_false(ok)
    end
    assert.is_nil(_G.__weft_pwned)
  end)

  it("survives random mutations of valid frames (errors or values, never crashes)", function()
    local base = S.encode({ 1, "two", { three = 3.5, four = { true, false } }, 5LL, -7 })
    local seed = 12345
    local function rnd(n) seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n end
    for _ = 1, 2000 do
      local b = { base:byte(1, -1) }
      for _ = 1, 1 + rnd(3) do b[1 + rnd(#b)] = rnd(256) end
      local cut = #b - rnd(3)
      local s = string.char(unpack(b, 1, cut))
      local ok, err = pcall(S.decode, s)
      if not ok then assert.is_truthy(tostring(err):match("^weft: decode: "), err) end
    end
  end)

  describe("tensors", function()
    local T = require("weft.tensor")

    it("travel by value: dtype, shape and bytes", function()
      for _, dt in ipairs({ "f32", "f16", "bf16", "i32", "i64", "u8", "f64", "f8e4m3" }) do
        local t = T.rand({ 3, 5 }, dt, nil, { seed = 3 })
        if dt == "i32" or dt == "i64" or dt == "u8" then t = T.full({ 3, 5 }, 7, dt) end
        local d = rt({ w = t })
        assert.is_true(T.is_tensor(d.w))
        assert.are.equal(dt, d.w.dtype)
        assert.are.same({ 3, 5 }, d.w.shape)
        assert.are.equal(ffi.string(t.ptr, t.nbytes), ffi.string(d.w.ptr, d.w.nbytes))
      end
    end)

    it("copies non-contiguous views and scalars/empties correctly", function()
      local t = T.randn({ 4, 6 }, "f32", nil, { seed = 9 })
      local v = t:transpose(0, 1):narrow(0, 1, 3)
      local d = rt(v)
      assert.are.same({ 3, 4 }, d.shape)
      assert.are.same(v:to_table(), d:to_table())
      local e = rt(T.empty({ 0, 7 }, "bf16"))
      assert.are.same({ 0, 7 }, e.shape)
      assert.are.equal(0, e.numel)
      local s = rt(T.full({}, 2.5, "f32"))
      assert.are.same({}, s.shape)
      assert.are.equal(2.5, s:to_table()[1])
    end)
  end)
end)
