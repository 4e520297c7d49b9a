-- The C core's layers (docs/architecture.md): core < store < host < cuda <
-- coll (with kernels/) < src/ (async, the contract). A file includes only
-- headers of its own folder or of a folder below it, and an object calls only
-- functions defined in its own layer or below (read from the built objects
-- with nm: the include rule alone misses a call declared in a lower header
-- but implemented above, the way the host waits once called into src/coll/).
local spec = require("helpers.spec_util")

local ROOT = os.getenv("PWD") or "."
local RANK = { core = 0, store = 1, host = 2, cuda = 3, coll = 4, kernels = 4, top = 5 }

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function lines(cmd)
  local out = spec.shell(cmd)
  local t = {}
  for l in out:gmatch("[^\n]+") do if not l:match("^rc=") then t[#t + 1] = l end end
  return t
end

-- every C/C++ source and header of src/ and kernels/: { path=, layer= }
local function sources()
  local t = {}
  for _, p in ipairs(lines(("cd %s && find src kernels -type f \\( -name '*.c' -o -name '*.cc' -o -name '*.h' "
                            .. "-o -name '*.cu' -o -name '*.cuh' \\) | sort"):format(q(ROOT)))) do
    local layer = p:match("^kernels/") and "kernels" or p:match("^src/([%w_]+)/") or "top"
    t[#t + 1] = { path = p, layer = layer }
  end
  return t
end

local function exists(p)
  local f = io.open(ROOT .. "/" .. p, "rb")
  if f then f:close() end
  return f ~= nil
end

describe("the C core's layers", function()
  it("knows every folder of src/", function()
    for _, s in ipairs(sources()) do
      assert.is_not_nil(RANK[s.layer], s.path .. ": folder '" .. s.layer .. "' has no place among the layers")
    end
  end)

  it("includes only its own folder's headers, those of folders below, and weft.h", function()
    local bad, checked = {}, 0
    for _, s in ipairs(sources()) do
      local dir = s.path:match("^(.*)/[^/]*$")
      for inc in io.open(ROOT .. "/" .. s.path):read("*a"):gmatch('#include%s+"([^"]+)"') do
        checked = checked + 1
        local folder = inc:match("^([%w_]+)/")
        local ok
        if inc == "weft.h" then ok = true
        elseif folder then
          ok = RANK[folder] ~= nil and RANK[folder] <= RANK[s.layer] and exists("src/" .. inc)
        else
          ok = exists(dir .. "/" .. inc)
        end
        if not ok then bad[#bad + 1] = s.path .. ' includes "' .. inc .. '"' end
      end
    end
    assert.is_true(checked > 100, "read " .. checked .. " includes")
    assert.are.same({}, bad)
  end)

  it("calls only functions of its own layer or below (nm of the built objects)", function()
    local nm = lines("command -v nm")[1]
    if not nm then return pending("nm not found (binutils)") end
    local objs = {}
    for _, s in ipairs(sources()) do
      local o
      if s.path:match("^src/.*%.cc?$") then o = "build/obj/" .. s.path:gsub("^src/", ""):gsub("%.cc?$", ".o")
      elseif s.path:match("^kernels/[^/]*%.cu$") then o = "build/obj/" .. s.path:gsub("^kernels/", "") .. ".o" end
      if o and exists(o) then objs[#objs + 1] = { obj = o, layer = s.layer } end
    end
    -- the kernel units the build writes (mk/kernel_units.mk) have no source in kernels/
    local seen = {}
    for _, o in ipairs(objs) do seen[o.obj] = true end
    for _, o in ipairs(lines(("cd %s && ls build/obj/*.cu.o 2>/dev/null"):format(q(ROOT)))) do
      if not seen[o] then objs[#objs + 1] = { obj = o, layer = "kernels" } end
    end
    if #objs < 20 then return pending("the library is not built here (make lib)") end
    local defined, used = {}, {}
    for _, o in ipairs(objs) do
      used[o.obj] = {}
      for _, l in ipairs(lines(("cd %s && nm %s"):format(q(ROOT), q(o.obj)))) do
        local kind, sym = l:match("^%x+%s+([TDBRV])%s+(%S+)$")
        if kind then defined[sym] = o.layer end
        local u = l:match("^%s+U%s+(%S+)$")
        if u then used[o.obj][#used[o.obj] + 1] = u end
      end
    end
    local bad = {}
    for _, o in ipairs(objs) do
      for _, sym in ipairs(used[o.obj]) do
        local at = defined[sym]
        if at and RANK[at] > RANK[o.layer] then
          bad[#bad + 1] = ("%s (%s) calls %s, defined in %s above it"):format(o.obj, o.layer, sym, at)
        end
      end
    end
    assert.are.same({}, bad)
  end)
end)
