-- Shared by the multi-rank helper scripts (tests/helpers/group_*.lua), which
-- run under scripts/weft-run and print "OK <name>" per passed check; any
-- failure raises, so the rank exits non-zero and weft-run fails.
local ffi = require("ffi")
local M = {}

local weft = require("weft")
M.weft = weft

function M.say(fmt, ...)
  io.stdout:write((fmt):format(...), "\n")
  io.stdout:flush()
end

function M.ok(name) M.say("OK %s", name) end

function M.check(cond, fmt, ...)
  if not cond then error("check failed: " .. fmt:format(...), 2) end
end

-- fn must raise an error whose message contains every plain string in `wants`
function M.expect_error(fn, wants, what)
  local ok, err = pcall(fn)
  if ok then error(("%s: expected an error containing %q, got none"):format(what or "?", wants[1]), 2) end
  err = tostring(err)
  for _, w in ipairs(wants) do
    if not err:find(w, 1, true) then
      error(("%s: error %q does not contain %q"):format(what or "?", err, w), 2)
    end
  end
  if not err:match("weft: ") then error(("%s: error %q lacks the 'weft: ' prefix"):format(what or "?", err), 2) end
  return err
end

-- deterministic data of (global rank, tag): integer-valued so sums, products,
-- maxima are exact in every dtype (values in [-3, 3], products kept small)
function M.data(shape, dtype, rank, tag, lo, hi)
  lo, hi = lo or -3, hi or 3
  local T = weft.tensor
  local n = 1
  for i = 1, #shape do n = n * shape[i] end
  local vals = {}
  local s = (rank * 7919 + tag * 104729) % 2147483647 + 1
  for i = 1, n do
    s = (s * 48271) % 2147483647
    vals[i] = lo + s % (hi - lo + 1)
  end
  return T.from_table(vals, dtype, shape), vals
end

function M.flat(t)
  return t:to_table()
end

function M.same(a, b, what)
  if #a ~= #b then error(("%s: %d values, expected %d"):format(what, #a, #b), 2) end
  for i = 1, #a do
    if a[i] ~= b[i] then
      error(("%s: element %d is %s, expected %s"):format(what, i, tostring(a[i]), tostring(b[i])), 2)
    end
  end
end

-- index helpers for row-major flat tables (1-based)
function M.numel(shape)
  local n = 1
  for i = 1, #shape do n = n * shape[i] end
  return n
end

-- concatenate flat tables of `shape` along dim (0-based) in list order
function M.concat(list, shape, dim)
  local outer, inner = 1, 1
  for i = 1, #shape do
    if i <= dim then outer = outer * shape[i] else inner = inner * shape[i] end
  end
  local out = {}
  for o = 0, outer - 1 do
    for _, v in ipairs(list) do
      for j = 1, inner do out[#out + 1] = v[o * inner + j] end
    end
  end
  return out
end

-- chunk `r` (0-based) of `w` equal chunks of a flat table along dim
function M.chunk(v, shape, dim, w, r)
  local outer, inner = 1, 1
  for i = 1, #shape do
    if i <= dim then outer = outer * shape[i] else inner = inner * shape[i] end
  end
  local c = inner / w
  local out = {}
  for o = 0, outer - 1 do
    for j = 1, c do out[#out + 1] = v[o * inner + r * c + j] end
  end
  return out
end

M.ffi = ffi
return M
