-- weft.topology: rank layouts of every group kind, as SGLang's
-- initialize_model_parallel builds them (SGLang's python/sglang/srt/distributed/parallel_state.py).
-- Each expected layout below is worked out by hand from the seed's loops.
describe("weft.topology", function()
  local topology = require("weft.topology")
  local spec = require("helpers.spec_util")

  local function singletons(n)
    local g = {}
    for i = 0, n - 1 do g[#g + 1] = { i } end
    return g
  end

  local function err_of(f, ...)
    local ok, err = pcall(f, ...)
    assert.is_false(ok, "expected an error")
    return err
  end

  it("seed docstring example 1: 8 GPUs, tp=2, pp=4", function()
    -- TP: blocks of 2 -> [0,1] [2,3] [4,5] [6,7] (docstring: 4 TP groups).
    -- PP: world/pp = 2 groups, range(i, 8, 2) -> [0,2,4,6] [1,3,5,7].
    local p = topology.plan { world_size = 8, tp = 2, pp = 4 }
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, p.groups.tp)
    assert.are.same({ { 0, 2, 4, 6 }, { 1, 3, 5, 7 } }, p.groups.pp)
    -- attn_tp = 2/1/1 = 2 == tp -> the TP group; moe_tp = 2/1/1 = 2 == tp -> TP.
    assert.are.same({ attn_tp = "tp", moe_tp = "tp" }, p.aliases)
    assert.are.same(p.groups.tp, p.groups.attn_tp)
    assert.are.same(p.groups.tp, p.groups.moe_tp)
    -- attn_cp (1 != 2): range(st, st + 2*1, 2) per attn_tp index -> singletons.
    assert.are.same(singletons(8), p.groups.attn_cp)
    -- moe_ep (1 != 2): range(st, st + 1*2, 2) -> singletons.
    assert.are.same(singletons(8), p.groups.moe_ep)
    -- moe_dp: 1 > 1 false, 1 == 2 false; range(t*2+c, (t+1)*2+c, 2) -> singletons.
    assert.are.same(singletons(8), p.groups.moe_dp)
    assert.is_nil(p.groups.dcp)
  end)

  it("seed docstring example 2: attn_cp=2 attn_tp=4, moe_dp=2 moe_ep=4 (tp=8)", function()
    -- The docstring's "2 tensor model-parallel groups [g0..g3] [g4..g7]" are
    -- the attention TP groups: the code only builds CP groups inside a TP
    -- group, so the CP groups [g0,g4].. need one TP group of 8 (tp=8, pp=1).
    local p = topology.plan { world_size = 8, tp = 8, attn_cp = 2, ep = 4, moe_dp = 2 }
    assert.are.same({ { 0, 1, 2, 3, 4, 5, 6, 7 } }, p.groups.tp)
    -- attn_tp = 8/2/1 = 4: blocks of 4 for c in 0..1 -> [0..3] [4..7]
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, p.groups.attn_tp)
    -- attn_cp: a in 0..3, range(a, 8 + a, 4) -> [0,4] [1,5] [2,6] [3,7]
    assert.are.same({ { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } }, p.groups.attn_cp)
    -- moe_tp = 8/4/2 = 1. moe_ep: d in 0..1, st = d*4, range(st, st+4, 1)
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, p.groups.moe_ep)
    -- moe_dp: attn_cp 2 > moe_dp 2 false; 2 == 8 false; c in 0..3:
    -- range(c, 8 + c, 4) -> [0,4] [1,5] [2,6] [3,7]
    assert.are.same({ { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } }, p.groups.moe_dp)
    assert.are.same(singletons(8), p.groups.moe_tp)
    assert.are.same(singletons(8), p.groups.pp)
    assert.are.same({}, p.aliases)
    assert.are.same({ world_size = 8, tp_size = 8, pp_size = 1, attn_tp_size = 4, attn_cp_size = 2,
                      attn_dp_size = 1, moe_ep_size = 4, moe_tp_size = 1, moe_dp_size = 2, dcp_size = 1 },
                    p.sizes)
  end)

  it("world of one: every kind is the TP group", function()
    -- attn_cp 1 == tp 1; attn_tp 1 == tp; moe_dp: 1 > 1 false, 1 == tp;
    -- ep 1 == tp; moe_tp 1 == tp. PP is always its own group.
    local p = topology.plan { world_size = 1, tp = 1 }
    assert.are.same({ attn_cp = "tp", attn_tp = "tp", moe_dp = "tp", moe_ep = "tp", moe_tp = "tp" },
                    p.aliases)
    for _, k in ipairs({ "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp" }) do
      assert.are.same({ { 0 } }, p.groups[k], k)
    end
  end)

  it("defaults: plan{tp=4} is world 4 with pp, ep, dp, cp, dcp = 1", function()
    local p = topology.plan { tp = 4 }
    assert.are.equal(4, p.world_size)
    assert.are.same({ { 0, 1, 2, 3 } }, p.groups.tp)
    assert.are.same(singletons(4), p.groups.pp)
    assert.are.same({ attn_tp = "tp", moe_tp = "tp" }, p.aliases)
    assert.are.same(singletons(4), p.groups.moe_ep)
  end)

  it("MoE: full expert parallelism reuses TP (ep == tp)", function()
    -- tp=8 ep=8: moe_tp = 1 -> singletons; moe_ep is the TP group;
    -- moe_dp: range(c, 8 + c, 8) for c in 0..7 -> singletons.
    local p = topology.plan { world_size = 8, tp = 8, ep = 8 }
    assert.are.equal("tp", p.aliases.moe_ep)
    assert.are.same(p.groups.tp, p.groups.moe_ep)
    assert.are.same(singletons(8), p.groups.moe_tp)
    assert.are.same(singletons(8), p.groups.moe_dp)
    assert.are.equal(8, p.group_sizes.moe_ep)
  end)

  it("MoE: ep=4 inside tp=8 strides by moe_tp", function()
    -- moe_tp = 8/4/1 = 2. moe_ep: m in 0..1, range(m, m + 8, 2)
    --   -> [0,2,4,6] [1,3,5,7]; moe_tp: blocks of 2; moe_dp: moe_tp*ep = 8
    --   -> range(c, 8 + c, 8) -> singletons.
    local p = topology.plan { world_size = 8, tp = 8, ep = 4 }
    assert.are.same({ { 0, 2, 4, 6 }, { 1, 3, 5, 7 } }, p.groups.moe_ep)
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, p.groups.moe_tp)
    assert.are.same(singletons(8), p.groups.moe_dp)
    assert.are.same({ attn_tp = "tp" }, p.aliases)
  end)

  it("MoE with pipeline stages: tp=4 pp=2 ep=2 moe_dp=2", function()
    -- two TP groups [0..3] [4..7]; moe_tp = 4/2/2 = 1.
    -- moe_ep: t, d: st = 4t + 2d, range(st, st + 2) -> [0,1] [2,3] [4,5] [6,7]
    -- moe_dp: c in 0..1: range(4t + c, 4(t+1) + c, 2) -> [0,2] [1,3] [4,6] [5,7]
    -- pp: world/pp = 4 groups: range(i, 8, 4) -> [0,4] [1,5] [2,6] [3,7]
    local p = topology.plan { world_size = 8, tp = 4, pp = 2, ep = 2, moe_dp = 2 }
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, p.groups.tp)
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, p.groups.moe_ep)
    assert.are.same({ { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }, p.groups.moe_dp)
    assert.are.same(singletons(8), p.groups.moe_tp)
    assert.are.same({ { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } }, p.groups.pp)
  end)

  it("MoE data parallel over the whole TP group aliases TP (moe_dp == tp)", function()
    local p = topology.plan { world_size = 4, tp = 4, moe_dp = 4 }
    assert.are.equal("tp", p.aliases.moe_dp)
    assert.are.same({ { 0, 1, 2, 3 } }, p.groups.moe_dp)
    -- moe_tp = 1, ep = 1: moe_ep singletons, moe_tp singletons
    assert.are.same(singletons(4), p.groups.moe_ep)
  end)

  it("attention CP with attention DP: tp=8 attn_cp=2 attn_dp=2", function()
    -- attn_tp = 8/2/2 = 2. attn_cp: d in 0..1, a in 0..1:
    --   st = 4d + a, en = 4(d+1) + a, step 2 -> [0,2] [1,3] [4,6] [5,7]
    -- attn_tp: c in 0..3 -> [0,1] [2,3] [4,5] [6,7]
    -- moe_dp: attn_cp 2 > moe_dp 1 -> the attention CP group.
    local p = topology.plan { world_size = 8, tp = 8, attn_cp = 2, attn_dp = 2 }
    assert.are.same({ { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }, p.groups.attn_cp)
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, p.groups.attn_tp)
    assert.are.equal("attn_cp", p.aliases.moe_dp)
    assert.are.same(p.groups.attn_cp, p.groups.moe_dp)
    assert.are.equal(2, p.group_sizes.moe_dp) -- the aliased group's size
    assert.are.equal(1, p.sizes.moe_dp_size)  -- the configured size
  end)

  it("attention DP alone: tp=4 attn_dp=4 gives singleton attention TP", function()
    -- attn_tp = 1: blocks of 1; attn_cp: d in 0..3, a = 0: range(d, d+1, 1)
    local p = topology.plan { world_size = 4, tp = 4, attn_dp = 4 }
    assert.are.same(singletons(4), p.groups.attn_tp)
    assert.are.same(singletons(4), p.groups.attn_cp)
    assert.is_nil(p.aliases.attn_tp)
  end)

  it("attention CP over the whole TP group: the alias chain resolves to tp", function()
    -- attn_cp 4 == tp -> TP; attn_tp = 1 -> singletons; moe_dp: 4 > 1 ->
    -- _MOE_DP = _ATTN_CP, which is _TP: aliases.moe_dp = "tp".
    local p = topology.plan { world_size = 8, tp = 4, pp = 2, attn_cp = 4 }
    assert.are.equal("tp", p.aliases.attn_cp)
    assert.are.equal("tp", p.aliases.moe_dp)
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, p.groups.moe_dp)
    assert.are.same(singletons(8), p.groups.attn_tp)
  end)

  it("DCP slices each TP group; only present when dcp > 1, never an alias", function()
    -- tp=8 pp=2 dcp=2: TP [0..7] [8..15]; slices of 2 inside each.
    local p = topology.plan { world_size = 16, tp = 8, pp = 2, dcp = 2 }
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 }, { 8, 9 }, { 10, 11 }, { 12, 13 }, { 14, 15 } },
                    p.groups.dcp)
    local q = topology.plan { world_size = 8, tp = 8, dcp = 4 }
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, q.groups.dcp)
    local r = topology.plan { world_size = 4, tp = 4, dcp = 4 }
    assert.are.same(r.groups.tp, r.groups.dcp)
    assert.is_nil(r.aliases.dcp) -- the seed always creates its own DCP group
    assert.is_nil(topology.plan({ world_size = 4, tp = 4, dcp = 1 }).groups.dcp)
  end)

  it("says what fits a world that is not tp x pp, in the caller's words", function()
    local words = { world = function(n) return "-n " .. n end, tp = "--tp %d", pp = "--pp %d" }
    assert.are.equal("world_size (3) is not equal to tp (2) x pp (2) = 4: use -n 4, or for 3 ranks --tp 3 --pp 1",
                     topology.world_mismatch(3, 2, 2, words))
    assert.are.equal("world_size (8) is not equal to tp (2) x pp (2) = 4: use -n 4, or for 8 ranks --pp 4 or --tp 4",
                     topology.world_mismatch(8, 2, 2, words))
    -- plan{}'s own words by default
    assert.are.equal("world_size (4) is not equal to tp (4) x pp (4) = 16: use world_size=16, or for 4 ranks pp=1 or tp=1",
                     topology.world_mismatch(4, 4, 4))
    -- every offer fits: tp x pp of each is the world
    for world = 1, 24 do
      for tp = 1, 6 do
        for pp = 1, 4 do
          if world ~= tp * pp then
            local msg = topology.world_mismatch(world, tp, pp)
            for t, p2 in msg:gmatch("tp=(%d+) pp=(%d+)") do assert.are.equal(world, t * p2, msg) end
            local rest = msg:match("ranks (.*)$"):gsub("tp=%d+ pp=%d+", "")
            for p2 in rest:gmatch("pp=(%d+)") do assert.are.equal(world, tp * p2, msg) end
            for t in rest:gmatch("tp=(%d+)") do assert.are.equal(world, t * pp, msg) end
          end
        end
      end
    end
  end)

  it("raises where SGLang would floor or refuse, naming the sizes", function()
    local e = err_of(topology.plan, { world_size = 8, tp = 3, pp = 2 })
    assert.matches("weft: topology.plan: world_size (8) is not equal to tp (3) x pp (2) = 6: "
                   .. "use world_size=6, or for 8 ranks tp=4", e, 1, true)
    e = err_of(topology.plan, { world_size = 6, tp = 6, attn_cp = 4 })
    assert.matches("tp (6) is not divisible by attn_cp (4) x attn_dp (1) = 4", e, 1, true)
    e = err_of(topology.plan, { world_size = 8, tp = 8, attn_cp = 2, attn_dp = 3 })
    assert.matches("tp (8) is not divisible by attn_cp (2) x attn_dp (3) = 6", e, 1, true)
    e = err_of(topology.plan, { world_size = 8, tp = 8, ep = 3 })
    assert.matches("tp (8) is not divisible by ep (3) x moe_dp (1) = 3", e, 1, true)
    e = err_of(topology.plan, { world_size = 8, tp = 8, ep = 4, moe_dp = 4 })
    assert.matches("tp (8) is not divisible by ep (4) x moe_dp (4) = 16", e, 1, true)
    e = err_of(topology.plan, { world_size = 8, tp = 8, dcp = 3 })
    assert.matches("tp (8) must be divisible by dcp (3)", e, 1, true)
    e = err_of(topology.plan, { world_size = 4, tp = 0 })
    assert.matches("tp must be a positive integer (got 0)", e, 1, true)
    e = err_of(topology.plan, { tp = 2.5 })
    assert.matches("tp must be a positive integer (got 2.5)", e, 1, true)
    e = err_of(topology.plan, { tp = 2, moe_ep = 2 })
    assert.matches("unknown argument 'moe_ep'", e, 1, true)
  end)

  it("every kind partitions the world into equal groups (sweep)", function()
    local checked = 0
    local sweep = spec.grid("tp", { 1, 2, 4, 6, 8 }, "pp", { 1, 2, 3 }, "ep", { 1, 2, 4 }, "adp", { 1, 2 },
                            "acp", { 1, 2, 4 }, "mdp", { 1, 2 }, "dcp", { 1, 2 })
    for _, c in ipairs(sweep) do
      local tp, pp = c.tp, c.pp
      local ok, p = pcall(topology.plan, { world_size = tp * pp, tp = tp, pp = pp, ep = c.ep,
                                           attn_dp = c.adp, attn_cp = c.acp, moe_dp = c.mdp, dcp = c.dcp })
      local divisible = tp % (c.acp * c.adp) == 0 and tp % (c.ep * c.mdp) == 0 and tp % c.dcp == 0
      assert.are.equal(divisible, ok, tostring(p))
      if ok then
        checked = checked + 1
        for kind, list in pairs(p.groups) do
          local seen, size = {}, #list[1]
          for _, r in ipairs(list) do
            assert.are.equal(size, #r, kind)
            for _, x in ipairs(r) do
              assert.is_nil(seen[x], kind .. " repeats rank " .. x)
              seen[x] = true
            end
          end
          for x = 0, p.world_size - 1 do assert.is_true(seen[x], kind .. " misses " .. x) end
          assert.are.equal(size, p.group_sizes[kind])
        end
        for kind, target in pairs(p.aliases) do
          assert.is_nil(p.aliases[target], kind .. " aliases an alias")
          assert.are.same(p.groups[target], p.groups[kind])
        end
        assert.are.equal(tp, p.group_sizes.tp)
        assert.are.equal(pp, p.group_sizes.pp)
      end
    end
    assert.is_true(checked > 100)
  end)

  -- initialize_model_parallel's loops (SGLang's python/sglang/srt/distributed/parallel_state.py),
  -- transcribed one for one: the reference of the sweep below
  local function seed_groups(tp, pp, ep, attn_dp, attn_cp, moe_dp)
    local world, ntp = tp * pp, tp * pp / tp
    local attn_tp, moe_tp = tp / attn_cp / attn_dp, tp / ep / moe_dp
    local function range(st, en, step)
      local r = {}
      for i = st, en - 1, step or 1 do r[#r + 1] = i end
      return r
    end
    local G = { tp = {} }
    for i = 0, ntp - 1 do G.tp[#G.tp + 1] = range(i * tp, (i + 1) * tp) end
    if attn_cp == tp then G.attn_cp = G.tp else
      G.attn_cp = {}
      for t = 0, ntp - 1 do for d = 0, attn_dp - 1 do for a = 0, attn_tp - 1 do
        local st = t * tp + d * attn_tp * attn_cp + a
        local en = t * tp + (d + 1) * attn_tp * attn_cp + a
        G.attn_cp[#G.attn_cp + 1] = range(st, en, attn_tp)
      end end end
    end
    -- attention TP and MoE TP: the seed's two loops of consecutive blocks
    local function blocks(count, size)
      local out = {}
      for t = 0, ntp - 1 do for c = 0, count - 1 do
        out[#out + 1] = range(t * tp + c * size, t * tp + (c + 1) * size)
      end end
      return out
    end
    G.attn_tp = attn_tp == tp and G.tp or blocks(attn_cp * attn_dp, attn_tp)
    if attn_cp > moe_dp then G.moe_dp = G.attn_cp elseif moe_dp == tp then G.moe_dp = G.tp else
      G.moe_dp = {}
      for t = 0, ntp - 1 do for c = 0, moe_tp * ep - 1 do
        G.moe_dp[#G.moe_dp + 1] = range(t * tp + c, (t + 1) * tp + c, moe_tp * ep)
      end end
    end
    if ep == tp then G.moe_ep = G.tp else
      G.moe_ep = {}
      for t = 0, ntp - 1 do for d = 0, moe_dp - 1 do for m = 0, moe_tp - 1 do
        local st = t * tp + d * ep * moe_tp + m
        G.moe_ep[#G.moe_ep + 1] = range(st, st + ep * moe_tp, moe_tp)
      end end end
    end
    G.moe_tp = moe_tp == tp and G.tp or blocks(ep * moe_dp, moe_tp)
    G.pp = {}
    for i = 0, world / pp - 1 do G.pp[#G.pp + 1] = range(i, world, world / pp) end
    return G
  end

  it("every kind's layout is the seed's, loop for loop (sweep)", function()
    local checked = 0
    local sweep = spec.grid("tp", { 1, 2, 4, 6, 8, 12, 16 }, "pp", { 1, 2, 3 }, "ep", { 1, 2, 3, 4, 8 },
                            "adp", { 1, 2, 3, 4 }, "acp", { 1, 2, 4, 8 }, "mdp", { 1, 2, 4 })
    for _, c in ipairs(sweep) do
      local tp, pp, ep, adp, acp, mdp = c.tp, c.pp, c.ep, c.adp, c.acp, c.mdp
      if tp % (acp * adp) == 0 and tp % (ep * mdp) == 0 then
        local p = topology.plan { world_size = tp * pp, tp = tp, pp = pp, ep = ep,
                                  attn_dp = adp, attn_cp = acp, moe_dp = mdp }
        for kind, list in pairs(seed_groups(tp, pp, ep, adp, acp, mdp)) do
          local got = p.groups[kind] or p.groups[p.aliases[kind]]
          assert.are.same(list, got, ("%s at tp=%d pp=%d ep=%d attn_dp=%d attn_cp=%d moe_dp=%d")
                          :format(kind, tp, pp, ep, adp, acp, mdp))
        end
        checked = checked + 1
      end
    end
    assert.is_true(checked > 300, "checked " .. checked)
  end)

  it("to_json gives the exact compact form, kinds in fixed order", function()
    local p = topology.plan { world_size = 4, tp = 2, pp = 2 }
    assert.are.equal(
      '{"world_size":4,"groups":{"tp":[[0,1],[2,3]],"pp":[[0,2],[1,3]],"attn_tp":[[0,1],[2,3]],'
      .. '"attn_cp":[[0],[1],[2],[3]],"moe_ep":[[0],[1],[2],[3]],"moe_tp":[[0,1],[2,3]],'
      .. '"moe_dp":[[0],[1],[2],[3]]},"aliases":{"attn_tp":"tp","moe_tp":"tp"}}',
      topology.to_json(p))
    local q = topology.plan { world_size = 4, tp = 4, attn_cp = 2, ep = 2, dcp = 2 }
    local j = topology.to_json(q)
    assert.matches('"moe_dp":[[0,2],[1,3]],"dcp":[[0,1],[2,3]]},"aliases":{"moe_dp":"attn_cp"}}', j, 1, true)
    assert.are.equal('{"world_size":2,"groups":{"tp":[[0],[1]],"pp":[[0,1]],"attn_tp":[[0],[1]],'
      .. '"attn_cp":[[0],[1]],"moe_ep":[[0],[1]],"moe_tp":[[0],[1]],"moe_dp":[[0],[1]]},'
      .. '"aliases":{"attn_tp":"tp","attn_cp":"tp","moe_ep":"tp","moe_tp":"tp","moe_dp":"tp"}}',
      topology.to_json(topology.plan { world_size = 2, tp = 1, pp = 2 }))
  end)

  it("to_json parses back to the plan's groups and aliases", function()
    local json = require("dkjson")
    local p = topology.plan { world_size = 16, tp = 8, pp = 2, attn_cp = 2, ep = 4, moe_dp = 2, dcp = 2 }
    local d = json.decode(topology.to_json(p))
    assert.are.equal(16, d.world_size)
    assert.are.same(p.groups, d.groups)
    assert.are.same(p.aliases, d.aliases)
  end)

  it("format prints one line per kind and marks aliases", function()
    local p = topology.plan { world_size = 8, tp = 2, pp = 4 }
    local text = topology.format(p)
    assert.matches("world_size 8: tp=2 pp=4", text, 1, true)
    assert.matches("\ntp +2 +4  %[0,1%] %[2,3%] %[4,5%] %[6,7%]\n", text)
    assert.matches("\npp +4 +2  %[0,2,4,6%] %[1,3,5,7%]\n", text)
    assert.matches("\nattn_tp +2 +4  %[0,1%] %[2,3%] %[4,5%] %[6,7%]  %(same as tp%)\n", text)
    local lines = 0
    for _ in text:gmatch("\n") do lines = lines + 1 end
    assert.are.equal(2 + 7, lines) -- header, column titles, 7 kinds (no dcp)
  end)

  it("groups_of gives the group of each kind containing a rank", function()
    local p = topology.plan { world_size = 8, tp = 2, pp = 4 }
    local g = topology.groups_of(p, 5)
    assert.are.same({ 4, 5 }, g.tp)
    assert.are.same({ 1, 3, 5, 7 }, g.pp)
    assert.are.same({ 4, 5 }, g.attn_tp)
    assert.are.same({ 5 }, g.moe_dp)
    g.tp[1] = 99 -- a copy: the plan is untouched
    assert.are.same({ 4, 5 }, p.groups.tp[3])
    local e = err_of(topology.groups_of, p, 8)
    assert.matches("weft: topology.groups_of: rank 8 out of range [0, 8)", e, 1, true)
    e = err_of(topology.to_json, { nope = 1 })
    assert.matches("weft: topology.to_json: argument is not a plan", e, 1, true)
  end)
  describe("validate (initialize_model_parallel's checks)", function()
    -- exact messages: weft.dist.initialize_model_parallel and weft-topo
    -- --dry-run both go through validate, so these are a real run's words
    local cases = {
      { { tp = 3 }, 8, "weft: initialize_model_parallel: world_size (8) is not equal to tp (3) x pp (1) = 3: "
        .. "use world_size=3, or for 8 ranks tp=8" },
      { {}, 8, "weft: initialize_model_parallel: world_size (8) is not equal to tp (1) x pp (1) = 1: "
        .. "use world_size=1, or for 8 ranks pp=8 or tp=8" },
      { { tp = 0 }, 8, "weft: initialize_model_parallel: tp must be a positive integer, got 0" },
      { { pp = 1.5, tp = 8 }, 8, "weft: initialize_model_parallel: pp must be a positive integer, got 1.5" },
      -- a value that is not a number is named with its type (issue 37)
      { { ep = "2", tp = 8 }, 8, 'weft: initialize_model_parallel: ep must be a positive integer, got the string "2"' },
      { { tp = "2" }, 2, 'weft: initialize_model_parallel: tp must be a positive integer, got the string "2"' },
      { { tp = true }, 2, "weft: initialize_model_parallel: tp must be a positive integer, got the boolean true" },
      { { pp = {} }, 2, "weft: initialize_model_parallel: pp must be a positive integer, got a table" },
      { { tp = math.huge }, 8, "weft: initialize_model_parallel: tp must be a positive integer, got inf" },
      { { tensor_model_parallel_size = -1 }, 8,
        "weft: initialize_model_parallel: tensor_model_parallel_size must be a positive integer, got -1" },
      { { tpp = 2 }, 8, 'weft: initialize_model_parallel: unknown option "tpp" (tp, pp, ep, moe_dp, attn_cp, '
        .. "attn_dp, dcp, duplicate_tp_group)" },
      { { world_size = 8, tp = 8 }, 8, 'weft: initialize_model_parallel: unknown option "world_size"' },
      { { tp = 6, attn_cp = 4 }, 6, "weft: initialize_model_parallel: tp (6) is not divisible by attn_cp (4) "
        .. "x attn_dp (1) = 4: the attention TP size would be floored to 1 (SGLang floors it silently)" },
      { { tp = 8, ep = 4, moe_dp = 4 }, 8, "weft: initialize_model_parallel: tp (8) is not divisible by ep (4) "
        .. "x moe_dp (4) = 16: the MoE TP size would be floored to 0 (SGLang floors it silently)" },
      { { tp = 8, dcp = 3 }, 8, "weft: initialize_model_parallel: tp (8) must be divisible by dcp (3)" },
      -- several wrong: the first in sorted key order is named
      { { zz = 1, tp = 0, aa = 1 }, 8, 'weft: initialize_model_parallel: unknown option "aa"' },
    }
    for n, c in ipairs(cases) do
      it("refuses case " .. n .. ": " .. c[3]:sub(36, 90), function()
        local e = err_of(topology.validate, c[1], c[2])
        assert.matches(c[3], e, 1, true)
        assert.are.equal(1, select(2, e:gsub("weft: ", "")), e) -- one prefix, no nesting
      end)
    end

    it("refuses a non-table", function()
      assert.are.equal("weft: initialize_model_parallel: options must be a table, got string",
                       err_of(topology.validate, "tp=2", 2))
    end)

    it("accepts long SGLang names and duplicate_tp_group; gives topology.plan's plan", function()
      local p, dup = topology.validate({ tensor_model_parallel_size = 4, pipeline_model_parallel_size = 2,
                                         expert_model_parallel_size = 2, moe_data_model_parallel_size = 2,
                                         duplicate_tp_group = true }, 8)
      assert.is_true(dup)
      assert.are.same(topology.plan { world_size = 8, tp = 4, pp = 2, ep = 2, moe_dp = 2 }, p)
      local q, d2 = topology.validate(nil, 1)
      assert.is_false(d2)
      assert.are.equal(1, q.world_size)
    end)

    it("blames the caller, or the caller's caller with level 2", function()
      local line = debug.getinfo(1, "l").currentline
      local ok, e = pcall(function() topology.validate({ tp = 0 }, 2) end)
      assert.is_false(ok)
      assert.matches("topology_spec.lua:" .. (line + 1) .. ": weft: ", e, 1, true)
      local function wrapper() topology.validate({ tp = 3 }, 2, 2) end
      ok, e = pcall(function() wrapper() end)
      assert.matches("topology_spec.lua:" .. (line + 5) .. ": weft: initialize_model_parallel: world_size", e, 1, true)
    end)
  end)

  it("index_of gives each rank's group index and position in O(world)", function()
    local p = topology.plan { world_size = 8, tp = 4, pp = 2, attn_dp = 2 }
    local idx, pos = topology.index_of(p)
    assert.are.same({ 0, 0, 0, 0, 1, 1, 1, 1 }, idx.tp)
    assert.are.same({ 0, 1, 2, 3, 0, 1, 2, 3 }, pos.tp)
    assert.are.same({ 0, 1, 2, 3, 0, 1, 2, 3 }, idx.pp)
    assert.are.same({ 0, 0, 0, 0, 1, 1, 1, 1 }, pos.pp)
    assert.are.same({ 0, 0, 1, 1, 2, 2, 3, 3 }, idx.attn_tp)
    local q = topology.plan { world_size = 512, tp = 16, pp = 32, ep = 8, moe_dp = 2, attn_cp = 2, dcp = 2 }
    local qi, qp = topology.index_of(q)
    for _, r in ipairs({ 0, 1, 17, 255, 300, 511 }) do
      local g = topology.groups_of(q, r)
      for kind, list in pairs(q.groups) do
        assert.are.same(g[kind], list[qi[kind][r + 1] + 1], kind)
        assert.are.equal(r, g[kind][qp[kind][r + 1] + 1], kind)
      end
    end
  end)

  it("ranks_str writes runs, strides and short lists", function()
    assert.are.equal("0-3", topology.ranks_str { 0, 1, 2, 3 })
    assert.are.equal("1,9,..,57", topology.ranks_str { 1, 9, 17, 25, 33, 41, 49, 57 })
    assert.are.equal("0,4", topology.ranks_str { 0, 4 })
    assert.are.equal("4,5", topology.ranks_str { 4, 5 })
    assert.are.equal("0,2,4", topology.ranks_str { 0, 2, 4 })
    assert.are.equal("0,3,5", topology.ranks_str { 0, 3, 5 })
    assert.are.equal("7", topology.ranks_str { 7 })
    local odd = {}
    for i = 1, 20 do odd[i] = i * i end
    assert.are.equal("1,4,9,16,25,36,49,64,81,100,.. (20 ranks)", topology.ranks_str(odd))
  end)

  it("node_span counts the most nodes one group reaches", function()
    local p = topology.plan { world_size = 64, tp = 16, pp = 4 }
    assert.are.equal(2, topology.node_span(p.groups.tp, 8))
    assert.are.equal(1, topology.node_span(p.groups.tp, 16))
    assert.are.equal(4, topology.node_span(p.groups.pp, 8))
    assert.are.equal(16, topology.node_span(p.groups.tp, 1))
  end)
end)
