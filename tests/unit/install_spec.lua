-- weft as an installed library: `make install` into a temporary prefix (and a
-- DESTDIR), `make uninstall`, and the rock through luarocks into a temporary
-- tree. README's "A script" runs at world 4 through the installed weft-run
-- from a folder outside the repository, with no WEFT_LIB / LUA_PATH, and
-- must load the installed modules and library. LUA_CPATH stays: weft has no
-- C modules of its own, and lua-cjson (weft-topo --json) is a dependency
-- that may live where the machine put it (the GPU machines unpack it under
-- /tmp/deps and point LUA_CPATH there). Host-only
-- (WEFT_CUDA=0) into build/host, the folder `make demo` uses without a GPU.
local spec = require("helpers.spec_util")

local ROOT = os.getenv("PWD") or "."
-- make and the tools see neither this run's make (jobserver) nor its paths
local CLEAN_ENV = "unset MAKEFLAGS MFLAGS MAKELEVEL WEFT_LIB LUA_PATH;"
local MAKE_VARS = "WEFT_CUDA=0 BUILD=build/host CFLAGS=-O2"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function sh(cmd) return spec.shell(CLEAN_ENV .. " " .. cmd) end

local function make(args)
  return sh(("cd %s && timeout -s KILL 600 make -s %s %s"):format(q(ROOT), MAKE_VARS, args))
end

local function exists(p)
  local f = io.open(p, "rb")
  if f then f:close() end
  return f ~= nil
end

