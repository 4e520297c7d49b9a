-- weft.internal.errors (issue 38): the one fail() every module raises through, and
-- the shape and group-name words their messages share. The messages are the
-- ones users already see, byte for byte: these pin the format and the level.
local E = require("weft.internal.errors")

local ROOT = os.getenv("PWD") or "."

-- fail's message as error() leaves it (with or without a position)
local function msg_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok)
  return e
end

describe("weft.internal.errors", function()
  it("fail raises 'weft: <op>: <formatted message>'", function()
    assert.are.equal("weft: all_reduce: group tp.0 is destroyed",
                     msg_of(E.fail, 0, "all_reduce", "group %s is destroyed", "tp.0"))
    assert.are.equal("weft: tensor.view: 100% of {2, 3}",
                     msg_of(E.fail, 0, "tensor.view", "%s", "100% of {2, 3}"))
  end)

  it("fail's level counts from its caller, as error()'s does; 0 gives no position", function()
    local function check(level) E.fail(level, "op", "bad") end   -- the line named by level 1
    local line1 = debug.getinfo(1, "l").currentline - 1
    local function api(level) check(level) end                  -- level 2
    local line2 = debug.getinfo(1, "l").currentline - 1
    assert.are.equal("weft: op: bad", msg_of(api, 0))
    assert.truthy(msg_of(api, 1):find("errors_spec.lua:" .. line1 .. ": weft: op: bad", 1, true))
    assert.truthy(msg_of(api, 2):find("errors_spec.lua:" .. line2 .. ": weft: op: bad", 1, true))
  end)

  it("shape_str: '{8,4096}', or with a separator each dim through tostring", function()
    assert.are.equal("{8,4096}", E.shape_str { 8, 4096 })
    assert.are.equal("{}", E.shape_str {})
    assert.are.equal("{2, 3}", E.shape_str({ 2, 3 }, ", "))
    assert.are.equal("{2, true, x}", E.shape_str({ 2, true, "x" }, ", "))
    -- numbers print alike either way (concat and tostring share LuaJIT's %.14g)
    local odd = { 1, 2.5, -0.0, 1e20, 2 ^ 53, 1 / 0 }
    assert.are.equal(E.shape_str(odd), E.shape_str(odd, ","))
  end)

  it("same_shape compares dims in order", function()
    assert.is_true(E.same_shape({ 2, 3 }, { 2, 3 }))
    assert.is_true(E.same_shape({}, {}))
    assert.is_false(E.same_shape({ 2, 3 }, { 3, 2 }))
    assert.is_false(E.same_shape({ 2, 3 }, { 2, 3, 1 }))
    assert.is_false(E.same_shape({ 6 }, { 2, 3 }))
  end)

  it("gname: the group's unique name as a string", function()
    assert.are.equal("tp.0", E.gname { unique_name = "tp.0" })
    assert.are.equal("nil", E.gname {})
  end)

  it("extra_str writes a call's other arguments as call descriptions do", function()
    assert.are.equal("{2,3}", E.extra_str { 2, 3 })
    assert.are.equal("dim=1", E.extra_str(1))
    assert.are.equal("max", E.extra_str "max")
    assert.is_nil(E.extra_str(nil))
  end)

  it("loads no other weft module (any module may require it first)", function()
    local p = io.popen(("cd %q && luajit -e \"package.path = 'lua/?.lua;' .. package.path; "
                       .. "require('weft.internal.errors'); for k in pairs(package.loaded) do "
                       .. "if k:match('^weft') then print(k) end end\" 2>&1"):format(ROOT))
    local out = p:read("*a"); p:close()
    assert.are.equal("weft.internal.errors\n", out)
  end)
end)
