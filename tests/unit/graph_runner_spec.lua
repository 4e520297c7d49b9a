-- weft.graph_runner bookkeeping on the CPU with a fake capture backend
-- (tests/helpers/graph_runner_fake.lua): size lists, largest-first capture,
-- padding and slicing, errors, verify against eager runs, the shared memory
-- pool, the capture digest; and divergent captures detected across 2 real
-- ranks (scripts/weft-run, the cpu group), with the message naming the rank.
local runner_mod = require("weft.graph_runner")
local tensor = require("weft.tensor")
local fake = require("helpers.graph_runner_fake")
local ffi = require("ffi")
local spec = require("helpers.spec_util")

local ROOT = os.getenv("PWD") or "."

local function err_of(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

local function simple(o)
  o = o or {}
  local log = { alloc = {}, steps = {} }
  local B = o.backend or fake.backend(o.fake)
  local r = runner_mod.new {
    sizes = o.sizes or { 1, 2, 4, 8 },
    backend = B,
    warmup = o.warmup,
    alloc = function(max_bs)
      log.alloc[#log.alloc + 1] = max_bs
      return { x = tensor.zeros({ max_bs, 4 }, "f32"), y = tensor.zeros({ max_bs, 4 }, "f32") }
    end,
    step = o.step or function(bs, bufs, ctx)
      log.steps[#log.steps + 1] = { bs = bs, mode = ctx.mode }
      fake.double_rows(bufs.x, bufs.y, bs)
      return bufs.y:narrow(0, 0, bs)
    end,
    groups = o.groups, fusion = o.fusion, pad = o.pad, slice = o.slice,
  }
  return r, log, B
end

describe("graph_runner: size lists", function()
  it("refuses an empty, unsorted, repeated or non-integer list clearly", function()
    local e = err_of(function() runner_mod.new { sizes = {}, step = function() end, backend = fake.backend() } end)
    assert.matches("weft: graph_runner.new: the capture size list is empty", e, 1, true)
    e = err_of(function() runner_mod.new { sizes = { 1, 4, 2, 8 }, step = function() end, backend = fake.backend() } end)
    assert.matches("the capture size list {1,4,2,8} is not sorted: 2 at position 3 follows 4", e, 1, true)
    e = err_of(function() runner_mod.new { sizes = { 1, 2, 2 }, step = function() end, backend = fake.backend() } end)
    assert.matches("not sorted: 2 at position 3 follows 2", e, 1, true)
    e = err_of(function() runner_mod.new { sizes = { 1, 2.5 }, step = function() end, backend = fake.backend() } end)
    assert.matches("size 2 of the capture list is 2.5", e, 1, true)
    e = err_of(function() runner_mod.new { sizes = { 0, 1 }, step = function() end, backend = fake.backend() } end)
    assert.matches("positive integers", e, 1, true)
    e = err_of(function() runner_mod.new { sizes = "1,2", step = function() end, backend = fake.backend() } end)
    assert.matches("sizes must be a list", e, 1, true)
    e = err_of(function() runner_mod.new { sizes = { 1 }, backend = fake.backend() } end)
    assert.matches("step must be a function", e, 1, true)
  end)

  it("padded_size: the next captured size", function()
    local s = { 1, 2, 4, 8, 16, 24, 32 }
    assert.are.equal(1, runner_mod.padded_size(s, 1))
    assert.are.equal(4, runner_mod.padded_size(s, 3))
    assert.are.equal(16, runner_mod.padded_size(s, 9))
    assert.are.equal(24, runner_mod.padded_size(s, 17))
    assert.are.equal(32, runner_mod.padded_size(s, 32))
    assert.is_nil(runner_mod.padded_size(s, 33))
  end)
end)

describe("graph_runner: capture and replay (fake backend)", function()
  it("allocates once for the largest size and captures largest first", function()
    local r, log, B = simple { warmup = 2 }
    assert.are.same({ 8 }, log.alloc)
    assert.are.same({ 8, 4, 2, 1 }, r.order)
    assert.are.equal(4, B.captured)
    -- per size: 2 eager warmups, then the capture
    local seq = {}
    for _, s in ipairs(log.steps) do seq[#seq + 1] = s.bs .. s.mode:sub(1, 1) end
    assert.are.equal("8e 8e 8g 4e 4e 4g 2e 2e 2g 1e 1e 1g", table.concat(seq, " "))
    r:destroy()
    assert.are.equal(4, B.destroyed)
  end)

  it("run pads to the next captured size and slices the outputs", function()
    local r, _, B = simple { warmup = 0 }
    local function fill(bufs, bs, padded)
      assert.are.equal(3, bs); assert.are.equal(4, padded)
      local p = ffi.cast("float *", bufs.x.ptr)
      for i = 0, 8 * 4 - 1 do p[i] = 7 end        -- garbage beyond row 3 too
      for i = 0, bs * 4 - 1 do p[i] = i end
    end
    local out, padded = r:run(3, fill)
    assert.are.equal(4, padded)
    assert.are.same({ 3, 4 }, out.shape)
    assert.are.same({ { 3, 4 }, { 3, 4 } }, B.pads)   -- rows [3, 4) of x and y zeroed
    local v = out:to_table()
    assert.are.equal(12, #v)
    for i = 0, 11 do assert.are.equal(2 * i + math.floor(i / 4), v[i + 1]) end
    -- the padded row saw zeros: y[3] = 2 * 0 + 3
    local y = ffi.cast("float *", r.bufs.y.ptr)
    assert.are.equal(3, y[3 * 4])
    -- an exact size needs no padding
    local out2, p2 = r:run(8)
    assert.are.equal(8, p2)
    assert.are.same({ 8, 4 }, out2.shape)
    assert.are.equal(2, #B.pads)
    assert.are.equal(2, r.stats.runs)
    assert.are.equal(1, r.stats.padded_runs)
    assert.are.same({ [4] = 1, [8] = 1 }, r.stats.replays)
    r:destroy()
  end)

  it("run refuses sizes above the largest captured one, and bad sizes", function()
    local r = simple { warmup = 0 }
    assert.matches("weft: graph_runner.run: batch size 9 exceeds the largest captured size 8 (captured {1,2,4,8})",
                   err_of(function() r:run(9) end), 1, true)
    assert.matches("batch size must be a positive integer, got 0", err_of(function() r:run(0) end), 1, true)
    assert.matches("got 2.5", err_of(function() r:run(2.5) end), 1, true)
    r:destroy()
    assert.matches("runner was destroyed", err_of(function() r:run(1) end), 1, true)
    r:destroy()   -- idempotent
  end)

  it("pad = false leaves the rows alone; pad = function is called instead", function()
    local r, _, B = simple { warmup = 0, pad = false }
    r:run(3)
    assert.are.equal(0, #B.pads)
    r:destroy()
    local calls = {}
    r = simple { warmup = 0, pad = function(_, bs, padded) calls[#calls + 1] = bs .. "->" .. padded end }
    r:run(5)
    assert.are.same({ "5->8" }, calls)
    r:destroy()
  end)

  it("verify: replays agree with eager runs", function()
    local r = simple { warmup = 0 }
    local rep = r:verify()
    assert.is_true(rep.ok)
    assert.are.equal(0, rep.worst)
    assert.are.equal(6, rep.checked)     -- 8, 4, 2, 1, then 7 and 3 (padded)
    rep = r:verify(3)
    assert.are.equal(3, rep.checked)
    r:destroy()
  end)

  it("verify: a graph that does not recompute is caught", function()
    local r = simple { warmup = 0, fake = { stale = true } }
    local e = err_of(function() r:verify(2) end)
    assert.matches("weft: graph_runner.verify: replayed outputs differ from eager runs on rank 0", e, 1, true)
    assert.matches("batch size 8 (graph of 8): output 1 max abs error", e, 1, true)
    r:destroy()
  end)

  it("a capture that fails drops every graph and names the size", function()
    local B = fake.backend()
    local e = err_of(function()
      simple { backend = B, warmup = 0, step = function(bs, bufs, ctx)
        if bs == 2 and ctx.mode == "graph" then error("no room for bs 2") end
        fake.double_rows(bufs.x, bufs.y, bs)
        return bufs.y
      end }
    end)
    assert.matches("weft: graph_runner.capture: capture of batch size 2 failed on rank 0", e, 1, true)
    assert.matches("no room for bs 2", e, 1, true)
    assert.are.equal(2, B.captured)       -- 8 and 4
    assert.are.equal(2, B.destroyed)
  end)

  it("counts the collectives of the groups during capture only, then restores them", function()
    local calls, class_calls = 0, 0
    local own = function(_, t) calls = calls + 1; return t end
    local grp = { unique_name = "tp.0", world_size = 1, all_reduce = own }
    -- a group whose method is its class's (found through __index)
    local class = { all_reduce = function(_, t) class_calls = class_calls + 1; return t end }
    local grp2 = setmetatable({ unique_name = "pp.0", world_size = 1 }, { __index = class })
    local r = simple { warmup = 1, groups = { grp, grp2 }, step = function(bs, bufs, ctx)
      grp:all_reduce(bufs.x)
      if bs >= 4 then grp:all_reduce(bufs.y) end
      ctx.note("norm " .. bs)
      return bufs.y
    end }
    assert.are.equal(3, r.summaries[8].n)               -- two all_reduce + one note
    assert.are.equal(2, r.summaries[1].n)
    assert.are.same({ ["tp.0"] = 2 }, r.summaries[8].per_group)
    assert.matches("tp.0 all_reduce f32 x32", r.summaries[8].lines[1], 1, true)
    assert.are_not.equal(r.summaries[8].digest, r.summaries[4].digest)   -- the note differs
    -- every call ran (one warmup and one capture per size), and the method is the table's own again
    assert.are.equal(4 + 4 + 2 + 2, calls)
    -- restored: the group's own function again, the class's group without a
    -- field of its own, and a call after capture is not counted anywhere
    assert.are.equal(own, rawget(grp, "all_reduce"))
    assert.is_nil(rawget(grp2, "all_reduce"))
    assert.are.equal(class.all_reduce, grp2.all_reduce)
    grp:all_reduce({})
    grp2:all_reduce({})
    assert.are.equal(4 + 4 + 2 + 2 + 1, calls)
    assert.are.equal(1, class_calls)
    assert.are.equal(3, r.summaries[8].n)
    r:destroy()
  end)

  it("pre-initializes fusion workspaces before the first capture", function()
    local seen = {}
    local ctxf = { pre_initialize_workspaces = function(_, a) seen[#seen + 1] = a; return { attn_tp = true } end }
    local grp = { unique_name = "tp.0", world_size = 2 }
    local B = fake.backend()
    local captured_before
    local r = simple { backend = B, warmup = 0, groups = { grp },
      fusion = { ctx = ctxf, hidden = 4096, dtype = "bf16" },
      step = function(bs, bufs)
        if captured_before == nil then captured_before = #seen end
        fake.double_rows(bufs.x, bufs.y, bs)
        return bufs.y
      end }
    assert.are.equal(1, captured_before)
    assert.are.equal(1, #seen)
    assert.are.equal(8, seen[1].max_tokens)
    assert.are.equal(4096, seen[1].hidden)
    assert.are.equal("bf16", seen[1].dtype)
    assert.are.equal(grp, seen[1].attn_coord)
    r:destroy()
  end)
end)

-- capture_verdict: the pure comparison of what the ranks captured, fed with
-- summaries recorded by real runners (fake backend, one per simulated rank)
-- and sent through weft.serialize as the all-gather does.
describe("graph_runner: capture_verdict (what must be equal, and where)", function()
  local ser = require("weft.serialize")
  local noop = function(_, t) return t end

  -- a stand-in group: its collectives recorded, not run
  local function grp(name, ranks)
    return { unique_name = name, ranks = ranks, world_size = ranks and #ranks or 2, all_reduce = noop,
             all_gather = noop }
  end

  -- the summary of batch size 4 on a rank whose runner watches `groups` and
  -- whose step is step(bs, x, ctx); as the all-gather delivers it
  local function summary(groups, step)
    local r = runner_mod.new { sizes = { 4 }, backend = fake.backend(), warmup = 0, groups = groups,
      alloc = function(m) return { x = tensor.zeros({ m, 8 }, "f32") } end,
      step = function(bs, b, ctx) step(bs, b.x:narrow(0, 0, bs), ctx); return b.x end }
    local s = r.summaries[4]
    r:destroy()
    return { ok = true, sum = ser.decode(ser.encode(s)) }
  end

  -- world 4 at TP 2 x PP 2: rank r's tp group and pp group
  local function tp_of(r) return r < 2 and grp("tp.0", { 0, 1 }) or grp("tp.1", { 2, 3 }) end
  local function pp_of(r) return r % 2 == 0 and grp("pp.0", { 0, 2 }) or grp("pp.1", { 1, 3 }) end
  local RANKS4 = { 0, 1, 2, 3 }
  local function world4(step, groups_of)
    local all = {}
    for r = 0, 3 do
      local tp, pp = tp_of(r), pp_of(r)
      local gs = groups_of and groups_of(r, tp, pp) or { tp }
      all[r + 1] = summary(gs, function(bs, x, ctx) step(r, tp, pp, x, ctx) end)
    end
    return all
  end

  it("TP 2 x PP 2, the same step everywhere: tp.0 and tp.1 are not compared with each other", function()
    local all = world4(function(_, tp, _, x) tp:all_reduce(x) end)
    assert.are_not.equal(all[1].sum.digest, all[3].sum.digest)   -- the names differ, as in issue 37
    assert.is_nil(runner_mod.capture_verdict(4, all, RANKS4))
    -- and with tp and pp watched, notes included
    all = world4(function(_, tp, _, x, ctx) tp:all_reduce(x); ctx.note("norm") end,
                 function(_, tp, pp) return { tp, pp } end)
    assert.is_nil(runner_mod.capture_verdict(4, all, RANKS4))
  end)

  it("a difference inside one TP group is named, with its group, the same way on every rank", function()
    local all = world4(function(r, tp, _, x)
      tp:all_reduce(x)
      if r == 3 then tp:all_gather(x) end
    end)
    local msg = runner_mod.capture_verdict(4, all, RANKS4)
    assert.matches("ranks captured different work at batch size 4: rank 3 differs from rank 2 in group tp.1 "
                   .. "(rank 2 captured 1 collective(s) on tp.1, digest ", msg, 1, true)
    assert.matches("rank 3 captured 2 collective(s) on tp.1, digest ", msg, 1, true)
    assert.matches("[tp.1 all_reduce f32 x32; tp.1 all_gather f32 x32]", msg, 1, true)
    assert.matches("every rank dropped its graphs", msg, 1, true)
    assert.is_nil(msg:find("tp.0", 1, true), msg)
    -- another element count inside tp.0
    all = world4(function(r, tp, _, x) tp:all_reduce(r == 0 and x:narrow(0, 0, 3) or x) end)
    msg = runner_mod.capture_verdict(4, all, RANKS4)
    assert.matches("rank 1 differs from rank 0 in group tp.0", msg, 1, true)
    assert.matches("tp.0 all_reduce f32 x24", msg, 1, true)
    -- both groups at once: each named
    all = world4(function(r, tp, _, x) tp:all_reduce(x); if r % 2 == 1 then tp:all_reduce(x) end end)
    msg = runner_mod.capture_verdict(4, all, RANKS4)
    assert.matches("rank 1 differs from rank 0 in group tp.0", msg, 1, true)
    assert.matches(" | rank 3 differs from rank 2 in group tp.1", msg, 1, true)
  end)

  it("a capture failed anywhere fails every rank, whatever the groups", function()
    local all = world4(function(_, tp, _, x) tp:all_reduce(x) end)
    all[3] = { ok = false, err = "out of memory" }
    assert.are.equal("capture of batch size 4 failed on rank 2 (rank 2: out of memory); "
                     .. "every rank dropped its graphs", runner_mod.capture_verdict(4, all, RANKS4))
  end)

  it("notes are compared within each watched group (and across ranks when none is watched)", function()
    local all = world4(function(r, tp, _, x, ctx) tp:all_reduce(x); ctx.note(r == 1 and "B" or "A") end)
    local msg = runner_mod.capture_verdict(4, all, RANKS4)
    assert.matches("rank 1 differs from rank 0 in group tp.0", msg, 1, true)
    assert.matches("rank 1 captured 1 collective(s) on tp.0 and 1 note(s)", msg, 1, true)
    assert.matches("[tp.0 all_reduce f32 x32; B]", msg, 1, true)
    all = world4(function(r, _, _, _, ctx) ctx.note(r == 2 and "B" or "A") end, function() return {} end)
    msg = runner_mod.capture_verdict(4, all, RANKS4)
    assert.matches("rank 2 differs from ranks 0,1,3 in the step's notes", msg, 1, true)
  end)

  it("a group without a member list is compared among the ranks that report it", function()
    local all = {}
    for r = 0, 1 do
      local g = grp("tp.0", nil)
      all[r + 1] = summary({ g }, function(_, x) g:all_reduce(r == 0 and x or x:narrow(0, 0, 1)) end)
    end
    assert.matches("rank 1 differs from rank 0 in group tp.0", runner_mod.capture_verdict(4, all, { 0, 1 }), 1, true)
    all[2] = all[1]
    assert.is_nil(runner_mod.capture_verdict(4, all, { 0, 1 }))
  end)

  it("a member that does not watch a group its peers issued collectives on differs", function()
    local function groups_of(r, tp, pp) return r == 2 and { tp } or { tp, pp } end
    local all = world4(function(r, tp, pp, x) tp:all_reduce(x); if r ~= 2 then pp:all_reduce(x) end end, groups_of)
    local msg = runner_mod.capture_verdict(4, all, RANKS4)
    assert.matches("rank 2 differs from rank 0 in group pp.0", msg, 1, true)
    assert.matches("rank 2 did not watch pp.0", msg, 1, true)
    assert.is_nil(msg:find("pp.1", 1, true), msg)
    -- no pp collective anywhere: nothing to disagree on
    all = world4(function(_, tp, _, x) tp:all_reduce(x) end, groups_of)
    assert.is_nil(runner_mod.capture_verdict(4, all, RANKS4))
  end)

  it("with a check group of some ranks only, a group's members outside it are not asked", function()
    -- check_group = tp.0 (ranks 0, 1), the runner watching tp and pp: pp.0
    -- (0, 2) and pp.1 (1, 3) each have one member here
    local all = world4(function(r, tp, pp, x) tp:all_reduce(x); pp:all_reduce(r == 0 and x or x:narrow(0, 0, 2)) end,
                       function(_, tp, pp) return { tp, pp } end)
    assert.is_nil(runner_mod.capture_verdict(4, { all[1], all[2] }, { 0, 1 }))
    local t1 = tp_of(1)
    all[2] = summary({ t1 }, function(_, x) t1:all_reduce(x:narrow(0, 0, 2)) end)
    assert.matches("rank 1 differs from rank 0 in group tp.0",
                   runner_mod.capture_verdict(4, { all[1], all[2] }, { 0, 1 }), 1, true)
  end)

  it("groups of one name but other members (groups of size 1) stay apart", function()
    local all = {}
    for r = 0, 1 do
      local g = grp("dcp.0", { r })
      all[r + 1] = summary({ g }, function(_, x) g:all_reduce(r == 0 and x or x:narrow(0, 0, 1)) end)
    end
    assert.is_nil(runner_mod.capture_verdict(4, all, { 0, 1 }))
  end)
end)

describe("graph_runner: one memory pool for the runner's graphs", function()
  -- a fake cuda module: pointers are numbers cast to void*
  local function fake_cuda()
    local c = { next = 0x10000, allocs = 0, frees = {} }
    function c.alloc(n)
      c.allocs = c.allocs + 1
      local p = ffi.cast("void *", c.next)
      c.next = c.next + math.max(n, 512)
      return p
    end
    function c.free(p) c.frees[#c.frees + 1] = tonumber(ffi.cast("uintptr_t", p)) end
    return c
  end

  it("blocks allocated during capture are reused by later captures, never handed out elsewhere", function()
    local cu = fake_cuda()
    local pool = runner_mod.new_pool(cu)
    pool:activate()
    local a = cu.alloc(1000)
    local b = cu.alloc(4096)
    cu.free(a)                                -- back to the runner, not the device pool
    assert.are.equal(0, #cu.frees)
    local a2 = cu.alloc(900)                  -- fits a's block (<= 25 % waste)
    assert.are.equal(tonumber(ffi.cast("uintptr_t", a)), tonumber(ffi.cast("uintptr_t", a2)))
    assert.are.equal(1, pool.reused)
    local c = cu.alloc(100)                   -- too small for a reuse of anything free: new
    pool:deactivate()
    cu.free(c)                                -- even after the capture: stays with the runner
    assert.are.equal(0, #cu.frees)
    local d = cu.alloc(100)                   -- outside a capture: ordinary
    assert.are_not.equal(tonumber(ffi.cast("uintptr_t", c)), tonumber(ffi.cast("uintptr_t", d)))
    cu.free(d)
    assert.are.equal(1, #cu.frees)            -- d went to the device pool
    pool:release()                            -- c goes back now; a2 and b are disowned
    assert.are.equal(2, #cu.frees)
    cu.free(b)
    assert.are.equal(3, #cu.frees)
    assert.are.equal(3, pool.allocs)
  end)
end)

-- ---------------------------------------------------------------- 2 ranks

local function run_ranks(n, script, timeout)
  return require("helpers.rank_passes").run(ROOT, "tests/helpers/" .. script, n, nil, timeout + 10)
end

-- one it() per check name: every rank (2, or `world`) printed "OK <name>"
local function both_ok(once, names, world)
  world = world or 2
  for _, name in ipairs(names) do
    it(name, function()
      local o = once()
      local n = 0
      for _ in o:gmatch("%] OK " .. name:gsub("%p", "%%%0") .. "\n") do n = n + 1 end
      assert.are.equal(world, n, "expected 'OK " .. name .. "' from " .. world .. " ranks:\n" .. o)
    end)
  end
end

-- A describe's body for a helper run on n ranks (run_ranks): one it() per
-- check name (both_ok), then one that every rank exited cleanly.
local function ranks_checks(n, script, timeout, names, exit_title)
  local out, rc
  local function once()
    if not out then out, rc = run_ranks(n, script, timeout) end
    return out
  end
  both_ok(once, names, n)
  it(exit_title, function()
    once()
    assert.are.equal(0, rc, out)
  end)
end

-- The GPU spec's helper (device all_reduce and fused path through a TP
-- group, weft.backends.device_backends, weft.fusion) on the simulated machine of
-- tests/helpers/tune_sim.lua: its plumbing checked without a GPU.
describe("graph_runner over device groups on a simulated machine", function()
  local out, rc
  local function once()
    if out then return out end
    out, rc = spec.shell(("WEFT_TIMEOUT_MS=30000 TUNE_SIM_ROOT='%s' TUNE_SIM_SCRIPT='%s/tests/helpers/graph_runner_gpu.lua' "
                          .. "LUA_PATH='%s/tests/?.lua;%s/lua/?.lua;;' timeout -s KILL 150 %s/scripts/weft-run -n 2 "
                          .. "--timeout 140 %s/tests/helpers/tune_sim.lua")
                         :format(ROOT, ROOT, ROOT, ROOT, ROOT, ROOT))
    return out
  end
  both_ok(once, {
    "captured 5 sizes over all_reduce and the fused path", "replays match eager runs, padded sizes included",
    "run pads to the next captured size", "divergent capture detected on every rank",
    "the group is usable after a refused capture",
  })
  it("exits cleanly", function() once(); assert.are.equal(0, rc, out) end)
end)

describe("graph_runner across 2 ranks (cpu group)", function()
  ranks_checks(2, "graph_runner_ranks.lua", 90, {
    "same captures agree", "verify agrees across ranks",
    "an extra collective on rank 1 is detected", "a note that differs is detected",
    "different size lists are refused before any capture", "a capture failing on one rank fails all",
    "the runner is usable after a refused one",
  }, "both ranks exit cleanly")
end)

-- issue 37 item 2: TP 2 x PP 2, the same step on every rank, default check
-- group (the world): tp.0 and tp.1 are different groups and their captures
-- must not be compared with each other; a difference inside one of them is.
describe("graph_runner at TP 2 x PP 2 across 4 ranks (cpu groups)", function()
  ranks_checks(4, "graph_runner_tpp_ranks.lua", 120, {
    "tp x pp captures agree with the default check group",
    "both tp groups replay random sizes at once, right",
    "an extra collective inside tp.1 is named at every rank",
    "another element count inside tp.0 is named at every rank",
    "a capture failing on one rank fails every rank",
    "check_group = tp works",
  }, "all 4 ranks exit cleanly")
end)

-- The GPU spec's TP 2 x PP 2 worker (tests/helpers/graph_runner_tpp_gpu.lua)
-- on the pretend GPU (tests/helpers/fake_device.lua, 2 devices, 2 ranks
-- each in shared-GPU mode): its plumbing checked without a GPU, 100 replays.
describe("graph_runner at TP 2 x PP 2 on a pretend GPU (the GPU spec's worker)", function()
  local out, rc
  local function once()
    if not out then
      out, rc = spec.shell(("cd %s && WEFT_FAKE_DEVICE=1 WEFT_ALLOW_SHARED_GPU=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 "
                            .. "WEFT_TIMEOUT_MS=30000 GR_TPP_REPLAYS=100 LUA_PATH='%s/tests/?.lua;;' timeout -s KILL 200 "
                            .. "scripts/weft-run -n 4 --timeout 190 tests/helpers/graph_runner_tpp_gpu.lua")
                           :format(ROOT, ROOT))
    end
    return out
  end
  for _, name in ipairs { "tpxpp_capture_default_check_group", "random_concurrent_replays_match_host",
                          "difference_inside_tp1_named_everywhere", "usable_after_refusal_and_check_group_tp" } do
    it(name, function()
      local o = once()
      for r = 0, 3 do
        assert.is_truthy(o:find("[rank" .. r .. "] PASS " .. name .. " (", 1, true), o)
      end
    end)
  end
  it("all 4 ranks exit cleanly", function() once(); assert.are.equal(0, rc, out) end)
end)
