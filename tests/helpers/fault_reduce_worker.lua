-- One definition of every reduction on every host backend (run through
-- weft-run by tests/faults/fault_reduce_spec.lua; WEFT_TEST_BACKEND=store forces the
-- store path, else shared memory). Prints "OK <name>" per passed check.
--   exact   integers wrap (two's complement, u8 mod 256) whatever the JIT
--           state: i32 2e9 + 2e9 - 2e9, i32 65536 * 65536, i64, u8
--   nan     float max/min propagate NaN wherever it sits and whichever rank
--           holds it (f32, f64, f16, bf16; short, vector-body and large sizes)
--   same    (WEFT_TEST_SAME=1) the shm engine and the store path give
--           bit-identical results on random data, every dtype x op, and
--           those results match a reference computed here in Lua from every
--           rank's inputs (regenerated from their seeds): integers exactly,
--           max/min exactly, float sums/products within the dtype's rounding
--           (so one wrong kernel shared by both paths is caught too)
local U = require("helpers.group_util")
local weft, ffi = U.weft, U.ffi
local T = weft.tensor
local ok, check = U.ok, U.check

local backend = os.getenv("WEFT_TEST_BACKEND")
local w = weft.init { backend = backend ~= "" and backend or nil }
local W, me = w.world_size, w.rank_in_group
local label = (backend ~= nil and backend ~= "") and backend or "shm"

local CT = { i32 = "int32_t *", i64 = "int64_t *", u8 = "uint8_t *" }

-- a tensor of n integers of dtype dt, element i (0-based) = f(i) (a number or
-- an int64 cdata), written through the FFI (exact for i64)
local function ints(dt, n, f)
  local t = T.zeros({ n }, dt)
  local p = ffi.cast(CT[dt], t.ptr)
  for i = 0, n - 1 do p[i] = f(i) end
  return t
end

local function expect_ints(t, dt, want, what)
  local p = ffi.cast(CT[dt], t.ptr)
  for i = 0, t.numel - 1 do
    local got, exp = p[i], want(i)
    if dt == "i64" then got, exp = ffi.cast("int64_t", got), ffi.cast("int64_t", exp) end
    check(got == exp, "%s %s: element %d is %s, expected %s", label, what, i, tostring(got), tostring(exp))
  end
end

---------------------------------------------------------------- exact integers
if W >= 3 then
  -- 2e9 + 2e9 - 2e9 on the first three ranks: the partial sum leaves the i32
  -- range and wraps back (a saturating conversion gives -2147483648)
  local v = ({ 2000000000, 2000000000, -2000000000 })[me + 1] or 0
  for _, n in ipairs({ 1, 7, 1000 }) do
    local x = ints("i32", n, function() return v end)
    w:all_reduce(x)
    expect_ints(x, "i32", function() return 2000000000 end, "i32 sum 2e9+2e9-2e9 n=" .. n)
  end
  -- i64: 2^62 + 2^62 - 2^62 wraps through -2^63
  local v64 = ({ 4611686018427387904LL, 4611686018427387904LL, -4611686018427387904LL })[me + 1] or 0LL
  local x = ints("i64", 9, function() return v64 end)
  w:all_reduce(x)
  expect_ints(x, "i64", function() return 4611686018427387904LL end, "i64 sum 2^62+2^62-2^62")
  ok(label .. " integer sums wrap")
end
do
  -- i32 65536 * 65536 = 2^32 = 0 (mod 2^32); i64 2^32 * 2^32 = 0 (mod 2^64)
  local x = ints("i32", 5, function() return me < 2 and 65536 or 1 end)
  w:all_reduce(x, "prod")
  expect_ints(x, "i32", function() return 0 end, "i32 prod 65536*65536")
  local y = ints("i32", 5, function(i) return me < 2 and 65536 + i or 1 end)
  w:all_reduce(y, "prod") -- (65536 + i)^2 mod 2^32 = 131072 i + i^2
  expect_ints(y, "i32", function(i) return 131072 * i + i * i end, "i32 prod (65536+i)^2")
  local z = ints("i64", 5, function() return me < 2 and 4294967296LL or 1LL end)
  w:all_reduce(z, "prod")
  expect_ints(z, "i64", function() return 0LL end, "i64 prod 2^32*2^32")
  -- u8: sums and products mod 256
  local s = ints("u8", 33, function(i) return (200 + i) % 256 end)
  w:all_reduce(s)
  expect_ints(s, "u8", function(i) return ((200 + i) % 256) * W % 256 end, "u8 sum")
  local p = ints("u8", 33, function() return me < 2 and 16 or 1 end)
  w:all_reduce(p, "prod")
  expect_ints(p, "u8", function() return 0 end, "u8 prod 16*16")
  -- extremes survive max/min exactly
  local m = ints("i64", 3, function(i)
    return me == i % W and (i == 1 and -9223372036854775807LL - 1 or 9223372036854775807LL) or 0LL
  end)
  w:all_reduce(m, "max")
  expect_ints(m, "i64", function(i) return i == 1 and 0LL or 9223372036854775807LL end, "i64 max extremes")
  ok(label .. " integer products wrap")
end

---------------------------------------------------------------- NaN
-- Element k holds NaN on rank k % W (and, at k % 5 == 4, on every rank);
-- every other value is finite. max/min must give NaN exactly where any rank
-- has one, the true max/min elsewhere.
local function nan_case(dt, n, rop)
  local vals, want = {}, {}
  for k = 0, n - 1 do
    local holder = (k % 3 == 0) and (k % W) or nil -- NaN on one rank
    local all = k % 17 == 16                       -- NaN on every rank
    local v = ((k * 7 + me * 3) % 11) - 5
    vals[k + 1] = (all or holder == me) and 0 / 0 or v
    if holder or all then want[k + 1] = "nan"
    else
      local best
      for r = 0, W - 1 do
        local u = ((k * 7 + r * 3) % 11) - 5
        if best == nil or (rop == "max" and u > best) or (rop == "min" and u < best) then best = u end
      end
      want[k + 1] = best
    end
  end
  local x = T.from_table(vals, dt)
  w:all_reduce(x, rop)
  local got = x:to_table()
  for k = 1, n do
    if want[k] == "nan" then
      check(got[k] ~= got[k], "%s %s %s n=%d: element %d is %s, expected NaN (held by rank %s)",
            label, dt, rop, n, k - 1, tostring(got[k]), tostring((k - 1) % W))
    else
      check(got[k] == want[k], "%s %s %s n=%d: element %d is %s, expected %s", label, dt, rop, n, k - 1,
            tostring(got[k]), tostring(want[k]))
    end
  end
end
for _, dt in ipairs({ "f32", "f64", "f16", "bf16" }) do
  for _, rop in ipairs({ "max", "min" }) do
    -- 2: scalar only; 67: vector body + tail; 40000: the 3+ rank split and
    -- zero-copy on shm (arena memory from 64 KiB)
    for _, n in ipairs({ 2, 67, 40000 }) do nan_case(dt, n, rop) end
  end
end
do -- the issue's case: rank 0 {NaN, 1}, rank 1 {1, NaN}
  local x = T.from_table(me == 0 and { 0 / 0, 1 } or me == 1 and { 1, 0 / 0 } or { 1, 1 }, "f32")
  w:all_reduce(x, "max")
  local g = x:to_table()
  check(g[1] ~= g[1] and g[2] ~= g[2], "%s f32 max {NaN,1},{1,NaN}: got {%s, %s}", label, tostring(g[1]), tostring(g[2]))
end
ok(label .. " max/min propagate NaN")

---------------------------------------------------------------- shm == store, bit for bit
if os.getenv("WEFT_TEST_SAME") == "1" then
  local function random_tensor(dt, n, seed)
    if dt == "i32" or dt == "i64" or dt == "u8" then
      local t = T.zeros({ n }, dt)
      local p = ffi.cast("uint8_t *", t.ptr)
      local s = seed * 2654435761 % 4294967296
      for i = 0, t.nbytes - 1 do
        s = (s * 1103515245 + 12345) % 2147483648
        p[i] = math.floor(s / 65536) % 256
      end
      return t
    end
    return T.randn({ n }, dt, nil, { seed = seed })
  end
  local function run(dt, rop, n, seed, how)
    w.host_backend = how == "store" and "store" or nil
    w._dispatch = nil -- the policy decides again with the forced backend
    local x = random_tensor(dt, n, seed)
    local chosen = weft.policy.select(w, "all_reduce", x, rop)
    w:all_reduce(x, rop)
    local s = ffi.string(x.ptr, x.nbytes)
    local vals = x:to_table()
    x:free()
    return s, chosen, vals
  end

  -- the reference: element i of the reduction of every rank's input,
  -- integers through int64 cdata (wraps mod 2^64), cut to the dtype's width
  local SEED = function(n, r, dt) return 1000 * n + 10 * r + #dt end
  local EPS = { f32 = 2 ^ -23, f16 = 2 ^ -10, bf16 = 2 ^ -7, f64 = 2 ^ -52 }
  local QUANTUM = { f32 = 2 ^ -149, f16 = 2 ^ -24, bf16 = 2 ^ -133, f64 = 2 ^ -1074 }   -- subnormal step
  local ICT = { i32 = "int32_t *", i64 = "int64_t *", u8 = "uint8_t *" }
  local function wrap(dt, v)
    if dt == "i32" then return ffi.cast("int32_t", v) end
    if dt == "u8" then return ffi.cast("uint8_t", v) end
    return v
  end
  local function check_reference(dt, rop, n, out_bytes, got)
    local ins = {}
    for r = 0, W - 1 do ins[r + 1] = random_tensor(dt, n, SEED(n, r, dt)) end
    if ICT[dt] then
      local o = ffi.cast(ICT[dt], ffi.cast("const char *", out_bytes))
      local ps = {}
      for r = 1, W do ps[r] = ffi.cast(ICT[dt], ins[r].ptr) end
      for i = 0, n - 1 do
        local a = ffi.new("int64_t", ps[1][i])
        for r = 2, W do
          local b = ffi.new("int64_t", ps[r][i])
          if rop == "sum" then a = a + b elseif rop == "prod" then a = a * b
          elseif rop == "max" then if b > a then a = b end
          else if b < a then a = b end end
        end
        local want = ffi.new("int64_t", wrap(dt, a))
        if ffi.new("int64_t", o[i]) ~= want then
          check(false, "%s %s n=%d element %d: %s, the reference says %s", dt, rop, n, i,
                tostring(o[i]), tostring(want))
        end
      end
    else
      local vs = {}
      for r = 1, W do vs[r] = ins[r]:to_table() end
      for i = 1, n do
        local a, mag = vs[1][i], math.abs(vs[1][i])
        for r = 2, W do
          local b = vs[r][i]
          if rop == "sum" then a = a + b; mag = mag + math.abs(b)
          elseif rop == "prod" then a = a * b; mag = math.abs(a)
          elseif rop == "max" then a = math.max(a, b)
          else a = math.min(a, b) end
        end
        -- sums, products: within a rounding of the dtype per operand (and
        -- the subnormal step, for tiny products)
        local tol = (rop == "sum" or rop == "prod") and 2 * W * EPS[dt] * mag + QUANTUM[dt] or 0
        if not (math.abs(got[i] - a) <= tol) then
          check(false, "%s %s n=%d element %d: %.9g, the reference says %.9g", dt, rop, n, i, got[i], a)
        end
      end
    end
    for r = 1, W do ins[r]:free() end
  end
  for _, dt in ipairs({ "f32", "f16", "bf16", "f64", "i32", "i64", "u8" }) do
    for _, rop in ipairs({ "sum", "max", "min", "prod" }) do
      for _, n in ipairs({ 13, 4111, 50000 }) do
        local seed = SEED(n, me, dt)
        local a, be_a, vals = run(dt, rop, n, seed, "shm")
        local b, be_b = run(dt, rop, n, seed, "store")
        check(be_b == "store" and be_a ~= "store", "backends %s / %s", tostring(be_a), tostring(be_b))
        check(a == b, "%s %s n=%d: the %s backend and the store disagree", dt, rop, n, be_a)
        check_reference(dt, rop, n, a, vals)
      end
    end
  end
  w.host_backend, w._dispatch = nil, nil
  ok("shm and store bit-identical, every dtype x op")
end

weft.shutdown()
