-- Specs that run helper ranks which count their own checks: each rank prints
-- "PASS <check>" or "FAIL <check>: <why>" lines and "DONE <k> failed" last.
-- run() starts them under scripts/weft-run from the repository root;
-- assert_passed() checks that every rank passed every one of its checks.
local spec = require("helpers.spec_util")

local P = {}

-- n ranks of `script` with WEFT_TIMEOUT_MS=20000 and the tests' Lua path;
-- `env` ("NAME=value ...") goes before them. weft-run's own timeout is 10 s
-- inside the kill after `limit_s`, so a hang reports rather than vanishes.
-- Returns what they printed followed by "rc=<exit status>".
function P.run(root, script, n, env, limit_s)
  return spec.shell(("cd %s && WEFT_TIMEOUT_MS=20000 %s LUA_PATH='%s/tests/?.lua;;' "
                     .. "timeout -s KILL %d scripts/weft-run -n %d --timeout %d %s")
                    :format(root, env or "", root, limit_s, n, limit_s - 10, script))
end

-- no FAIL line, every rank done with none failed, weft-run's exit status 0
-- when `exit0`, and `count` PASS lines a rank (busted's assert, passed in
-- by the spec)
function P.assert_passed(assert, out, n, count, exit0)
  assert.is_nil(out:match("FAIL [^\n]*"), out)
  for r = 0, n - 1 do assert.matches("%[rank" .. r .. "%] DONE 0 failed", out) end
  if exit0 then assert.matches("rc=0%s*$", out) end
  local k = 0
  for _ in out:gmatch("%] PASS ") do k = k + 1 end
  assert.are.equal(n * count, k, out)
end

return P
