-- A rank that is gone is named as gone within seconds, not after the timeout
-- (issue 13 item 6). Ranks run with the plain per-rank environment, no
-- weft-run (which would stop the others itself); WEFT_TIMEOUT_MS stays at
-- 60000, so a failure within 5 s proves the death was seen, not the timeout.
-- The victim kills itself with SIGKILL at a chosen point; a stopped rank
-- (SIGSTOP) is not dead and still ends at a (short) timeout. Nothing may be
-- left behind: no rank process, no /dev/shm file of these ranks.
local P = require("helpers.procs")
local L = require("weft.tools.launcher")

local ROOT = P.ROOT
local BOUND_MS = 5000   -- survivors fail within this of the death (timeout: 60000)

-- Runs world ranks of helpers/liveness_rank.lua; returns per-rank outputs
-- {pid=, fail_ms=, err=, shutdown_ms=, shutdown=, text=} and the directory.
local function run(scenario, world, victim, timeout_ms)
  local dir = P.tmpdir("weft-liveness")
  local port = assert(L.free_port("127.0.0.1"))
  local cmds = {}
  for r = 0, world - 1 do
    cmds[#cmds + 1] = ("(cd %s && RANK=%d LOCAL_RANK=%d WORLD_SIZE=%d LOCAL_WORLD_SIZE=%d "
      .. "MASTER_ADDR=127.0.0.1 MASTER_PORT=%d WEFT_TIMEOUT_MS=%d "
      .. "LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;%s/tests/?.lua;;' "
      .. "timeout -s KILL 90 luajit tests/helpers/liveness_rank.lua %s %d %s > %s/out.%d 2>&1) &")
      :format(P.q(ROOT), r, r, world, world, port, timeout_ms or 60000, ROOT, ROOT, ROOT,
              scenario, victim, dir, dir, r)
  end
  local script = table.concat(cmds, "\n") .. "\n"
  if scenario == "stopped" then
    -- the stopped victim never ends by itself: kill it once the others are done
    script = script .. ("for r in $(seq 0 %d); do [ $r = %d ] || wait %%$((r + 1)); done\n")
      :format(world - 1, victim)
      .. ("sleep 0.2; kill -9 $(sed -n 's/^PID //p' %s/out.%d) 2>/dev/null\n"):format(dir, victim)
  end
  script = script .. "wait\n"
  P.spit(dir .. "/run.sh", script)
  local t0 = P.now()
  os.execute("bash " .. dir .. "/run.sh 2>/dev/null")   -- not bash's "Killed" notes
  local wall = P.now() - t0
  local outs = {}
  for r = 0, world - 1 do
    local text = P.slurp(("%s/out.%d"):format(dir, r)) or ""
    local o = { text = text, pid = tonumber(text:match("PID (%d+)")) }
    local fms, ferr = text:match("\nFAIL (%-?%d+) ([^\n]*)")
    o.fail_ms, o.err = tonumber(fms), ferr
    local sms, sres = text:match("\nSHUTDOWN (%-?%d+) ([^\n]*)")
    o.shutdown_ms, o.shutdown = tonumber(sms), sres
    outs[r] = o
  end
  os.execute("rm -rf " .. P.q(dir))   -- the run's script and outputs are read: leave nothing in /tmp
  return outs, dir, wall
end

