-- weft.tune (the pure half of scripts/weft-tune): what is measured, the
-- crossover derivation from synthetic timing tables (clean, noisy, ties,
-- one backend, gaps), the policy file it writes (loads as Lua, documented
-- shape), and the before/after verdict. CPU only.
local tune = require("weft.tune")
local ffi = require("ffi")

pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")

local KiB, MiB = 1024, 1048576

-- a synthetic table: latency + bytes / bandwidth per backend (µs)
local function model(sizes, lat_bw, noise)
  local rows = {}
  for i, b in ipairs(sizes) do
    local t = {}
    for name, m in pairs(lat_bw) do
      local us = m[1] + b / m[2]
      if noise then us = us * (1 + noise(i, name)) end
      t[name] = us
    end
    rows[i] = { bytes = b, times = t }
  end
  return rows
end

local CLEAN = { oneshot = { 2, 30e3 }, twoshot = { 6, 60e3 }, nccl = { 8, 70e3 } }

local function uptos(entries)
  local s = {}
  for _, e in ipairs(entries) do s[#s + 1] = (e.upto and tostring(e.upto) or "*") .. ":" .. e.backend end
  return table.concat(s, " ")
end

describe("tune: what is measured", function()
  it("all-reduce sizes: 1 KiB .. 256 MiB in powers of 2, --quick in powers of 4", function()
    local full = tune.ar_sizes(false)
    assert.are.equal(19, #full)
    assert.are.equal(KiB, full[1]); assert.are.equal(256 * MiB, full[#full])
    for i = 2, #full do assert.are.equal(full[i - 1] * 2, full[i]) end
    local quick = tune.ar_sizes(true)
    assert.are.equal(10, #quick)
    assert.are.equal(KiB, quick[1]); assert.are.equal(256 * MiB, quick[#quick])
    for i = 2, #quick do assert.are.equal(quick[i - 1] * 4, quick[i]) end
  end)

  it("fused shapes: hidden {4096, 8192} x tokens 1 .. 8192", function()
    local full = tune.fused_shapes(false)
    assert.are.equal(28, #full)
    assert.are.same({ hidden = 4096, tokens = 1 }, full[1])
    assert.are.same({ hidden = 8192, tokens = 8192 }, full[28])
    local quick = tune.fused_shapes(true)
    assert.are.equal(14, #quick)
    assert.are.same({ hidden = 8192, tokens = 4096 }, quick[14])
  end)

  it("summarize: median of rounds and their relative spread; NaN ignored", function()
    local med, spread = tune.summarize({ 10, 12, 11 })
    assert.are.equal(11, med)
    assert.is_true(math.abs(spread - 2 / 11) < 1e-12)
    med = tune.summarize({ 4, 0 / 0, 2 })
    assert.are.equal(3, med)
    assert.is_nil(tune.summarize({}))
  end)
end)

describe("tune.derive: crossovers", function()
  it("a clean table gives the fastest backend per size, merged into upto ranges", function()
    local rows = model(tune.ar_sizes(false), CLEAN)
    local entries, choices = tune.derive(rows)
    assert.are.equal(tostring(128 * KiB) .. ":oneshot " .. tostring(512 * KiB) .. ":twoshot *:nccl", uptos(entries))
    -- every size gets its fastest backend
    for i, r in ipairs(rows) do
      local best, bn = math.huge, nil
      for n, us in pairs(r.times) do if us < best then best, bn = us, n end end
      assert.are.equal(bn, choices[i], "size " .. r.bytes)
      assert.are.equal(bn, tune.pick(entries, r.bytes))
    end
  end)

  it("noise within the margin never causes a switch", function()
    -- two backends of equal cost, each winning every other size by 1 %
    local rows = model(tune.ar_sizes(false), { oneshot = { 5, 40e3 }, twoshot = { 5, 40e3 } },
                       function(i, name) return ((i % 2 == 0) == (name == "oneshot")) and 0.01 or 0 end)
    local entries = tune.derive(rows)
    assert.are.equal(1, #entries, uptos(entries))
    assert.is_nil(entries[1].upto)
  end)

  it("a real crossover under noise switches once, at the crossover", function()
    local seed = 12345
    local function rnd()
      seed = (seed * 1103515245 + 12345) % 2147483648
      return seed / 2147483648
    end
    for _ = 1, 20 do
      local rows = model(tune.ar_sizes(false), { oneshot = CLEAN.oneshot, twoshot = CLEAN.twoshot },
                         function() return (rnd() - 0.5) * 0.02 end)   -- +-1 %
      local entries = tune.derive(rows)
      assert.are.equal(2, #entries, uptos(entries))
      assert.are.equal("oneshot", entries[1].backend)
      -- the true crossover is near 234 KiB: the switch is at 128 or 256 KiB
      assert.is_true(entries[1].upto == 128 * KiB or entries[1].upto == 256 * KiB, uptos(entries))
    end
  end)

  it("a clear win (beyond the margin) does switch, even at one size", function()
    local rows = {}
    for i, b in ipairs({ KiB, 2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB }) do
      rows[i] = { bytes = b, times = { oneshot = 3, twoshot = (i == 3) and 2 or 6 } }
    end
    local entries = tune.derive(rows)
    assert.are.equal(tostring(2 * KiB) .. ":oneshot " .. tostring(4 * KiB) .. ":twoshot *:oneshot", uptos(entries))
  end)

  it("ties go to the built-in policy's choice, else to the preference order", function()
    local rows = {}
    for i, b in ipairs({ KiB, 4 * KiB, 16 * KiB, 64 * KiB }) do
      rows[i] = { bytes = b, times = { nccl = 5, oneshot = 5, twoshot = 5 } }
    end
    local entries = tune.derive(rows)
    assert.are.equal("*:oneshot", uptos(entries))
    for _, r in ipairs(rows) do r.builtin = "nccl" end
    assert.are.equal("*:nccl", uptos(tune.derive(rows)))
    -- the built-in's own crossover is kept when it is within the margin
    for i, r in ipairs(rows) do r.builtin = i <= 2 and "oneshot" or "twoshot" end
    assert.are.equal(tostring(4 * KiB) .. ":oneshot *:twoshot", uptos(tune.derive(rows)))
    -- an explicit order
    for _, r in ipairs(rows) do r.builtin = nil end
    assert.are.equal("*:twoshot", uptos(tune.derive(rows, { order = { "twoshot", "oneshot", "nccl" } })))
  end)

  it("correcting the built-in gives one clean crossover, not a flip-flop", function()
    -- built-in: one-shot up to 8 MiB; measured: two-shot clearly faster at 1
    -- and 4 MiB, tied at 2 and 8 MiB
    local b = { 512 * KiB, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB }
    local os_ = { 4, 6, 10, 17, 30, 60 }
    local ts = { 8, 5, 10, 15, 30, 50 }
    local rows = {}
    for i = 1, #b do
      rows[i] = { bytes = b[i], times = { oneshot = os_[i], twoshot = ts[i] },
                  builtin = b[i] <= 8 * MiB and "oneshot" or "twoshot" }
    end
    assert.are.equal(tostring(512 * KiB) .. ":oneshot *:twoshot", uptos(tune.derive(rows)))
  end)

  it("a built-in choice that is clearly slower is not kept", function()
    local rows = {}
    for i, b in ipairs({ KiB, 4 * KiB, 16 * KiB }) do
      rows[i] = { bytes = b, times = { nccl = 10, oneshot = 3 }, builtin = "nccl" }
    end
    assert.are.equal("*:oneshot", uptos(tune.derive(rows)))
  end)

  it("a single backend gives one open-ended entry", function()
    local rows = model({ KiB, 2 * KiB, 4 * KiB }, { nccl = { 8, 70e3 } })
    local entries = tune.derive(rows)
    assert.are.same({ { backend = "nccl" } }, entries)
  end)

  it("a backend missing at some sizes is only chosen where it was measured", function()
    -- fused two-shot is not measured below world-size tokens
    local rows = {
      { bytes = 8 * KiB, times = { fused_oneshot = 4.3 } },
      { bytes = 16 * KiB, times = { fused_oneshot = 4.4, fused_twoshot = 8.4 } },
      { bytes = 64 * MiB, times = { fused_oneshot = 240, fused_twoshot = 200 } },
    }
    local entries = tune.derive(rows)
    assert.are.equal(tostring(16 * KiB) .. ":fused_oneshot *:fused_twoshot", uptos(entries))
  end)

  it("bad tables are refused clearly", function()
    assert.has_error(function() tune.derive({}) end, "weft: tune.derive: no measured rows")
    assert.has_error(function()
      tune.derive({ { bytes = 2, times = { a = 1 } }, { bytes = 1, times = { a = 1 } } })
    end)
    local ok, err = pcall(tune.derive, { { bytes = 2, times = { a = 1 } }, { bytes = 1, times = { a = 1 } } })
    assert.is_false(ok)
    assert.matches("sorted by increasing bytes", err)
    ok, err = pcall(tune.derive, { { bytes = 2, times = {} } })
    assert.is_false(ok)
    assert.matches("no backend has a time", err)
  end)

  it("rows: shapes of one size summed, wrong or missing backends left out", function()
    local p1 = { bytes = 64 * KiB, res = { fused_oneshot = { us = 4, ok = true }, fused_twoshot = { us = 9, ok = true } } }
    local p2 = { bytes = 64 * KiB, res = { fused_oneshot = { us = 5, ok = true } } }           -- 2nd shape: no two-shot
    local p3 = { bytes = 8 * KiB, res = { fused_oneshot = { us = 3, ok = false }, fused_twoshot = { us = 8, ok = true } } }
    local p4 = { bytes = 4 * KiB, res = { fused_oneshot = { us = 3, ok = false } } }           -- nothing correct
    local builtin = { [p1] = "fused_auto", [p2] = "fused_auto", [p3] = "fused_auto", [p4] = "fused_auto" }
    local rows = tune.rows({ p1, p2, p3, p4 }, builtin, tune.FUSED_BACKENDS)
    assert.are.equal(2, #rows)
    assert.are.same({ bytes = 8 * KiB, times = { fused_twoshot = 8 }, builtin = "fused_auto" }, rows[1])
    assert.are.same({ bytes = 64 * KiB, times = { fused_oneshot = 9 }, builtin = "fused_auto" }, rows[2])
    -- the built-in choice is dropped where the shapes of a size disagree
    builtin[p2] = "fused_twoshot"
    assert.is_nil(tune.rows({ p1, p2 }, builtin, tune.FUSED_BACKENDS)[1].builtin)
    -- and the rows feed derive
    local entries = tune.derive(tune.rows({ p1, p3 }, nil, tune.FUSED_BACKENDS))
    assert.are.equal(tostring(8 * KiB) .. ":fused_twoshot *:fused_oneshot", uptos(entries))
  end)

  it("checksum tells different texts apart", function()
    assert.are.equal(tune.checksum("abc"), tune.checksum("abc"))
    assert.are_not.equal(tune.checksum("abc"), tune.checksum("acb"))
    assert.is_true(tune.checksum(string.rep("x", 100000)) < 2 ^ 31)
  end)

  it("pick: upto is inclusive; the open entry serves everything larger", function()
    local e = { { upto = 100, backend = "a" }, { upto = 200, backend = "b" }, { backend = "c" } }
    assert.are.equal("a", tune.pick(e, 1))
    assert.are.equal("a", tune.pick(e, 100))
    assert.are.equal("b", tune.pick(e, 101))
    assert.are.equal("b", tune.pick(e, 200))
    assert.are.equal("c", tune.pick(e, 201))
    assert.are.equal("c", tune.pick(e, 2 ^ 40))
  end)
end)

describe("tune: the policy file", function()
  local function doc()
    local ar = tune.derive(model(tune.ar_sizes(false), CLEAN))
    return {
      machine = "nvidia-h200-x2", date = "2026-11-30",
      all_reduce = { [2] = { bf16 = ar, f16 = ar, f32 = { { backend = "nccl" } } } },
      fused = { [2] = { bf16 = { { upto = 64 * MiB, backend = "fused_oneshot" }, { backend = "fused_twoshot" } } } },
    }
  end

  it("renders Lua that loads (loadstring and dofile) and has the documented shape", function()
    local text = tune.render(doc())
    local t = assert(tune.parse(text))
    assert.is_true(tune.check_shape(t))
    assert.are.equal(1, t.version)
    assert.are.equal("nvidia-h200-x2", t.machine)
    assert.are.equal("2026-11-30", t.date)
    assert.are.equal("oneshot", t.all_reduce[2].bf16[1].backend)
    assert.are.equal(128 * KiB, t.all_reduce[2].bf16[1].upto)
    assert.is_nil(t.all_reduce[2].bf16[3].upto)
    assert.are.equal("fused_twoshot", t.fused[2].bf16[2].backend)
    -- a plain dofile of the written file gives the same table
    local dir = os.tmpname(); os.remove(dir)
    local path = dir .. "/weft/policy.lua"
    tune.write_file(path, text)
    local t2 = dofile(path)
    assert.are.same(t, t2)
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("weft's own policy loader accepts it, and the policy then follows it", function()
    local pf = require("weft.internal.policy_file")   -- a loader that does not load fails here
    local text = tune.render(doc())
    local t = pf.parse(text, "tuned.lua")
    assert.are.equal("oneshot", (pf.lookup(t, "all_reduce", 2, "bf16", 128 * KiB)))
    assert.are.equal("twoshot", (pf.lookup(t, "all_reduce", 2, "bf16", 128 * KiB + 1)))
    assert.are.equal("nccl", (pf.lookup(t, "all_reduce", 2, "bf16", 2 ^ 40)))
    assert.are.equal("nccl", (pf.lookup(t, "all_reduce", 2, "f32", KiB)))
    assert.are.equal("fused_twoshot", (pf.lookup(t, "fused", 2, "bf16", 64 * MiB + 1)))
    assert.is_nil((pf.lookup(t, "all_reduce", 4, "bf16", KiB)))      -- world 4 not tuned: built-in
    -- tune.pick agrees with the loader's lookup everywhere
    for _, b in ipairs(tune.ar_sizes(false)) do
      for _, x in ipairs({ b - 1, b, b + 1 }) do
        assert.are.equal(tune.pick(t.all_reduce[2].bf16, x), (pf.lookup(t, "all_reduce", 2, "bf16", x)))
      end
    end
    -- through weft.policy: load_file / clear_file
    local policy = require("weft.policy")
    local dir = os.tmpname(); os.remove(dir)
    local path = dir .. "/policy.lua"
    tune.write_file(path, text)
    local saved = policy.tuned and policy.tuned_path
    policy.load_file(path)
    assert.are.equal(path, policy.tuned_path)
    assert.are.equal("oneshot", (policy.tuned_backend("all_reduce", 2, "bf16", KiB)))
    assert.are.equal("twoshot", (policy.tuned_backend("all_reduce", 2, "bf16", 256 * KiB)))
    assert.are.equal("nccl", (policy.tuned_backend("all_reduce", 2, "bf16", 2 ^ 40)))
    policy.clear_file()
    assert.is_nil(policy.tuned_backend("all_reduce", 2, "bf16", MiB))
    if saved then policy.load_file(saved) end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  it("rendering is deterministic (worlds and dtypes sorted)", function()
    assert.are.equal(tune.render(doc()), tune.render(doc()))
    local text = tune.render(doc())
    assert.is_truthy(text:find("bf16 = {.*f16 = {.*f32 = {"))
  end)

  it("check_shape refuses what the loader would refuse", function()
    local function bad(mut, want)
      local d = assert(tune.parse(tune.render(doc())))
      mut(d)
      local ok, err = tune.check_shape(d)
      assert.is_nil(ok)
      assert.matches(want, err)
    end
    bad(function(d) d.version = 2 end, "version must be 1")
    bad(function(d) d.date = "30/11/2026" end, "YYYY%-MM%-DD")
    bad(function(d) d.all_reduce[2].bf16[1].backend = "magic" end, 'all_reduce%[2%]%.bf16%[1%]%.backend: unknown backend "magic"')
    bad(function(d) d.all_reduce[2].bf16[1].backend = "oneshot_flag" end, "weft%-tune measures no backend oneshot_flag")
    bad(function(d) d.all_reduce[2].bf16[2].upto = 1 end, "upto: must be an integer byte count above the previous entry's")
    bad(function(d) d.all_reduce[2].bf16[3].upto = 2 ^ 40 end, "last entry must have no upto")
    bad(function(d) d.all_reduce[2].f64 = { { backend = "nccl" } } end, "unknown dtype")
    bad(function(d) d.all_reduce[1] = d.all_reduce[2] end, "all_reduce%[1%]: world size must be an integer >= 2")
    bad(function(d) d.all_reduce["*"] = d.all_reduce[2] end, 'world key %*: weft%-tune writes sizes')
    bad(function(d) d.fused[2].bf16 = {} end, "non%-empty")
  end)

  it("parse runs the file without globals and reports syntax errors", function()
    local t, err = tune.parse("return { version = 1 ")
    assert.is_nil(t)
    assert.matches("expected", err)
    t, err = tune.parse("os.exit(3) return {}")
    assert.is_nil(t)
    assert.matches("os", err)
    t, err = tune.parse("return 42")
    assert.is_nil(t)
    assert.matches("does not return a table", err)
  end)

  it("default path: $XDG_CONFIG_HOME/weft/policy.lua, else ~/.config/weft/policy.lua", function()
    local old_x, old_h = os.getenv("XDG_CONFIG_HOME"), os.getenv("HOME")
    ffi.C.setenv("XDG_CONFIG_HOME", "/tmp/xdg-test", 1)
    assert.are.equal("/tmp/xdg-test/weft/policy.lua", tune.default_path())
    ffi.C.unsetenv("XDG_CONFIG_HOME")
    ffi.C.setenv("HOME", "/home/someone", 1)
    assert.are.equal("/home/someone/.config/weft/policy.lua", tune.default_path())
    if old_x then ffi.C.setenv("XDG_CONFIG_HOME", old_x, 1) end
    if old_h then ffi.C.setenv("HOME", old_h, 1) else ffi.C.unsetenv("HOME") end
  end)

  it("write_file replaces a file atomically and creates its folder", function()
    local dir = os.tmpname(); os.remove(dir)
    local path = dir .. "/a/b/policy.lua"
    tune.write_file(path, "return 1\n")
    tune.write_file(path, "return 2\n")
    assert.are.equal(2, dofile(path))
    local p = io.popen("ls -a '" .. dir .. "/a/b'")
    local listing = p:read("*a"); p:close()
    assert.is_nil(listing:find("tmp", 1, true), listing)
    os.execute("rm -rf '" .. dir .. "'")
  end)
end)

-- The whole of scripts/weft-tune on a simulated machine (tests/helpers/
-- tune_sim.lua: host fakes for the CUDA side, simulated time; the real
-- policy, device backends, cpu groups, files), under weft-run.
describe("scripts/weft-tune on a simulated machine", function()
  local ROOT = os.getenv("PWD") or "."
  local function sim(n, args, env)
    local dir = os.tmpname(); os.remove(dir); os.execute("mkdir -p '" .. dir .. "'")
    local cmd = ("%s WEFT_TIMEOUT_MS=30000 TUNE_SIM_ROOT='%s' LUA_PATH='%s/tests/?.lua;%s/lua/?.lua;;' "
                 .. "timeout -s KILL 200 %s/scripts/weft-run -n %d --timeout 180 %s/tests/helpers/tune_sim.lua "
                 .. "%s --out '%s/policy.lua' --results '%s/results' 2>&1; echo \"rc=$?\"")
                :format(env or "", ROOT, ROOT, ROOT, ROOT, n, ROOT, args, dir, dir)
    local p = io.popen(cmd)
    local out = p:read("*a"); p:close()
    local function read(pat)
      local l = io.popen("ls " .. dir .. "/results/" .. pat .. " 2>/dev/null"):read("*l")
      if not l then return nil end
      local f = io.open(l); local t = f:read("*a"); f:close()
      return t
    end
    local ok, t = pcall(require("weft.internal.policy_file").load, dir .. "/policy.lua")
    local r = { out = out, rc = tonumber(out:match("rc=(%d+)%s*$")), file = ok and t or nil, file_err = not ok and t or nil,
                json = read("tune-*.json"), md = read("tune-*.md") }
    os.execute("rm -rf '" .. dir .. "'")
    return r
  end

  local base
  local function run_base()
    base = base or sim(2, "--quick --dtypes bf16,f32 --max-bytes 262144 --max-tokens 16")
    return base
  end

  it("runs to the end and writes the crossovers of the simulated kernels", function()
    local r = run_base()
    assert.are.equal(0, r.rc, r.out)
    assert.is_truthy(r.file, tostring(r.file_err))
    assert.is_true(tune.check_shape(r.file))
    for _, d in ipairs({ "bf16", "f32" }) do
      assert.are.equal("16384:oneshot 65536:twoshot *:nccl", uptos(r.file.all_reduce[2][d]))
      assert.are.equal("65536:fused_oneshot *:fused_twoshot", uptos(r.file.fused[2][d]))
    end
    assert.are.equal("sim-gpu-x2", r.file.machine)
  end)

  it("shows the built-in policy against the tuned one: never slower, faster where they differ", function()
    local r = run_base()
    assert.is_truthy(r.out:find("22 points, 7 with a different choice, 7 faster, 0 slower beyond noise, 0 untimed; "
                                .. "0 check(s) failed", 1, true), r.out)
    assert.is_truthy(r.md and r.md:find("| 2 | all_reduce | bf16 | 256 KiB | auto (twoshot) | 12.74 | nccl | 11.24 | 0.883 | faster |",
                                         1, true), r.md)
    assert.is_truthy(r.md:find("| 2 | all_reduce | bf16 | 1 KiB | auto (oneshot) | 2.10 | oneshot | 2.10 | 1.000 | same |",
                               1, true), r.md)
    -- the results format's records (docs/architecture.md#conventions-in-one-place): every backend measured, and both policies
    for _, want in ipairs({ '"backend": "policy_builtin"', '"backend": "policy_tuned"', '"backend": "nccl"',
                            '"backend": "auto"', '"backend": "fused_twoshot"', '"op": "fused_ar_rmsnorm"',
                            '"machine": "sim-gpu-x2"', '"kernel": "twoshot"' }) do
      assert.is_truthy(r.json and r.json:find(want, 1, true), "missing " .. want)
    end
    assert.is_nil(r.json:find('"check": "FAIL"', 1, true))
  end)

  it("shows its progress on rank 0's stderr: a line per point measured, k of n up to n; -q: none", function()
    local r = run_base()
    -- 2 dtypes x (5 sizes + 6 fused shapes), measured, then before/after
    assert.is_truthy(r.out:find("[rank0] weft-tune: [1/44] world 2, all_reduce bf16 1 KiB (", 1, true), r.out)
    assert.is_truthy(r.out:find("[rank0] weft-tune: [23/44] world 2, before/after, all_reduce bf16 1 KiB (", 1, true), r.out)
    assert.is_truthy(r.out:find("[rank0] weft-tune: [44/44] world 2, before/after, fused f32 16 x 8192 (", 1, true), r.out)
    assert.is_truthy(r.out:find("[rank0] weft-tune: 44 points, done in", 1, true), r.out)
    assert.is_nil(r.out:find("[rank1] weft-tune: [", 1, true), r.out)
    local q = sim(2, "--quick --dtypes bf16 --max-bytes 16384 --no-fused --no-compare -q")
    assert.are.equal(0, q.rc, q.out)
    assert.is_nil(q.out:find("weft-tune: [", 1, true), q.out)
    assert.is_nil(q.out:find("done in", 1, true), q.out)
  end)

  it("folds fresh numbers in and derives again when the tuned choice turns out slower", function()
    local r = sim(2, "--quick --no-fused --max-bytes 262144", "TUNE_SIM_DRIFT=1")
    assert.are.equal(0, r.rc, r.out)
    assert.is_truthy(r.out:find("deriving again with the fresh numbers (pass 2)", 1, true), r.out)
    assert.are.equal("16384:oneshot *:twoshot", uptos(r.file.all_reduce[2].bf16))
    assert.is_nil(r.file.fused)
    assert.is_truthy(r.out:find("0 slower beyond noise", 1, true), r.out)
  end)

  it("--quick-codecs measures the quick codecs and writes quick_min", function()
    local r = sim(2, "--quick --dtypes bf16,f32 --max-bytes 262144 --no-fused --no-compare --quick-codecs")
    assert.are.equal(0, r.rc, r.out)
    assert.is_truthy(r.file, tostring(r.file_err))
    local q = r.file.quick_min and r.file.quick_min[2] and r.file.quick_min[2].bf16
    assert.is_truthy(q, "no quick_min[2].bf16 in the file")
    assert.are.equal(262144, q.int8)           -- the simulated int8 wins at 256 KiB only
    assert.are.equal(262144, q.int4)
    assert.are.equal(tune.QUICK_NEVER, q.fp8)  -- the simulated fp8 never wins
    assert.is_nil(r.file.quick_min[2].f32)     -- no quick codec for f32
    assert.is_truthy(r.json:find('"backend": "quick_int8"', 1, true), "no quick records in the JSON")
  end)

  it("tunes every world size, ranks outside a world waiting for it", function()
    local r = sim(4, "--quick --max-bytes 16384 --max-tokens 4")
    assert.are.equal(0, r.rc, r.out)
    assert.is_table(r.file.all_reduce[2].bf16)
    assert.is_table(r.file.all_reduce[4].bf16)
    assert.is_table(r.file.fused[4].bf16)
    assert.is_truthy(r.md:find("| 4 | fused | bf16 |", 1, true), r.md)
  end)
end)

describe("tune.quick_min: the quick all-reduce's minimum sizes", function()
  local function row(bytes, exact, q) return { bytes = bytes, exact = exact, quick = q } end

  it("the smallest size from which a codec wins at every larger size, by the margin", function()
    local rows = {
      row(1024, 5, { int8 = 9, int4 = 9, fp8 = 9 }),
      row(4096, 6, { int8 = 5, int4 = 5.95, fp8 = 9 }),     -- int4 within the tie margin: no win
      row(16384, 10, { int8 = 11, int4 = 8, fp8 = 12 }),    -- int8 loses again here
      row(65536, 20, { int8 = 15, int4 = 14, fp8 = 21 }),
    }
    local q = tune.quick_min(rows)
    assert.are.equal(65536, q.int8)          -- the win at 4 KiB does not count: it loses at 16 KiB
    assert.are.equal(16384, q.int4)
    assert.are.equal(tune.QUICK_NEVER, q.fp8)
    -- a codec never measured is left out (the seed's table stays in force for it)
    local q2 = tune.quick_min({ row(1024, 5, { int8 = 1 }) })
    assert.are.same({ int8 = 1024 }, q2)
  end)

  it("renders a quick_min section that weft's policy file loader accepts", function()
    local text = tune.render { machine = "m", date = "2026-12-03",
                               quick_min = { [2] = { bf16 = { int8 = 65536, int4 = 16384, fp8 = tune.QUICK_NEVER } } } }
    local t = require("weft.internal.policy_file").parse(text, "t.lua")
    assert.are.equal(65536, t.quick_min[2].bf16.int8)
    assert.are.equal(tune.QUICK_NEVER, t.quick_min[2].bf16.fp8)
    assert.are.equal(16384, (require("weft.quick").min_bytes("bf16", 2, "int4", t)))
  end)
end)

describe("tune.verdict: before/after", function()
  it("equal times pass; slower beyond the noise fails", function()
    assert.is_true((tune.verdict(10, 10)))
    assert.is_true((tune.verdict(10, 10.4)))      -- 3 % + 0.2 µs
    assert.is_false((tune.verdict(10, 10.6)))
    assert.is_true((tune.verdict(10, 10.6, 0.05))) -- a noisier point allows more
    assert.is_true((tune.verdict(2, 2.2)))         -- the absolute floor at small times
    local ok, limit = tune.verdict(100, 50)
    assert.is_true(ok)
    assert.are.equal(100 * 1.03 + 0.2, limit)
  end)
end)
