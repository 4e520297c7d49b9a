-- The README's commands work as written (issue 15 item 1: `scripts/serve/start
-- -n 2` failed at once, and no test ran it without --port). Every command the
-- README shows (the rule is in tests/helpers/doc_commands.lua: shell lines of
-- code blocks and table cells' code spans starting with `scripts/` or `make `, and
-- a ```lua block whose first comment line names the command that runs it) is
-- run verbatim from the repository root with a time limit and must exit 0 —
-- unless SKIP below says why not (GPU, long benchmark, interactive, root,
-- `make test` itself). A command the README gains is run by default: add it
-- to SKIP (with the reason) only if it cannot run here. Templates ("-n N",
-- "[--json | --svg FILE]") are skipped as such.
local ROOT = os.getenv("PWD") or "."
local S = require("helpers.spec_util")
local doc = require("helpers.doc_commands")
local checked = require("helpers.checked_shell")
local http = require("helpers.serve_http")
local server = require("helpers.serve_server") -- declares kill and poll
local ffi = require("ffi")

-- { Lua pattern on the command, reason }: first match wins
local SKIP = {
  { "^make test$", "the suite itself (this spec is part of it)" },
  { "^make gpu%-test", "needs a GPU (the lead's device runs)" },
  { "^scripts/weft%-tune", "needs a GPU (measures NCCL and weft's kernels)" },
  { "^scripts/gpu%-", "needs a GPU" },
  { "^scripts/bench$", "GPU benchmark" },
  { "^scripts/bench%-", "benchmark: minutes on a busy machine (results under bench/results/)" },
  { "^scripts/fetch%-gpu%-deps", "downloads packages for a GPU machine" },
  { "^scripts/weft%-repl", "interactive (tests/unit/repl_spec.lua drives it through tmux)" },
  { "%-%-repl", "interactive (tests/unit/repl_spec.lua drives it through tmux)" },
  { "^make serve%-deps", "installs packages (root)" },
  { "^scripts/weft%-sim%-nodes", "needs root and network namespaces (tests/unit/nodes_spec.lua runs it)" },
  { "^make install", "installs outside the tree (covered by its own test)" },
  { "^make uninstall", "removes an installation" },
}

-- { Lua pattern on the command, check of what it printed }: what the README
-- promises a command prints, beyond exiting 0
local EXPECT = {
  { "^scripts/weft%-run %-n 4 my_experiment%.lua$", function(out)
    -- the first script: the reduced value and the explanation, once, from rank 0
    local _, values = out:gsub("\n?%[rank0%] tp ranks {0,1} summed 1 %+ 2: x%[1%] = 3\n", "")
    assert.are.equal(1, values, "the reduced value, once from rank 0:\n" .. out)
    local _, explained = out:gsub("all_reduce bf16 {8,4096} %(64 KiB, cpu%) on tp%.0", "")
    assert.are.equal(1, explained, "the explanation, once:\n" .. out)
    assert.is_nil(out:find("%[ranks? ?[1-9]"), "other ranks print nothing:\n" .. out)
  end },
}

local TIMEOUT_S = { ["make demo"] = 300 }   -- may build the library first
local DEFAULT_TIMEOUT_S = 120

local function skip_reason(cmd)
  for _, s in ipairs(SKIP) do
    if cmd:find(s[1]) then return s[2] end
  end
  return doc.placeholder(cmd)
end

local function tmpdir()
  return S.shell("mktemp -d /tmp/weft-readme.XXXXXX"):match("^(%S+)")
end

local alive = server.alive

-- a server command (scripts/serve/start): started in its own session, must
-- print its address and answer /health with status ok, then stops on SIGTERM
local function run_server(cmd, timeout_s)
  -- nginx is optional: without it the command is skipped, saying why (under CI=true it fails)
  if not S.needs(server.have_nginx(), server.no_nginx()) then return end
  local dir = tmpdir()
  local log = dir .. "/log"
  local pid = tonumber(S.shell(("cd %s && setsid %s > %s 2>&1 < /dev/null & echo $!"):format(ROOT, cmd, log)):match("^(%d+)"))
  local function stop()
    ffi.C.kill(-pid, 15)
    local deadline = http.now_ms() + 15000
    while alive(pid) and http.now_ms() < deadline do ffi.C.poll(nil, 0, 50) end
    local stuck = alive(pid)
    if stuck then ffi.C.kill(-pid, 9) end
    local f = io.open(log); local out = f and f:read("*a") or ""; if f then f:close() end
    S.shell("rm -rf " .. dir)
    return out, stuck
  end
  local deadline = http.now_ms() + timeout_s * 1000
  local port
  while not port and http.now_ms() < deadline and alive(pid) do
    local f = io.open(log)
    if f then port = tonumber((f:read("*a") or ""):match("http://[%d.]+:(%d+)/")); f:close() end
    if not port then ffi.C.poll(nil, 0, 50) end
  end
  local up, st, body = false, nil, nil
  if port then
    up, st, body = http.wait_up(port, "/health", math.max(1000, deadline - http.now_ms()),
                                function(s, b) return s == 200 and b:find('"status":"ok"', 1, true) end)
  end
  local out, stuck = stop()
  assert.truthy(port, "it never printed its address:\n" .. out)
  assert.is_true(up, ("/health did not answer ok (last: %s %s):\n%s"):format(tostring(st), tostring(body), out))
  assert.is_false(stuck, "it did not stop within 15 s of SIGTERM:\n" .. out)
end

