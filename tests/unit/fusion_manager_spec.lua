-- weft.fusion workspace manager: the seed's decisions (grow-only high-water
-- mark, reuse, recreate, separate attention/MoE workspaces, preflight vote,
-- disable on every rank together, pre-initialisation, cleanup) and the fused
-- entry point's checks, on the CPU with a fake backend standing in for
-- src/coll/fusion.c and the other ranks of the group.
local fusion = require("weft.fusion")

-- A fake backend: records every call; `others` scripts what the other ranks
-- of the group vote (preflight ok? did their creation fail?).
local function fake(o)
  o = o or {}
  local B = { log = {}, live = {}, others = { room = true, failed = false },
              room = o.room ~= false, create_fails = o.create_fails, runs = {} }
  local n = 0
  local function log(s) B.log[#B.log + 1] = s end
  function B.preflight(_, spec) log(("preflight %d %d %s"):format(spec.max_tokens, spec.hidden, spec.dtype)); return B.room end
  function B.vote(_, v, op)
    log("vote " .. op .. " " .. v)
    if op == "and" then return (v == 1 and B.others.room) and 1 or 0 end
    return (v ~= 0 or B.others.failed) and 1 or 0
  end
  function B.create(coord, spec)
    log(("create %d %d %s w%d"):format(spec.max_tokens, spec.hidden, spec.dtype, coord.world_size))
    if B.create_fails then return nil, "cuMemCreate: out of memory (fake)" end
    n = n + 1
    local ws = { id = n, spec = spec }
    B.live[ws] = true
    return ws
  end
  function B.destroy(ws) log("destroy " .. ws.id); B.live[ws] = nil end
  local esz = { f32 = 4, f16 = 2, bf16 = 2 }
  function B.sufficient(ws, tokens, hidden, dtype, algo)
    if B.sufficient_raises then error("not implemented (fake)") end
    local s = ws.spec
    return tokens <= s.max_tokens and hidden <= s.hidden and esz[dtype] <= esz[s.dtype]
  end
  function B.new_params() return {} end
  function B.run(ws, p)
    local c = {}
    for k, v in pairs(p) do c[k] = v end
    c.ws = ws
    B.runs[#B.runs + 1] = c
    return true
  end
  function B.empty_like(t) return { shape = t.shape, dtype = t.dtype, device = t.device, ptr = "new" } end
  function B.count(prefix)
    local k = 0
    for _, s in ipairs(B.log) do if s:sub(1, #prefix) == prefix then k = k + 1 end end
    return k
  end
  function B.nlive() local k = 0; for _ in pairs(B.live) do k = k + 1 end; return k end
  return B
end

local function coord(world, rank, name)
  return { world_size = world or 2, rank_in_group = rank or 0, unique_name = name or "tp" }
end

-- minimal tensor stand-in: what the entry point reads
local function tensor(shape, dtype, device, contiguous)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  return { shape = shape, dtype = dtype or "bf16", device = device or "cuda:0", numel = n,
           ptr = "p" .. tostring(n), is_contiguous = function() return contiguous ~= false end }
end

-- each test's fake backend, a fusion context on it and a TP coordinator (rank 0 of 2)
local function fresh()
  local B = fake()
  return B, fusion.new { backend = B }, coord(2, 0)
end

describe("weft.fusion manager", function()
  local B, ctx, tp
  before_each(function() B, ctx, tp = fresh() end)

  it("creates once and reuses a workspace that covers the request", function()
    assert.is_true(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 2048, hidden = 4096 })
    assert.are.equal(1, B.count("create"))
    assert.is_true(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 1024, hidden = 4096, tokens = 7 })
    assert.is_true(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 2048, hidden = 2048 })
    assert.are.equal(1, B.count("create"))
    assert.are.equal(1, ctx.attn.creates)
  end)

  it("recreates when too small, at the high-water mark of every dimension", function()
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 4096, hidden = 2048 }
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 1024, hidden = 8192 }
    assert.are.equal(2, B.count("create"))
    assert.are.equal("create 4096 8192 bf16 w2", B.log[#B.log - 1])  -- then the MAX vote
    assert.are.equal(1, B.count("destroy"))                          -- the old one freed first
    assert.are.equal(1, B.nlive())
    -- a request inside the mark reuses it
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 4096, hidden = 8192 }
    assert.are.equal(2, B.count("create"))
  end)

  it("grows the element size too and never shrinks it", function()
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 128, hidden = 4096, dtype = "bf16" }
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 128, hidden = 4096, dtype = "f32" }
    assert.are.equal(2, B.count("create"))
    assert.are.equal("f32", ctx.attn.dtype)
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 128, hidden = 4096, dtype = "f16" }
    assert.are.equal(2, B.count("create"))
  end)

  it("recreates for a different group or world size", function()
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 128, hidden = 4096 }
    local tp4 = coord(4, 1, "tp4")
    ctx:ensure_workspace_initialized { coord = tp4, max_tokens = 128, hidden = 4096 }
    assert.are.equal(2, B.count("create"))
    assert.are.equal(4, ctx.attn.world_size)
    assert.are.equal(1, ctx.attn.rank)
  end)

  it("keeps attention-TP and MoE workspaces apart", function()
    local ep = coord(2, 1, "ep")
    assert.is_true(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 256, hidden = 4096 })
    assert.is_nil(ctx.moe.ws)
    assert.is_true(ctx:ensure_workspace_initialized { coord = ep, max_tokens = 512, hidden = 2048,
                                                      use_attn_tp_group = false })
    assert.are_not.equal(ctx.attn.ws, ctx.moe.ws)
    assert.are.equal(256, ctx.attn.max_tokens)
    assert.are.equal(512, ctx.moe.max_tokens)
    assert.are.equal(2, B.nlive())
  end)

  it("pre-initialises MoE then attention before capture, and cleans both up", function()
    local ep = coord(2, 0, "ep")
    local r = ctx:pre_initialize_workspaces { max_tokens = 1024, hidden = 4096, dtype = "bf16",
                                              attn_coord = tp, moe_coord = ep }
    assert.is_true(r.attn_tp)
    assert.is_true(r.moe)
    assert.are.equal(2, B.count("create"))
    assert.are.equal(1, ctx.moe.ws.id)   -- MoE first (every rank takes the same order)
    assert.are.equal(2, ctx.attn.ws.id)
    ctx:cleanup()
    assert.are.equal(0, B.nlive())
    assert.is_false(ctx.attn.initialized)
    assert.is_false(ctx.moe.initialized)
    -- the high-water mark survives cleanup: the next creation is at least as large
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 16, hidden = 1024 }
    assert.are.equal("create 1024 4096 bf16 w2", B.log[#B.log - 1])
  end)

  it("does nothing for a group of one", function()
    assert.is_false(ctx:ensure_workspace_initialized { coord = coord(1, 0), max_tokens = 128, hidden = 4096 })
    assert.are.equal(0, #B.log)
  end)

  it("skips creation on every rank when the preflight vote fails (this rank has no room)", function()
    B.room = false
    assert.is_false(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 8192, hidden = 8192 })
    assert.are.equal(0, B.count("create"))
    assert.is_true(ctx.attn.disabled)
    assert.matches("no room", ctx.attn.disabled_reason)
    -- disabled stays disabled: no more collectives, no creation
    local n = #B.log
    assert.is_false(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 16, hidden = 1024 })
    assert.are.equal(n, #B.log)
  end)

  it("skips creation when another rank has no room, though this one has", function()
    B.others.room = false
    assert.is_false(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 8192, hidden = 8192 })
    assert.are.equal(0, B.count("create"))
    assert.matches("another rank", ctx.attn.disabled_reason)
    -- the MoE workspace is voted on its own group: not disabled with this one
    B.others.room = true
    assert.is_true(ctx:ensure_workspace_initialized { coord = coord(2, 0, "ep"), max_tokens = 16,
                                                      hidden = 1024, use_attn_tp_group = false })
    assert.is_true(ctx.attn.disabled)
    assert.is_false(ctx.moe.disabled)
  end)

  it("disables on every rank when creation fails here", function()
    B.create_fails = true
    assert.is_false(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 2048, hidden = 4096 })
    assert.is_true(ctx.attn.disabled)
    assert.matches("out of memory", ctx.attn.disabled_reason)
    assert.are.equal("vote max 1", B.log[#B.log])  -- the others learn it from this vote
  end)

  it("disables here when creation failed on another rank, and drops the workspace", function()
    B.others.failed = true
    assert.is_false(ctx:ensure_workspace_initialized { coord = tp, max_tokens = 2048, hidden = 4096 })
    assert.is_true(ctx.attn.disabled)
    assert.matches("another rank", ctx.attn.disabled_reason)
    assert.are.equal(1, B.count("create"))
    assert.are.equal(0, B.nlive())
  end)

  it("falls back to the allocated dimensions when the backend cannot answer sufficiency", function()
    ctx:ensure_workspace_initialized { coord = tp, max_tokens = 2048, hidden = 4096 }
    B.sufficient_raises = true
    assert.is_true(ctx.attn:is_buffer_size_sufficient(2048, 4096, "bf16"))
    assert.is_false(ctx.attn:is_buffer_size_sufficient(2049, 4096, "bf16"))
    assert.is_false(ctx.attn:is_buffer_size_sufficient(16, 8192, "bf16"))
    assert.is_false(ctx.attn:is_buffer_size_sufficient(16, 4096, "f32"))
  end)
end)

