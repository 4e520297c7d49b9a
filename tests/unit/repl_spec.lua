-- The live REPL: chunk handling, value display and deadlines in-process;
-- then real sessions of scripts/weft-repl and `weft-run -n N --repl` driven
-- through a pseudo-terminal (tmux) and through a pipe. Every wait is bounded;
-- no session or rank process may outlive a test.
local R = require("weft.tools.repl")
local U = require("helpers.repl_tmux")

-- both ranks of a 2-rank session answered s (as one merged line or two)
local function both_said(text, s)
  return text:find("[ranks 0,1] " .. s, 1, true) or
         (text:find("[rank 0] " .. s, 1, true) and text:find("[rank 1] " .. s, 1, true))
end

-- rank k printed a line matching pattern (after its prefix), alone or in a
-- line the launcher folded for both ranks ("[ranks 0,1] ...")
local function rank_said(text, k, pattern)
  return text:find(("%%[rank %d%%] "):format(k) .. pattern) or text:find("%[ranks 0,1%] " .. pattern)
end

local function has_tmux() return os.execute("command -v tmux >/dev/null 2>&1") == 0 end

describe("weft.tools.repl chunks", function()
  it("tells expressions, statements, incomplete input and syntax errors apart", function()
    local kind, code = R.prepare("1 + 1")
    assert.are.equal("expr", kind)
    assert.truthy(code:find("1 + 1", 1, true))
    assert.are.equal("expr", (R.prepare("=weft")))
    assert.are.equal("expr", (R.prepare("f()")))
    assert.are.equal("stmt", (R.prepare("x = 1")))
    assert.are.equal("stmt", (R.prepare("for i = 1, 2 do print(i) end")))
    for _, t in ipairs { "for i = 1, 3 do", "x = {", "return 1 +", "=1 +", "f(", "x = [[abc",
                         "--[[ comment", "if x then\nprint(x)", "local function f()" } do
      assert.are.equal("incomplete", (R.prepare(t)), t)
    end
    local k2, err = R.prepare("x = = 1")
    assert.are.equal("error", k2)
    assert.truthy(err:find("^stdin:1:"), err)
    assert.are.equal("error", (R.prepare("return x =")))
  end)

  it("prints the value of a line whose last statement is an expression", function()
    for _, t in ipairs { "x = {5}; x[1]", "x = 1\nx + 1", "local y = 2; y * 3", "f(); g(); t:to_table()[1]",
                         "for i = 1, 2 do end; 7", "x = {1}; #x, 'two'" } do
      local kind, code = R.prepare(t)
      assert.are.equal("expr", kind, t .. ": " .. tostring(code))
    end
    assert.are.equal("stmt", (R.prepare("f(); g()")))             -- calls stay statements
    assert.are.equal("incomplete", (R.prepare("x = 1; if x then")))
    assert.are.equal("error", (R.prepare("x = 1; y = = 2; x")))
  end)

  it("turns top-level locals into environment fields and leaves nested ones", function()
    local g = R.globalize_locals
    assert.are.equal(" x = 1", g("local x = 1"))
    assert.are.equal(" a, b = 1, 2", g("local a, b = 1, 2"))
    assert.are.equal(" z = nil", g("local z"))
    assert.are.equal(" p, q = nil; print(p)", g("local p, q; print(p)"))
    assert.are.equal(" function f() local y = 1 return y end", g("local function f() local y = 1 return y end"))
    assert.are.equal("do local y = 2 end  w = 3", g("do local y = 2 end local w = 3"))
    assert.are.equal("s = 'local a = 1' -- local b\n c = [[local d]]",
                     g("s = 'local a = 1' -- local b\nlocal c = [[local d]]"))
    assert.are.equal("if x then local y = 1 end", g("if x then local y = 1 end"))
    assert.are.equal("repeat local r = 1 until r  t = 1", g("repeat local r = 1 until r local t = 1"))
    assert.are.equal("x = 'unfinished", g("x = 'unfinished"))   -- cannot lex: unchanged
  end)

  it("shows values briefly: tables sorted and bounded, strings quoted inside, cycles marked", function()
    assert.are.equal("{1, 2, a = {b = \"c\"}}", R.show { 1, 2, a = { b = "c" } })
    assert.are.equal("plain", R.show "plain")
    assert.are.equal("{[true] = 1, [\"two words\"] = \"x\\ny\"}", R.show { ["two words"] = "x\ny", [true] = 1 })
    local t = { 1 }
    t.self = t
    assert.are.equal("{1, self = <cycle>}", R.show(t))
    assert.are.equal("{{{{...}}}}", R.show { { { { { 1 } } } } })
    local big = {}
    for i = 1, 40 do big[i] = i end
    assert.truthy(R.show(big):find("%.%.%. %(24 more%)}$"), R.show(big))
    local obj = setmetatable({}, { __tostring = function() return "OBJ" end })
    assert.are.equal("OBJ", R.show(obj))
    assert.are.equal("1\tnil\tx", R.show_values({ n = 3, 1, nil, "x" }, 1, 3))
    local tensor = require("weft.tensor")
    local s = R.show(tensor.from_table({ 1, 2, 3 }, "f32"))
    assert.truthy(s:find("^tensor%(f32, {3}, cpu%)") and s:find("1, 2, 3"), s)
  end)

  it("parses and prints rank lists", function()
    assert.are.same({ 0, 2, 3 }, R.parse_ranks("0,2-3", 4))
    assert.are.same({ 1, 2, 3 }, R.parse_ranks("3,1-2,2", 4))
    assert.is_nil(R.parse_ranks("4", 4))
    assert.is_nil(R.parse_ranks("a", 4))
    assert.are.equal("0-3", R.ranks_str { 0, 1, 2, 3 })
    assert.are.equal("0,2,5-7", R.ranks_str { 0, 2, 5, 6, 7 })
    assert.are.equal("1,2", R.ranks_str { 1, 2 })
  end)

  it("completes names, fields and methods", function()
    local env = R.new_env { rank = 0, world = 1 }
    env.thing = setmetatable({ alpha = 1 }, { __index = { beta = function() end } })
    assert.are.same({ "weft" }, R.complete("wef", env))
    local c = R.complete("weft.tp_", env)
    assert.truthy(#c >= 2 and c[1]:find("^weft%.tp_"), table.concat(c, " "))
    assert.are.same({ "thing:beta" }, R.complete("thing:b", env))
    assert.are.same({ "thing.alpha", "thing.beta" }, R.complete("thing.", env))
    assert.are.same({}, R.complete("nosuch.x", env))
  end)
end)

describe("weft.tools.repl execution", function()
  local ctx
  local function run(text, deadline)
    local kind, code = R.prepare(text)
    assert.is_true(kind == "expr" or kind == "stmt", text .. ": " .. tostring(code))
    return R.execute(ctx, code, "=stdin", deadline)
  end
  before_each(function()
    ctx = { rank = 3, world = 4, capture = true }
    ctx.env = R.new_env(ctx)
  end)

  it("returns values, captured output and errors with their position", function()
    local r = run("print('a', 1) io.write('b', 2, '\\n') return 1, nil, 'x'")
    assert.are.equal("a\t1\nb2\n", r.out)
    assert.are.equal("1\tnil\tx", r.vals)
    r = run("error('boom')")
    assert.are.equal("stdin:1: boom", r.err)
    r = run("=error('in expr')")
    assert.are.equal("stdin:1: in expr", r.err)   -- no tail call: the position stays
    r = run("error({code = 7})")
    assert.are.equal("{code = 7}", r.err)
    assert.are.equal(3, run("rank").vals + 0)
    assert.are.equal("4", run("world_size").vals)
  end)

  it("runs statements ending in an expression and returns the expression's values", function()
    local r = run("v = {5, 6}; v[2] = v[2] + 1; v[2]")
    assert.are.equal("7", r.vals)
    r = run("local w = 3; w * 2, w")
    assert.are.equal("6\t3", r.vals)
    assert.are.equal("3", run("w").vals)                          -- the local persisted
    r = run("z = 1\nerror('late')\nz")
    assert.are.equal("stdin:2: late", r.err)                      -- positions stay
  end)

  it("keeps top-level locals and globals in its environment, not in _G", function()
    run("local kept = 41")
    run("local function inc(v) return v + 1 end")
    assert.are.equal("42", run("inc(kept)").vals)
    run("g_only = 1")
    assert.is_nil(rawget(_G, "g_only"))
    assert.is_nil(rawget(_G, "kept"))
    assert.are.equal("1", run("_G.g_only").vals)
  end)

  it("refuses os.exit in a chunk when several ranks share the session", function()
    local r = run("os.exit(3)")
    assert.truthy(r.err:find("os.exit would end this rank only", 1, true), r.err)
  end)

  it("interrupts runaway chunks at the deadline, even past pcall, in coroutines and tail calls", function()
    for _, c in ipairs { "while true do end",
                         "while true do pcall(function() for i = 1, 100 do end end) end",
                         "local co = coroutine.wrap(function() while true do end end) co()",
                         "local function g() return g() end return g()" } do
      local r = run(c, 150)
      assert.truthy(r.err and r.err:find("interrupted: still running after 150 ms", 1, true), c .. ": " .. tostring(r.err))
    end
    -- the hook is gone afterwards: a long but finite chunk completes
    assert.are.equal("5", run("for i = 1, 3e6 do end return 5", 10000).vals)
    local s = 0
    for i = 1, 1e6 do s = s + i end   -- plain code after the chunk is never interrupted
    assert.is_true(s > 0)
  end)

  it("cuts captured output at MAX_OUTPUT", function()
    local r = run(("for i = 1, %d do io.write('xxxxxxxxxx') end"):format(R.MAX_OUTPUT / 10 + 100))
    assert.are.equal(R.MAX_OUTPUT, #r.out)
    assert.is_true(r.cut)
    local lines = R.format_answer(r, "[rank 3] ")
    assert.truthy(lines[#lines]:find("output cut", 1, true))
  end)

  it("formats answers per rank", function()
    assert.are.same({ "[rank 1] hi", "[rank 1] 1\t2" }, R.format_answer({ out = "hi\n", vals = "1\t2" }, "[rank 1] "))
    assert.are.same({ "[rank 2] error: stdin:1: bad", "[rank 2]   more" },
                    R.format_answer({ out = "", err = "stdin:1: bad\nmore" }, "[rank 2] "))
    assert.are.same({ "[rank 1] (late) done" }, R.format_answer({ out = "" }, "[rank 1] ", "(late) "))
    assert.are.same({}, R.format_answer({ out = "" }, ""))
  end)
end)

describe("weft-run --repl through a pipe", function()
  after_each(function()
    local s = U.reap(10)
    assert.are.equal("", s, "rank processes left running")
  end)

  for _, channel in ipairs { "auto", "p2p" } do
    it(("runs every chunk on every rank and survives errors and runaways (%s channel)"):format(channel), function()
      local input = table.concat({
        ":timeout 1500",
        "weft.initialize_model_parallel{tp = 3}",
        "x = weft.tensor.full({2}, rank + 1, 'f32')",
        "weft.tp():all_reduce(x)",
        "if rank == 2 then error('bad ' .. rank) end",
        "if rank == 1 then while true do end end",
        "'alive ' .. rank",
        "y = weft.tensor.full({2}, rank + 1, 'f32'); weft.tp():all_reduce(y); 'last ' .. y:to_table()[1]",
        ":ranks",
        "for i = 1, 2 do",
        "  print('line', i, rank)",
        "end",
        ":quit",
      }, "\n") .. "\n"
      local r = U.pipe(("-n 3 --repl %s %s"):format(U.INIT, U.TOKEN), input, { WEFT_REPL_CHANNEL = channel }, 90)
      assert.are.equal(0, r.rc, r.out .. r.err)
      for k = 0, 2 do
        assert.truthy(r.out:find(("[rank %d] init %d %s"):format(k, k, U.TOKEN), 1, true), r.out)
        assert.truthy(r.out:find(("[rank %d] alive %d"):format(k, k), 1, true), r.out)
        assert.truthy(r.out:find(("[rank %d] line\t2\t%d"):format(k, k), 1, true), r.out)
      end
      -- a line ending in an expression prints its value, no continuation prompt
      assert.truthy(r.out:find("last 6", 1, true), r.out)
      assert.is_nil((r.out .. r.err):find("'=' expected", 1, true), r.out .. r.err)
      assert.truthy(r.out:find("[rank 2] error: stdin:1: bad 2", 1, true), r.out)
      -- equal answers print once for all ranks, differing ones per rank
      assert.truthy(r.out:find("[ranks 0-2] tensor(f32, {2}, cpu)[6, 6]", 1, true), r.out)
      assert.is_nil(r.out:find("[rank 0] tensor(", 1, true), r.out)
      assert.truthy(r.out:find("[rank 1] error: stdin:1: interrupted: still running after 1500 ms", 1, true), r.out)
      assert.is_nil(r.out:find("[rank 0] error", 1, true), r.out)
      -- one node: the shared-memory broadcaster carries the chunks unless told not to
      assert.truthy(r.out:find("channel " .. (channel == "auto" and "mq" or "p2p"), 1, true), r.out)
    end)
  end

  it("reports a rank stuck where no hook runs, goes on without it, and takes it back", function()
    local input = table.concat({
      ":timeout 500",
      "if rank == 1 then os.execute('sleep 4') end",   -- C code: the hook cannot fire
      "'next ' .. rank",
      ":ranks",
      "os.execute('sleep 3')",                         -- give rank 1 time to come back
      "'back ' .. rank",
      ":quit",
    }, "\n") .. "\n"
    local r = U.pipe(("-n 2 --repl %s %s"):format(U.INIT, U.TOKEN), input, nil, 90)
    assert.are.equal(0, r.rc, r.out .. r.err)
    assert.truthy(r.out:find("no answer from rank 1 within", 1, true), r.out)
    assert.truthy(r.out:find("[rank 1] (not run: still busy with chunk 2)", 1, true), r.out)
    assert.truthy(r.out:find("[rank 0] next 0", 1, true), r.out)
    assert.truthy(r.out:find("rank 1  pid %d+  %S+  not answering: busy with chunk 2"), r.out)
    assert.truthy(r.out:find("[rank 1] (late answer to chunk 2", 1, true), r.out)
    assert.truthy(r.out:find("[rank 1] back 1", 1, true), r.out)
  end)

  it(":timeout ends a collective blocked in C on every rank; the group names weft.recover(), which works", function()
    local input = table.concat({
      ":timeout 1500",
      "w = weft.init(); x = weft.tensor.full({4}, 1, 'f32'); w:all_reduce(x); return 'sum ' .. x:to_table()[1]",
      "side = weft.create_custom_group({0, 1}, 'side')",
      -- calls no agreement can pair (a barrier against an all_reduce, or a
      -- recv against a collective of its own group, fail at once): rank 0
      -- waits in the world's shm all-reduce, rank 1 in a recv on another group
      "if rank == 0 then w:all_reduce(x) else side:recv(x, 0) end",
      "w:barrier()",
      "w = weft.recover(); x = weft.tensor.full({4}, rank + 1, 'f32'); w:all_reduce(x); return 'again ' .. x:to_table()[1]",
      ":quit",
    }, "\n") .. "\n"
    local r = U.pipe(("-n 2 --repl %s %s"):format(U.INIT, U.TOKEN), input, { WEFT_TIMEOUT_MS = "30000" }, 90)
    assert.are.equal(0, r.rc, r.out .. r.err)
    assert.truthy(both_said(r.out, "sum 2"), r.out)
    assert.truthy(both_said(r.out, "again 3"), r.out)
    for k = 0, 1 do
      assert.truthy(rank_said(r.out, k, "error: [^\n]*interrupted"), r.out)
      assert.truthy(rank_said(r.out, k, "error: [^\n]*cannot be used any more[^\n]*weft%.recover%(%)"), r.out)
    end
    assert.is_nil(r.out:find("No such file", 1, true), r.out)
    assert.is_nil(r.out:find("no answer from rank", 1, true), r.out)
  end)

  it("ends with a clear message and exit code 1 when a stuck rank cannot be recovered", function()
    local input = ":timeout 300\nif rank == 1 then os.execute('sleep 60') end\n:quit\n"
    local t0 = U.now()
    local r = U.pipe(("-n 2 --repl %s %s"):format(U.INIT, U.TOKEN), input, nil, 60)
    assert.are.equal(1, r.rc, r.out .. r.err)
    assert.truthy(r.out:find("rank 1 did not answer :quit (busy with chunk 2", 1, true), r.out)
    assert.truthy(r.err:find("rank 0 exited with code 1", 1, true), r.err)
    assert.is_true(U.now() - t0 < 40)
  end)

  it("rejects -- command, a missing script and several nodes without a port", function()
    local r = U.pipe("--repl -- true", "", nil, 20)
    assert.are.equal(2, r.rc)
    assert.truthy(r.err:find("--repl runs Lua chunks", 1, true), r.err)
    r = U.pipe("--repl /nonexistent/x.lua", "", nil, 20)
    assert.are.equal(2, r.rc)
    assert.truthy(r.err:find("cannot open script", 1, true), r.err)
    r = U.pipe("-n 2 --repl --nnodes 2", "", nil, 20)
    assert.are.equal(2, r.rc)
    assert.truthy(r.err:find("--master-port is required", 1, true), r.err)
    r = U.pipe("--help", "", nil, 20)
    assert.truthy(r.out:find("--repl", 1, true), r.out)
  end)
end)

describe("REPL sessions in a pseudo-terminal (tmux)", function()
  local sess, dir
  before_each(function()
    if not has_tmux() then return end
    dir = U.tmpdir()
  end)
  after_each(function()
    if sess then sess:kill(); sess = nil end
    U.rmdir(dir)
    local s = U.reap(10)
    assert.are.equal("", s, "processes left running")
  end)
  teardown(function() if has_tmux() then U.kill_server() end end)

  -- after: shell text run in the pane right after weft-run (it must end with
  -- weft-run's status, which the pane prints as REPL-EXIT)
  local function start(n, extra_env, after)
    local env = { WEFT_REPL_HISTORY = dir .. "/history", WEFT_TIMEOUT_MS = "20000" }
    for k, v in pairs(extra_env or {}) do env[k] = v end
    sess = U.start(("scripts/weft-run -n %d --repl %s %s%s"):format(n, U.INIT, U.TOKEN, after or ""), env)
    local pats = {}
    for k = 0, n - 1 do pats[#pats + 1] = ("%%[rank %d%%] init %d"):format(k, k) end
    pats[#pats + 1] = "\n>$"
    local scr, last = sess:wait(pats, 60)
    assert.truthy(scr, "session did not start:\n" .. tostring(last))
    return scr
  end
  local function expect(pats, timeout)
    local scr, last = sess:wait(pats, timeout or 30)
    assert.truthy(scr, "expected " .. table.concat(type(pats) == "table" and pats or { pats }, " & ")
                  .. " on the screen:\n" .. tostring(last))
    return scr
  end

  it("2 ranks: groups, an all-reduce, errors, a multi-line chunk, a runaway rank, Ctrl-D", function()
    if not has_tmux() then pending("tmux not installed"); return end
    local scr = start(2)
    assert.truthy(scr:find("weft REPL (LuaJIT) - 2 ranks", 1, true), scr)
    sess:type("weft.initialize_model_parallel{tp = 2}; tp = weft.tp()")
    sess:type("=tp.world_size, tp.rank_in_group")
    expect("%[rank 1%] 2%s+1")
    sess:type("x = weft.tensor.from_table({rank + 1, 10 * (rank + 1)}, 'f32')")
    sess:type("tp:all_reduce(x); return x:to_table()[1], x:to_table()[2]")
    expect("%[ranks 0,1%] 3%s+30")
    sess:type("if rank == 1 then error('only rank ' .. rank) end; return 'fine ' .. rank")
    expect { "%[rank 1%] error: stdin:1: only rank 1", "%[rank 0%] fine 0" }
    sess:type("y = 0")
    sess:type("for i = 1, 3 do")
    expect("\n>>$")
    sess:type("  y = y + i * (rank + 1)")
    sess:type("end")
    sess:type("=y")
    expect { "%[rank 0%] 6\n", "%[rank 1%] 12\n" }
    sess:type(":timeout 1000")
    expect("timeout 1000 ms")
    sess:type("if rank == 1 then while true do end end; return 'r0 done'")
    expect { "%[rank 0%] r0 done", "%[rank 1%] error: stdin:1: interrupted: still running after 1000 ms" }
    sess:type("'after ' .. rank .. ' ' .. started")
    expect { "%[rank 0%] after 0 started 0/2", "%[rank 1%] after 1 started 1/2" }
    sess:key("C-d")
    local code, last = sess:exit_code(30)
    assert.are.equal(0, code, last)
  end)

  it("4 ranks: tp=2 pairs, :ranks selection, a stuck rank reported and back, :quit", function()
    if not has_tmux() then pending("tmux not installed"); return end
    start(4)
    sess:type("weft.initialize_model_parallel{tp = 2, pp = 2}; return weft.tp().ranks")
    expect { "%[ranks 0,1%] {0, 1}", "%[ranks 2,3%] {2, 3}" }
    sess:type("x = weft.tensor.full({3}, rank + 1, 'f32'); weft.tp():all_reduce(x); return 'sum ' .. x:to_table()[3]")
    expect { "%[ranks 0,1%] sum 3", "%[ranks 2,3%] sum 7" }
    sess:type(":ranks 1-2")
    expect("chunks go to ranks 1,2")
    sess:type("'sel ' .. rank")
    expect { "%[rank 1%] sel 1", "%[rank 2%] sel 2" }
    assert.are.equal(0, sess:count("%[rank 0%] sel") + sess:count("%[rank 3%] sel"))
    sess:type(":ranks all")
    sess:type(":timeout 500")
    expect("timeout 500 ms")
    sess:type("if rank == 3 then os.execute('sleep 3') end; return 'st ' .. rank")
    expect("no answer from rank 3 within")
    sess:type("'without ' .. rank")
    expect { "%[rank 3%] %(not run: still busy with chunk %d+%)", "%[rank 2%] without 2" }
    sess:type(":ranks")
    expect("rank 3  pid %d+  %S+  not answering")
    -- once rank 3 is back, its late answer is shown and it runs chunks again
    local deadline = U.now() + 30
    repeat
      U.sleep(1)
      sess:type("'again ' .. rank")
    until sess:screen():find("%[rank 3%] again 3") or U.now() > deadline
    expect { "%[rank 3%] %(late answer to chunk %d+, after [%d.]+ s%) st 3", "%[rank 3%] again 3" }
    sess:type(":quit")
    local code, last = sess:exit_code(30)
    assert.are.equal(0, code, last)
  end)

  it("Ctrl-C clears the line at the prompt and interrupts a running chunk on every rank", function()
    if not has_tmux() then pending("tmux not installed"); return end
    start(2)
    sess:type("while true do end")
    U.sleep(1)
    sess:key("C-c")
    expect("%[ranks 0,1%] error: stdin:1: interrupted %(Ctrl%-C%)")
    sess:type("if rank == 1 then while true do end end")
    U.sleep(1)
    sess:key("C-c")
    local ok, last = sess:wait_count("interrupting rank 1", 2)
    assert.truthy(ok, last)
    ok, last = sess:wait_count("%[rank 1%] error: stdin:1: interrupted %(Ctrl%-C%)", 1)
    assert.truthy(ok, last)
    expect("\n>$")
    sess:type("half typed", false)
    expect("> half typed$")   -- read by readline (the terminal drops unread input on ^C)
    sess:key("C-c")
    expect("> half typed%^C")
    sess:type("'clean ' .. rank")
    expect { "%[rank 0%] clean 0", "%[rank 1%] clean 1" }
    assert.are.equal(0, sess:count("half typed'clean"))
    sess:type(":quit")
    local code, last = sess:exit_code(30)
    assert.are.equal(0, code, last)
  end)

  it("SIGINT sent to weft-run is Ctrl-C (the session goes on); SIGTERM stops every rank", function()
    if not has_tmux() then pending("tmux not installed"); return end
    local P = require("helpers.procs")
    start(2)
    local function launcher_pid()
      local l = P.pgrep("^luajit scripts/weft[-]run -n 2 --repl .*" .. U.TOKEN)
      return assert(tonumber(l:match("^(%d+)")), "no weft-run process: " .. l)
    end
    local pid = launcher_pid()
    sess:type("while true do end")
    U.sleep(1)
    os.execute("kill -INT " .. pid)                 -- as a job runner would
    expect("%[ranks 0,1%] error: stdin:1: interrupted %(Ctrl%-C%)")
    os.execute("kill -INT " .. pid)                 -- at the prompt: clears the line
    U.sleep(0.5)
    sess:type("'after ' .. rank")
    expect { "%[rank 0%] after 0", "%[rank 1%] after 1" }
    assert.are.equal(0, sess:count("did not stop"))
    sess:type("while true do end")
    U.sleep(1)
    os.execute("kill -TERM " .. pid)
    local code, last = sess:exit_code(30)
    assert.are.equal(143, code, last)
    assert.truthy(last:find("received SIGTERM: stopped all 2 ranks", 1, true), last)
    assert.is_nil(last:find("SIGKILL", 1, true), last)
  end)

  it("with its input on a pipe too: SIGINT to weft-run is Ctrl-C, SIGTERM stops every rank (143, no SIGKILL)", function()
    local d = U.tmpdir()
    -- a FIFO kept open by the driver; each step waits (bounded) for the last one's mark
    local script = table.concat({
      "set -u; cd " .. U.q(U.ROOT),
      "mkfifo " .. d .. "/in",
      ("(timeout -k 5 60 scripts/weft-run -n 2 --repl %s %s <%s/in >%s/out 2>%s/err; echo $? >%s/rc) &")
        :format(U.INIT, U.TOKEN, d, d, d, d),
      "exec 7>" .. d .. "/in",
      "upto() { for i in $(seq 300); do grep -q \"$1\" " .. d .. "/out 2>/dev/null && return 0; sleep 0.1; done; return 1; }",
      "pid() { pgrep -f '^luajit scripts/weft[-]run -n 2 --repl .*" .. U.TOKEN .. "' | head -1; }",
      "upto 'init 1'",
      "echo 'while true do end' >&7; sleep 1",
      "kill -INT $(pid); upto 'interrupted (Ctrl-C)'",
      "kill -INT $(pid); sleep 0.5",                 -- at the prompt: clears the line
      "echo \"'after ' .. rank\" >&7; upto 'after 1'",
      "kill -TERM $(pid)",
      "for i in $(seq 300); do [ -s " .. d .. "/rc ] && break; sleep 0.1; done",
      "exec 7>&-",
    }, "\n")
    U.spit(d .. "/drive.sh", script .. "\n")
    os.execute("bash " .. d .. "/drive.sh")
    local out, err = U.slurp(d .. "/out") or "", U.slurp(d .. "/err") or ""
    local rc = tonumber(U.slurp(d .. "/rc") or "")
    U.rmdir(d)
    assert.truthy(out:find("[ranks 0,1] error: stdin:1: interrupted (Ctrl-C)", 1, true), out .. err)
    assert.truthy(out:find("[rank 0] after 0", 1, true) and out:find("[rank 1] after 1", 1, true), out .. err)
    assert.are.equal(143, rc, out .. err)
    assert.truthy(err:find("received SIGTERM: stopped all 2 ranks", 1, true), out .. err)
    assert.is_nil((out .. err):find("SIGKILL", 1, true), out .. err)
    assert.is_nil((out .. err):find("did not stop", 1, true), out .. err)
    assert.are.equal("", U.reap(10))
  end)

  it("SIGTERM sent to weft-run at the prompt: every rank stops at once, 143, the terminal given back as it was", function()
    if not has_tmux() then pending("tmux not installed"); return end
    local P = require("helpers.procs")
    -- the terminal's modes right after weft-run ends, before any shell resets them
    start(2, nil, [[; s=$?; echo "TTY-MODES $(stty -a | tr ' ;' '\n\n' | grep -x -- '-\?echo\|-\?icanon' | sort | tr '\n' ' ')"; (exit $s)]])
    local l = P.pgrep("^luajit scripts/weft[-]run -n 2 --repl .*" .. U.TOKEN)
    local pid = assert(tonumber(l:match("^(%d+)")), "no weft-run process: " .. l)
    sess:type("half typed", false)
    expect("> half typed$")
    local t0 = U.now()
    os.execute("kill -TERM " .. pid)
    local code, last = sess:exit_code(30)
    assert.are.equal(143, code, last)
    assert.is_true(U.now() - t0 < 4, "took " .. (U.now() - t0) .. " s")
    -- the report on a line of its own, not after the half-typed input
    assert.truthy(last:find("\nweft-run: received SIGTERM: stopped all 2 ranks\n", 1, true), last)
    assert.is_nil(last:find("SIGKILL", 1, true), last)
    assert.is_nil(last:find("did not stop", 1, true), last)
    -- readline had the terminal in raw mode: weft-run restores what it found
    assert.truthy(last:find("TTY-MODES echo icanon", 1, true), last)
  end)

  it("Ctrl-C aborts collectives blocked in C on every rank; weft.recover() rebuilds the groups", function()
    if not has_tmux() then pending("tmux not installed"); return end
    start(2)   -- WEFT_TIMEOUT_MS 20000: an answer within seconds is the interrupt, not the timeout
    sess:type("w = weft.init(); x = weft.tensor.full({4}, 1, 'f32'); w:all_reduce(x); return 'sum ' .. x:to_table()[1]")
    assert.truthy(both_said(expect("%] sum 2"), "sum 2"))
    -- calls no agreement can pair: rank 0 waits in the world's shm all-reduce, rank 1 in a
    -- recv on another group (a recv against a collective of its own group fails at once)
    sess:type("side = weft.create_custom_group({0, 1}, 'side')")
    sess:type("if rank == 0 then w:all_reduce(x) else side:recv(x, 0) end")
    U.sleep(1)
    local t0 = U.now()
    sess:key("C-c")
    expect { "%[rank 0%] error: [^\n]*interrupted", "%[rank 1%] error: [^\n]*interrupted" }
    assert.is_true(U.now() - t0 < 10, "interrupt took " .. (U.now() - t0) .. " s")
    -- the group refuses work and says how to recover ...
    sess:type("w:barrier()")
    expect { "%[rank 0%] error: [^\n]*weft%.recover%(%)", "%[rank 1%] error: [^\n]*weft%.recover%(%)" }
    -- ... and one call on every rank recovers
    sess:type("w = weft.recover(); x = weft.tensor.full({4}, rank + 1, 'f32'); w:all_reduce(x); return 'again ' .. x:to_table()[1]")
    assert.truthy(both_said(expect("%] again 3"), "again 3"))
    assert.are.equal(0, sess:count("No such file"))
    sess:type(":quit")
    local code, last = sess:exit_code(30)
    assert.are.equal(0, code, last)
  end)

  it("weft-repl alone: prompt, history file, completion, values, meta-commands", function()
    if not has_tmux() then pending("tmux not installed"); return end
    local hist = dir .. "/history"
    sess = U.start("scripts/weft-repl " .. U.INIT .. " " .. U.TOKEN, { WEFT_REPL_HISTORY = hist })
    expect { "weft REPL %(LuaJIT%) %- one process", "init 0 " .. U.TOKEN, "\n>$" }
    sess:type("wef", false)
    sess:key("Tab")
    expect("> weft$")
    sess:type(".tp_si", false)
    sess:key("Tab")
    expect("> weft%.tp_size$")
    sess:key("C-c")
    sess:type("local t = {1, 'two', k = {true}}")
    sess:type("t")
    expect('{1, "two", k = {true}}')
    sess:type("=pair_sum(41)")
    expect("\n42\n")
    sess:type(":help")
    expect(":ranks 0,2 | 1%-3")
    sess:type(":timeout 300")
    sess:type("while true do end")
    expect("error: stdin:1: interrupted: still running after 300 ms")
    sess:type(":bogus")
    expect("unknown command ':bogus'")
    sess:type(":quit")
    local code, last = sess:exit_code(20)
    assert.are.equal(0, code, last)
    local h = U.slurp(hist) or ""
    assert.truthy(h:find("local t = {1, 'two', k = {true}}", 1, true), h)
  end)

  it("plain input without readline: prompts, continuation, Ctrl-C, Ctrl-D", function()
    if not has_tmux() then pending("tmux not installed"); return end
    sess = U.start("scripts/weft-repl " .. U.INIT .. " " .. U.TOKEN, { WEFT_REPL_READLINE = "0" })
    expect { "no readline: plain input", "\n>$" }
    sess:type("for i = 1, 2 do")
    expect("\n>>$")
    sess:type("print('p' .. i)")
    sess:type("end")
    expect { "\np1\np2\n>$" }
    sess:type("dropped", false)
    expect("> dropped$")
    sess:key("C-c")
    expect("> dropped%^C\n>$")
    sess:type("=started")
    expect("\nstarted 0/1\n>$")
    sess:key("C-d")
    local code, last = sess:exit_code(20)
    assert.are.equal(0, code, last)
  end)
end)
