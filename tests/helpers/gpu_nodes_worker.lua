-- One rank of tests/gpu/gpu_nodes_spec.lua: device collectives across two
-- simulated nodes (scripts/weft-sim-nodes -N 2 -n 1: a network namespace,
-- hostname and /dev/shm per node). NCCL must run across the nodes over its
-- socket transport (no P2P, no SHM between nodes), results exact against the
-- same collective on host tensors (Gloo or the store across the nodes); the
-- custom all-reduce and the fused kernel must be refused with the reason in
-- explain, and the fused call still right (NCCL, then the norm).
-- Both nodes may use the same physical GPU (a 1-GPU machine): NCCL tells
-- hosts apart by hostname, so each node is a host of its own; the kernels
-- then share the GPU by time slices (slow, right). Prints PASS/FAIL lines
-- per check (helpers.gpu_ranks), exits 1 when one failed.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local G, weft, T, policy, db = R.G, R.weft, R.T, R.policy, R.db

local world = weft.init { timeout_ms = 120000 }
local me, W = world.rank, world.world_size
assert(W == 2, "run with 2 ranks, one per node")
local DEV = R.dev()

local S = G.soft_checks()
local want, ints = S.want, G.ints
local check, done = G.checks(world, S)

local function same(got, ref, what)
  if not want(got.numel == ref.numel, "%s: %d elements, reference %d", what, got.numel, ref.numel) then return end
  local ma = got:compare(ref)
  want(ma == 0, "%s: max abs difference %g", what, ma)
end

check("nodes_layout", function()
  want(not world.same_node, "world reports one node")
  local hosts = world.cpu_group:allgather(io.popen("hostname"):read("*l"))
  want(hosts[1] ~= hosts[2], "both ranks on host %s", tostring(hosts[1]))
end)

check("nccl_across_nodes", function()
  local x = T.ones({ 16 }, "f32", DEV)
  world:all_reduce(x)
  same(x, T.full({ 16 }, 2, "f32"), "first all_reduce")
  local info = db.info(world)
  want(info.nccl, "no NCCL communicator across nodes: %s", tostring(info.nccl_why))
  want(policy.select(world, "all_reduce", x) == "nccl", "backend %s", tostring(policy.select(world, "all_reduce", x)))
  G.each_case(me, DEV, 100, { 1, 1023, 65539 }, function(h, d, op, label)
    world:all_reduce(d, op)
    world:all_reduce(h, op)
    same(d, h, label)
  end)
end)

check("other_collectives", function()
  local h = ints(900 + me, { 6, 5 }, "bf16")
  local d = h:clone(DEV)
  same(world:all_gather(d, 0), world:all_gather(h, 0), "all_gather")
  local hr = ints(950 + me, { 8, 3 }, "f32")
  same(world:reduce_scatter(hr:clone(DEV), 0), world:reduce_scatter(hr, 0), "reduce_scatter")
  local b = ints(990 + me, 1001, "i32")
  local db_ = b:clone(DEV)
  world:broadcast(db_, 1)
  world:broadcast(b, 1)
  same(db_, b, "broadcast from rank 1")
end)

check("custom_ar_refused", function()
  local x = T.zeros({ 8, 4096 }, "bf16", DEV)
  local be, why = db.choice(world, "all_reduce", x)
  want(be ~= "oneshot" and be ~= "twoshot", "custom all-reduce chosen across nodes (%s)", tostring(why))
  local e = policy.explain(world, x)
  want(e:find("x one node: ranks on several nodes", 1, true), "explain gives no reason: %s", e)
  want(db.info(world).custom_ar ~= "ready", "custom all-reduce set up across nodes")
end)

check("fused_refused_and_right", function()
  local shape, dt, eps = { 7, 4096 }, "bf16", 1e-6
  local xseed = 7000
  local hx = T.randn(shape, dt, "cpu", { seed = xseed + me })
  local hres = T.randn(shape, dt, "cpu", { seed = 77 })
  local hw = T.rand({ 4096 }, dt, "cpu", { seed = 78 })
  local y, ro = world:fused_allreduce_rmsnorm(hx:clone(DEV), hres:clone(DEV), hw:clone(DEV), eps)
  local rref, nref = G.fused_ref(xseed, shape, dt, hres, hw, eps, false, { 0, 1 })
  G.close(want, ro, rref, dt, "residual_out")
  G.close(want, y, nref, dt, "norm_out")
  local info = db.info(world)
  want(info.last_fused and info.last_fused.path ~= "fused", "fused kernel ran across nodes")
  local e = policy.explain(world, T.zeros(shape, dt, DEV), "fused_allreduce_rmsnorm")
  want(e:find("x one node: ranks on several nodes", 1, true), "explain gives no reason: %s", e)
end)

done()
