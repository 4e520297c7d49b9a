-- Faults across simulated nodes (scripts/weft-sim-nodes; needs root, else
-- pending): a rank killed on node 1, a rank that stalls past the timeout, a
-- node cut off from the others (a partition), a node started with a wrong
-- store secret, and the simulator itself stopped with SIGINT. Every
-- survivor fails within bounds naming the cause; every node's launcher
-- exits non-zero; nothing is left behind.
local N = require("helpers.nodes_util")
local P = require("helpers.procs")

local BOUND_MS = 5000

local function run_or_skip(o)
  local out, rc, wall = N.run(o)
  if rc == N.SKIP then pending("simulated nodes unavailable: " .. N.skipped(out)); return nil end
  return out, rc, wall
end

-- a case that exercises Gloo needs a build with Gloo (libgloo-dev):
-- elsewhere those routes are the store path, which other cases cover
local function gloo_or_skip()
  if require("weft.gloo").available() then return true end
  pending("weft was built without Gloo (libgloo-dev): no Gloo route to fault")
  return false
end

-- the time of the fault's marker line ("DEATH <ms>", "CUT <ms>") and every
-- rank's "FAIL <ms> <message>" line (tests/helpers/nodes_ranks.lua)
local function fault_and_fails(out, marker)
  local at
  local fails = {}
  for _, l in ipairs(N.rank_lines(out)) do
    local t = l.text:match("^" .. marker .. " (%d+)")
    if t then at = tonumber(t) end
    local ms, msg = l.text:match("^FAIL (%d+) (.*)$")
    if ms then fails[l.rank] = { ms = tonumber(ms), msg = msg, node = l.node } end
  end
  return at, fails
end

local function both_launchers_failed(out, rc)
  assert.are_not.equal(0, rc, out)
  for k = 0, 1 do
    assert.is_truthy(out:find(("weft-sim-nodes: node%d: weft-run exited with code"):format(k), 1, true),
                     ("node%d's launcher did not fail:\n%s"):format(k, out))
  end
end

