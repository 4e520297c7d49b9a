-- GroupCoordinator and model-parallel groups with real processes (weft-run):
-- group properties of several layouts against hand-checked rank lists, every
-- collective against a reference on 1, 2, 3, 4 and 8 ranks (shared memory and
-- the store fallback), bad inputs, and the life cycle of the groups.
local ROOT = os.getenv("PWD") or "."
local U = require("helpers.spec_util")

local function run(n, script, env, timeout)
  local parts = { "WEFT_TIMEOUT_MS=20000", ("LUA_PATH='%s/tests/?.lua;;'"):format(ROOT) }
  for k, v in pairs(env or {}) do parts[#parts + 1] = ("%s='%s'"):format(k, v) end
  local cmd = ("%s timeout -s KILL %d %s/scripts/weft-run -n %d --timeout %d %s/tests/helpers/%s 2>&1; echo \"rc=$?\"")
    :format(table.concat(parts, " "), (timeout or 90) + 10, ROOT, n, timeout or 90, ROOT, script)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  return out, rc
end

local count_ok = U.count_ok

local function assert_ran(out, rc, n_ok)
  assert(rc == 0, "ranks failed (rc=" .. tostring(rc) .. "):\n" .. out)
  if n_ok then assert.are.equal(n_ok, count_ok(out), out) end
end

describe("groups (multi-rank)", function()
  describe("layouts", function()
    local function singles(n) local t = {} for r = 0, n - 1 do t[#t + 1] = { r } end return t end
    local KINDS = { "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp", "dcp", "pdmux_prefill_tp" }
    -- hand-checked against the seed's initialize_model_parallel; a string is an alias
    local layouts = {
      { n = 1, mp = "", g = { tp = { { 0 } }, pp = { { 0 } }, attn_tp = "tp", attn_cp = "tp", moe_ep = "tp",
                              moe_tp = "tp", moe_dp = "tp" } },
      { n = 2, mp = "tp=1,pp=2", g = { tp = { { 0 }, { 1 } }, pp = { { 0, 1 } }, attn_tp = "tp", attn_cp = "tp",
                                       moe_ep = "tp", moe_tp = "tp", moe_dp = "tp" } },
      { n = 3, mp = "tp=3", g = { tp = { { 0, 1, 2 } }, pp = singles(3), attn_tp = "tp", attn_cp = singles(3),
                                  moe_ep = singles(3), moe_tp = "tp", moe_dp = singles(3) } },
      { n = 4, mp = "tp=2,pp=2", g = { tp = { { 0, 1 }, { 2, 3 } }, pp = { { 0, 2 }, { 1, 3 } }, attn_tp = "tp",
                                       attn_cp = singles(4), moe_ep = singles(4), moe_tp = "tp", moe_dp = singles(4) } },
      { n = 4, mp = "tp=4", g = { tp = { { 0, 1, 2, 3 } }, pp = singles(4), attn_tp = "tp", attn_cp = singles(4),
                                  moe_ep = singles(4), moe_tp = "tp", moe_dp = singles(4) } },
      { n = 4, mp = "tp=4,ep=2", g = { tp = { { 0, 1, 2, 3 } }, pp = singles(4), attn_tp = "tp", attn_cp = singles(4),
                                       moe_ep = { { 0, 2 }, { 1, 3 } }, moe_tp = { { 0, 1 }, { 2, 3 } },
                                       moe_dp = singles(4) } },
      { n = 4, mp = "tp=4,attn_dp=2", g = { tp = { { 0, 1, 2, 3 } }, pp = singles(4), attn_tp = { { 0, 1 }, { 2, 3 } },
                                            attn_cp = singles(4), moe_ep = singles(4), moe_tp = "tp",
                                            moe_dp = singles(4) } },
      { n = 8, mp = "tp=8,attn_cp=2", g = { tp = { { 0, 1, 2, 3, 4, 5, 6, 7 } }, pp = singles(8),
                                            attn_tp = { { 0, 1, 2, 3 }, { 4, 5, 6, 7 } },
                                            attn_cp = { { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } },
                                            moe_ep = singles(8), moe_tp = "tp", moe_dp = "attn_cp" } },
      { n = 8, mp = "tp=8,ep=4,moe_dp=2", g = { tp = { { 0, 1, 2, 3, 4, 5, 6, 7 } }, pp = singles(8), attn_tp = "tp",
                                                attn_cp = singles(8), moe_ep = { { 0, 1, 2, 3 }, { 4, 5, 6, 7 } },
                                                moe_tp = singles(8),
                                                moe_dp = { { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } } } },
      { n = 8, mp = "tp=4,pp=2,dcp=2,duplicate_tp_group=true",
        g = { tp = { { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, pp = { { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } },
              dcp = { { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, attn_tp = "tp", attn_cp = singles(8),
              moe_ep = singles(8), moe_tp = "tp", moe_dp = singles(8),
              pdmux_prefill_tp = { { 0, 1, 2, 3 }, { 4, 5, 6, 7 } } } },
    }

    local function parse(out)
      local props = {}
      for line in out:gmatch("[^\n]+") do
        local body = line:match("PROP (.*)$")
        if body then
          local p = {}
          for k, v in body:gmatch("(%w+)=(%S+)") do p[k] = v end
          props[tonumber(p.rank) .. ":" .. p.kind] = p
        end
      end
      return props
    end

    -- rank r's group of a kind (spec: its rank lists, or the kind it aliases)
    -- against the properties it printed
    local function check_group_props(L, r, kind, spec, p, out)
      assert.is_not_nil(p, ("rank %d lacks its %s group\n%s"):format(r, kind, out))
      local target = type(spec) == "string" and spec or kind
      local lists = L.g[target]
      assert.are.equal(type(spec) == "string" and spec or "-", p.same, ("rank %d %s alias"):format(r, kind))
      local idx, pos
      for i, ranks in ipairs(lists) do
        for j, x in ipairs(ranks) do if x == r then idx, pos = i, j end end
      end
      local ranks = lists[idx]
      local ctx = ("rank %d kind %s"):format(r, kind)
      assert.are.equal(table.concat(ranks, ","), p.ranks, ctx)
      assert.are.equal(target .. "." .. (idx - 1), p.name, ctx)
      assert.are.equal(tostring(pos - 1), p.rig, ctx)
      assert.are.equal(tostring(#ranks), p.ws, ctx)
      assert.are.equal(tostring(ranks[1]), p.first, ctx)
      assert.are.equal(tostring(ranks[#ranks]), p.last, ctx)
      assert.are.equal(tostring(ranks[1] == r), p.isfirst, ctx)
      assert.are.equal(tostring(ranks[#ranks] == r), p.islast, ctx)
      assert.are.equal(tostring(ranks[pos % #ranks + 1]), p.next, ctx)
      assert.are.equal(tostring(ranks[(pos - 2) % #ranks + 1]), p.prev, ctx)
      assert.are.equal(tostring(r), p["local"], ctx)
    end

    for _, L in ipairs(layouts) do
      it(("%d ranks, %s: every group's properties and aliases"):format(L.n, L.mp ~= "" and L.mp or "defaults"), function()
        local out, rc = run(L.n, "group_layout.lua", { WEFT_TEST_MP = L.mp })
        assert_ran(out, rc)
        local props = parse(out)
        local npdmux = L.g.pdmux_prefill_tp and 1 or 0
        assert.are.equal(L.n * (2 + npdmux), count_ok(out), out)
        for r = 0, L.n - 1 do
          for _, kind in ipairs(KINDS) do
            local spec = L.g[kind]
            local p = props[r .. ":" .. kind]
            if spec == nil then
              assert.is_nil(p, ("rank %d has an unexpected %s group"):format(r, kind))
            else
              check_group_props(L, r, kind, spec, p, out)
            end
          end
        end
      end)
    end
  end)

  describe("collectives against references", function()
    -- per rank: world suite (11 checks, 10 without peers), evens (when a
    -- member), solo (10), shutdown (1)
    local function expected(n)
      local total = 0
      for r = 0, n - 1 do
        local world = n > 1 and 11 or 10
        local evens_n = math.ceil(n / 2)
        local evens = (r % 2 == 0) and ((evens_n > 1) and 11 or 10) or 0
        total = total + world + evens + 10 + 1
      end
      return total
    end
    for _, n in ipairs({ 1, 2, 3, 4, 8 }) do
      it(("%d rank%s, shared memory"):format(n, n > 1 and "s" or ""), function()
        local out, rc = run(n, "group_collectives.lua")
        assert_ran(out, rc, expected(n))
      end)
    end
    it("3 ranks, the store fallback (WEFT_HOST_BACKEND=store)", function()
      local out, rc = run(3, "group_collectives.lua", { WEFT_TEST_BACKEND = "store" })
      assert_ran(out, rc, expected(3))
    end)
  end)

  describe("bad inputs: clear errors, no hang, groups still usable", function()
    local per_rank = 11
    it("2 ranks", function()
      local out, rc = run(2, "group_errors.lua")
      assert_ran(out, rc, 2 * per_rank)
    end)
    it("4 ranks, store fallback", function()
      local out, rc = run(4, "group_errors.lua", { WEFT_TEST_BACKEND = "store" })
      assert_ran(out, rc, 4 * per_rank)
    end)
    it("8 ranks", function()
      local out, rc = run(8, "group_errors.lua")
      assert_ran(out, rc, 8 * per_rank)
    end)
  end)

  describe("a rank that dies", function()
    it("makes the others' next collective fail naming it, and leaves no shared memory", function()
      local out, rc = run(3, "group_killed.lua")
      assert_ran(out, rc, 5)
      assert.matches("error: weft: all_reduce: group world: .*rank 2", out)
      -- only this run's names (other runs may share the machine): by creator pid
      local pids = {}
      for pid in out:gmatch("%] pid (%d+)") do pids[#pids + 1] = tonumber(pid) end
      assert.are.equal(3, #pids, out)
      local left = require("weft.internal.shm_names").of(pids)
      assert.are.equal(0, #left, "left behind: " .. table.concat(left, " "))
    end)
  end)

  describe("life cycle", function()
    for _, n in ipairs({ 2, 4 }) do
      it(("%d ranks: init, destroy, re-initialize, custom groups, shutdown, init again"):format(n), function()
        local out, rc = run(n, "group_lifecycle.lua")
        assert_ran(out, rc, n * 6)
      end)
    end
  end)
end)
