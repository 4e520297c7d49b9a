-- weft.shm: the shared-memory host data plane. In one process (a group of
-- one: every collective, argument checks, lifetime) and across real processes
-- (1, 2, 3, 4, 8 ranks: every collective, dtype and op against an f64
-- reference, mismatched calls, a late rank, a killed rank, same_node), and
-- nothing left behind in /dev/shm. The fork()-based C test of the same engine
-- (tests/c/shm_fork_test.c, `make shm-test-c`) runs here too, its quick form.
local ffi = require("ffi")
local shm = require("weft.shm")
local util = require("helpers.store_util")
local spec = require("helpers.spec_util")

local WORKER = "tests/helpers/shm_worker.lua"

local err_of = spec.err_of

-- Leaked names: ours (weft-shm-/weft-node-<pid>-<hex>) whose creator is gone.
-- Names of live processes (another engineer's run) are in use, not leaked.
local function leftovers()
  return spec.dev_shm(function(name)
    local pid = name:match("^weft%-shm%-(%d+)%-%x+$") or name:match("^weft%-node%-(%d+)%-%x+$")
    return pid and not util.alive(tonumber(pid))
  end)
end

local before_all = leftovers()

describe("weft.shm in one process", function()
  local s, g
  before_each(function() s, g = util.one_rank_group("solo", 7, 2000) end)
  after_each(function()
    g:destroy()
    s:close()
  end)

  it("a group of one does every collective", function()
    local c = shm.new(g, 4096)
    assert.are.equal(1, c.size)
    local x = ffi.new("float[5]", { 1, -2, 3.5, -0.0, 8 })
    local y = ffi.new("float[5]")
    c:all_reduce(x, y, 5, "f32", "sum")
    for i = 0, 4 do assert.are.equal(x[i], y[i]) end
    c:all_reduce(x, x, 5, 0, 1) -- codes work too, in place
    assert.are.equal(3.5, x[2])
    local big = ffi.new("double[?]", 10000)
    for i = 0, 9999 do big[i] = i end
    c:all_reduce(big, big, 10000, "f64", "max") -- larger than a slot
    assert.are.equal(9999, big[9999])
    local rs = ffi.new("int32_t[3]")
    c:reduce_scatter(ffi.new("int32_t[3]", { 4, 5, 6 }), rs, 3, "i32", "min")
    assert.are.same({ 4, 5, 6 }, { rs[0], rs[1], rs[2] })
    local gat = ffi.new("uint8_t[3]")
    c:all_gather(ffi.new("uint8_t[3]", { 9, 8, 7 }), gat, 3)
    assert.are.same({ 9, 8, 7 }, { gat[0], gat[1], gat[2] })
    c:broadcast(gat, 3, 0)
    assert.are.same({ true }, shm.same_node(g, 0))
    assert.is_truthy(tostring(c):find("group 'solo', 1 ranks", 1, true))
    c:destroy()
    c:destroy()
    assert.is_truthy(tostring(c):find("destroyed", 1, true))
  end)

  it("creators remove names left by dead creators (old enough), and only those", function()
    local hex = ("0123456789abcdef"):rep(2)
    local dead = "/dev/shm/weft-shm-2147483646-" .. hex          -- no such pid
    local young = "/dev/shm/weft-node-2147483646-" .. hex:reverse()
    local alive = ("/dev/shm/weft-shm-%d-%s"):format(1, hex)      -- init lives
    local other = "/dev/shm/weft-shm-2147483646-xyz"                -- not our pattern
    for _, p in ipairs { dead, young, alive, other } do assert(io.open(p, "w")):close() end
    for _, p in ipairs { dead, alive, other } do os.execute("touch -d '2 hours ago' '" .. p .. "'") end
    local c = shm.new(g, 4096)
    c:destroy()
    local function exists(p) local f = io.open(p, "r"); if f then f:close() end; return f ~= nil end
    local kept = { exists(dead), exists(young), exists(alive), exists(other) }
    for _, p in ipairs { dead, young, alive, other } do os.remove(p) end
    assert.are.same({ false, true, true, true }, kept)
  end)

  it("names the problem in its errors", function()
    assert.is_truthy(err_of(shm.new, {}, 4096):find("weft: shm new: expected a live weft.cpugroup", 1, true))
    assert.is_truthy(err_of(shm.new, g, -1):find("bytes_per_rank must be a positive integer", 1, true))
    local c = shm.new(g)
    local x = ffi.new("float[4]")
    assert.is_truthy(err_of(c.all_reduce, c, x, x, 4, "f8", "sum"):find("unknown dtype f8", 1, true))
    assert.is_truthy(err_of(c.all_reduce, c, x, x, 4, "f32", "xor"):find("unknown op xor", 1, true))
    local e = err_of(c.all_reduce, c, x, x, 4, "u8", "sum")
    assert.is_truthy(e:find("weft_shm_all_reduce: group 'solo': unsupported dtype/op", 1, true), e)
    e = err_of(c.broadcast, c, x, 4, 1)
    assert.is_truthy(e:find("root out of range", 1, true), e)
    e = err_of(c.all_gather, c, nil, x, 4)
    assert.is_truthy(e:find("NULL buffer", 1, true), e)
    -- misuse does not break the communicator
    c:all_reduce(x, x, 4, "f32", "sum")
    c:destroy()
    e = err_of(c.broadcast, c, x, 4, 0)
    assert.is_truthy(e:find("weft: shm broadcast: communicator of group 'solo' was destroyed", 1, true), e)
    assert.is_truthy(err_of(shm.same_node, g, 1):find("root 1 out of range", 1, true))
  end)
end)

describe("weft.shm across processes", function()
  local function run(n, mode, tmo, limit)
    return util.run_ranks(n, WORKER, { SHM_MODE = mode, SHM_TIMEOUT_MS = tmo or 30000 }, limit or 120)
  end

  local function all_ok(n, res)
    for r = 0, n - 1 do
      local out = res[r].out
      assert.are.equal(0, res[r].rc, ("rank %d failed:\n%s"):format(r, out))
      assert.is_truthy(out:find("OK rank " .. r, 1, true), out)
    end
  end

  for _, n in ipairs { 1, 2, 3, 4, 8 } do
    it(("every collective, dtype and op, 1 element to 6 MiB (many chunks), with %d rank(s)"):format(n), function()
      all_ok(n, run(n, "correct"))
    end)
  end

  for _, n in ipairs { 1, 2, 3, 4, 8 } do
    it(("all_reduce of shared host buffers reads the peers in place, bit-identical to the segment (%d rank(s))")
       :format(n), function()
      all_ok(n, run(n, "zerocopy"))
    end)
  end

  for _, n in ipairs { 2, 4 } do
    it(("ranks that disagree all get an error and stay usable (%d ranks)"):format(n), function()
      all_ok(n, run(n, "mismatch"))
    end)
  end

  for _, n in ipairs { 1, 3 } do
    it(("same_node says every rank shares memory with every root (%d ranks)"):format(n), function()
      all_ok(n, run(n, "same_node"))
    end)
  end

  local function failure_lines(res, n, tag)
    local got = {}
    for r = 0, n - 1 do got[r] = spec.report_of(spec.lines_of(res[r].out), tag) end
    return got
  end

  -- every rank but the last reported `tag` failed within tmo + 2 s, its
  -- message holding each of `texts`
  local function others_failed(res, n, tag, tmo, texts)
    local got = failure_lines(res, n, tag)
    for r = 0, n - 2 do
      local g = got[r]
      assert.is_truthy(g, ("rank %d reported nothing:\n%s"):format(r, res[r].out))
      assert.are.equal("false", g.ok)
      assert.is_true(g.ms < tmo + 2000, ("rank %d failed after %d ms"):format(r, g.ms))
      for _, text in ipairs(texts) do assert.is_truthy(g.msg:find(text, 1, true), g.msg) end
    end
  end

  it("a late rank: the others fail within the timeout, naming the group, the operation and it", function()
    local n, tmo = 3, 3000
    local res = run(n, "late", tmo, 60)
    others_failed(res, n, "LATE", tmo, { "weft_shm_all_reduce: group 'shmtest'", "rank 2 (global 2, pid" })
    local self = failure_lines(res, n, "LATE_SELF")[n - 1]
    assert.is_truthy(self and self.msg:find("communicator aborted by rank", 1, true), res[n - 1].out)
  end)

  for _, zc in ipairs { false, true } do
  it(("a killed rank%s: the survivors fail within the timeout + 2 s, naming it")
     :format(zc and " (zero-copy calls)" or ""), function()
    local n, tmo = 4, 5000
    local res = util.run_ranks(n, WORKER, { SHM_MODE = "kill", SHM_TIMEOUT_MS = tmo,
                                            SHM_KILL_ZC = zc and "1" or "0" }, 60)
    assert.are_not.equal(0, res[n - 1].rc)
    for r = 0, n - 2 do assert.is_falsy(res[r].out:find("FAIL", 1, true), res[r].out) end
    others_failed(res, n, "KILLED", tmo, { "rank 3 (global 3, pid", "died" })
  end)
  end

  it("a rank that never creates: the others fail within the timeout, nothing is left behind", function()
    local n, tmo = 3, 3000
    local res = run(n, "absent", tmo, 60)
    others_failed(res, n, "ABSENT_CREATE", tmo, { "weft_shm_create: group 'shmtest'", "rank 2" })
    assert.are.equal(before_all, leftovers())
  end)

  it("leaves nothing in /dev/shm", function()
    assert.are.equal(before_all, leftovers())
  end)
end)

-- The engine without the cpu group or Lua: fork()ed ranks attach by name,
-- every collective against its reference, then the failure paths (it had
-- stopped linking unnoticed while it ran only by hand).
describe("the fork()ed C test of the engine (tests/c/shm_fork_test.c --quick)", function()
  local run_c = spec.c_test("shm_fork_test", 240, "--quick")
  it("links, and every check passes", function()
    spec.assert_c_passed(assert, run_c(), "shm_fork", 1000)
  end)
end)
