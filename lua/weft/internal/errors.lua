-- weft.internal.errors — the one way weft raises an error, and the words its messages
-- share. fail(level, op, fmt, ...) raises "weft: <op>: <what happened>" at
-- the caller's level; shape_str, same_shape and gname name shapes and groups
-- in those messages. Pure Lua that requires no other weft module, so any
-- module may load it first (no require cycle). The convention it serves:
-- docs/lua-interfaces.md, "Errors".
local concat = table.concat
local tostring, error, type = tostring, error, type

local M = {}

-- Raises "weft: " .. op .. ": " .. fmt:format(...). level counts as error()'s
-- does, from the function that calls fail: 1 names that function's line, 2
-- its caller's (a public function checking its own arguments), ...; 0 names
-- no position (an outcome that is nobody's call site: a peer's disagreement,
-- a parsed file). A wrapper that calls fail (not as a tail call) is one more
-- frame: it passes its own level + 1.
function M.fail(level, op, fmt, ...)
  error("weft: " .. op .. ": " .. fmt:format(...), level == 0 and 0 or level + 1)
end

-- shape_str({8, 4096}) -> "{8,4096}" (dims: numbers, as a tensor's shape).
-- With sep every dim goes through tostring (weft.tensor's messages, which
-- also print shapes they refuse): shape_str({2, true}, ", ") -> "{2, true}".
function M.shape_str(shape, sep)
  if sep == nil then return "{" .. concat(shape, ",") .. "}" end
  local parts = {}
  for i = 1, #shape do parts[i] = tostring(shape[i]) end
  return "{" .. concat(parts, sep) .. "}"
end

-- true when two shapes have the same dims in the same order
function M.same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- a group's name in messages ("tp.0", "world", a custom group's name)
function M.gname(g) return tostring(g.unique_name) end

-- a call's other arguments as its description writes them: a sizes table
-- "{2,3}", a dim "dim=1", else as it is ("max"); nil stays nil
function M.extra_str(e)
  if type(e) == "table" then return "{" .. concat(e, ",") .. "}" end
  if type(e) == "number" then return "dim=" .. e end
  if e == nil then return nil end
  return tostring(e)
end

return M
