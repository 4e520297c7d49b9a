-- weft.internal.progress (issue 39 item 4): the long tools say what runs, how far they
-- are and about how long is left: one line rewritten on a terminal, one line
-- per step when piped, nothing with -q. The module with a fake clock and
-- stream, then the tools themselves: bench-host and bench-soak piped, on a
-- pseudo-terminal (script(1)) and with -q.
local S = require("helpers.spec_util")
local progress = require("weft.internal.progress")

local ROOT = os.getenv("PWD") or "."

-- a stream that keeps what is written, and a clock the test moves
local function rig(opts)
  local out, t = {}, 0
  opts.stream = { write = function(_, s) out[#out + 1] = s end }
  opts.now = function() return t end
  local p = progress.new(opts)
  return p, function() return table.concat(out) end, function(dt) t = t + dt end
end

describe("weft.internal.progress", function()
  it("piped: one line per step, what runs, k of n, the time so far and about how long is left", function()
    local p, text, tick = rig { name = "tool", steps = 4, tty = false }
    p:step("first")
    tick(10)
    p:step("second")
    tick(10)
    p:update(50, 100, "calls")   -- half of the second step: 1.5 steps in 20 s
    p:update(52, 100, "calls")   -- within the same 10 %: no line
    tick(70)
    p:step("third")
    p:finish("wrote x")
    assert.are.equal(table.concat({
      "tool: [1/4] first (0 s)",
      "tool: [2/4] second (10 s, about 30 s left)",
      "tool: [2/4] second, 50/100 calls (20 s, about 33 s left)",
      "tool: [3/4] third (1 min 30 s, about 1 min 30 s left)",
      "tool: wrote x, done in 1 min 30 s",
      "" }, "\n"), text())
    assert.is_nil(text():find("\r", 1, true))
  end)

  it("on a terminal: one line rewritten in place, kept to the width, cleared before other output", function()
    local p, text, tick = rig { name = "tool", steps = 2, tty = true, width = 60 }
    p:step("first")
    tick(1)
    p:update(1, 4)
    tick(0.1)
    p:update(2, 4)                  -- within 0.2 s of the last draw: not drawn
    p:note("a line of its own")
    tick(1)
    local long = "a second step with a label far too long for sixty columns of terminal"
    p:step(long)
    p:finish()
    local cut = ("tool: [2/2] " .. long):sub(1, 58) .. "~"     -- width - 1 columns
    assert.are.equal(table.concat({
      "\r\27[Ktool: [1/2] first (0 s)",
      "\r\27[Ktool: [1/2] first, 1/4 (1 s, about 7 s left)",
      "\r\27[Ktool: a line of its own\n",
      "\r\27[Ktool: [1/2] first, 2/4 (1 s, about 3 s left)",
      "\r\27[K" .. cut,
      "\r\27[Ktool: done in 2 s\n" }), text())
  end)

  it("quiet (-q): nothing at all", function()
    local p, text = rig { name = "tool", steps = 2, tty = true, quiet = true }
    p:step("x"); p:update(1, 2); p:note("n"); p:clear(); p:finish("y")
    assert.are.equal("", text())
    p, text = rig { name = "tool", steps = 2, tty = false, quiet = true }
    p:step("x"); p:update(1, 2); p:note("n"); p:finish("y")
    assert.are.equal("", text())
  end)

  it("weighs steps that cost differently, and counts steps past the announced total", function()
    local p, text, tick = rig { name = "t", weights = { 1, 3 }, tty = false }
    p:step("cheap")
    tick(10)
    p:step("dear")                   -- 1 of 4 units in 10 s: 30 s left
    assert.matches("[2/2] dear (10 s, about 30 s left)", text(), 1, true)
    p:step("extra")                  -- a pass the tool added
    assert.matches("[3/3] extra", text(), 1, true)
    assert.are.equal("59 s", progress.duration(59.4))
    assert.are.equal("2 h 05 min", progress.duration(7500))
  end)

  it("WEFT_PROGRESS_FD: the lines go to that descriptor", function()
    local out = S.shell(("cd %s && WEFT_PROGRESS_FD=3 luajit -e %s 3>&1 1>/dev/null 2>/dev/null"):format(ROOT,
      "'package.path = \"lua/?.lua;\" .. package.path; local p = require(\"weft.internal.progress\").new{name = \"fd\", steps = 1}; p:step(\"three\")'"))
    assert.matches("^fd: %[1/1%] three %(0 s%)\n", out)
  end)
end)

describe("the long tools' progress", function()
  local dir
  before_each(function() dir = S.shell("mktemp -d /tmp/weft-progress.XXXXXX"):match("^(%S+)") end)
  after_each(function() if dir then os.execute("rm -rf " .. dir) end end)

  -- stderr only (stdout: the tables), under a pseudo-terminal when tty
  local function run(cmd, tty)
    local line = ("cd %s && timeout 120 %s --out %s 2>&1 >/dev/null"):format(ROOT, cmd, dir)
    if tty then line = ("script -qec %s /dev/null"):format("'" .. line .. "'") end
    return S.shell("(" .. line .. ")")
  end
  local HOST = "luajit scripts/bench-host.lua --worlds 2 --dtypes f32,bf16 --load none --min 1024 --max 4096 "
               .. "--iters 20 --repeat 1 --no-mpi"
  local SOAK = "luajit scripts/bench-soak.lua --ranks 2 --small 2000 --big 20 --big-bytes 65536 --samples 5"

  it("bench-host: a line per step when piped, one line rewritten on a terminal, nothing with -q", function()
    local out, rc = run(HOST)
    assert.are.equal(0, rc, out)
    assert.matches("bench-host: [1/3] weft, 2 ranks, f32, load none, run 1 (", out, 1, true)
    assert.matches("\nbench%-host: %[2/3%] weft, 2 ranks, bf16, load none, run 1 %(%d+ s, about %d+ s left%)\n", out)
    assert.matches("\nbench-host: [3/3] the Lua call path, 2 ranks (", out, 1, true)
    assert.matches("\nbench%-host: 3 steps, done in %d+ s\n", out)
    out, rc = run(HOST, true)
    assert.are.equal(0, rc, out)
    local _, rewrites = out:gsub("\r\27%[Kbench%-host: %[%d/3%]", "")
    assert.are.equal(3, rewrites, out)
    assert.is_nil(out:find("left%)\r?\n"), out)              -- no step line ends a line
    out, rc = run(HOST .. " -q")
    assert.are.equal(0, rc, out)
    assert.are.equal("rc=0\n", out)
  end)

  it("bench-soak: the phase and its calls from rank 0's samples; nothing with -q", function()
    local out, rc = run(SOAK)
    assert.are.equal(0, rc, out)
    assert.matches("bench-soak: [1/2] small phase: 2000 x 1 KiB (", out, 1, true)
    assert.matches("bench-soak: [1/2] small phase: 2000 x 1 KiB, 2000/2000 calls (", out, 1, true)
    assert.matches("bench-soak: [2/2] big phase: 20 x 64 KiB, 20/20 calls (", out, 1, true)
    assert.matches("\nbench%-soak: wrote [^\n]*, done in %d+ s\n", out)
    out, rc = run(SOAK .. " -q")
    assert.are.equal(0, rc, out)
    assert.are.equal("rc=0\n", out)
  end)

  it("the GPU scripts (scripts/progress.sh): a line per phase, a line every PROGRESS_EVERY s while one runs, none with -q", function()
    local script = table.concat({
      ". scripts/progress.sh", "progress_init gpu-x",
      "slow() { echo first > %s/log; sleep 2.5; echo 'second line' >> %s/log; return 3; }",
      "progress_step 1 2 'a phase'",
      "PROGRESS_EVERY=1 progress_run 60 %s/log 'the phase' slow; echo \"status $?\"",
    }, "\n"):format(dir, dir, dir)
    local out = S.shell(("cd %s && bash -c %s"):format(ROOT, "'" .. script:gsub("'", "'\\''") .. "'"))
    assert.matches("^gpu%-x: %[1/2%] a phase %(0 s so far%)\n", out)
    assert.matches("\ngpu%-x: the phase: %d s of at most 60 s; last: first\n", out)
    assert.matches("\nstatus 3\n", out)
    out = S.shell(("cd %s && PROGRESS_QUIET=1 bash -c %s"):format(ROOT, "'" .. script:gsub("'", "'\\''") .. "'"))
    assert.are.equal("status 3\nrc=0\n", out)
    -- the scripts take -q (here they stop at once: no GPU)
    for _, tool in ipairs { "scripts/gpu-ar", "scripts/gpu-fusion" } do
      out = S.shell(("cd %s && OUT=%s %s -q"):format(ROOT, dir, tool))
      assert.is_nil(out:find("usage:", 1, true), out)
    end
  end)
end)
