-- One rank of tests/gpu/gpu_graph_runner_spec.lua's TP 2 x PP 2 run (issue 37
-- item 2): scripts/weft-run -n 4 tests/helpers/graph_runner_tpp_gpu.lua, one
-- GPU per rank, or under scripts/weft-mps -n 4 with the ranks sharing the
-- GPUs. weft.graph_runner with groups = {tp} and the default check group
-- (the world), the same step on every rank (a device all_reduce of the
-- batch's rows, bf16, hidden 1024), 16 piecewise graphs for batch sizes 1 to
-- 256. Then 300 replays per rank, both TP groups (tp.0 = ranks 0,1 and
-- tp.1 = ranks 2,3) replaying different sizes at once in a random order
-- (one sequence per TP group), each replay's output compared with a host
-- all_reduce of the same data (small integers: exact). Then one collective
-- more on rank 3 at batch size 64 (recorded, not run: a stub) must be
-- refused at every rank naming tp.1 only, and the group must still work
-- (an eager all_reduce, a runner with check_group = tp).
-- Prints "PASS <name> (<s> s)" or "FAIL <name>: <why>"; exits 1 on a failure.
-- GR_TPP_REPLAYS=n: fewer replays (a rehearsal on the pretend GPU).
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local G, weft, T, cuda, db = R.G, R.weft, R.T, R.cuda, R.db
local runner_mod = require("weft.graph_runner")

local world = weft.init { timeout_ms = tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 60000 }
local me, W = world.rank, world.world_size
assert(W == 4, "run with 4 ranks")
weft.initialize_model_parallel { tp = 2, pp = 2 }
local tp = weft.tp()
local DEV = R.dev()

local S = G.soft_checks()
local want, ints = S.want, G.ints
local check, done = G.checks(world, S)

local H, DT = 1024, "bf16"
local SIZES = { 1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 240, 256 }
local REPLAYS = tonumber(os.getenv("GR_TPP_REPLAYS") or "") or 300

local function alloc(m)
  return { x = T.zeros({ m, H }, DT, DEV), y = T.zeros({ m, H }, DT, DEV) }
end

-- y[0:bs] = the TP group's sum of x[0:bs]
local function step(bs, b)
  local y = b.y:narrow(0, 0, bs)
  tp:all_reduce(b.x:narrow(0, 0, bs), "sum", y)
  return y
end

local function new_runner(o)
  o = o or {}
  return runner_mod.new { sizes = SIZES, groups = { tp }, alloc = alloc, step = o.step or step,
                          check_group = o.check_group }
end

-- bs rows of the group's sequence i: fill x with this rank's small integers,
-- replay, compare with the host all_reduce of the same integers
local function replay_checked(r, bs, seed, what)
  local h = ints(seed + me, { bs, H }, DT)
  local out, padded = r:run(bs, function(b, n) b.x:narrow(0, 0, n):copy_(h) end)
  want(out.shape[1] == bs, "%s: output has %d rows", what, out.shape[1])
  tp:all_reduce(h)                                  -- the host path, the same data
  local err = out:compare(h)
  want(err == 0, "%s (bs %d, graph of %d): max abs difference from the host all_reduce %g",
       what, bs, padded, err)
  h:free()
  return padded
end

local runner

check("tpxpp_capture_default_check_group", function()
  runner = new_runner()
  want(runner.cg == world.cpu_group, "the check group is not the world's cpu group")
  want(#runner.order == 16 and runner.order[1] == 256 and runner.order[16] == 1,
       "captured %d sizes, largest first expected 16 from 256", #runner.order)
  for _, bs in ipairs(SIZES) do
    local s = runner.summaries[bs]
    want(s and s.n == 1, "batch size %d: %s collective(s) captured, expected 1", bs, tostring(s and s.n))
  end
  if me % 2 == 0 then
    print(("INFO rank %d (tp group %s): all_reduce of 256 x %d %s by %s"):format(me, tp.unique_name, H, DT,
          tostring(db.choice(tp, "all_reduce", runner.bufs.x))))
  end
end)

check("random_concurrent_replays_match_host", function()
  if not want(runner ~= nil, "no runner (the capture check failed)") then return end
  -- one random sequence per TP group (seeded by its first rank): the ranks
  -- of a group replay alike, the two groups different sizes at once
  math.randomseed(1000 + tp.ranks[1])
  local hits = {}
  for i = 1, REPLAYS do
    local k = math.random(#SIZES)
    local lo = k > 1 and SIZES[k - 1] or 0
    local bs = math.random(lo + 1, SIZES[k])
    local padded = replay_checked(runner, bs, 100000 * tp.ranks[1] + 10 * i, "replay " .. i)
    want(padded == SIZES[k], "replay %d: bs %d used the graph of %d, expected %d", i, bs, padded, SIZES[k])
    hits[padded] = (hits[padded] or 0) + 1
  end
  local n = 0
  for _ in pairs(hits) do n = n + 1 end
  want(REPLAYS < 300 or n == 16, "%d replays reached %d of the 16 graphs", REPLAYS, n)
  want(runner.stats.runs == REPLAYS, "stats.runs %d, expected %d", runner.stats.runs, REPLAYS)
  runner:destroy()
  runner = nil
end)

check("difference_inside_tp1_named_everywhere", function()
  -- rank 3's all_gather is a stub while this check runs: its call is
  -- recorded by the runner, and nothing is sent, so its peer does not hang
  if me == 3 then rawset(tp, "all_gather", function(_, x) return x end) end
  local ok, err = pcall(new_runner, { step = function(bs, b, ctx)
    local y = step(bs, b)
    if me == 3 and bs == 64 and ctx.mode == "graph" then tp:all_gather(y) end
    return y
  end })
  if me == 3 then rawset(tp, "all_gather", nil) end
  if not want(not ok, "a capture that differs inside tp.1 was accepted") then return end
  err = tostring(err)
  for _, w in ipairs { "ranks captured different work at batch size 64", "rank 3 differs from rank 2 in group tp.1",
                       "rank 3 captured 2 collective(s) on tp.1", "tp.1 all_gather bf16 x65536",
                       "every rank dropped its graphs" } do
    want(err:find(w, 1, true), "the error lacks %q: %s", w, err)
  end
  want(not err:find("tp.0", 1, true), "the error names tp.0, which agreed: %s", err)
end)

check("usable_after_refusal_and_check_group_tp", function()
  local t = T.ones({ 4096 }, DT, DEV)
  tp:all_reduce(t)
  want(t:to_table()[1] == 2, "eager all_reduce after the refused capture gave %s", tostring(t:to_table()[1]))
  t:free()
  local r = new_runner { check_group = tp }
  want(r.cg == tp.cpu_group, "check_group = tp: the check group is not tp's cpu group")
  math.randomseed(2000 + tp.ranks[1])
  for i = 1, 20 do
    replay_checked(r, math.random(1, 256), 900000 + 100000 * tp.ranks[1] + 10 * i, "check_group = tp replay " .. i)
  end
  r:destroy()
end)

weft.destroy_model_parallel()
weft.shutdown()
done()