local function run_command(c)
  local timeout_s = TIMEOUT_S[c.cmd] or DEFAULT_TIMEOUT_S
  if c.cmd:find("^scripts/serve/start") then return run_server(c.cmd, timeout_s) end
  local dir, cwd = nil, ROOT
  if c.kind == "script" then
    -- the block is the file; it runs beside it, with scripts/ as in the repository
    dir = tmpdir()
    cwd = dir
    S.shell(("ln -s %s/scripts %s/scripts"):format(ROOT, dir))
    local f = assert(io.open(dir .. "/" .. c.file, "w"))
    f:write(c.text)
    f:close()
  end
  -- under bash with every statement's status checked: a failing command
  -- before `&&` or inside a pipeline fails the line (tests/helpers/checked_shell.lua)
  local sh = os.tmpname()
  local f = assert(io.open(sh, "w"))
  f:write(checked.script(c.cmd, function() return "README line " .. c.line end))
  f:close()
  local out, rc = S.shell(("cd %s && timeout -k 5 %d setsid bash %s < /dev/null"):format(cwd, timeout_s, sh))
  os.remove(sh)
  if dir then S.shell("rm -rf " .. dir) end
  assert.are.equal(0, rc, ("README line %d: `%s` failed (status %s%s):\n%s"):format(
    c.line, c.cmd, tostring(rc), rc == 124 and ", timed out after " .. timeout_s .. " s" or "", out))
  for _, e in ipairs(EXPECT) do
    if c.cmd:find(e[1]) then e[2](out) end
  end
end

describe("README commands, run as written", function()
  local cmds = doc.extract_file(ROOT .. "/README.md")

  it("finds the README's commands (the extraction rule still matches the page)", function()
    local have = {}
    for _, c in ipairs(cmds) do have[c.cmd] = true end
    assert.is_true(#cmds >= 3, ("only %d commands found"):format(#cmds))
    assert.truthy(have["make demo"], "no `make demo` found")
  end)

  for _, c in ipairs(cmds) do
    local why = skip_reason(c.cmd)
    it(("line %d: %s"):format(c.line, c.cmd), function()
      if why then pending(why) return end
      run_command(c)
    end)
  end
end)

describe("a documented command fails when any of its commands fails (tests/helpers/checked_shell.lua)", function()
  local function run(code)
    local sh = os.tmpname()
    local f = assert(io.open(sh, "w"))
    f:write(checked.script(code, function(l) return "doc:" .. l end))
    f:close()
    local out, rc = S.shell("bash " .. sh .. " < /dev/null")
    os.remove(sh)
    return out, rc
  end

  it("checks each statement: before &&, inside a pipeline, in a loop, after a here-document", function()
    for _, bad in ipairs({
      "false && echo valid\necho after",
      "scripts/weft-topo --dry-run --world 16 --tp 8 --ep 4 > /dev/null && echo valid",
      "false | cat\necho after",
      "for i in 1 2; do\n  false && echo $i\ndone\necho after",
      "cat > /dev/null <<'EOF'\nfalse && x\nEOF\ntrue && false && echo no\necho after",
    }) do
      local out, rc = run(bad)
      assert.are_not.equal(0, rc, bad .. " passed:\n" .. out)
      assert.is_nil(out:find("after", 1, true), bad .. ": went on after the failure:\n" .. out)
    end
    local out, rc = run("false && echo valid")
    assert.matches("doc:1: `false && echo valid`: exited with status 1", out, 1, true)
    assert.are.equal(1, rc)
  end)

  it("passes what succeeds: || fallbacks, if conditions, loops, here-documents", function()
    local out, rc = run(table.concat({
      "cat > /dev/null <<'EOF'", "false", "EOF",
      "if false; then echo no; fi",
      "false || true",
      "for i in 1 2 3; do test $i = 2 && break; done",
      "x=$(echo 4) && test \"$x\" = 4",
      "# a comment", "", "echo done \\", "  here",
    }, "\n"))
    assert.are.equal(0, rc, out)
    assert.matches("done here", out, 1, true)
  end)
end)

describe("the docs stand on their own", function()
  it("no README, doc, module, script or source cites a file outside the repository", function()
    -- figures live in docs/reference-measurements.md and bench/results/ with
    -- their provenance; the SGLang code compared with is named by its own path
    local out = S.shell(("cd %s && grep -rnE 'DESIGN\\.md|\\.\\./shared|seeds/' README.md docs lua scripts src"):format(ROOT))
    assert.are.equal("rc=1\n", out, "references outside the repository:\n" .. out)
  end)
end)

describe("the extraction rule (tests/helpers/doc_commands.lua)", function()
  it("takes shell lines of code blocks, table rows' command spans and lua blocks that name their command", function()
    local page = table.concat({
      "# t", "", "    make demo    # the main job", "    make test", "",
      "```sh", "$ scripts/serve/start -n 2", "curl -s localhost/health", "```", "",
      "```lua", "-- scripts/weft-run -n 2 a.lua", "print(1)", "```", "",
      "```lua", "print('no command')", "```", "",
      "| `scripts/weft-topo --world 8 [--json \\| --svg FILE]` | `scripts/` | `ls` |",
      "| `make lib` | `make demo` (listed once) |",
      "Prose mentions such as `scripts/weft-run -n 4` are not run.",
    }, "\n")
    local got = {}
    for _, c in ipairs(doc.extract(page)) do got[#got + 1] = c.kind .. ":" .. c.cmd end
    assert.are.same({
      "block:make demo", "block:make test", "block:scripts/serve/start -n 2",
      "script:scripts/weft-run -n 2 a.lua",
      "span:scripts/weft-topo --world 8 [--json | --svg FILE]", "span:make lib",
    }, got)
    assert.truthy(doc.placeholder("scripts/weft-run -n N x.lua"))
    assert.truthy(doc.placeholder("scripts/weft-topo [--json]"))
    assert.is_nil(doc.placeholder("make demo V=1"))
  end)
end)