local function left_behind(outs)
  local bad = {}
  for _, o in pairs(outs) do
    if o.pid then
      if os.execute(("kill -0 %d 2>/dev/null"):format(o.pid)) == 0 then
        bad[#bad + 1] = "process " .. o.pid .. " still runs"
      end
      local p = io.popen("ls /dev/shm 2>/dev/null | grep -- '-" .. o.pid .. "-'")
      local files = p:read("*a"); p:close()
      if files ~= "" then bad[#bad + 1] = "/dev/shm files of pid " .. o.pid .. ": " .. files end
    end
  end
  return table.concat(bad, "; ")
end

-- how a rank is named: "rank R (pid P, host H" by the store's words, "rank
-- R (global G, pid P, host H" by the shm engine's (a barrier goes where the
-- group's collectives go: shm on one node)
local function names(err, r, pid)
  return err:find(("rank %d (pid %d, host "):format(r, pid), 1, true)
         or err:find(("(global %d, pid %d, host "):format(r, pid), 1, true)
end

-- every survivor failed within BOUND_MS of the death, naming rank, pid, host;
-- and its shutdown after that did not wait for the dead rank either
local function assert_named(outs, victim, world, want)
  local vpid = outs[victim].pid
  assert.is_number(vpid, "victim pid: " .. outs[victim].text)
  for r = 0, world - 1 do
    if r ~= victim then
      local o = outs[r]
      assert.is_truthy(o.err, ("rank %d did not fail:\n%s"):format(r, o.text))
      assert.is_true(o.fail_ms >= 0 and o.fail_ms < BOUND_MS,
                     ("rank %d failed %d ms after the death: %s"):format(r, o.fail_ms, o.err))
      local who = want or ("rank %d (pid %d, host "):format(victim, vpid)
      assert.is_truthy(want and o.err:find(who, 1, true) or not want and names(o.err, victim, vpid),
                       ("rank %d: %q lacks %q"):format(r, o.err, who))
      assert.is_truthy(o.err:find("died", 1, true) or o.err:find("gone", 1, true), o.err)
      assert.is_truthy(o.shutdown_ms and o.shutdown_ms < BOUND_MS + 2000,
                       ("rank %d shutdown: %s"):format(r, tostring(o.shutdown)))
    end
  end
end

describe("ranks that are gone #fault", function()
  for _, world in ipairs { 2, 4 } do
    for _, case in ipairs {
      { "between", "between collectives" },
      { "in_barrier", "while the others are blocked in a barrier" },
      { "in_bcast", "while the others wait for its broadcast" },
      { "in_shm", "while the others are blocked in a shared-memory all_reduce" },
      { "in_init", "during weft.init (after it connected)" },
      { "in_mp_init", "during initialize_model_parallel" },
    } do
      it(("world %d: a rank killed %s is named within 5 s"):format(world, case[2]), function()
        local victim = world - 1
        local outs = run(case[1], world, victim)
        local want
        if case[1] == "in_shm" then
          -- the shm barrier sees the pid itself (same node)
          want = ("pid %d, host "):format(outs[victim].pid or -1)
        end
        assert_named(outs, victim, world, want)
        assert.are.equal("", left_behind(outs))
      end)
    end
  end

  for _, case in ipairs { { "raise_in_barrier", "raises" }, { "end_in_barrier", "ends its script" } } do
    it(("world 3: a rank that %s without the barrier (no weft.shutdown) is named as left within 5 s")
       :format(case[2]), function()
      local outs = run(case[1], 3, 2, 30000)
      for r = 0, 1 do
        local o = outs[r]
        assert.is_truthy(o.err, ("rank %d did not fail:\n%s"):format(r, o.text))
        assert.is_true(o.fail_ms >= 0 and o.fail_ms < BOUND_MS, ("rank %d: %d ms: %s"):format(r, o.fail_ms, o.err))
        assert.is_truthy(names(o.err, 2, outs[2].pid) and o.err:find("left without weft.shutdown", 1, true), o.err)
        -- and weft.shutdown() after it waits for no one that left
        assert.is_truthy(o.shutdown_ms and o.shutdown_ms < BOUND_MS + 2000, ("rank %d shutdown: %s"):format(r, tostring(o.shutdown)))
      end
      assert.are.equal("", left_behind(outs))
    end)
  end

  it("world 2: rank 0 (the store's host) killed between collectives is named within 5 s", function()
    local outs = run("between", 2, 0)
    local o = outs[1]
    assert.is_truthy(o.err, o.text)
    assert.is_true(o.fail_ms >= 0 and o.fail_ms < BOUND_MS, tostring(o.fail_ms))
    assert.is_truthy(names(o.err, 0, outs[0].pid) and o.err:find("hosts the store", 1, true), o.err)
    assert.are.equal("", left_behind(outs))
  end)

  it("world 2: a rank killed before weft.init is reported as never connected at the timeout", function()
    -- nothing can tell a rank that never started from a slow one: the
    -- timeout (short here) ends it, with what the store knows
    local outs = run("before_init", 2, 1, 3000)
    local o = outs[0]
    assert.is_truthy(o.err, o.text)
    assert.is_truthy(o.err:find("rank 1 (never connected to the store", 1, true), o.err)
    assert.are.equal("", left_behind(outs))
  end)

  for _, world in ipairs { 2, 4 } do
    it(("world %d: a stopped rank (SIGSTOP) is not dead: it times out, named as stopped"):format(world), function()
      local victim = world - 1
      local outs, _, wall = run("stopped", world, victim, 2500)
      for r = 0, world - 2 do
        local o = outs[r]
        assert.is_truthy(o.err, o.text)
        assert.is_truthy(o.err:find("timed out after 2500 ms", 1, true), o.err)
        assert.is_truthy(names(o.err, victim, outs[victim].pid), o.err)
        assert.is_truthy(o.err:find("stopped", 1, true), o.err)
        assert.is_falsy(o.err:find("died", 1, true), o.err)
        assert.is_true(o.fail_ms >= 2000, tostring(o.fail_ms))
      end
      assert.is_true(wall < 60)
      assert.are.equal("", left_behind(outs))
    end)
  end
end)
