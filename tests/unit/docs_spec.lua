-- The docs a newcomer reads (issue 39 item 2): a README of at most 150 lines
-- (the two commands, a script, install, tools, where to read on) with no
-- benchmark tables; the figures in docs/performance.md, each from a results
-- file that exists; docs/*.md the reference of what they name, the history of
-- how a figure was reached beside the results (bench/results/*-notes-*.md);
-- every link between them resolves. The README's commands and the guide's
-- snippets are run by tests/unit/readme_commands_spec.lua and tests/unit/guide_spec.lua.
local ROOT = os.getenv("PWD") or "."

local function read(path)
  local f = io.open(ROOT .. "/" .. path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local function exists(path)   -- a file or a folder
  local f = io.open(ROOT .. "/" .. path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function lines(s)
  local n = 0
  for _ in s:gmatch("[^\n]*\n") do n = n + 1 end
  return n
end

describe("the docs", function()
  it("README: at most 150 lines, no benchmark tables, and it points at the figures", function()
    local s = assert(read("README.md"))
    assert.is_true(lines(s) <= 150, ("README.md has %d lines"):format(lines(s)))
    for l in s:gmatch("[^\n]+") do
      assert.is_nil(l:match("^|.*%d µs") or l:match("^|.*| %d+%.%d+x? |"), "a table of figures in README.md: " .. l)
    end
    assert.truthy(s:find("(docs/performance.md)", 1, true), "README.md does not link docs/performance.md")
    for _, h in ipairs { "## Two commands", "## A script", "## Install", "## Tools", "## Where to read on" } do
      assert.truthy(s:find("\n" .. h, 1, true), "README.md has no " .. h)
    end
  end)

  it("docs/performance.md: every results file it names exists, with the machine, date and commit of each table", function()
    local s = assert(read("docs/performance.md"), "no docs/performance.md")
    local named = 0
    for path in s:gmatch("bench/results/([%w%-_.]+%.md)") do
      assert.is_true(exists("bench/results/" .. path), "docs/performance.md names a missing bench/results/" .. path)
      named = named + 1
    end
    assert.is_true(named >= 8, "only " .. named .. " results files named")
    -- each section with a table names its machine, date and commit
    local sections = 0
    for section in (s:gsub("\n## ", "\0")):gmatch("%z([^%z]*)") do
      if section:find("\n|---", 1, true) then
        sections = sections + 1
        assert.matches("20%d%d%-%d%d%-%d%d", section, nil, false)
        assert.truthy(section:find("commit", 1, true), "no commit in: " .. section:sub(1, 60))
        assert.truthy(section:find("`[%w%-]+%-[%dx]+cpu`") or section:find("nvidia%-h200") or section:find("vm%-2cpu"),
                      "no machine in: " .. section:sub(1, 60))
      end
    end
    assert.is_true(sections >= 3, sections .. " sections with tables")
  end)

  it("docs/fusion.md is the reference: the history of its figures lives beside the results", function()
    local s = assert(read("docs/fusion.md"))
    for _, history in ipairs { "All 23 failures", "device run %d", "session %d", "The first GPU run",
                               "Tried and not kept", "logs/fusion%-sweep" } do
      assert.is_nil(s:find(history), "docs/fusion.md still tells how a figure was reached: " .. history)
    end
    for _, notes in ipairs { "bench/results/fusion-notes-nvidia-h200-x2-2026-11-30.md",
                             "bench/results/fusion-ext-notes-nvidia-h200-2026-12-03.md" } do
      assert.truthy(s:find(notes, 1, true), "docs/fusion.md does not point at " .. notes)
      local n = assert(read(notes), "missing " .. notes)
      assert.truthy(n:find("docs/fusion.md", 1, true), notes .. " does not say what it belongs to")
    end
    assert.truthy(read("bench/results/fusion-notes-nvidia-h200-x2-2026-11-30.md"):find("All 23 failures of the first run", 1, true))
  end)

  it("every relative link of README.md, docs/*.md and bench/results/*-notes-*.md resolves", function()
    local files = { "README.md" }
    local p = io.popen("cd " .. ROOT .. " && ls docs/*.md bench/results/*-notes-*.md")
    for f in p:lines() do files[#files + 1] = f end
    p:close()
    for _, f in ipairs(files) do
      local dir = f:match("^(.*)/[^/]*$") or "."
      for target in assert(read(f)):gmatch("%]%(([^)%s]+)%)") do
        if not target:match("^%a+:") and not target:match("^#") then
          local path = target:gsub("#.*$", "")
          local full = dir == "." and path or (dir .. "/" .. path)
          -- collapse "docs/../x"
          repeat local n; full, n = full:gsub("[^/]+/%.%./", "") until n == 0
          assert.is_true(exists(full), ("%s links to %s, which is not there"):format(f, target))
        end
      end
    end
  end)
end)