local function files_under(dir)
  local t = {}
  local p = io.popen(("cd %s 2>/dev/null && find . -type f | sort"):format(q(dir)))
  for l in p:lines() do t[#t + 1] = l:sub(3) end
  p:close()
  return t
end

local function write(path, s)
  local f = assert(io.open(path, "w"))
  f:write(s)
  f:close()
end

-- README.md's "A script" block, verbatim
local function readme_script()
  local f = assert(io.open(ROOT .. "/README.md"))
  local text = f:read("*a")
  f:close()
  local code = text:match("\n## A script\n.-```lua\n(.-)```")
  assert(code, "README.md has no lua block under \"## A script\"")
  return code
end

local function mktemp_dir()
  local p = io.popen("mktemp -d /tmp/weft-install-XXXXXX")
  local d = p:read("*l")
  p:close()
  return d
end

-- Runs README's script and a probe (where weft and libweft.so came from)
-- with tool `weft_run` from a folder outside the repository.
local function run_outside(weft_run, dir)
  write(dir .. "/readme.lua", readme_script())
  write(dir .. "/probe.lua", 'print("lib=" .. require("weft.internal.ffi").path)\n'
        .. 'print("mod=" .. package.searchpath("weft", package.path))\n')
  local out, rc = sh(("cd %s && timeout -s KILL 120 %s -n 4 readme.lua"):format(q(dir), q(weft_run)))
  local probe = sh(("cd %s && timeout -s KILL 60 %s -n 1 probe.lua"):format(q(dir), q(weft_run)))
  return out, rc, probe
end

-- the modules the tree has, relative to lua/ (weft/**.lua)
local function tree_modules()
  local t = {}
  for _, f in ipairs(files_under(ROOT .. "/lua/weft")) do
    if f:match("%.lua$") then t[#t + 1] = "weft/" .. f end
  end
  return t
end

-- The weft-run of an installed tree (<root>/bin/weft-run) runs README's script
-- from `dir`, outside the repository, on that tree's weft: its module and its
-- library (lib_pat: a pattern of the library's path below <root>).
local function runs_outside(root, dir, lib_pat)
  os.execute("mkdir -p " .. q(dir))
  local out, rc, probe = run_outside(root .. "/bin/weft-run", dir)
  assert.are.equal(0, rc, out)
  assert.matches("%[rank0%] all_reduce bf16 {8,4096} %(64 KiB, cpu%) on tp%.0 %(2 ranks%): shm", out)
  local r = root:gsub("%p", "%%%0")
  assert.matches("lib=" .. r .. "/share/lua/5%.1/%.%./%.%./%.%./" .. lib_pat, probe)
  assert.matches("mod=" .. r .. "/share/lua/5%.1/weft/init%.lua", probe)
end

describe("make install", function()
  local tmp, prefix
  local built, build_out

  setup(function()
    tmp = mktemp_dir()
    prefix = tmp .. "/prefix"
    build_out, built = make("install PREFIX=" .. q(prefix))
  end)

  teardown(function()
    if tmp then os.execute("rm -rf " .. q(tmp)) end
  end)

  it("installs the library, header, pkg-config file, tools and every Lua module", function()
    assert.are.equal(0, built, build_out)
    for _, f in ipairs { "lib/libweft.so", "include/weft.h", "lib/pkgconfig/weft.pc" } do
      assert.is_true(exists(prefix .. "/" .. f), f)
    end
    for _, t in ipairs { "weft-run", "weft-topo", "weft-repl", "weft-tune", "weft-plot" } do
      local _, rc = spec.shell(("test -x %s"):format(q(prefix .. "/bin/" .. t)))
      assert.are.equal(0, rc, "bin/" .. t .. " is not an executable")
    end
    local mods = tree_modules()
    assert.is_true(#mods > 10)
    for _, m in ipairs(mods) do
      assert.is_true(exists(prefix .. "/share/lua/5.1/" .. m), m)
    end
  end)

  it("runs README's script at world 4 from outside the repository on the installed weft", function()
    assert.are.equal(0, built, build_out)
    runs_outside(prefix, tmp .. "/elsewhere", "lib/libweft%.so")
  end)

  it("installs weft-topo, weft-repl, weft-tune and weft-plot that start from anywhere", function()
    assert.are.equal(0, built, build_out)
    local out, rc = sh(("cd / && %s --world 4 --tp 2 --pp 2 --json"):format(q(prefix .. "/bin/weft-topo")))
    assert.are.equal(0, rc, out)
    assert.matches('"tp":%[%[0,1%],%[2,3%]%]', out)
    for _, t in ipairs { "weft-repl", "weft-tune", "weft-run", "weft-plot" } do
      out, rc = sh(("cd / && %s --help"):format(q(prefix .. "/bin/" .. t)))
      assert.are.equal(0, rc, t .. ": " .. out)
      assert.matches("usage", out)
    end
  end)

  it("gives C programs weft.h and libweft.so through pkg-config", function()
    assert.are.equal(0, built, build_out)
    if select(2, spec.shell("command -v pkg-config >/dev/null")) ~= 0 then
      return pending("pkg-config not installed (apt-get install pkg-config)")
    end
    write(tmp .. "/abi.c", '#include <stdio.h>\n#include <weft.h>\n'
          .. 'int main(void) { printf("abi=%d\\n", weft_abi_version()); return 0; }\n')
    -- README's line as written, with the PKG_CONFIG_PATH it documents; the
    -- program runs with no LD_LIBRARY_PATH (weft.pc's Libs carry the rpath)
    local out, rc = sh(("cd %s && export PKG_CONFIG_PATH=%s && unset LD_LIBRARY_PATH && "
                        .. "cc abi.c -o abi $(pkg-config --cflags --libs weft) && ./abi")
                       :format(q(tmp), q(prefix .. "/lib/pkgconfig")))
    assert.are.equal(0, rc, out)
    local ldd = sh(("cd %s && ldd ./abi"):format(q(tmp)))
    assert.matches("libweft.so => " .. prefix:gsub("%p", "%%%0") .. "/lib/libweft.so", ldd)
    local f = assert(io.open(ROOT .. "/lua/weft/internal/ffi.lua"))
    local abi = f:read("*a"):match("M%.ABI_VERSION = (%d+)")
    f:close()
    assert.matches("abi=" .. abi .. "\n", out)
  end)

  it("stages the same tree under DESTDIR, with paths for PREFIX", function()
    assert.are.equal(0, built, build_out)
    local stage = tmp .. "/stage"
    local out, rc = make(("install DESTDIR=%s PREFIX=/opt/weft"):format(q(stage)))
    assert.are.equal(0, rc, out)
    local staged = files_under(stage .. "/opt/weft")
    assert.are.same(files_under(prefix), staged)
    local f = assert(io.open(stage .. "/opt/weft/lib/pkgconfig/weft.pc"))
    local pc = f:read("*a")
    f:close()
    assert.matches("prefix=/opt/weft\n", pc)
  end)

  it("uninstall removes every file install put there, and the folders it made", function()
    assert.are.equal(0, built, build_out)
    local out, rc = make("uninstall PREFIX=" .. q(prefix))
    assert.are.equal(0, rc, out)
    assert.are.same({}, files_under(prefix))
    local _, gone = spec.shell("test -e " .. q(prefix))
    assert.are_not.equal(0, gone, prefix .. " is still there after uninstall")
  end)

  it("uninstall keeps the folders that were there before, empty or not", function()
    assert.are.equal(0, built, build_out)
    local pre = tmp .. "/pre"
    os.execute(("mkdir -p %s/include %s/bin && echo mine > %s/bin/other"):format(q(pre), q(pre), q(pre)))
    local out, rc = make("install PREFIX=" .. q(pre))
    assert.are.equal(0, rc, out)
    out, rc = make("install PREFIX=" .. q(pre))   -- twice: the first install's list is kept
    assert.are.equal(0, rc, out)
    out, rc = make("uninstall PREFIX=" .. q(pre))
    assert.are.equal(0, rc, out)
    assert.are.same({ "bin/other" }, files_under(pre))
    local left = sh(("cd %s && find . -type d | sort"):format(q(pre)))
    assert.are.equal(".\n./bin\n./include\nrc=0\n", left)
  end)
end)

describe("luarocks make", function()
  local tmp

  teardown(function()
    if tmp then os.execute("rm -rf " .. q(tmp)) end
  end)

  it("builds the rock into a local tree whose weft-run runs README's script from anywhere", function()
    if select(2, spec.shell("command -v luarocks >/dev/null")) ~= 0 then
      return pending("luarocks not installed (apt-get install luarocks; .ci/run installs it)")
    end
    tmp = mktemp_dir()
    local tree = tmp .. "/tree"
    local out, rc = sh(("cd %s && %s timeout -s KILL 600 luarocks --lua-version 5.1 make --tree %s "
                        .. "weft-dev-1.rockspec CFLAGS=-O2"):format(q(ROOT), MAKE_VARS, q(tree)))
    assert.are.equal(0, rc, out)
    runs_outside(tree, tmp .. "/elsewhere", "lib/lua/5%.1/libweft%.so")
  end)
end)