describe("weft.fusion fused entry point", function()
  local B, ctx, tp
  before_each(function() B, ctx, tp = fresh() end)

  local function args(tokens, hidden, dt)
    return tensor({ tokens, hidden }, dt), tensor({ tokens, hidden }, dt), tensor({ hidden }, dt)
  end

  it("runs the kernel with the seed's defaults (pattern, fp32 accumulation, PDL)", function()
    local x, r, w = args(7, 4096)
    local n, ro = ctx:fused_allreduce_rmsnorm(tp, x, r, w, 1e-6, { max_tokens = 2048 })
    assert.are.equal("new", n.ptr)
    assert.are.equal("new", ro.ptr)
    local p = B.runs[1]
    assert.are.equal(fusion.PATTERN.ar_rmsnorm, p.pattern)
    assert.are.equal(fusion.ALGO.auto, p.algo)
    assert.are.equal(fusion.FLAG.fp32_acc + fusion.FLAG.pdl, p.flags)
    assert.are.equal(7, p.tokens)
    assert.are.equal(4096, p.hidden)
    assert.are.equal(x.ptr, p.input)
    assert.are.equal(ctx.attn.ws, p.ws)
    assert.matches("fused kernel", ctx.last_reason)
  end)

  it("passes trigger_completion_at_end, gemma, algorithm and MoE group through", function()
    local x, r, w = args(64, 2048)
    ctx:fused_allreduce_rmsnorm(coord(2, 1, "ep"), x, r, w, 1e-5,
      { trigger_completion_at_end = true, gemma = true, algo = "twoshot", fp32_acc = false,
        use_attn_tp_group = false })
    local p = B.runs[1]
    assert.are.equal(fusion.FLAG.pdl + fusion.FLAG.trigger_at_end + fusion.FLAG.gemma, p.flags)
    assert.are.equal(fusion.ALGO.twoshot, p.algo)
    assert.are.equal(ctx.moe.ws, p.ws)
    assert.is_nil(ctx.attn.ws)
  end)

  it("refuses misuse with a clear error before anything runs", function()
    local x, r, w = args(8, 4096)
    local cases = {
      { "dtypes differ", function() ctx:fused_allreduce_rmsnorm(tp, x, tensor({ 8, 4096 }, "f16"), w) end },
      { "residual shape", function() ctx:fused_allreduce_rmsnorm(tp, x, tensor({ 8, 2048 }), w) end },
      { "weight shape", function() ctx:fused_allreduce_rmsnorm(tp, x, r, tensor({ 4095 })) end },
      { "multiple of 8", function()
          ctx:fused_allreduce_rmsnorm(tp, tensor({ 8, 4092 }), tensor({ 8, 4092 }), tensor({ 4092 })) end },
      { "exceed the declared maximum", function()
          ctx:fused_allreduce_rmsnorm(tp, x, r, w, 1e-6, { max_tokens = 4 }) end },
      { "not supported", function()
          ctx:fused_allreduce_rmsnorm(tp, tensor({ 8, 64 }, "i32"), tensor({ 8, 64 }, "i32"), tensor({ 64 }, "i32")) end },
    }
    for _, c in ipairs(cases) do
      local ok, e = pcall(c[2])
      assert.is_false(ok)
      assert.matches("weft: fused_allreduce_rmsnorm: .*" .. c[1], tostring(e))
    end
    assert.are.equal(0, #B.runs)
    assert.are.equal(0, B.count("create"))
  end)

  it("declines (nil, reason) where fusion does not apply, so the caller goes unfused", function()
    local x, r, w = args(8, 4096)
    local n, why = ctx:fused_allreduce_rmsnorm(coord(1, 0), x, r, w)
    assert.is_nil(n); assert.matches("one rank", why)
    n, why = ctx:fused_allreduce_rmsnorm(tp, tensor({ 8, 4096 }, "bf16", "cpu"), r, w)
    assert.is_nil(n); assert.matches("host tensors", why)
    n, why = ctx:fused_allreduce_rmsnorm(tp, tensor({ 8, 4096 }, "bf16", "cuda:0", false), r, w)
    assert.is_nil(n); assert.matches("non%-contiguous", why)
    B.create_fails = true
    n, why = ctx:fused_allreduce_rmsnorm(tp, x, r, w)
    assert.is_nil(n); assert.matches("unavailable.*out of memory", why)
    assert.are.equal(0, #B.runs)
  end)
end)

describe("weft.fusion policy", function()
  it("picks one-shot for small tensors and two-shot past the limit", function()
    assert.are.equal("oneshot", (fusion.resolve_algo(2, 1, 4096, "bf16")))
    assert.are.equal("oneshot", (fusion.resolve_algo(2, 8192, 8192, "bf16")))   -- 2 ranks: no limit
    assert.are.equal("oneshot", (fusion.resolve_algo(4, 256, 4096, "bf16")))    -- 2 MiB, 4 ranks
    assert.are.equal("twoshot", (fusion.resolve_algo(4, 257, 4096, "bf16")))
    assert.are.equal("twoshot", (fusion.resolve_algo(8, 128, 4096, "bf16")))    -- 1 MiB, 8 ranks
    assert.are.equal("twoshot", (fusion.resolve_algo(2, 1, 4096, "bf16", "twoshot")))
    local a, why = fusion.resolve_algo(4, 8, 4096, "f32", nil, 1024)
    assert.are.equal("twoshot", a)
    assert.matches("131072 bytes > one%-shot limit 1024", why)
  end)

  it("resolves the backend like the seed, with multicast kept off", function()
    assert.are.equal("weft", (fusion.resolve_backend("auto")))
    assert.is_nil((fusion.resolve_backend("auto", { multi_node = true })))
    local b, why = fusion.resolve_backend("multicast")
    assert.are.equal("weft", b); assert.matches("not allowed", why)
    b, why = fusion.resolve_backend("multicast", { allow_multicast = true })
    assert.are.equal("weft", b); assert.matches("no multicast kernel", why)
    assert.is_nil((fusion.resolve_backend("mnnvl")))
  end)
end)
