-- scripts/weft-topo: the command-line view of weft.topology.
describe("weft-topo", function()
  local root = io.popen("pwd"):read("*l")
  local script = root .. "/scripts/weft-topo"

  -- Runs the script from another directory; returns stdout, stderr, exit code.
  local function run(args)
    local err = os.tmpname()
    local p = io.popen(("cd /tmp && %s %s 2>%s; echo \"rc=$?\""):format(script, args, err))
    local out = p:read("*a")
    p:close()
    local f = io.open(err)
    local e = f:read("*a")
    f:close()
    os.remove(err)
    local rc = tonumber(out:match("rc=(%d+)\n$"))
    return out:gsub("rc=%d+\n$", ""), e, rc
  end

  it("prints the exact JSON for a small case", function()
    local out, err, rc = run("--world 4 --tp 2 --pp 2 --json")
    assert.are.equal(0, rc, err)
    assert.are.equal(
      '{"world_size":4,"groups":{"tp":[[0,1],[2,3]],"pp":[[0,2],[1,3]],"attn_tp":[[0,1],[2,3]],'
      .. '"attn_cp":[[0],[1],[2],[3]],"moe_ep":[[0],[1],[2],[3]],"moe_tp":[[0,1],[2,3]],'
      .. '"moe_dp":[[0],[1],[2],[3]]},"aliases":{"attn_tp":"tp","moe_tp":"tp"}}\n', out)
    assert.are.equal("", err)
  end)

  it("--json is parseable and matches the library", function()
    local json = require "dkjson"
    local out, _, rc = run("--world=16 --tp=8 --pp 2 --ep 4 --attn-cp 2 --moe-dp 2 --dcp 2 --json")
    assert.are.equal(0, rc)
    local d = json.decode(out)
    local p = require("weft.topology").plan { world_size = 16, tp = 8, pp = 2, ep = 4, attn_cp = 2,
                                              moe_dp = 2, dcp = 2 }
    assert.are.same(p.groups, d.groups)
    assert.are.same(p.aliases, d.aliases)
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 }, { 8, 9 }, { 10, 11 }, { 12, 13 }, { 14, 15 } },
                    d.groups.dcp)
  end)

  it("prints a table with aliases marked", function()
    local out, _, rc = run("--world 8 --tp 4 --pp 2 --attn-dp 2")
    assert.are.equal(0, rc)
    local p = require("weft.topology").plan { world_size = 8, tp = 4, pp = 2, attn_dp = 2 }
    assert.are.equal(require("weft.topology").format(p), out)
    assert.matches("\nattn_tp +2 +4  %[0,1%] %[2,3%] %[4,5%] %[6,7%]\n", out)
    assert.matches("\nmoe_tp +4 +2  %[0,1,2,3%] %[4,5,6,7%]  %(same as tp%)\n", out)
  end)

  it("shows one rank's groups with --rank", function()
    local out, _, rc = run("--tp 2 --pp 2 --rank 3")
    assert.are.equal(0, rc)
    assert.matches("rank 3 of 4\n", out, 1, true)
    assert.matches("\ntp +%[2,3%]\n", out)
    assert.matches("\npp +%[1,3%]\n", out)
    assert.matches("\nattn_tp +%[2,3%]  %(same as tp%)\n", out)
    local j = run("--tp 2 --pp 2 --rank 3 --json")
    assert.matches('^{"rank":3,"groups":{"tp":%[2,3%],"pp":%[1,3%],', j)
  end)

  it("exits 2 with a message on stderr for bad arguments", function()
    local cases = {
      { "--tp", "--tp needs a value" },
      { "--tp x", "--tp expects a non-negative integer, got 'x'" },
      { "--tp 2 --bogus 3", "unknown argument '--bogus'" },
      { "--world 4", "--tp is required" },
      { "--world 6 --tp 4", "world_size (6) is not equal to tp (4) x pp (1)" },
      { "--tp 6 --attn-cp 4", "tp (6) is not divisible by attn_cp (4) x attn_dp (1) = 4" },
      { "--tp 4 --ep 3", "tp (4) is not divisible by ep (3) x moe_dp (1) = 3" },
      { "--tp 0", "tp must be a positive integer" },
      { "--tp 2 --rank 7", "rank 7 out of range [0, 2)" },
    }
    for _, c in ipairs(cases) do
      local out, err, rc = run(c[1])
      assert.are.equal(2, rc, c[1])
      assert.are.equal("", out, c[1])
      assert.matches("weft-topo: ", err, 1, true)
      assert.matches(c[2], err, 1, true)
    end
  end)

  it("--help prints usage and exits 0", function()
    local out, _, rc = run("--help")
    assert.are.equal(0, rc)
    assert.matches("usage: weft-topo", out, 1, true)
  end)
end)
