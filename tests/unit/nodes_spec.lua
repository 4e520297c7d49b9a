-- Several nodes, simulated on this machine (scripts/weft-sim-nodes: each
-- node a network namespace with its own address, its own /dev/shm and
-- hostname), so node boundaries are real: the same-node probe, the shm path
-- and TCP between nodes. Needs root; elsewhere every test is pending.
-- The rank side is tests/helpers/nodes_ranks.lua.
local N = require("helpers.nodes_util")
local G = require("helpers.gpu_ranks")

local function run_or_skip(o)
  local out, rc, wall = N.run(o)
  if rc == N.SKIP then pending("simulated nodes unavailable: " .. N.skipped(out)); return nil end
  return out, rc, wall
end

local function all_ok(out, rc, world, whats)
  assert.are.equal(0, rc, out)
  for _, w in ipairs(whats) do
    assert.are.equal(world, N.count_ok(out, w), ("'OK %s' from every rank:\n%s"):format(w, out))
  end
end

describe("simulated nodes", function()
  it("2 nodes x 2 ranks: hostnames, same_node flags, TP inside a node, PP across, mq broadcaster, objects", function()
    local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 60,
      env = { WEFT_USE_MQ_BROADCASTER = "1" }, args = { "tests/helpers/nodes_ranks.lua", "layout" } }
    if not out then return end
    all_ok(out, rc, 4, { "same_node flags", "tp inside a node, pp across nodes",
                         "object collectives and the mq broadcaster", "explain", "shutdown" })
    -- the output carries the node: every line of rank 2 and 3 says node1
    for _, l in ipairs(N.rank_lines(out)) do
      assert.are.equal(l.rank >= 2 and 1 or 0, l.node)
    end
    assert.is_truthy(out:find(" across nodes: yes", 1, true) or out:find("ranks on several nodes: yes", 1, true), out)
  end)

  it("3 nodes x 1 rank: every rank its own node", function()
    local out, rc = run_or_skip { nodes = 3, per_node = 1, timeout = 60,
      args = { "tests/helpers/nodes_ranks.lua", "layout" } }
    if not out then return end
    all_ok(out, rc, 3, { "same_node flags", "tp inside a node, pp across nodes", "shutdown" })
  end)

  it("2 x 2: host collectives, every op x dtype x odd size, exact (integer wrap, NaN) on world, tp, pp", function()
    local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 120,
      args = { "tests/helpers/nodes_ranks.lua", "collectives" } }
    if not out then return end
    all_ok(out, rc, 4, { "world all_reduce every dtype x op x odd size", "tp all_reduce every dtype x op x odd size",
                         "world reduce_scatter, all_gather, broadcast at odd sizes", "world send/recv and barrier",
                         "pp all_reduce every dtype x op x odd size", "pp send/recv and barrier", "shutdown" })
  end)

  -- the world all-reduce suite once per forced route
  for _, case in ipairs {
    { "the hierarchical all-reduce at every size (WEFT_HOST_BACKEND=hier)", { WEFT_HOST_BACKEND = "hier" } },
    { "flat Gloo forced: the synchronous small path at world 4 (two rounds), the ring above it",
      { WEFT_HOST_BACKEND = "gloo" } },
    { "flat Gloo, recursive halving at every size in 4 KiB chunks (empty and odd halves, many chunks)",
      { WEFT_HOST_BACKEND = "gloo", WEFT_GLOO_HALVING_MIN = "1", WEFT_GLOO_CHUNK = "4096" } },
  } do
    it("2 x 2: " .. case[1], function()
      local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 120, env = case[2],
        args = { "tests/helpers/nodes_ranks.lua", "collectives" } }
      if not out then return end
      all_ok(out, rc, 4, { "world all_reduce every dtype x op x odd size", "world send/recv and barrier", "shutdown" })
    end)
  end

  it("2 x 1: device collectives across nodes on the pretend GPU (gpu_nodes_worker: NCCL, refusals in explain)", function()
    local out, rc = run_or_skip { nodes = 2, per_node = 1, timeout = 120, env = { WEFT_FAKE_DEVICE = "1" },
      args = { "tests/helpers/gpu_nodes_worker.lua" } }
    if not out then return end
    assert.are.equal(0, rc, out)
    for _, name in ipairs { "nodes_layout", "nccl_across_nodes", "other_collectives", "custom_ar_refused",
                            "fused_refused_and_right" } do
      G.assert_ranks_passed(assert, out, name, 2, function(r) return ("[node%d rank%d] "):format(r, r) end)
    end
  end)

  it("3 x 1: host collectives across three nodes", function()
    local out, rc = run_or_skip { nodes = 3, per_node = 1, timeout = 120,
      args = { "tests/helpers/nodes_ranks.lua", "collectives" } }
    if not out then return end
    all_ok(out, rc, 3, { "world all_reduce every dtype x op x odd size",
                         "world reduce_scatter, all_gather, broadcast at odd sizes", "shutdown" })
  end)

  it("2 x 2: the GroupCoordinator suite (group_collectives.lua) across nodes", function()
    local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 120,
      args = { "tests/helpers/group_collectives.lua" } }
    if not out then return end
    all_ok(out, rc, 4, { "world all_reduce dtypes x ops", "world object collectives", "world tensor dicts",
                         "world fused_allreduce_rmsnorm", "shutdown" })
  end)

  it("2 x 2: the store path still serves when forced (WEFT_HOST_BACKEND=store)", function()
    local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 120,
      env = { WEFT_HOST_BACKEND = "store", NODES_SMALL = "1" },
      args = { "tests/helpers/nodes_ranks.lua", "collectives" } }
    if not out then return end
    all_ok(out, rc, 4, { "world all_reduce every dtype x op x odd size", "shutdown" })
    assert.is_falsy(out:find("built without Gloo", 1, true), "a forced store path warns of nothing")
  end)

  it("leaves no namespace behind", function()
    assert.are.equal("", N.leftover_namespaces())
  end)
end)
