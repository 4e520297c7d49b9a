-- Runs under scripts/weft-run -n 2 (tests/unit/graph_runner_spec.lua): weft.graph_runner
-- with the fake capture backend, the real world cpu group comparing captures.
-- Prints "OK <name>" per check; any failed check raises (non-zero exit).
local weft = require("weft")
local runner_mod = require("weft.graph_runner")
local tensor = require("weft.tensor")
local fake = require("helpers.graph_runner_fake")

local world = weft.init()
local rank = world.rank

local W = require("helpers.rank_util")
local ok, check, expect = W.ok, W.must, W.expect_error

-- a stand-in tensor-parallel group: its collectives are recorded, not run
local tp = { unique_name = "tp.0", world_size = 2, rank_in_group = rank,
             all_reduce = function(_, t) return t end,
             fused_allreduce_rmsnorm = function(_, x) return x, x end }

local function make(o)
  local B = fake.backend()
  return runner_mod.new {
    sizes = o.sizes or { 1, 2, 4, 8 }, backend = B, warmup = 1, groups = { tp },
    alloc = function(m) return { x = tensor.zeros({ m, 8 }, "f32"), y = tensor.zeros({ m, 8 }, "f32") } end,
    step = o.step or function(bs, bufs)
      tp:all_reduce(bufs.x)
      fake.double_rows(bufs.x, bufs.y, bs)
      return bufs.y:narrow(0, 0, bs)
    end,
  }, B
end

-- 1. the same work everywhere
local r, B = make {}
check(#r.order == 4 and r.order[1] == 8, "captured largest first")
check(r.cg ~= nil and r.cg == world.cpu_group, "compares over the world cpu group")
ok("same captures agree")
local rep = r:verify(4)
check(rep.ok and rep.checked == 4, "verify ran 4 checks")
ok("verify agrees across ranks")
r:destroy()
check(B.destroyed == 4, "graphs destroyed")

-- 2. rank 1 issues one more collective at batch size 4, only while capturing
local B2
expect(function()
  local _, b = make { step = function(bs, bufs, ctx)
    tp:all_reduce(bufs.x)
    if rank == 1 and bs == 4 and ctx.mode == "graph" then tp:fused_allreduce_rmsnorm(bufs.y) end
    fake.double_rows(bufs.x, bufs.y, bs)
    return bufs.y
  end }
  B2 = b
end, { "weft: graph_runner.capture: ranks captured different work at batch size 4",
       "rank 1 differs from rank 0 in group tp.0", "rank 1 captured 2 collective(s) on tp.0",
       "rank 0 captured 1 collective(s) on tp.0", "tp.0 fused_allreduce_rmsnorm f32 x64",
       "every rank dropped its graphs" }, "extra collective")
ok("an extra collective on rank 1 is detected")

-- 3. the step's own note differs (work the groups do not see)
expect(function()
  make { step = function(bs, bufs, ctx)
    ctx.note(rank == 0 and "kernel A" or "kernel B")
    fake.double_rows(bufs.x, bufs.y, bs)
    return bufs.y
  end }
end, { "ranks captured different work at batch size 8", "rank 1 differs from rank 0 in group tp.0",
       "rank 1 captured 0 collective(s) on tp.0 and 1 note(s)", "[kernel B]" },
  "note")
ok("a note that differs is detected")

-- 4. different lists: refused before any step runs
local steps = 0
expect(function()
  make { sizes = rank == 0 and { 1, 2, 4, 8 } or { 1, 2, 4 },
         step = function(_, bufs) steps = steps + 1; return bufs.y end }
end, { "ranks were given different capture size lists", "rank 0: {1,2,4,8}", "rank 1: {1,2,4}",
       "nothing was captured" }, "sizes")
check(steps == 0, "no step ran")
ok("different size lists are refused before any capture")

-- 5. a failure on one rank fails every rank together
expect(function()
  make { step = function(bs, bufs, ctx)
    if rank == 1 and bs == 2 and ctx.mode == "graph" then error("out of memory at bs 2") end
    fake.double_rows(bufs.x, bufs.y, bs)
    return bufs.y
  end }
end, { "capture of batch size 2 failed on rank 1", "out of memory at bs 2" }, "failure")
ok("a capture failing on one rank fails all")

-- 6. and the group keeps working afterwards
local r6 = make {}
r6:run(3)
r6:verify(2)
r6:destroy()
ok("the runner is usable after a refused one")

weft.shutdown()
