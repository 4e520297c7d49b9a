-- The table of every WEFT_* variable (lua/weft/internal/settings.lua): it agrees with
-- the code and with docs/environment.md, and weft.init() checks what is set
-- (a bad value raises naming the variable, the value and what is allowed; an
-- unknown WEFT_* name is reported once per job with the closest known name).
local S = require("helpers.spec_util")
local settings = require("weft.internal.settings")

local ROOT = os.getenv("PWD") or "."

local function read(path)
  local f = assert(io.open(ROOT .. "/" .. path, "rb"))
  local t = f:read("*a")
  f:close()
  return t
end

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- a bad value for an entry (nil: free text, nothing is bad)
local function bad_values(e)
  if e.type == "int" then
    local t = { "lots", "1.5", tostring(e.min - 1) }
    if e.max and e.max < 2 ^ 53 - 1 then t[#t + 1] = tostring(e.max + 1) end
    return t
  elseif e.type == "enum" then
    return { "bogus", e.choices[1]:upper() ~= e.choices[1] and e.choices[1]:upper() or "X" .. e.choices[1] }
  elseif e.type == "flag" then
    return { "yes" }
  end
  return nil
end

describe("weft.internal.settings: the table", function()
  it("docs/environment.md is what scripts/gen-environment writes from it", function()
    local out, rc = S.shell("cd " .. q(ROOT) .. " && scripts/gen-environment 2>&1")
    assert.are.equal(0, rc)
    local want = out:gsub("rc=%d+%s*$", "")
    assert.are.equal(want, read("docs/environment.md"),
                     "docs/environment.md is stale: run scripts/gen-environment > docs/environment.md")
  end)

  it("has every WEFT_* name the code reads from the environment", function()
    -- The rule: a WEFT_* name quoted as a whole string ("WEFT_X" or 'WEFT_X')
    -- in src/, lua/, scripts/, kernels/, bench/ or tests/ (getenv,
    -- wf_env_long, os.getenv, env helpers all take it so), a $WEFT_X or
    -- ${WEFT_X in scripts/ and make files, and a make default WEFT_X ?=.
    local cmd = [==[cd %s && { grep -rhoE "[\"']WEFT_[A-Z0-9_]+[\"']" src lua scripts kernels bench tests \
                  --include='*.c' --include='*.cc' --include='*.h' --include='*.cu' --include='*.cuh' \
                  --include='*.lua' --include='*.in' --exclude=settings_spec.lua | tr -d "\"'";
                grep -rlE '^#!' scripts | xargs grep -hoE "[\"']WEFT_[A-Z0-9_]+[\"']" | tr -d "\"'";
                grep -rhoE '\$\{?WEFT_[A-Z0-9_]+' scripts mk Makefile | tr -d '${';
                grep -rhoE '^WEFT_[A-Z0-9_]+[[:space:]]*\?=' mk Makefile | grep -oE 'WEFT_[A-Z0-9_]+'; } | sort -u]==]
    local out = S.shell(cmd:format(q(ROOT)))
    local missing, n = {}, 0
    for name in out:gmatch("(WEFT_[A-Z0-9_]+)") do
      n = n + 1
      if not settings.by_name[name] then missing[#missing + 1] = name end
    end
    assert.is_true(n > 50, "found only " .. n .. " names")
    assert.are.same({}, missing)
  end)

  it("names, for each entry, files that read it", function()
    for _, e in ipairs(settings.list) do
      assert.is_true(#e.read > 0, e.name)
      for _, f in ipairs(e.read) do
        assert.is_truthy(read(f):find(e.name, 1, true), e.name .. " is not in " .. f)
      end
      assert.is_truthy(({ setting = 1, launcher = 1, tool = 1, build = 1, test = 1 })[e.scope], e.name)
      assert.is_truthy(e.doc and e.default, e.name)
    end
  end)

  it("allows what the policy allows", function()
    local policy = require("weft.policy")
    local function keys(t, extra)
      local l = { extra }
      for k in pairs(t) do l[#l + 1] = k end
      table.sort(l)
      return l
    end
    assert.are.same(keys(policy.OVERRIDES.all_reduce, "default"), settings.by_name.WEFT_ALLREDUCE.choices)
    assert.are.same(keys(policy.OVERRIDES.quick, "default"), settings.by_name.WEFT_QUICK_ALLREDUCE.choices)
  end)

  it("takes the good values and names the bad ones", function()
    for _, e in ipairs(settings.list) do
      local good = e.type == "int" and tostring(e.min) or e.type == "enum" and e.choices[#e.choices]
                   or e.type == "flag" and "1" or "anything"
      assert.is_nil(settings.problem(e.name, good), e.name .. "=" .. good)
      assert.is_nil(settings.problem(e.name, ""), e.name .. " empty")
      for _, v in ipairs(bad_values(e) or {}) do
        local msg = settings.problem(e.name, v)
        assert.is_truthy(msg, e.name .. "=" .. v .. " was taken")
        assert.are.equal(("%s=%q is not allowed: it takes %s (docs/environment.md)")
                         :format(e.name, v, settings.allowed(e)), msg)
      end
    end
  end)

  it("suggests the closest known name", function()
    assert.are.equal("WEFT_QUICK_ALLREDUCE", settings.closest("WEFT_QUICK_ALLREDUC"))
    assert.are.equal("WEFT_TIMEOUT_MS", settings.closest("WEFT_TIMEOUT"))
    assert.are.equal("WEFT_DETERMINISTIC", settings.closest("WEFT_DETERMINSTIC"))
    assert.is_nil(settings.closest("WEFT_FOO"))
    assert.matches("did you mean WEFT_QUICK_ALLREDUCE%?", settings.unknown("WEFT_QUICK_ALLREDUC"))
    assert.is_nil(settings.unknown("WEFT_LOG"))
  end)
end)

describe("weft.init() checks the environment", function()
  -- weft.init() in a plain luajit process (a world of one) with NAME=VALUE set
  local function init_with(assign)
    return S.luajit("local ok, e = pcall(require('weft').init) print(ok and 'INIT OK' or e)", assign)
  end

  it("raises for every variable set to a bad value, naming it, the value and what is allowed", function()
    local n = 0
    for _, e in ipairs(settings.list) do
      local bad = bad_values(e)
      if bad then
        n = n + 1
        local out = init_with(e.name .. "=" .. q(bad[1]))
        local want = ("weft: init: %s=%q is not allowed: it takes %s"):format(e.name, bad[1], settings.allowed(e))
        assert.is_truthy(out:find(want, 1, true), e.name .. ": " .. out)
      end
    end
    assert.is_true(n > 60, n .. " checked")
  end)

  it("raises for the values of the issue (int7, INT8, 1, fast, verbose, maybe, lots, -5)", function()
    for _, a in ipairs { "WEFT_QUICK_ALLREDUCE=int7", "WEFT_QUICK_ALLREDUCE=INT8", "WEFT_QUICK_ALLREDUCE=1",
                         "WEFT_ALLREDUCE=fast", "WEFT_LOG=verbose", "WEFT_SHM_ZEROCOPY=maybe",
                         "WEFT_HOST_ARENA_GB=lots", "WEFT_TIMEOUT_MS=-5" } do
      local name, v = a:match("^([^=]+)=(.*)$")
      local out = init_with(a)
      assert.is_truthy(out:find(("weft: init: %s=%q is not allowed"):format(name, v), 1, true), a .. ": " .. out)
      assert.is_falsy(out:find("INIT OK", 1, true), a)
      assert.is_falsy(out:find("nil)", 1, true), a)
    end
  end)

  it("takes good values and empty ones", function()
    local out = init_with("WEFT_TIMEOUT_MS=5000 WEFT_LOG=0 WEFT_QUICK_ALLREDUCE=int8 WEFT_SHM_ZEROCOPY= WEFT_CUDA=0")
    assert.matches("INIT OK", out)
    assert.is_falsy(out:find("warning", 1, true), out)
  end)

  it("reports an unknown WEFT_* name once per job, with the closest known name", function()
    local f = os.tmpname()
    local h = assert(io.open(f, "w"))
    h:write('local weft = require("weft")\nweft.init()\nweft.shutdown()\nweft.init()\nprint("done")\n')
    h:close()
    local out, rc = S.shell(("cd %s && WEFT_QUICK_ALLREDUC=int8 scripts/weft-run -n 2 %s"):format(q(ROOT), f))
    os.remove(f)
    assert.are.equal(0, rc, out)
    local _, warnings = out:gsub("WEFT_QUICK_ALLREDUC is not a weft setting", "")
    assert.are.equal(1, warnings, out)
    assert.matches("did you mean WEFT_QUICK_ALLREDUCE%?", out)
    local _, done = out:gsub("done", "")
    assert.are.equal(2, done, out)
  end)
end)
