-- scripts/ensure-deps on a machine whose package mirror cannot be reached:
-- optional packages cost one line each and never stop the build; a required
-- one stops it, saying what to install. The script runs with a PATH of its
-- own: luajit and cc (so the required tools are found), no tmux and no ip
-- (so those optional ones are missing), GLOO_INC pointing nowhere (Gloo's
-- headers missing), `id` saying root, and an apt-get that either fails as an
-- unreachable mirror does (a stub that logs its calls) or is the real one,
-- configured (APT_CONFIG) with a source on a closed local port, an empty
-- package status and temporary lists: nothing on this machine is changed.
local S = require("helpers.spec_util")
local util = require("helpers.store_util")

local ROOT = util.root()

local function which(cmd)
  local out = S.shell("command -v " .. cmd)
  return out:match("^(/%S+)")
end

-- a PATH folder: luajit and cc linked in, `id` answering uid, apt-get as given
local function stub_path(dir, uid, apt)
  S.shell(("mkdir -p '%s/bin'"):format(dir))
  for _, cmd in ipairs({ "luajit", "cc" }) do
    S.shell(("ln -s '%s' '%s/bin/%s'"):format(assert(which(cmd), cmd), dir, cmd))
  end
  local function script(name, body)
    local f = assert(io.open(dir .. "/bin/" .. name, "w"))
    f:write("#!/bin/sh\n", body, "\n")
    f:close()
    S.shell(("chmod +x '%s/bin/%s'"):format(dir, name))
  end
  script("id", "echo " .. uid)
  if apt == "stub" then
    script("apt-get", ('echo "apt-get $*" >> "%s/apt.log"\n'
      .. "echo \"E: Failed to fetch http://deb.debian.org/debian/  Temporary failure resolving 'deb.debian.org'\" >&2\n"
      .. "exit 100"):format(dir))
  elseif apt then
    S.shell(("ln -s '%s' '%s/bin/apt-get'"):format(apt, dir))
  end
  return dir .. "/bin"
end

-- LUA_PATH, LUA_CPATH and CRYPTO_CFLAGS pass through: where busted or
-- OpenSSL's headers are found through them (scripts/gpu-test's unpacked
-- .deps), they are there for the script as they are for these tests
local function run(dir, path, args, env)
  local keep = {}
  for _, k in ipairs({ "LUA_PATH", "LUA_CPATH", "CRYPTO_CFLAGS" }) do
    local v = os.getenv(k)
    if v then keep[#keep + 1] = ("%s='%s'"):format(k, v) end
  end
  return S.shell(("cd '%s' && env -i HOME=/tmp PATH='%s' GLOO_INC='%s/nowhere' %s %s /bin/sh scripts/ensure-deps %s")
                 :format(ROOT, path, dir, table.concat(keep, " "), env or "", args or ""))
end

local function lines(out, pat)
  local n = 0
  for l in out:gmatch("[^\n]+") do if l:find(pat) then n = n + 1 end end
  return n
end

describe("scripts/ensure-deps without a reachable mirror", function()
  local dir
  before_each(function() dir = util.tmpdir() end)
  after_each(function() util.rmdir(dir) end)

  it("goes on without the optional packages, one line each saying what it costs", function()
    local out, rc = run(dir, stub_path(dir, 0, "stub"))
    assert.are.equal(0, rc, out)
    assert.are.equal(3, lines(out, "^weft: optional "), out)
    assert.matches("weft: optional tmux not installed %(apt%-get failed%): the REPL's terminal specs", out)
    assert.matches("weft: optional libgloo%-dev not installed %(apt%-get failed%): host collectives across nodes take the slower store path", out)
    assert.matches("weft: optional iproute2 not installed %(apt%-get failed%): simulated nodes", out)
    assert.are.equal(4, lines(out, "^weft:") + lines(out, "^rc="), out)   -- nothing else printed
    local log = util.read_file(dir .. "/apt.log") or ""
    for _, p in ipairs({ "tmux", "libgloo%-dev", "iproute2" }) do
      assert.matches("install %-y %-qq " .. p, log)      -- each was tried
    end
  end)

  it("stops on a required package it cannot install, naming what to install", function()
    local out, rc = run(dir, stub_path(dir, 0, "stub"), "weft-no-such-tool")
    assert.are.equal(1, rc, out)
    assert.matches("required: as root, apt%-get install weft%-no%-such%-tool", out)
  end)

  it("installs nothing when not root: says what to install, and fails only for a required package", function()
    local path = stub_path(dir, 1000, "stub")
    local out, rc = run(dir, path)
    assert.are.equal(0, rc, out)
    assert.are.equal(3, lines(out, "^weft: optional .*%(as root: apt%-get install "), out)
    assert.is_nil(util.read_file(dir .. "/apt.log"), "apt-get was called")
    out, rc = run(dir, path, "weft-no-such-tool")
    assert.are.equal(1, rc, out)
    assert.matches("install them as root: apt%-get install weft%-no%-such%-tool", out)
  end)

  it("with the real apt-get and a mirror on a closed port: the same, in bounded time", function()
    local apt = which("apt-get")
    if not S.needs(apt ~= nil, "apt-get is not here (not a Debian machine)") then return end
    for _, d in ipairs({ "etc/parts", "state/lists/partial", "cache/archives/partial", "log" }) do
      S.shell(("mkdir -p '%s/apt/%s'"):format(dir, d))
    end
    local a = dir .. "/apt"
    local f = assert(io.open(a .. "/sources.list", "w"))
    f:write("deb http://127.0.0.1:9/debian bookworm main\n")   -- port 9: nothing listens
    f:close()
    assert(io.open(a .. "/status", "w")):close()               -- apt sees nothing installed
    f = assert(io.open(a .. "/apt.conf", "w"))
    f:write(([[Dir::Etc::SourceList "%s/sources.list"; Dir::Etc::SourceParts "%s/etc/parts";
Dir::State "%s/state"; Dir::State::status "%s/status"; Dir::Cache "%s/cache"; Dir::Log "%s/log";
Debug::NoLocking "true";
]]):format(a, a, a, a, a, a))
    f:close()
    local t0 = os.time()
    local out, rc = run(dir, stub_path(dir, 0, apt), nil, ("APT_CONFIG='%s/apt.conf'"):format(a))
    assert.are.equal(0, rc, out)
    assert.are.equal(3, lines(out, "^weft: optional .*%(apt%-get failed%)"), out)
    assert.is_true(os.time() - t0 < 60, "took " .. (os.time() - t0) .. " s")
    out, rc = run(dir, stub_path(dir .. "/2", 0, apt), "weft-no-such-tool", ("APT_CONFIG='%s/apt.conf'"):format(a))
    assert.are.equal(1, rc, out)
    assert.matches("required: as root, apt%-get install weft%-no%-such%-tool", out)
  end)
end)
