-- scripts/run-tests itself, on small spec files written here: the closing
-- line's counts (serial and with -j, where each file runs in its own busted
-- and the counts are summed), skipped tests summed up as one line per file
-- with their reasons, and failures that are never lost (a failing test, a
-- file that dies before busted's status line).
-- run-tests: one GPU process (no GPU work at all: '#gpu' is only in the files it writes)
local S = require("helpers.spec_util")

local ROOT = os.getenv("PWD") or "."

local function write(path, s)
  local f = assert(io.open(path, "w"))
  f:write(s)
  f:close()
end

describe("scripts/run-tests", function()
  local dir
  local files = {}

  setup(function()
    dir = S.shell("mktemp -d /tmp/weft-run-tests.XXXXXX"):match("^(%S+)")
    files.pass = dir .. "/a_pass_spec.lua"
    write(files.pass, 'describe("a", function()\n  it("one", function() assert.are.equal(2, 1 + 1) end)\n'
          .. '  it("two", function() assert.truthy(true) end)\nend)\n')
    files.fail = dir .. "/b_fail_spec.lua"
    write(files.fail, 'describe("b", function()\n  it("passes", function() end)\n'
          .. '  it("fails", function() assert.are.equal(1, 2) end)\nend)\n')
    files.skip = dir .. "/c_skip_spec.lua"
    write(files.skip, 'describe("c", function()\n'
          .. '  it("needs a device #gpu", function() pending("no CUDA device") end)\n'
          .. '  it("needs another #gpu", function() pending("no CUDA device") end)\n'
          .. '  it("needs a tool", function() pending("wrk is not installed") end)\n'
          .. '  it("runs", function() end)\nend)\n')
    files.crash = dir .. "/d_crash_spec.lua"
    write(files.crash, 'describe("d", function()\n  it("dies", function() os.exit(3) end)\nend)\n')
  end)

  teardown(function()
    if dir then S.shell("rm -rf " .. dir) end
  end)

  local function run(args, env)
    return S.shell(("cd %s && %s scripts/run-tests %s < /dev/null"):format(ROOT, env or "", args))
  end

  it("sums skipped tests up per file with their reasons, and counts them as skipped", function()
    local out, rc = run(files.skip)
    assert.are.equal(0, rc, out)
    assert.matches("\nskipped 3 in " .. files.skip:gsub("%p", "%%%0")
                   .. ": no CUDA device %(2%); wrk is not installed %(1%)\n", out)
    assert.matches("\n1 passed, 0 failed, 3 skipped\nrc=0", out)
    assert.is_nil(out:find("Pending", 1, true), out)
    -- the full list on demand
    out = run("WEFT_TEST_PENDING=all " .. files.skip)
    assert.matches("no CUDA device", out)
  end)

  it("gives the same closing line with -j as in one busted run, and fails when a test fails", function()
    local list = table.concat({ files.pass, files.fail, files.skip }, " ")
    local serial, src = run(list)
    local par, prc = run("-j 2 " .. list)
    assert.matches("\n4 passed, 1 failed, 3 skipped\nrc=", serial)
    assert.matches("\n4 passed, 1 failed, 3 skipped\nrc=", par)
    assert.are_not.equal(0, src)
    assert.are_not.equal(0, prc)
    assert.matches("\nfailed: " .. files.fail:gsub("%p", "%%%0") .. "\n", par)
    -- each file's output in one piece, under its name, how many files ended
    -- (the progress) and about how long is left; the #gpu file in its own lane
    assert.matches("2 in 2 lanes beside 1 with #gpu tests in one lane", par, 1, true)
    local ended = {}
    for _, f in ipairs({ files.pass, files.fail, files.skip }) do
      local k = par:match("\n== " .. f:gsub("%p", "%%%0")
                          .. " %(%d+ s; (%d)/3 files ended, %d+ s so far, about %d+ s left%)\n")
      assert.truthy(k, par)
      ended[tonumber(k)] = true
    end
    assert.are.same({ true, true, true }, ended)
  end)

  it("counts a file that dies before its status line as a failure, never as nothing", function()
    local par, rc = run("-j 2 " .. files.pass .. " " .. files.crash)
    assert.are_not.equal(0, rc)
    assert.matches("\nfailed: " .. files.crash:gsub("%p", "%%%0") .. " %(no status line: status 3%)\n", par)
    assert.matches("\n2 passed, 1 failed, 0 skipped\nrc=", par)
    local serial, src = run(files.crash)
    assert.are_not.equal(0, src)
    assert.matches("0 passed, 1 failed, 0 skipped\nrc=", serial, 1, true)
  end)

  -- a writer of fixture specs under folder L whose bodies can touch(n),
  -- has(n) and wait_for(n) (up to 10 s) marks under L/m: spec(name, body)
  local function lane_fixtures(L)
    S.shell("mkdir -p " .. L .. "/m")
    local pre = ('local M = %q\n'):format(L .. "/m/")
                .. 'local function touch(n) assert(io.open(M .. n, "w")):close() end\n'
                .. 'local function has(n) local f = io.open(M .. n) if f then f:close() end return f ~= nil end\n'
                .. 'local function wait_for(n) for _ = 1, 200 do if has(n) then return true end '
                .. 'os.execute("sleep 0.05") end return false end\n'
    return function(name, body) write(L .. "/" .. name, pre .. body) end
  end

  -- each file marks when it ran (files under <dir>/lanes/m); a wait of at most
  -- 10 s for a file of another lane fails the test if the lanes ran one
  -- after the other instead of beside each other
  it("runs the GPU lane, the solo GPU lane and the other lanes at once, one GPU file at a time, shm and mq after them all", function()
    local L = dir .. "/lanes"
    local spec = lane_fixtures(L)
    spec("g1_spec.lua", 'it("first #gpu file", function()\n  assert.is_false(has("gpu-busy"))\n  touch("gpu-busy")\n'
         .. '  touch("g1")\n  assert.is_true(wait_for("solo"), "the solo GPU lane did not run beside the GPU lane")\n'
         .. '  os.remove(M .. "gpu-busy")\n  touch("g1-done")\nend)\n')
    spec("g2_spec.lua", 'it("second #gpu file", function()\n  assert.is_false(has("gpu-busy"), "two GPU-lane files at once")\n'
         .. '  touch("gpu-busy")\n  os.execute("sleep 0.2")\n  os.remove(M .. "gpu-busy")\n  touch("g2-done")\nend)\n')
    spec("s_spec.lua", '-- run-tests: one GPU process (a test fixture)\n'
         .. 'it("a #gpu file in one process", function()\n  touch("solo")\n'
         .. '  assert.is_true(wait_for("g1"), "the GPU lane did not run beside the solo GPU lane")\n  touch("solo-done")\nend)\n')
    spec("f_spec.lua", 'it("a host file", function()\n  assert.is_true(wait_for("solo"), "not beside the GPU lanes")\n'
         .. '  touch("free-done")\nend)\n')
    for _, p in ipairs { { "shm", "mq" }, { "mq", "shm" } } do
      spec(p[1] .. "_spec.lua", ('it("alone", function()\n  for _, n in ipairs { "g1-done", "g2-done", "solo-done", "free-done" } do\n'
           .. '    assert.is_true(has(n), n .. " had not ended")\n  end\n  touch(%q)\n'
           .. '  assert.is_true(wait_for(%q), "shm and mq did not run beside each other")\nend)\n'):format(p[1], p[2]))
    end
    local list = {}
    for _, n in ipairs { "g1", "g2", "s", "f", "shm", "mq" } do list[#list + 1] = L .. "/" .. n .. "_spec.lua" end
    local out, rc = run("-j 2 " .. table.concat(list, " "), "WEFT_TEST_GPU_LANES=1")
    assert.matches("1 in 2 lanes beside 2 with #gpu tests in one lane and 1 in the solo GPU lane, then 2 alone", out, 1, true)
    assert.matches("\n6 passed, 0 failed, 0 skipped\nrc=0", out)
  end)

  -- two GPU lanes: the file marked long starts first (it is last on the
  -- command line), a second file runs beside it, and the third starts when
  -- the lane of the second is free again, while the long one still runs
  it("runs two GPU lanes at once, the long files first, each lane taking the next file when it is free", function()
    local L = dir .. "/gpu2"
    local spec = lane_fixtures(L)
    spec("a_spec.lua", 'it("a #gpu file", function()\n  touch("a")\n'
         .. '  assert.is_true(wait_for("long"), "not beside the long file")\n  touch("a-done")\nend)\n')
    spec("b_spec.lua", 'it("another #gpu file", function()\n  assert.is_true(has("a-done"), "started before a lane was free")\n'
         .. '  assert.is_false(has("long-done"), "waited for the long file")\n  touch("b")\nend)\n')
    spec("z_spec.lua", '-- run-tests: long (a test fixture)\n'
         .. 'it("a long #gpu file", function()\n  touch("long")\n  assert.is_false(has("b"), "the long file did not start first")\n'
         .. '  assert.is_true(wait_for("a"), "no second GPU lane beside it")\n'
         .. '  assert.is_true(wait_for("b"), "the free lane did not take the next file")\n  touch("long-done")\nend)\n')
    local list = { L .. "/a_spec.lua", L .. "/b_spec.lua", L .. "/z_spec.lua" }
    local out, rc = run("-j 2 " .. table.concat(list, " "), "WEFT_TEST_GPU_LANES=2")
    assert.matches("0 in 2 lanes beside 3 with #gpu tests in 2 lanes", out, 1, true)
    assert.matches("\nrun%-tests: GPU 1 lane ended at %d+ s\n", out)
    assert.matches("\nrun%-tests: GPU 2 lane ended at %d+ s\n", out)
    assert.matches("\n3 passed, 0 failed, 0 skipped\nrc=0", out)
    out, rc = run("-j 2 " .. list[1], "WEFT_TEST_GPU_LANES=x")
    assert.are.equal(2, rc, out)
    assert.matches("WEFT_TEST_GPU_LANES must be a positive number of lanes", out, 1, true)
  end)

  it("refuses a -j that is not a number of lanes", function()
    local out, rc = run("-j x " .. files.pass)
    assert.are.equal(2, rc)
    assert.matches("-j needs a positive number of lanes", out, 1, true)
  end)
end)
