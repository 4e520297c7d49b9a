-- The quick all-reduce's codec on the CPU: its reference (weft_qr_reference,
-- the kernel's exact operations; tests/gpu/gpu_quick_spec.lua holds the kernel to
-- it bit for bit) against an f64 reference, element by element, within the
-- bound docs/quick-allreduce.md states, at worlds 2/4/6/8, bf16 and f16, on
-- normal data, outlier channels (50-100x), all-zero blocks, subnormals and
-- the range's extremes; NaN/Inf confined to their block; the bound not
-- vacuous; SNR on normal and outlier data (printed for the docs).
local Q = require("weft.quick")
local T = require("weft.tensor")
local QC = require("helpers.quick_cases")

local CODECS = { "fp", "int8", "int4", "fp8" }
local N = 4096 + 13   -- odd tail: a partial vector and a partial block

describe("quick all-reduce codec (CPU reference)", function()
  for _, dt in ipairs { "bf16", "f16" } do
    for _, W in ipairs { 2, 4, 6, 8 } do
      for _, class in ipairs(QC.CLASSES) do
        it(("%s world %d %s: every element within the stated bound, every codec"):format(dt, W, class), function()
          local xs, ts = QC.make(class, dt, W, N)
          local ex = QC.exact(xs)
          for _, codec in ipairs(CODECS) do
            local got = Q.reference(codec, dt, ts):to_table()
            local b = Q.bounds(codec, dt, xs)
            local i, g, e, bb = QC.violation(got, ex, b)
            assert(i == nil, ("%s %s W=%d %s: element %s: got %s, exact %s, |err| %s > bound %s"):format(
              codec, dt, W, class, tostring(i), tostring(g), tostring(e), tostring(g and e and math.abs(g - e)),
              tostring(bb)))
          end
        end)
      end
    end
  end

  it("all-zero blocks come out exactly zero, every codec", function()
    local xs, ts = QC.make("zero_blocks", "bf16", 4, N)
    for _, codec in ipairs(CODECS) do
      local got = Q.reference(codec, "bf16", ts):to_table()
      for i = 1, N do
        local blk = math.floor((i - 1) / 32)
        if blk % 5 == 0 or blk % 5 == 2 then
          assert(got[i] == 0, ("%s: element %d of a zero block is %s"):format(codec, i, tostring(got[i])))
        end
      end
      _ = xs
    end
  end)

  it("NaN and Inf: never finite, their block only (quantized: the block is NaN), other blocks bit-identical", function()
    for _, dt in ipairs { "bf16", "f16" } do
      local W = 4
      local _, ts = QC.make("normal", dt, W, N)
      local clean = {}
      for _, codec in ipairs(CODECS) do clean[codec] = QC.bits(Q.reference(codec, dt, ts)) end
      local vals = {}
      for r = 1, W do vals[r] = ts[r]:to_table() end
      local poison = { { 2, 40, 0 / 0 }, { 3, 100, math.huge }, { 4, 101, -math.huge }, { 1, 200, math.huge } }
      for _, p in ipairs(poison) do vals[p[1]][p[2]] = p[3] end
      local pts = {}
      for r = 1, W do pts[r] = T.from_table(vals[r], dt, { N }, "cpu") end
      local bad_block = { [1] = true, [3] = true, [6] = true }   -- 0-based blocks of 40, 100/101, 200
      for _, codec in ipairs(CODECS) do
        local out = Q.reference(codec, dt, pts)
        local got, bits = out:to_table(), QC.bits(out)
        for _, p in ipairs(poison) do
          local v = got[p[2]]
          assert(v ~= v or v == math.huge or v == -math.huge,
                 ("%s %s: element %d (non-finite input) came out %s"):format(codec, dt, p[2], tostring(v)))
        end
        if codec ~= "fp" then assert(got[200] ~= got[200], codec .. ": a lone +Inf should make its block NaN") end
        if codec == "fp" then assert(got[200] == math.huge, "fp: +Inf + finite must stay +Inf") end
        for i = 1, N do
          local blk = math.floor((i - 1) / 32)
          if not bad_block[blk] then
            assert(bits[i] == clean[codec][i], ("%s %s: element %d of a clean block changed"):format(codec, dt, i))
          elseif codec ~= "fp" then
            assert(got[i] ~= got[i], ("%s %s: element %d in a poisoned block is %s, documented NaN"):format(
              codec, dt, i, tostring(got[i])))
          elseif i ~= 40 and i ~= 100 and i ~= 101 and i ~= 200 then
            assert(bits[i] == clean[codec][i], ("fp %s: finite element %d of a poisoned block changed"):format(dt, i))
          end
        end
      end
    end
  end)

  it("f16: a sum beyond f16's range (not f32's) is +-Inf in that element only, as with the exact kernels", function()
    local a, b = {}, {}
    for i = 1, 64 do a[i], b[i] = (i % 7) / 7, (i % 5) / 5 end
    a[3], b[3] = 60000, 60000
    local ts = { T.from_table(a, "f16", { 64 }, "cpu"), T.from_table(b, "f16", { 64 }, "cpu") }
    for _, codec in ipairs(CODECS) do
      local got = Q.reference(codec, "f16", ts):to_table()
      assert.are.equal(math.huge, got[3], codec)
      for i = 1, 64 do
        if i ~= 3 then assert(got[i] == got[i] and math.abs(got[i]) < 65504, codec .. ": element " .. i) end
      end
    end
  end)

  it("the bound is not vacuous: the worst error uses a fair share of it, and halving it fails", function()
    local xs, ts = QC.make("normal", "bf16", 4, N)
    local ex = QC.exact(xs)
    for _, codec in ipairs { "int8", "int4", "fp8" } do
      local got = Q.reference(codec, "bf16", ts):to_table()
      local b = Q.bounds(codec, "bf16", xs)
      local worst = 0
      for i = 1, N do worst = math.max(worst, math.abs(got[i] - ex[i]) / b[i]) end
      assert(worst > 0.15, ("%s: worst error is only %.3f of the bound"):format(codec, worst))
      assert(worst <= 1, codec)
    end
  end)

  it("every rank's data counts, each with its own block scale (dropping a scale breaks the bound)", function()
    local xs, ts = QC.make("outliers", "bf16", 4, N)
    -- rank 3's data scaled by 100 in one block: a reference that reused a
    -- neighbour's scale, or dropped a rank, would be off by far more than the bound
    local v = ts[3]:to_table()
    for i = 65, 96 do v[i] = v[i] * 100 end
    ts[3] = T.from_table(v, "bf16", { N }, "cpu")
    xs[3] = ts[3]:to_table()
    local ex = QC.exact(xs)
    for _, codec in ipairs { "int8", "int4", "fp8" } do
      local got = Q.reference(codec, "bf16", ts):to_table()
      local b = Q.bounds(codec, "bf16", xs)
      assert(QC.violation(got, ex, b) == nil, codec)
      -- the same block with rank 3 left out is far outside the bound
      local off = 0
      for i = 65, 96 do off = math.max(off, math.abs((ex[i] - xs[3][i]) - ex[i]) / b[i]) end
      assert(off > 5, codec .. ": the test data does not separate a dropped contribution")
    end
  end)

  it("measured SNR (dB) on normal and outlier data", function()
    local lines = {}
    local floor = { fp = 40, int8 = 30, int4 = 10, fp8 = 20 }
    for _, W in ipairs { 2, 4, 8 } do
      for _, class in ipairs { "normal", "outliers" } do
        local xs, ts = QC.make(class, "bf16", W, 65536)
        local ex = QC.exact(xs)
        local row = {}
        for _, codec in ipairs(CODECS) do
          local got = Q.reference(codec, "bf16", ts):to_table()
          local snr = Q.snr_db(ex, got)
          row[#row + 1] = ("%s %.1f"):format(codec, snr)
          assert(snr > floor[codec], ("%s W=%d %s: SNR %.1f dB"):format(codec, W, class, snr))
        end
        lines[#lines + 1] = ("bf16 W=%d %-8s %s"):format(W, class, table.concat(row, "  "))
      end
    end
    if os.getenv("WEFT_QUICK_SNR") then print("\n" .. table.concat(lines, "\n")) end
  end)

  it("the C entry points refuse bad arguments, naming them", function()
    local ffi = require("ffi")
    local C = require("weft.internal.ffi").C
    local function err(rc)
      assert.are_not.equal(0, rc)
      return ffi.string(C.weft_last_error())
    end
    local x = T.zeros({ 64 }, "bf16", "cpu")
    local ins = ffi.new("const void *[2]", x.ptr, x.ptr)
    assert.matches("codec 7 unknown", err(C.weft_qr_reference(7, 2, 2, ins, x.ptr, 64)))
    assert.matches("dtype 0 is not bf16 or f16", err(C.weft_qr_reference(1, 0, 2, ins, x.ptr, 64)))
    assert.matches("step 4 is not 0", err(C.weft_qr_codec_step(4, 1, 2, 2, x.ptr, x.ptr, x.ptr, 64, nil)))
    assert.matches("world 3 is not 2, 4, 6 or 8", err(C.weft_qr_codec_step(1, 1, 2, 3, x.ptr, x.ptr, x.ptr, 64, nil)))
    assert.matches("dtype f32 is not bf16 or f16", err(C.weft_qr_codec_step(0, 1, 0, 2, x.ptr, x.ptr, nil, 64, nil)))
    local n = ffi.new("size_t[1]")
    assert.are.equal(0, C.weft_qr_wire_bytes(1, 4096, n))
    assert.are.equal(4608, tonumber(n[0]))      -- one part of 512 vectors: 4096 code bytes + 128 scales
    assert.are.equal(0, C.weft_qr_wire_bytes(2, 4097, n))
    assert.are.equal(2 * 2560, tonumber(n[0]))  -- int4: two parts (the last one partial, stored whole)
  end)

  it("the seed's minimum sizes, and the policy file's quick_min over them", function()
    assert.are.equal(8 * 1048576, (Q.min_bytes("bf16", 2, "int8", false)))
    assert.are.equal(2 * 1048576, (Q.min_bytes("f16", 4, "int4", false)))
    assert.are.equal(2048 * 1048576, (Q.min_bytes("bf16", 6, "int8", false)))   -- max of worlds 4 and 8
    local n, src = Q.min_bytes("bf16", 2, "int8", { quick_min = { [2] = { bf16 = { int8 = 4096 } } } })
    assert.are.equal(4096, n)
    assert.is_truthy(src:find("quick_min", 1, true))
    assert.are.equal(math.huge, (Q.min_bytes("f32", 2, "int8", false)))
  end)
end)

-- The fused quick two-shot's reference (weft_qr_fused_reference; the GPU
-- kernel is held to its residual_out bit for bit by tests/gpu/gpu_quick_spec.lua):
-- blocks from each row's start; the all-reduced value equals the quick
-- all-reduce's when rows are a multiple of 32; residual_out and norm_out
-- within weft.quick.fused_bounds of the f64 computation.
describe("fused quick two-shot (CPU reference)", function()
  local function case(dt, W, class, tk, h)
    local xs, ins = {}, {}
    for r = 0, W - 1 do
      ins[r + 1] = T.from_table(QC.values(class, dt, W, tk * h, r), dt, { tk, h }, "cpu")
      xs[r + 1] = ins[r + 1]:to_table()
    end
    local res = T.randn({ tk, h }, dt, "cpu", { seed = 5 + W })
    local wv, u = {}, QC.rng(9)
    for j = 1, h do wv[j] = 0.5 + u() end
    return xs, ins, res, T.from_table(wv, dt, { h }, "cpu")
  end

  it("rows of a multiple of 32: the all-reduced value is the quick all-reduce's, bit for bit", function()
    for _, codec in ipairs { "int8", "int4", "fp8" } do
      local _, ins, res, w = case("bf16", 4, "outliers", 5, 512)
      local sum = Q.fused_reference(codec, "bf16", ins, res, w, 1e-6)
      local flat = {}
      for r = 1, 4 do flat[r] = T.from_table(ins[r]:to_table(), "bf16", { 5 * 512 }, "cpu") end
      local ar = Q.reference(codec, "bf16", flat)
      assert.are.same(QC.bits(ar), QC.bits(sum))
    end
  end)

  it("rows of 200: blocks restart at each row (not the quick all-reduce's buffer blocks)", function()
    local _, ins, res, w = case("bf16", 2, "outliers", 3, 200)
    local sum = Q.fused_reference("int4", "bf16", ins, res, w, 1e-6)
    local flat = {}
    for r = 1, 2 do flat[r] = T.from_table(ins[r]:to_table(), "bf16", { 600 }, "cpu") end
    local a, b = QC.bits(Q.reference("int4", "bf16", flat)), QC.bits(sum)
    local same = true
    for i = 201, 600 do if a[i] ~= b[i] then same = false end end
    assert.is_false(same, "row 2 is blocked as the buffer would be")
  end)

  for _, dt in ipairs { "bf16", "f16" } do
    for _, W in ipairs { 2, 4, 6, 8 } do
      it(("%s world %d: residual_out and norm_out within the stated bounds (not vacuous), every codec, rows of 512 "
          .. "and 200"):format(dt, W), function()
        local used = 0   -- the largest share of norm_out's bound an element uses
        for _, shp in ipairs { { 3, 512 }, { 4, 200 } } do
          for _, class in ipairs { "normal", "outliers" } do
            local tk, h = shp[1], shp[2]
            local xs, ins, res, w = case(dt, W, class, tk, h)
            local rv, wv = res:to_table(), w:to_table()
            for _, codec in ipairs { "int8", "int4", "fp8" } do
              local _, ro, no = Q.fused_reference(codec, dt, ins, res, w, 1e-5)
              local got = ro:to_table()
              local b = Q.fused_bounds(codec, dt, xs, rv, wv, h, 1e-5, false, got)
              local ex, exn = {}, {}
              for t0 = 0, tk - 1 do
                local ss = 0
                for k = 1, h do
                  local e = rv[t0 * h + k]
                  for r = 1, W do e = e + xs[r][t0 * h + k] end
                  ex[t0 * h + k], ss = e, ss + e * e
                end
                local rs = 1 / math.sqrt(ss / h + 1e-5)
                for k = 1, h do exn[t0 * h + k] = ex[t0 * h + k] * rs * wv[k] end
              end
              local what = ("%s %s W=%d %s %dx%d"):format(codec, dt, W, class, tk, h)
              local i, g, e, bb = QC.violation(got, ex, b.res)
              assert(i == nil, ("%s residual_out element %s: %s, exact %s, bound %s"):format(what, tostring(i),
                     tostring(g), tostring(e), tostring(bb)))
              local nv = no:to_table()
              i, g, e, bb = QC.violation(nv, exn, b.norm)
              assert(i == nil, ("%s norm_out element %s: %s, exact %s, bound %s"):format(what, tostring(i),
                     tostring(g), tostring(e), tostring(bb)))
              for k = 1, #nv do used = math.max(used, math.abs(nv[k] - exn[k]) / b.norm[k]) end
            end
          end
        end
        assert(used > 0.15, ("the worst norm_out element uses only %.3f of its bound"):format(used))
      end)
    end
  end
end)

-- the float facts the kernels' cheaper codec forms rest on (rounding by one
-- FADD, codes back through the exponent of 2^23, a / QM by the reciprocal and
-- one FMA), exhaustively on the CPU: tests/c/quick_codec_arith_test.c
describe("quick codec arithmetic (tests/c/quick_codec_arith_test.c)", function()
  local spec = require("helpers.spec_util")
  it("holds for every input it covers", function()
    local o = spec.c_test("quick_codec_arith_test", 120)()
    spec.assert_c_passed(assert, o, "quick_codec_arith", 9)
    assert.is_truthy(o:match("rc=0%s*$"), o)
  end)
end)
