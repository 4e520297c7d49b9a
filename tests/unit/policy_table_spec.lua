-- weft.policy's rule table in one file (docs/architecture.md, "The rebuild
-- still to do", item 1): policy.lua writes every rule in its order, host and
-- device and the fusion patterns'; the backends register the predicates of
-- the rules' `when` keys when they load (policy.predicate), and no module
-- inserts rules by position. A rule whose key has no predicate is skipped.
local weft = require("weft")
local spec = require("helpers.spec_util")
local policy = require("weft.policy")
local T = weft.tensor

local ROOT = os.getenv("PWD") or "."
local POLICY_LUA = ROOT .. "/lua/weft/policy.lua"

-- the rule names in the order policy.lua's `M.rules = { ... }` writes them
local function written_names()
  local f = assert(io.open(POLICY_LUA))
  local src = f:read("*a")
  f:close()
  local a = assert(src:find("\nM%.rules = {\n"), "policy.lua: no M.rules table")
  local b = assert(src:find("\n}\n", a, true), "policy.lua: M.rules not closed")
  local names = {}
  for name in src:sub(a, b):gmatch("\n  { name = \"([^\"]+)\"") do names[#names + 1] = name end
  return names
end

local function names_of(rules)
  local l = {}
  for i, r in ipairs(rules) do l[i] = r.name end
  return l
end

local dev = spec.dev_standin
local function group(o) return spec.group_standin(o, { max_bytes = 64 * 1048576, oneshot_max = 8 * 1048576,
  resolve = function() return "oneshot", "fake" end }) end

describe("weft.policy: the rules table in one file", function()
  before_each(spec.reset_policy)

  it("is, once weft has loaded, exactly the table policy.lua writes: no module spliced a rule in", function()
    local written = written_names()
    assert.is_true(#written >= 17, table.concat(written, " | "))
    assert.are.same(written, names_of(policy.rules))
    -- the device rules, the fusion patterns' among them, are the file's too
    assert.are.equal("no CUDA", written[2])
    assert.are.equal("fused kernel (MoE, pre/post norm, reduce-scatter)", written[6])
    assert.are.equal("NCCL", written[9])
  end)

  it("resolves every rule's predicate: a function, or a key a loaded backend registered", function()
    for i, r in ipairs(policy.rules) do
      local what = ("rule %d (%s)"):format(i, tostring(r.name))
      assert.is_function(r.test, what)
      if type(r.when) == "string" then
        local p = policy.predicates[r.when]
        assert.is_table(p, what .. ": no predicate registered for " .. r.when)
        assert.are.equal(p.when, r.test, what)
      else
        assert.are.equal(r.when, r.test, what)
      end
      assert.is_truthy(r.why, what)
    end
    -- the device rules name keys; the host rules' predicates are policy.lua's own
    for _, key in ipairs { "no_cuda", "invalid_override", "custom_ar", "fused", "fused_ext",
                           "deterministic", "host_staging", "nccl" } do
      assert.is_table(policy.predicates[key], key)
    end
  end)

  it("keeps the modules from inserting rules: install() adds backends and hooks only", function()
    local n = #policy.rules
    local G = require("weft.group")
    require("weft.backends.device_backends").install(G)
    require("weft.fusion_ext").install(G)
    require("weft.backends.host_nodes")
    assert.are.equal(n, #policy.rules)
    assert.are.same(written_names(), names_of(policy.rules))
  end)

  it("skips a rule whose key has no predicate, and takes it once one is registered", function()
    local key = "policy_table_spec_missing"
    local v0 = policy.version
    local r = policy.add_rule { name = "test keyed", backend = "test_keyed", when = key, why = "a test" }
    local ok, err = pcall(function()
      assert.is_true(policy.version > v0)
      assert.is_nil(r.test)
      local g = group()
      -- passed over: the choice is what it was
      assert.are.equal("shm", spec.select_backend(g, T.zeros({ 8 }, "f32")))
      local e = policy.explain(g, T.zeros({ 8 }, "f32"))
      assert.matches("\n    2%. test keyed: no %(skipped: no predicate registered for when = \"" .. key
                     .. "\" %(its backend module is not loaded%)%)", e)
      local d = policy.decide(g, "all_reduce", T.zeros({ 8 }, "f32"))
      assert.is_true(d.chain[2].skipped)
      assert.are.equal(2, d.chain[2].index)
      -- registered: resolved on the rule once, and taken
      local v1 = policy.version
      policy.predicate(key, function() return true end, { why = "registered" })
      assert.is_true(policy.version > v1)
      assert.is_function(r.test)
      assert.are.equal("test_keyed", spec.select_backend(g, T.zeros({ 8 }, "f32")))
      assert.matches("2%. test keyed: yes %-> test_keyed %(registered%)", policy.explain(g, T.zeros({ 8 }, "f32")))
    end)
    policy.remove_rule("test keyed")
    policy.predicates[key] = nil
    assert.is_true(ok, err)
    assert.are.same(written_names(), names_of(policy.rules))
  end)

  it("answers from policy.lua alone (no backend loaded): device tensors refused, keyed rules skipped", function()
    -- a second instance of the module, with nothing registered but its own
    local P = dofile(POLICY_LUA)
    assert.are.same(written_names(), names_of(P.rules))
    for _, r in ipairs(P.rules) do
      if r.device and r.when ~= "no_cuda" then assert.is_nil(r.test, r.name) end
    end
    local g = group()
    local be, why = P.select(g, "all_reduce", dev({ 8, 64 }))
    assert.are.equal("no_device_backend", be)
    assert.matches("no device backend is registered", why)
    assert.are.equal("shm", (P.select(g, "all_reduce", T.zeros({ 8 }, "f32"))))
    assert.are.equal("shm", (P.select(g, "all_gather", T.zeros({ 8 }, "f32"))))
    -- "no CUDA" then tells the module's own default apart from the backend's
    P.predicate("no_cuda", function() return false end)
    local e = P.explain(g, dev({ 8, 64 }))
    assert.matches("3%. invalid WEFT_ALLREDUCE: no %(skipped: no predicate registered for when = \"invalid_override\"", e)
    assert.matches("4%. custom all%-reduce %(should_custom_ar%): no %(skipped", e)
    -- the texts the table wrote come back when the registration gives none
    assert.are.equal("device tensor, but this process has no CUDA device (or libweft was built without CUDA)",
                     P.rules[2].why)
  end)

  it("refuses a bad registration", function()
    assert.has_error(function() policy.predicate("", function() end) end,
                     "weft: policy.predicate: key must be a non-empty string, got string")
    assert.has_error(function() policy.predicate("nccl", "x") end,
                     "weft: policy.predicate: \"nccl\": expected a function, got string")
    assert.has_error(function() policy.predicate("nccl", function() end, "why") end)
    assert.is_function(policy.rules[9].test)
  end)

  it("selects without allocating: the predicate is a field of the rule", function()
    local g = group()
    local h, d = T.zeros({ 8 }, "f32"), dev({ 8, 4096 })
    local select = policy.select
    for _ = 1, 1000 do select(g, "all_reduce", h); select(g, "all_gather", d) end
    collectgarbage(); collectgarbage("stop")
    local before = collectgarbage("count")
    for _ = 1, 100000 do select(g, "all_reduce", h); select(g, "all_gather", d) end
    local kib = collectgarbage("count") - before
    collectgarbage("restart")
    assert.is_true(kib < 64, ("%.1f KiB allocated by 2 x 10^5 select calls"):format(kib))
  end)
end)