describe("faults across simulated nodes #fault", function()
  for _, case in ipairs { { "flat Gloo", 4096 }, { "hierarchical", 524288 } } do
    it("a rank killed on node 1 (" .. case[1] .. "): every other rank fails within 5 s naming it", function()
      local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 60,
        env = { NODES_KILL_NUMEL = tostring(case[2]) }, args = { "tests/helpers/nodes_ranks.lua", "kill", "3" } }
      if not out then return end
      local death, fails = fault_and_fails(out, "DEATH")
      assert.is_number(death, out)
      -- Each survivor names rank 3 as dead (the store saw it go), or, when
      -- rank 0 (the store's host) has already exited with its own error, the
      -- ranks behind the connection it lost, rank 3 among them.
      local named = 0
      for r = 0, 2 do   -- node 0's ranks and rank 3's node mate
        local f = fails[r]
        assert.is_truthy(f, ("rank %d did not fail:\n%s"):format(r, out))
        assert.is_true(f.ms - death < BOUND_MS, ("rank %d failed %d ms after the death"):format(r, f.ms - death))
        local precise = f.msg:find("rank 3 (pid", 1, true) or f.msg:find("(global 3, pid", 1, true)
        if precise then named = named + 1 end
        assert.is_truthy(precise or f.msg:find("lost the connection to rank%(s%) [%d, ]*3"),
                         ("rank %d names neither rank 3 nor its connection: %s"):format(r, f.msg))
        assert.is_truthy(f.msg:find("all_reduce", 1, true), f.msg)
      end
      assert.is_true(named >= 1, out)
      -- node 1's launcher names its dead rank
      assert.is_truthy(out:find("weft-run[node1]: rank 3 killed by signal 9", 1, true), out)
      both_launchers_failed(out, rc)
      assert.are.equal("", N.leftover_namespaces())
    end)
  end

  for _, case in ipairs {
    { "flat Gloo's ring", { NODES_STALL_NUMEL = "65536", WEFT_HOST_BACKEND = "gloo", WEFT_GLOO_SMALL_MAX = "0" } },
    { "flat Gloo's small path, recursive doubling", { NODES_STALL_NUMEL = "256", WEFT_HOST_BACKEND = "gloo" } },
    { "the hierarchy, leaders' recursive halving in chunks", { NODES_STALL_NUMEL = "1048576" } },
  } do
  it("a rank that stalls past the timeout (" .. case[1] .. "): the others fail at the timeout naming the group and op", function()
    local env = { WEFT_TIMEOUT_MS = "2000" }
    for k, v in pairs(case[2]) do env[k] = v end
    local out, rc, wall = run_or_skip { nodes = 2, per_node = 2, timeout = 60,
      env = env, args = { "tests/helpers/nodes_ranks.lua", "stall", "3" } }
    if not out then return end
    local stall
    local fails = 0
    for _, l in ipairs(N.rank_lines(out)) do
      local s = l.text:match("^STALL (%d+)")
      if s then stall = tonumber(s) end
      local ms, msg = l.text:match("^FAIL (%d+) (.*)$")
      if ms and l.rank ~= 3 then
        fails = fails + 1
        assert.is_true(tonumber(ms) - stall < 2000 + BOUND_MS, out)
        assert.is_truthy(msg:find("all_reduce", 1, true) and msg:find("group", 1, true), msg)
        assert.is_truthy(msg:find("2000 ms", 1, true) or msg:find("aborted by", 1, true)
                         or msg:find("died", 1, true), msg)
      end
    end
    assert.is_true(fails >= 1, out)
    both_launchers_failed(out, rc)
    assert.is_true(wall < 30, ("the run took %.1f s"):format(wall))
  end)
  end

  -- Issue 24 item 3: node 1's link cut from the hub mid-loop. Every rank on
  -- both sides fails within the timeout + 1 s; the near side names node 1's
  -- ranks or host, the far side the store it cannot reach (rank 0's). The
  -- routes: flat Gloo (small, 2 nodes), the hierarchy (shm + leaders' Gloo),
  -- the leaders' store all-gather (3 nodes, small), the store path.
  -- In a build without Gloo the Gloo routes (4th field) take the store path
  -- with more than one rank per side, which these cases check as well (a
  -- member that timed out and left was once named as the cause there).
  local T = 3000
  local gloo = require("weft.gloo").available()
  for _, case in ipairs {
    { 2, "flat Gloo", { NODES_PART_NUMEL = "4096" }, true },
    { 2, "the hierarchy", { NODES_PART_NUMEL = "524288" }, true },   -- shm + the leaders' Gloo
    { 2, "the store path", { NODES_PART_NUMEL = "4096", WEFT_HOST_BACKEND = "store" } },
    -- a node-0 member times out, aborts and leaves a moment before rank 0's
    -- own timeout: rank 0 must still name node 1, not the member that left
    { 2, "the store path, 2 MiB", { NODES_PART_NUMEL = "524288", WEFT_HOST_BACKEND = "store" } },
    { 3, "the store path, 2 MiB", { NODES_PART_NUMEL = "524288", WEFT_HOST_BACKEND = "store" } },
    { 3, "the hierarchy, leaders' Gloo ring", { NODES_PART_NUMEL = "524288" }, true },
    { 3, "the hierarchy, leaders' store all-gather", { NODES_PART_NUMEL = "4096" } },
  } do
    local nodes, route = case[1], case[2]
    if case[4] and not gloo then route = route .. ": the store path here, a build without Gloo" end
    it(("a partition (%dx2 ranks, %s): every rank on both sides fails within the timeout + 1 s naming whom it cannot reach")
       :format(nodes, route), function()
      local env = { WEFT_TIMEOUT_MS = tostring(T) }
      for k, v in pairs(case[3]) do env[k] = v end
      local out, rc = run_or_skip { nodes = nodes, per_node = 2, timeout = 60, env = env,
                                    args = { "tests/helpers/nodes_ranks.lua", "partition", "1" } }
      if not out then return end
      local cut, fails = fault_and_fails(out, "CUT")
      assert.is_number(cut, out)
      for r = 0, 2 * nodes - 1 do
        local f = fails[r]
        assert.is_truthy(f, ("rank %d did not fail:\n%s"):format(r, out))
        local late = f.ms - cut
        assert.is_true(late < T + 1000, ("rank %d failed %d ms after the cut (timeout %d ms): %s"):format(r, late, T, f.msg))
        assert.is_truthy(f.msg:find("all_reduce", 1, true), f.msg)
        if f.node == 1 then
          -- the far side: the store (on node 0) is unreachable, or Gloo's peers there
          assert.is_truthy(f.msg:find("the store is unreachable", 1, true)
                           or f.msg:find("the store at [^ ]+, served by rank 0 %(pid %d+, host node0%), is unreachable")
                           or f.msg:find("waiting for rank%(s%) 0"),
                           ("rank %d names neither the store nor node 0: %s"):format(r, f.msg))
        else
          -- the near side: node 1's host or ranks (2 and 3); or, on a loaded
          -- machine, rank 0 (the store's host) timed out first and closed its
          -- connections after its linger: then the store's host is named, gone
          -- (seen once in 4 CI runs on 2 CPUs, 2026-12-06)
          assert.is_truthy(f.msg:find("node1", 1, true) or f.msg:find("rank%(s%) 2") or f.msg:find("ranks? 2[ ,]")
                           or (r ~= 0 and f.msg:find("lost the connection to rank%(s%) 0 ")
                               and f.msg:find("store gone", 1, true)),
                           ("rank %d does not name node 1 or its ranks: %s"):format(r, f.msg))
        end
      end
      assert.are_not.equal(0, rc, out)
      assert.are.equal("", N.leftover_namespaces())
    end)
  end

  it("a partition shorter than the timeout: node 1's ranks are marked unreachable while it lasts, and the job goes on", function()
    local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 60, env = { WEFT_TIMEOUT_MS = "15000" },
                                  args = { "tests/helpers/nodes_ranks.lua", "heal" } }
    if not out then return end
    assert.is_truthy(out:find("MARK cut pid=%d+ host=node1"), out)
    assert.is_truthy(out:find("MARK healed nil", 1, true), out)
    assert.are.equal(4, N.count_ok(out, "heal"), out)
    assert.are.equal(0, rc, out)
  end)

  -- Issue 24 item 7: deterministic mode on rank 3 only sent it down the store
  -- path while the others built a Gloo context; ranks 0-2 failed with an
  -- empty cause ("weft_gloo_create: group 'world': "): the cleanup after the
  -- failed rendezvous cleared the thread's last error. Now the group agrees
  -- on the mode at its first host reduction across nodes, and names who
  -- differs; and a Gloo rendezvous that fails names whom it waited for.
  local function fail_lines(out)
    local fails = {}
    for _, l in ipairs(N.rank_lines(out)) do
      local msg = l.text:match("^FAIL %d+ (.*)$")
      if msg then fails[l.rank] = msg end
    end
    return fails
  end
  local function no_empty_cause(r, msg)
    assert.is_falsy(msg:find(":%s*$") or msg:find("(gloo: )", 1, true) or msg:find("no message was recorded", 1, true),
                    ("rank %d: empty cause: %s"):format(r, msg))
  end
  -- every one of the 4 ranks printed a FAIL line with a cause; check(msg) for each
  local function every_rank_failed(out, check)
    local fails = fail_lines(out)
    for r = 0, 3 do
      local msg = fails[r]
      assert.is_truthy(msg, ("rank %d did not fail:\n%s"):format(r, out))
      no_empty_cause(r, msg)
      check(msg)
    end
  end

  it("deterministic mode on one rank only: every rank fails at once naming who is on and who is off", function()
    local out, rc, wall = run_or_skip { nodes = 2, per_node = 2, timeout = 60, env = { WEFT_TIMEOUT_MS = "5000" },
                                        args = { "tests/helpers/nodes_ranks.lua", "determ_one", "3" } }
    if not out then return end
    every_rank_failed(out, function(msg)
      assert.is_truthy(msg:find("deterministic mode is on for rank 3 and off for ranks 0, 1, 2", 1, true), msg)
    end)
    assert.are_not.equal(0, rc, out)
    assert.is_true(wall < 5, ("took %.1f s: the disagreement must not wait for the timeout"):format(wall))
  end)

  it("node 1 forced to the store path while node 0 builds a Gloo context: every rank names the two calls at once", function()
    if not gloo_or_skip() then return end
    local out, rc = run_or_skip { nodes = 2, per_node = 2, timeout = 60, env = { WEFT_TIMEOUT_MS = "2000" },
                                  node_env = { "1:WEFT_HOST_BACKEND=store" },
                                  args = { "tests/helpers/nodes_ranks.lua", "determ_one", "-1" } }
    if not out then return end
    every_rank_failed(out, function(msg)
      -- node 0 agrees on a rendezvous name (a broadcast) while node 1 starts
      -- its all_reduce on the store (an all-gather): the same collective
      -- number, different calls, told to every rank by the agreement word
      assert.is_truthy(msg:find("called different collectives", 1, true), msg)
      assert.is_truthy(msg:find("ranks 0, 1: broadcast", 1, true) and msg:find("ranks 2, 3: allgather", 1, true), msg)
    end)
    assert.are_not.equal(0, rc, out)
  end)

  it("a node started with a wrong secret is refused, with a clear message on both sides", function()
    local out, rc, wall = run_or_skip { nodes = 2, per_node = 1, timeout = 60,
      env = { WEFT_STORE_SECRET = "right-secret", WEFT_TIMEOUT_MS = "20000" },
      node_env = { "1:WEFT_STORE_SECRET=wrong-secret" },
      args = { "tests/helpers/nodes_ranks.lua", "layout" } }
    if not out then return end
    local r0, r1
    for _, l in ipairs(N.rank_lines(out)) do
      if l.rank == 0 and l.text:find("WEFT_STORE_SECRET", 1, true) then r0 = l.text end
      if l.rank == 1 and l.text:find("WEFT_STORE_SECRET", 1, true) then r1 = l.text end
    end
    assert.is_truthy(r0 and r0:find("rejected for a wrong WEFT_STORE_SECRET", 1, true)
                     and r0:find("rank 1", 1, true) and r0:find("node1", 1, true), out)
    assert.is_truthy(r1 and r1:find("rejected this client: the secrets differ", 1, true), out)
    both_launchers_failed(out, rc)
    assert.is_true(wall < 15, ("refused after %.1f s"):format(wall))
  end)

  it("weft-sim-nodes stopped with SIGINT stops every node and removes its namespaces", function()
    local dir = P.tmpdir("weft-nodes-int")
    P.spit(dir .. "/sleep.lua", 'local weft = require("weft"); weft.init(); print("READY"); io.stdout:flush(); os.execute("sleep 60")\n')
    local out_file = dir .. "/out"
    -- in the background, holding no pipe of ours; a background job of a
    -- non-interactive shell starts with SIGINT ignored (and bash cannot trap
    -- a signal ignored at entry), so a small exec wrapper restores it, as a
    -- terminal's Ctrl-C would find it
    P.spit(dir .. "/dfl.lua", [[
local ffi = require("ffi")
ffi.cdef "void *signal(int sig, void *h); int execvp(const char *f, const char **argv);"
ffi.C.signal(2, nil)
local argv = ffi.new("const char *[?]", #arg + 1)
for i = 1, #arg do argv[i - 1] = arg[i] end
ffi.C.execvp(arg[1], argv)
os.exit(127)
]])
    os.execute(("cd %s && (luajit %s/dfl.lua scripts/weft-sim-nodes -N 2 -n 1 %s/sleep.lua > %s 2>&1; "
      .. "echo \"rc=$?\" >> %s) < /dev/null > /dev/null 2>&1 &"):format(P.q(N.ROOT), dir, dir, out_file, out_file))
    local t0 = P.now()
    local text = ""
    while P.now() - t0 < 20 do
      text = P.slurp(out_file) or ""
      if select(2, text:gsub("READY", "")) >= 2 or text:find("skipped") then break end
      P.sleep(0.1)
    end
    if text:find("weft%-sim%-nodes: skipped") then pending("simulated nodes unavailable"); return end
    local pid = tonumber(P.pgrep("^[b]ash scripts/weft-sim-nodes -N 2 -n 1 " .. dir):match("^(%d+)"))
    assert.is_number(pid, "the simulator is not running:\n" .. text)
    os.execute("kill -INT " .. pid)
    local t1 = P.now()
    while P.now() - t1 < 15 and not (P.slurp(out_file) or ""):find("rc=%d+") do P.sleep(0.1) end
    text = P.slurp(out_file) or ""
    assert.is_truthy(text:find("rc=130", 1, true), text)
    assert.is_truthy(text:find("received SIGINT", 1, true), text)
    assert.is_true(P.now() - t1 < 10, "stopping took too long")
    assert.are.equal("", N.leftover_namespaces())
    assert.are.equal("", P.pgrep(dir .. "/[s]leep.lua"), "a rank is still running")
    os.execute("rm -rf " .. P.q(dir))
  end)
end)
