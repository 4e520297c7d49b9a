-- create_custom_group + destroy leaves nothing behind (issue 24 item 8):
-- before, each cycle left a store key per rank (the cpu group's generation
-- counter under a name unique to the cycle) and an entry in
-- dist.state.custom: 3000 cycles took the store from 6 to 6004 keys and RSS
-- from 6.9 to 12.5 MB. Now 3000 cycles keep both flat. Issue 37 item 5: a
-- group named anew each cycle ("g" .. i) still left a generation counter per
-- member and name (208 -> 4008 keys over 1000 cycles); the counter is now
-- one per rank set.
local N = require("helpers.nodes_util")
local P = require("helpers.procs")
local S = require("helpers.spec_util")

local function run(args)
  return S.shell(("cd %s && WEFT_TIMEOUT_MS=20000 timeout -s KILL 120 scripts/weft-run -n 2 --timeout 110 "
                  .. "tests/helpers/custom_cycle_ranks.lua %s"):format(P.q(P.ROOT), args))
end

-- rank 0's "<tag> keys <before> <after>" line: the store's key count moved
-- by 3 at most over the cycles (`what`, for the message)
local function keys_flat(out, tag, what)
  local k0, k1 = out:match("%[rank0%] " .. tag .. " keys (%d+) (%d+)")
  assert.is_truthy(k0, out)
  assert.is_true(math.abs(tonumber(k1) - tonumber(k0)) <= 3, "store keys before and after " .. what .. ":\n" .. out)
end

describe("custom groups created and destroyed in a loop #fault", function()
  it("3000 create + destroy cycles on 2 ranks keep the store's key count and RSS flat", function()
    local out = run("200 3000")
    local seen = 0
    for _, l in ipairs(N.rank_lines(out:gsub("%[rank(%d+)%]", "[node0 rank%1]"))) do
      local k0, k1, r0, r1, custom = l.text:match("^CYCLES keys (%-?%d+) (%-?%d+) rss_kb (%d+) (%d+) custom (%d+)")
      if k0 then
        seen = seen + 1
        if l.rank == 0 then
          -- flat: nothing left behind per cycle (a leak is thousands of keys
          -- here); the count moves by one or two with what is in flight at
          -- the moment it is read (6 -> 7 and 7 -> 6 both seen on CI)
          assert.is_true(math.abs(tonumber(k1) - tonumber(k0)) <= 3, "store keys before and after 3000 cycles:\n" .. out)
        end
        assert.are.equal(0, tonumber(custom), "dist.state.custom still lists destroyed groups")
        local grew = tonumber(r1) - tonumber(r0)
        assert.is_true(grew < 1536, ("rank %d: RSS grew %d kB over 3000 cycles"):format(l.rank, grew))
      end
    end
    assert.are.equal(2, seen, out)
  end)

  it("1000 create + destroy cycles of groups named anew each time keep the store's key count flat", function()
    -- a leak is a key per member and name (~2000 here); the count moves by
    -- one or two with what is in flight when it is read, as above
    keys_flat(run("20 1000 named"), "CYCLES", "1000 named cycles")
  end)

  it("300 initialize_model_parallel + destroy_model_parallel cycles keep the store's key count flat", function()
    keys_flat(run("20 300 mp"), "MPCYCLES", "300 cycles")
  end)
end)
