-- weft.internal.show — how an argument check names the value it refuses.
--
-- A number reads as itself (2, 0.5, nan, inf); anything else names its
-- type, so `tp = "2"` reads `the string "2"`, not `2` (which would hide why
-- it was refused); tables, booleans, functions and nil read `a table`,
-- `the boolean true`, `a function`, `nil`.
local type, tostring, fmt = type, tostring, string.format

local M = {}

function M.value(v)
  local t = type(v)
  if t == "number" then return tostring(v) end
  if t == "string" then
    if #v > 60 then v = v:sub(1, 60) .. "..." end
    return fmt("the string %q", v)
  end
  if t == "nil" then return "nil" end
  if t == "boolean" then return "the boolean " .. tostring(v) end
  if t == "cdata" then return "a cdata (" .. tostring(v) .. ")" end
  return "a " .. t
end

return M
