-- Runs under scripts/weft-run -n 4 (tests/unit/graph_runner_spec.lua): weft.graph_runner
-- at TP 2 x PP 2 (issue 37 item 2) with the fake capture backend and the
-- real host groups: the same step on every rank (a tp:all_reduce of the
-- batch's rows), 16 sizes from 1 to 256, the default check group (the
-- world). Captures agree although tp.0 and tp.1 are different groups; both
-- TP groups replay different sizes at once in a random order, checked
-- against the sum computed here; a real difference inside one TP group
-- (one collective more, or another element count) is still refused and
-- named at every rank, a capture failing on one rank fails all four, and
-- check_group = tp still works. Prints "OK <name>" per check; a failed check
-- raises (non-zero exit).
local weft = require("weft")
local runner_mod = require("weft.graph_runner")
local tensor = require("weft.tensor")
local fake = require("helpers.graph_runner_fake")
local ints = require("helpers.gpu_ranks").ints

local world = weft.init()
local rank = world.rank
assert(world.world_size == 4, "run with 4 ranks")
weft.initialize_model_parallel { tp = 2, pp = 2 }
local tp = weft.tp()

local W = require("helpers.rank_util")
local ok, check, expect = W.ok, W.must, W.expect_error

local H = 16
local SIZES = { 1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 240, 256 }

-- the group the runner watches: tp itself, or (divergence checks) a proxy
-- whose call can be recorded without running, so a rank's extra or
-- different collective is seen at capture instead of hanging its peer
local function proxy()
  local p = setmetatable({ skip = false }, { __index = tp })
  p.all_reduce = function(self, x, op, out)
    if self.skip then return out or x end
    return tp:all_reduce(x, op, out)
  end
  return p
end

local function make(o)
  o = o or {}
  local g = o.group or tp
  return runner_mod.new {
    sizes = SIZES, backend = fake.backend(), warmup = 1, groups = { g }, check_group = o.check_group,
    alloc = function(m) return { x = tensor.zeros({ m, H }, "f32"), y = tensor.zeros({ m, H }, "f32") } end,
    step = o.step or function(bs, b)
      local y = b.y:narrow(0, 0, bs)
      g:all_reduce(b.x:narrow(0, 0, bs), "sum", y)
      return y
    end,
  }
end

-- 1. the same step everywhere, default check group: no refusal
local r = make()
check(r.cg == world.cpu_group, "compares over the world cpu group")
check(#r.order == 16 and r.order[1] == 256 and r.order[16] == 1, "captured 16 sizes, largest first")
check(r.summaries[256].n == 1, "one collective per capture")
ok("tp x pp captures agree with the default check group")

-- 2. both TP groups replay different sizes at once, in a random order:
-- the sequence is the TP group's (its first rank seeds it), so the ranks of
-- one group replay alike and the two groups differently
math.randomseed(1000 + tp.ranks[1])
local seen = {}
for i = 1, 120 do
  local k = math.random(#SIZES)
  local lo = k > 1 and SIZES[k - 1] or 0
  local bs = math.random(lo + 1, SIZES[k])
  local seed = 100000 * tp.ranks[1] + 10 * i
  local out, padded = r:run(bs, function(b, n)
    local h = ints(seed + rank, { n, H }, "f32")
    b.x:narrow(0, 0, n):copy_(h)
    h:free()
  end)
  check(padded == SIZES[k] and out.shape[1] == bs, ("run(%d) used the graph of %d"):format(bs, padded))
  -- the sum of the group's inputs, made here from their seeds
  local want = ints(seed + tp.ranks[1], { bs, H }, "f32")
  local other = ints(seed + tp.ranks[2], { bs, H }, "f32")
  local wp, op = require("ffi").cast("float *", want.ptr), require("ffi").cast("float *", other.ptr)
  for j = 0, bs * H - 1 do wp[j] = wp[j] + op[j] end
  local err = out:compare(want)
  check(err == 0, ("replay %d (bs %d, graph %d): max abs error %g"):format(i, bs, padded, err))
  want:free(); other:free()
  seen[padded] = true
end
local n = 0
for _ in pairs(seen) do n = n + 1 end
check(n >= 12, "replays reached " .. n .. " of the 16 graphs")
r:destroy()
world:barrier()
ok("both tp groups replay random sizes at once, right")

-- 3. one collective more on rank 3 (tp.1) at batch size 64: every rank refuses,
-- and ranks 0 and 1 (tp.0, whose captures agree) name tp.1 too
local p = proxy()
local e = expect(function()
  make { group = p, step = function(bs, b, ctx)
    local y = b.y:narrow(0, 0, bs)
    p:all_reduce(b.x:narrow(0, 0, bs), "sum", y)
    if rank == 3 and bs == 64 and ctx.mode == "graph" then
      p.skip = true; p:all_reduce(y); p.skip = false
    end
    return y
  end }
end, { "weft: graph_runner.capture: ranks captured different work at batch size 64",
       "rank 3 differs from rank 2 in group tp.1", "rank 2 captured 1 collective(s) on tp.1",
       "rank 3 captured 2 collective(s) on tp.1", "tp.1 all_reduce f32 x1024",
       "every rank dropped its graphs" }, "extra collective in tp.1")
check(not e:find("tp.0", 1, true), "tp.0 agreed and is not named: " .. e)
ok("an extra collective inside tp.1 is named at every rank")

-- 4. another element count on rank 0 (tp.0) at batch size 8 (the real
-- all_reduce runs unrecorded, so the peers still meet)
p = proxy()
expect(function()
  make { group = p, step = function(bs, b, ctx)
    local y = b.y:narrow(0, 0, bs)
    if rank == 0 and bs == 8 and ctx.mode == "graph" then
      p.skip = true; p:all_reduce(b.x:narrow(0, 0, bs + 1)); p.skip = false
      tp:all_reduce(b.x:narrow(0, 0, bs), "sum", y)
    else
      p:all_reduce(b.x:narrow(0, 0, bs), "sum", y)
    end
    return y
  end }
end, { "ranks captured different work at batch size 8", "rank 1 differs from rank 0 in group tp.0",
       "tp.0 all_reduce f32 x144", "tp.0 all_reduce f32 x128" }, "count in tp.0")
ok("another element count inside tp.0 is named at every rank")

-- 5. a capture failing on rank 3 fails all four (after its collective)
expect(function()
  make { step = function(bs, b, ctx)
    local y = b.y:narrow(0, 0, bs)
    tp:all_reduce(b.x:narrow(0, 0, bs), "sum", y)
    if rank == 3 and bs == 32 and ctx.mode == "graph" then error("out of memory at bs 32") end
    return y
  end }
end, { "capture of batch size 32 failed on rank 3", "out of memory at bs 32" }, "failure")
ok("a capture failing on one rank fails every rank")

-- 6. check_group = tp keeps working
local r6 = make { check_group = tp }
check(r6.cg == tp.cpu_group, "compares over the tp cpu group")
r6:run(3, function(b, bs) b.x:narrow(0, 0, bs):fill_(rank + 1) end)
check(r6.outputs[4]:to_table()[1] == tp.ranks[1] + tp.ranks[2] + 2, "replay sums the tp group")
r6:destroy()
ok("check_group = tp works")

weft.destroy_model_parallel()
weft.shutdown()
