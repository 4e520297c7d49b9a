-- scripts/serve/serve_json.lua without nginx: lua-cjson under the served
-- demo's limits on untrusted input (size, depth, number forms) and the error
-- words the demo's 400 replies carry (tests/unit/serve_spec.lua checks them over
-- HTTP where nginx is installed).
local ROOT = os.getenv("PWD") or "."
package.path = ROOT .. "/scripts/serve/?.lua;" .. ROOT .. "/tests/?.lua;" .. package.path
local S = require("helpers.spec_util")

local have_cjson = pcall(require, "cjson")

describe("serve_json (lua-cjson with the demo's limits)", function()
  local json = have_cjson and require("serve_json")
  local function need()
    return S.needs(have_cjson, "lua-cjson is not installed (as root: apt-get install lua-cjson)")
  end

  local function refused(s)
    local ok, e = pcall(json.decode, s)
    assert.is_false(ok, ("%q was accepted"):format(tostring(s):sub(1, 40)))
    return tostring(e)
  end

  it("reads a request and writes an answer", function()
    if not need() then return end
    local r = json.decode('{"x":[[0.5,-2,1e-3],[3,4,5]],"layer":"mlp","debug":null}')
    assert.are.same({ { 0.5, -2, 1e-3 }, { 3, 4, 5 } }, r.x)
    assert.are.equal("mlp", r.layer)
    assert.are.equal(json.null, r.debug)
    local back = json.decode(json.encode({ y = { 0.25, -1.5, 1 / 0 }, step = 7, error = 'a "b"\n' }))
    assert.are.same({ 0.25, -1.5, json.null }, back.y)
    assert.are.equal(7, back.step)
    assert.are.equal('a "b"\n', back.error)
  end)

  it("says where and why a body is malformed", function()
    if not need() then return end
    assert.matches("^malformed JSON at byte 2: ", refused("{not json"))
    assert.matches("^malformed JSON at byte 8: ", refused("[1,2,3]x"))
    assert.matches("^malformed JSON at byte 4: .*']'", refused("[1,]"))
    assert.matches("end of the input", refused("[1,"))
    assert.matches("^malformed JSON: expected a string", refused(nil))
  end)

  it("refuses nesting deeper than 32, and takes 32", function()
    if not need() then return end
    assert.are.equal("malformed JSON at byte 33: nested deeper than 32",
                     refused(("["):rep(33) .. ("]"):rep(33)))
    assert.is_table(json.decode(("["):rep(32) .. ("]"):rep(32)))
    assert.matches("nested deeper than 32", refused('{"x":' .. ("["):rep(100) .. ("]"):rep(100) .. "}"))
  end)

  it("takes numbers only in JSON's forms, and finite", function()
    if not need() then return end
    for _, s in ipairs({ "[01]", "[-01]", "[0x10]", "[NaN]", "[nan]", "[Infinity]", "[-Infinity]",
                         "[inf]", "[.5]", "[+1]", "[1e]", "[--1]" }) do
      assert.matches("^malformed JSON", refused(s))
    end
    for _, s in ipairs({ "[1e999]", "[-1e999]", '{"x":[1,[2,1e400]]}', "[" .. ("9"):rep(400) .. "]" }) do
      assert.matches("number out of range", refused(s))
    end
    assert.are.same({ 0, -0.5, 1e300, 1e-300, 12345678901234 },
                    json.decode("[0,-0.5,1E300,1e-300,12345678901234]"))
  end)

  it("refuses a body over 4 MiB with the words nginx uses for it", function()
    if not need() then return end
    local big = "[" .. ("1,"):rep(2 * 1024 * 1024) .. "1]"
    assert.are.equal("body over 4 MiB (over-size tensor)", refused(big))
    assert.is_table(json.decode("[" .. ("1,"):rep(2 * 1024 * 1024 - 2) .. "1]"))
  end)

  it("keeps its settings to itself (another cjson user keeps the defaults)", function()
    if not need() then return end
    local other = require("cjson")
    assert.is_table(other.decode(("["):rep(100) .. ("]"):rep(100)))
  end)
end)
