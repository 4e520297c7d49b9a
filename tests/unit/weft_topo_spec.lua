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

  -- weft-topo `args` exits 2, prints nothing on stdout and `text` on stderr;
  -- returns the stderr
  local function refused(args, text)
    local out, err, rc = run(args)
    assert.are.equal(2, rc, args)
    assert.are.equal("", out, args)
    assert.matches(text, err, 1, true)
    return err
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
    local json = require("dkjson")
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
      { "--world 6 --tp 4", "world_size (6) is not equal to tp (4) x pp (1) = 4: use --world 4, or for 6 ranks --tp 6\n" },
      { "--tp 6 --attn-cp 4", "tp (6) is not divisible by attn_cp (4) x attn_dp (1) = 4" },
      { "--tp 4 --ep 3", "tp (4) is not divisible by ep (3) x moe_dp (1) = 3" },
      { "--tp 0", "tp must be a positive integer" },
      { "--tp 2 --rank 7", "rank 7 out of range [0, 2)" },
    }
    for _, c in ipairs(cases) do assert.matches("weft-topo: ", refused(c[1], c[2]), 1, true) end
  end)

  it("--help prints usage and exits 0", function()
    local out, _, rc = run("--help")
    assert.are.equal(0, rc)
    assert.matches("usage: weft-topo", out, 1, true)
  end)
  describe("--dry-run", function()
    it("prints sizes, kinds and each rank's group indices for a valid world", function()
      local out, err, rc = run("--dry-run --world 16 --tp 8 --pp 2 --ep 2 --moe-dp 2 --attn-cp 2 --gpus-per-node 4")
      assert.are.equal(0, rc, err)
      assert.are.equal("", err)
      local lines = {}
      for l in out:gmatch("[^\n]+") do lines[#lines + 1] = l end
      assert.are.equal("valid: initialize_model_parallel{tp=8, pp=2, ep=2, attn_cp=2, moe_dp=2} on a world of 16 "
                       .. "(4 nodes x 4 GPUs)", lines[1])
      assert.are.equal("sizes: tp=8 pp=2 attn_tp=4 attn_cp=2 attn_dp=1 moe_ep=2 moe_tp=2 moe_dp=2 dcp=1", lines[2])
      assert.are.equal("kind     groups  size nodes/grp", lines[3])
      assert.are.equal("tp            2     8         2", lines[4])
      assert.are.equal("pp            8     2         2", lines[5])
      assert.are.equal("moe_ep        8     2         1", lines[8])
      assert.are.equal(" rank  node      tp      pp attn_tp attn_cp  moe_ep  moe_tp  moe_dp", lines[13])
      -- rank 5 (node 1): tp.0, pp.5 ([5,13]), attn_tp.1 ([4..7]), attn_cp.1 ([1,5]),
      -- moe_ep.3 ([5,7]: stride moe_tp=2 in the second MoE DP slice), moe_tp.2 ([4,5]), moe_dp.1 ([1,5])
      assert.are.equal("    5     1       0       5       1       1       3       2       1", lines[14 + 5])
      assert.are.equal("   15     3       1       7       3       7       7       7       7", lines[14 + 15])
      assert.are.equal(14 + 15, #lines)
      -- every line agrees with the library
      local p = require("weft.topology").plan { world_size = 16, tp = 8, pp = 2, ep = 2, moe_dp = 2, attn_cp = 2 }
      local kinds = { "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp" }
      for r = 0, 15 do
        local g = require("weft.topology").groups_of(p, r)
        local cols = {}
        for c in lines[14 + r]:gmatch("%d+") do cols[#cols + 1] = tonumber(c) end
        assert.are.equal(r, cols[1])
        assert.are.equal(math.floor(r / 4), cols[2])
        for j, k in ipairs(kinds) do assert.are.same(g[k], p.groups[k][cols[2 + j] + 1], k .. " of " .. r) end
      end
    end)

    it("marks aliases and single-rank kinds and leaves them out of the rank table", function()
      local out, _, rc = run("--dry-run --world 4 --tp 4 --attn-cp 4")
      assert.are.equal(0, rc)
      assert.matches("\nattn_cp +1 +4 +1  same as tp\n", out)
      assert.matches("\nmoe_dp +1 +4 +1  same as tp\n", out)
      assert.matches("\npp +4 +1 +1  each rank alone\n", out)
      assert.matches("\n rank  node      tp\n    0     0       0\n", out)
      assert.matches("\n    3     0       0\n$", out)
    end)

    it("uses a real run's defaults: every size 1", function()
      local out, err, rc = run("--dry-run --world 1")
      assert.are.equal(0, rc, err)
      assert.matches("^valid: initialize_model_parallel{} on a world of 1 %(1 node x 8 GPUs%)\n", out)
    end)

    it("--json gives every rank's group index per kind", function()
      local json = require("dkjson")
      local out, _, rc = run("--dry-run --world 8 --tp 8 --ep 2 --json")
      assert.are.equal(0, rc)
      local d = json.decode(out)
      assert.is_true(d.valid)
      assert.are.equal(8, d.world_size)
      assert.are.same({ attn_tp = "tp" }, d.aliases)
      assert.are.same({ 0, 0, 0, 0, 0, 0, 0, 0 }, d.group_index.tp)
      assert.are.same({ 0, 1, 2, 3, 0, 1, 2, 3 }, d.group_index.moe_ep)
      assert.are.same({ 0, 0, 0, 0, 1, 1, 1, 1 }, d.group_index.moe_tp)
    end)

    it("handles 512 ranks, one line each", function()
      local out, _, rc = run("--dry-run --world 512 --tp 16 --pp 32 --ep 8 --moe-dp 2 --attn-cp 2 --dcp 2")
      assert.are.equal(0, rc)
      local n = 0
      for _ in out:gmatch("\n +%d+ +%d+ [ %d]+") do n = n + 1 end
      assert.are.equal(512, n)
      -- rank 511 = 31 * 16 + 8 + 7: tp.31, pp.15 (511 % 16), attn_tp.63 (blocks of 8),
      -- attn_cp.255 (t=31 has 8 groups, a=7), moe_ep.63 (t*2 + d, d=1), moe_dp.255
      -- (t*8 + c, c=7), dcp.255 (pairs); moe_tp is all singletons, left out
      assert.matches("\n rank  node      tp      pp attn_tp attn_cp  moe_ep  moe_dp     dcp\n", out)
      assert.matches("\n  511    63      31      15      63     255      63     255     255\n$", out)
    end)

    it("refuses what a real run refuses, with its exact message, exit 2", function()
      local P = "weft: initialize_model_parallel: "
      local cases = {
        { "--dry-run --world 8 --tp 3", P .. "world_size (8) is not equal to tp (3) x pp (1) = 3: use --world 3, or for 8 ranks --tp 8" },
        { "--dry-run --world 8", P .. "world_size (8) is not equal to tp (1) x pp (1) = 1: use --world 1, or for 8 ranks --pp 8 or --tp 8" },
        { "--dry-run --world 16 --tp 4 --pp 2", P .. "world_size (16) is not equal to tp (4) x pp (2) = 8: use --world 8, or for 16 ranks --pp 4 or --tp 8" },
        -- (the guide's old mistake) and a world no tp x pp of these sizes fits
        { "--dry-run --world 16 --tp 8 --ep 4", P .. "world_size (16) is not equal to tp (8) x pp (1) = 8: use --world 8, or for 16 ranks --pp 2 or --tp 16" },
        { "--dry-run --world 6 --tp 4 --pp 4", P .. "world_size (6) is not equal to tp (4) x pp (4) = 16: use --world 16, or for 6 ranks --tp 6 --pp 1" },
        { "--dry-run --world 8 --tp 0 --pp 8", P .. "tp must be a positive integer, got 0" },
        { "--dry-run --world 8 --tp 8 --moe-dp 0", P .. "moe_dp must be a positive integer, got 0" },
        { "--dry-run --world 6 --tp 6 --attn-cp 4", P .. "tp (6) is not divisible by attn_cp (4) x attn_dp (1) "
          .. "= 4: the attention TP size would be floored to 1 (SGLang floors it silently)" },
        { "--dry-run --world 8 --tp 8 --ep 3", P .. "tp (8) is not divisible by ep (3) x moe_dp (1) = 3: the MoE "
          .. "TP size would be floored to 2 (SGLang floors it silently)" },
        { "--dry-run --world 64 --tp 8 --pp 8 --ep 4 --moe-dp 4", P .. "tp (8) is not divisible by ep (4) x moe_dp (4) "
          .. "= 16: the MoE TP size would be floored to 0 (SGLang floors it silently)" },
        { "--dry-run --world 8 --tp 8 --dcp 3", P .. "tp (8) must be divisible by dcp (3)" },
        { "--dry-run --world 0 --tp 1", "weft: init: WORLD_SIZE=0 is out of range (1..1048576)" },
        { "--dry-run --world 2000000 --tp 1", "weft: init: WORLD_SIZE=2000000 is out of range (1..1048576)" },
      }
      for _, c in ipairs(cases) do
        local out, err, rc = run(c[1])
        assert.are.equal(2, rc, c[1])
        assert.are.equal("", out, c[1])
        assert.are.equal("weft-topo: " .. c[2] .. "\n", err, c[1])
      end
    end)

    it("needs --world and takes no --rank", function()
      local _, err, rc = run("--dry-run --tp 2")
      assert.are.equal(2, rc)
      assert.matches("^weft%-topo: %-%-dry%-run needs %-%-world N", err)
      _, err, rc = run("--dry-run --world 2 --tp 2 --rank 1")
      assert.are.equal(2, rc)
      assert.matches("--rank does not go with --dry-run", err, 1, true)
    end)

    it("errors are a real run's: weft.dist.initialize_model_parallel says the same #dist", function()
      -- the real run's path through lua/weft/dist.lua, on a world whose
      -- state is set by hand (no store, no processes: every case fails
      -- before any group is built)
      local dist = require("weft.dist")   -- a dist.lua that does not load fails here
      local S = dist.state
      local saved = {}
      for k, v in pairs(S) do saved[k] = v end
      local cases = {
        { "--world 8 --tp 3", 8, { tp = 3 } },
        { "--world 8", 8, {} },
        { "--world 8 --tp 0 --pp 8", 8, { tp = 0, pp = 8 } },
        { "--world 6 --tp 6 --attn-cp 4", 6, { tp = 6, attn_cp = 4 } },
        { "--world 8 --tp 8 --ep 3", 8, { tp = 8, ep = 3 } },
        { "--world 64 --tp 8 --pp 8 --ep 4 --moe-dp 4", 64, { tp = 8, pp = 8, ep = 4, moe_dp = 4 } },
        { "--world 8 --tp 8 --dcp 3", 8, { tp = 8, dcp = 3 } },
      }
      local okc, cerr = pcall(function()
        for _, c in ipairs(cases) do
          S.initialized, S.world_size, S.rank, S.groups = true, c[2], 0, {}
          local ok, e = pcall(dist.initialize_model_parallel, c[3])
          assert.is_false(ok, c[1])
          -- dist.lua and weft-topo both call topology.validate: the same words
          local real = tostring(e):gsub("^.-weft: ", "weft: ")
          local _, err, rc = run("--dry-run " .. c[1])
          assert.are.equal(2, rc)
          -- what would fit is said in each one's words (--world 3 / weft-run -n 3)
          local function said(m) return (m:gsub(" = %d+: use .*$", "")) end
          assert.are.equal(said("weft-topo: " .. real .. "\n"), said(err), c[1])
        end
      end)
      for k in pairs(S) do S[k] = nil end
      for k, v in pairs(saved) do S[k] = v end
      assert.is_true(okc, tostring(cerr))
    end)
  end)

  describe("--svg", function()
    local slurp = require("helpers.store_util").read_file

    it("writes the picture and says so on stderr", function()
      local file = os.tmpname()
      local out, err, rc = run("--tp 4 --pp 2 --svg " .. file)
      assert.are.equal(0, rc, err)
      assert.are.equal("", out)
      local svg = slurp(file)
      os.remove(file)
      assert.are.equal("weft-topo: wrote " .. file .. " (8 ranks, 7 panels, " .. #svg .. " bytes)\n", err)
      local p = require("weft.topology").plan { world_size = 8, tp = 4, pp = 2 }
      assert.are.equal(require("weft.tools.topo_svg").render(p), svg)
    end)

    it("draws 64 and 512 ranks with --gpus-per-node, after a dry run check", function()
      local file = os.tmpname()
      local out, err, rc = run("--dry-run --world 64 --tp 16 --pp 4 --ep 4 --gpus-per-node 4 --svg " .. file)
      assert.are.equal(0, rc, err)
      assert.matches("^valid: ", out)
      local svg = slurp(file)
      assert.matches("16 nodes x 4 GPUs", svg, 1, true)
      assert.matches("tensor parallel; a group spans up to 4 nodes", svg, 1, true)
      out, err, rc = run("--world 512 --tp 8 --pp 64 --ep 8 --svg=" .. file)
      assert.are.equal(0, rc, err)
      svg = slurp(file)
      os.remove(file)
      assert.is_true(#svg < 2 * 1024 * 1024)
      assert.matches("weft topology: world 512 = tp 8 x pp 64", svg, 1, true)
      assert.matches("(512 ranks, 7 panels, ", err, 1, true)
      local linted, lint = require("helpers.spec_util").xmllint_ok(svg)
      if linted ~= nil then assert.are.equal("rc=0\n", lint) end
    end)

    it("--svg - writes to stdout; bad uses are refused", function()
      local out, _, rc = run("--tp 2 --svg -")
      assert.are.equal(0, rc)
      assert.matches("^<%?xml", out)
      assert.matches("</svg>\n$", out)
      local cases = {
        { "--tp 2 --svg - --json", "--svg - writes the picture to stdout" },
        { "--tp 2 --svg", "--svg needs a value" },
        { "--tp 2 --svg /nonexistent-dir/x.svg", "cannot write the picture: /nonexistent-dir/x.svg" },
        { "--tp 2 --gpus-per-node 0 --svg /tmp/x.svg", "--gpus-per-node must be at least 1" },
        { "--dry-run --world 8 --tp 3 --svg /tmp/never.svg", "world_size (8) is not equal to tp (3)" },
      }
      for _, c in ipairs(cases) do refused(c[1], c[2]) end
      assert.is_nil(io.open("/tmp/never.svg"))
    end)
  end)
end)
