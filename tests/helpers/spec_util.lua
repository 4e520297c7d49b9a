-- The spec side of the multi-process tests: the message of an expected error,
-- a process's output as lines, and the "<WHAT> ok=<bool> ms=<n> msg=<text>"
-- reports that the rank workers print (tests/helpers/rank_util.lua).
local S = {}

-- f(...) must raise: returns its message (the calling test fails otherwise)
function S.err_of(f, ...)
  local ok, e = pcall(f, ...)
  if ok then error("expected an error", 2) end
  return tostring(e)
end

function S.lines_of(out)
  local t = {}
  for l in out:gmatch("[^\n]+") do t[#t + 1] = l end
  return t
end

-- Runs a shell command line; returns everything it printed (stderr too)
-- followed by "rc=<exit status>", and that status as a number.
function S.shell(cmd)
  local p = io.popen(cmd .. ' 2>&1; echo "rc=$?"')
  local out = p:read("*a"); p:close()
  return out, tonumber(out:match("rc=(%d+)%s*$"))
end

-- Runs Lua `code` (no double quotes in it) in a fresh luajit from the
-- repository root (the specs' working directory) with the tree's lua/ first on
-- package.path, after `env` ("NAME=value ...", optional): S.shell's output and status.
function S.luajit(code, env)
  return S.shell(("cd '%s' && env %s luajit -e \"package.path='lua/?.lua;lua/?/init.lua;'..package.path %s\"")
                 :format(os.getenv("PWD") or ".", env or "", code))
end

-- A test that needs an optional tool: true when `ok`; otherwise the test is
-- marked pending with `why` (what is missing, how to install it), except in
-- CI (CI=true), where a missing tool is CI's own mistake and the test fails.
function S.needs(ok, why)
  if ok then return true end
  if os.getenv("CI") == "true" then error("CI=true, and this test cannot run: " .. why, 2) end
  getfenv(2).pending(why)   -- busted's, from the calling spec's environment
  return false
end

-- How many "<prefix>] OK " lines the rank workers printed.
function S.count_ok(out)
  local n = 0
  for _ in out:gmatch("%] OK ") do n = n + 1 end
  return n
end

-- A function that, on its first call, builds the C test binary `target` (a
-- make target under BUILD) into a fresh temporary folder, runs it (with the
-- words args, if given) with a time limit and removes the folder; every call returns what it printed followed
-- by "rc=<exit status>" (one run shared by a describe block's checks).
function S.c_test(target, timeout_s, args)
  local out
  return function()
    if not out then
      local dir = os.tmpname(); os.remove(dir)
      out = S.shell(("(make -s BUILD=%s %s/%s && timeout %d %s/%s %s; r=$?; rm -rf %s; exit $r)")
                    :format(dir, dir, target, timeout_s, dir, target, args or "", dir))
    end
    return out
  end
end

-- xmllint --noout on the text s: nil when xmllint is not installed, else
-- whether it passed and what it printed followed by "rc=<exit status>".
function S.xmllint_ok(s)
  local r = os.execute("command -v xmllint >/dev/null 2>&1")
  if r ~= 0 and r ~= true then return nil end
  local f = os.tmpname()
  local h = io.open(f, "w")
  h:write(s)
  h:close()
  local p = io.popen("xmllint --noout " .. f .. " 2>&1; echo rc=$?")
  local out = p:read("*a")
  p:close()
  os.remove(f)
  return out:match("rc=0\n$") ~= nil, out
end

-- A C test's output (S.c_test) ends well: its "<name>: P passed, F failed"
-- line with F = 0 and P >= at_least (busted's assert, passed in by the spec).
function S.assert_c_passed(assert, out, name, at_least)
  local passed, failed = out:match(name .. ": (%d+) passed, (%d+) failed")
  assert.is_truthy(passed, out)
  assert.are.equal("0", failed, out)
  assert.is_true(tonumber(passed) >= at_least, out)
end

-- the last report tagged `tag` among lines: { ok = "true"|"false", ms =, msg = }
function S.report_of(lines, tag)
  local got
  for _, l in ipairs(lines) do
    local what, ok, ms, msg = l:match("^(%u[%u_]*) ok=(%a+) ms=(%d+) msg=(.*)$")
    if what == tag then got = { ok = ok, ms = tonumber(ms), msg = msg } end
  end
  return got
end

-- the names in /dev/shm for which keep(name) is true, sorted, space-separated
function S.dev_shm(keep)
  local t = {}
  local p = io.popen("ls /dev/shm 2>/dev/null")
  for name in p:lines() do
    if keep(name) then t[#t + 1] = name end
  end
  p:close()
  table.sort(t)
  return table.concat(t, " ")
end

-- A device tensor stand-in for the policy specs: host storage labelled
-- "cuda:0" (never dereferenced), its host tensor kept alive for the run.
local standins = {}
function S.dev_standin(shape, dtype)
  local T = require("weft").tensor
  local h = T.empty(shape, dtype or "bf16")
  standins[#standins + 1] = h
  return T.wrap(h.ptr, shape, dtype or "bf16", "cuda:0", h)
end

-- A custom all-reduce stand-in for the policy specs (o: fields added or
-- replaced, e.g. run): a 64 MiB workspace whose kernel choice is C's rule in
-- miniature, one function for both of weft.backends.custom_ar's questions:
-- kernel(count, dtype, algo) -> code (auto: one-shot up to oneshot_max bytes,
-- else two-shot; a named one itself; nil above the workspace or for an
-- unknown dtype) and resolve(count, dtype, algo) -> name, "fake resolve <algo>".
local AR_NAMES = { [0] = "auto", "oneshot", "twoshot", "oneshot_flag", "quick_fp", "quick_int8", "quick_int4",
                   "quick_fp8" }
local AR_CODES = {}
for c, n in pairs(AR_NAMES) do AR_CODES[n] = c end
local ESIZE = { f32 = 4, f16 = 2, bf16 = 2 }
function S.fake_ar(o)
  local MIB = 1048576
  local ar = { max_bytes = 64 * MIB, oneshot_max = 8 * MIB }
  function ar.kernel(self, count, dtype, algo)
    local es = ESIZE[dtype]
    if type(algo) == "string" then algo = AR_CODES[algo] end
    if es == nil or algo == nil or count * es > self.max_bytes then return nil end
    if algo ~= 0 then return algo end
    return count * es <= self.oneshot_max and 1 or 2
  end
  function ar.resolve(self, count, dtype, algo)
    local k = self:kernel(count, dtype, algo)
    if k == nil then return nil, "fake: refused" end
    return AR_NAMES[k], "fake resolve " .. tostring(algo)
  end
  for k, v in pairs(o or {}) do ar[k] = v end
  return ar
end

-- A group stand-in with a prepared device state (o.setup == false: none yet)
-- whose custom all-reduce is `ar`: o.world (2), o.same_node (true), o.name
-- ("tp.0"), o.determ (the agreed deterministic flag).
function S.group_standin(o, ar)
  o = o or {}
  local g = {
    world_size = o.world or 2, same_node = o.same_node ~= false, unique_name = o.name or "tp.0",
    rank = 0, rank_in_group = 0, is_member = true, ranks = { 0, 1, 2, 3, 4, 5, 6, 7 },
  }
  if o.setup ~= false then
    g._dev = { device = 0, nccl = { handle = true, device = 0 }, ar_state = "ready", ar = ar,
               ar_why = "fake workspace", scratch = {}, retired = {}, determ = o.determ }
  end
  return g
end

-- weft.policy as it loads, for the policy specs' before_each and teardown:
-- no policy.set overrides or their error, no policy file, and a new version
-- (so the groups' cached picks are stale).
function S.reset_policy()
  local policy = require("weft.policy")
  policy.overrides.global, policy.overrides.groups = {}, {}
  policy.override_error = nil
  policy.clear_file()
  policy.version = policy.version + 1
end

-- The backend policy.select picks for g and t (op: all_reduce); S.last: the
-- choice it handed with it (the "custom_ar" rule's { pick, kernel, det } or { err };
-- {} for rules that choose nothing inside their backend).
S.last = {}
function S.select_backend(g, t, op, rop, out)
  local name, _, _, choice = require("weft.policy").select(g, op or "all_reduce", t, rop, out)
  S.last = choice or {}
  return name
end

-- Every combination of a sweep's axes, in order (the last axis fastest):
-- grid("tp", {1, 2}, "pp", {1, 3}) -> {{tp=1, pp=1}, {tp=1, pp=3}, {tp=2, pp=1}, ...};
-- one loop instead of a nest of them.
function S.grid(...)
  local axes, out = { ... }, { {} }
  for a = 1, #axes, 2 do
    local name, values, nxt = axes[a], axes[a + 1], {}
    for _, c in ipairs(out) do
      for _, v in ipairs(values) do
        local d = {}
        for k, x in pairs(c) do d[k] = x end
        d[name] = v
        nxt[#nxt + 1] = d
      end
    end
    out = nxt
  end
  return out
end

return S
