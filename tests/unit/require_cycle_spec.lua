-- Every module under lua/weft loads on its own (issue 38): each is required
-- first in a fresh process (tests/helpers/require_probe.lua) against the
-- host-only library, and must load without "loop or previous error loading
-- module". A module that needs a GPU or nginx to load would be pending with
-- the reason instead (none does today). Besides, the spec prints the require
-- loops it finds, not failing on them: those met while loading (caught by a
-- pcall or not), and those of the source's requires, lazy ones included
-- (`require("weft.x")`, `pcall(require, "weft.x")`, `mod("weft.x")` anywhere
-- in a module), which load only because one side waits until it is called.
local ROOT = os.getenv("PWD") or "."

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- {module name = path} of every .lua under lua/weft; the sorted names
local function modules()
  local list, path = {}, {}
  local p = io.popen("cd " .. q(ROOT .. "/lua") .. " && find weft -name '*.lua' | sort")
  for f in p:lines() do
    local m = f:gsub("%.lua$", ""):gsub("/", "."):gsub("%.init$", "")
    list[#list + 1] = m
    path[m] = "lua/" .. f
  end
  p:close()
  return list, path
end

-- what needs a machine this host may not be: a GPU, nginx
local NEEDS = {
  { "libcuda", "a GPU (the CUDA driver)" }, { "libcudart", "a GPU (the CUDA runtime)" },
  { "libnccl", "a GPU (NCCL)" }, { "no CUDA device", "a GPU" },
  { "ngx", "nginx (OpenResty)" }, { "resty", "nginx (OpenResty)" },
}
local function needs(err)
  for _, n in ipairs(NEEDS) do
    if err:find(n[1], 1, true) then return n[2] end
  end
end

-- the source's require graph: {module = {required module = true}}
local PATTERNS = {
  "require%s*%(?%s*[\"'](weft[%w_.]*)[\"']",
  "pcall%(%s*require%s*,%s*[\"'](weft[%w_.]*)[\"']",
  "mod%(%s*[\"'](weft[%w_.]*)[\"']",
}
local function source_graph(list, path)
  local is, adj = {}, {}
  for _, m in ipairs(list) do is[m] = true end
  for _, m in ipairs(list) do
    adj[m] = {}
    local code = {}   -- without comments: they name modules too
    for l in io.lines(ROOT .. "/" .. path[m]) do code[#code + 1] = (l:gsub("%-%-.*", "")) end
    local s = table.concat(code, "\n")
    for _, pat in ipairs(PATTERNS) do
      for name in s:gmatch(pat) do
        if is[name] and name ~= m then adj[m][name] = true end
      end
    end
  end
  return adj
end

-- the strongly connected components of more than one module (Tarjan), sorted
local function loops(list, adj)
  local index, low, on, stack, n, out = {}, {}, {}, {}, 0, {}
  local function visit(v)
    n = n + 1; index[v], low[v] = n, n
    stack[#stack + 1] = v; on[v] = true
    local ws = {}
    for w in pairs(adj[v]) do ws[#ws + 1] = w end
    table.sort(ws)
    for _, w in ipairs(ws) do
      if not index[w] then visit(w); low[v] = math.min(low[v], low[w])
      elseif on[w] then low[v] = math.min(low[v], index[w]) end
    end
    if low[v] == index[v] then
      local c = {}
      repeat local w = table.remove(stack); on[w] = nil; c[#c + 1] = w until w == v
      if #c > 1 then table.sort(c); out[#out + 1] = table.concat(c, " ") end
    end
  end
  for _, m in ipairs(list) do if not index[m] then visit(m) end end
  table.sort(out)
  return out
end

describe("require loops", function()
  local list, path = modules()
  local load_loops = {}   -- "a > b > a" = module whose load met it

  it("finds the modules under lua/weft", function()
    assert.is_true(#list > 40, "only " .. #list .. " modules under lua/weft")
    assert.truthy(path["weft"] and path["weft.internal.errors"] and path["weft.group.checks"])
  end)

  for _, m in ipairs(list) do
    it("loads " .. m .. " first in a fresh process", function()
      local p = io.popen(("cd %s && timeout 60 luajit -e %s tests/helpers/require_probe.lua 2>&1")
                         :format(q(ROOT), q("MOD = '" .. m .. "'")))
      local out = p:read("*a")
      p:close()
      for l in out:gmatch("LOOP ([^\n]+)") do load_loops[l] = load_loops[l] or m end
      local err = out:match("\nERR ([^\n]*)") or out:match("^ERR ([^\n]*)")
      if out:match("\nOK\n?$") or out:match("^OK\n?$") then return end
      err = err or out
      assert.is_nil(err:find("loop or previous error loading module", 1, true),
                    m .. " is in a require loop: " .. err)
      local why = needs(err)
      if why then pending(m .. " needs " .. why .. " to load: " .. err) return end
      error(m .. " does not load: " .. err)
    end)
  end

  it("no module is in a require loop, lazy requires included", function()
    local met = {}
    for l, m in pairs(load_loops) do met[#met + 1] = l .. "   (loading " .. m .. ")" end
    table.sort(met)
    assert.are.equal(0, #met, "require loops met while loading (caught by a pcall):\n  "
                     .. table.concat(met, "\n  "))
    local found = loops(list, source_graph(list, path))
    assert.are.equal(0, #found, "require loops in the source (lazy requires included):\n  "
                     .. table.concat(found, "\n  "))
  end)
end)
