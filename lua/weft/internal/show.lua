-- weft.internal.show — how an argument check names the value it refuses.
--
-- A number reads as itself (2, 0.5, nan, inf); anything else names its
-- type, so `tp = "2"` reads `the string "2"`, not `2` (which would hide why
-- it was refused); tables, booleans, functions and nil read `a table`,
-- `the boolean true`, `a function`, `nil`. And a list of ranks as the
-- launcher and the REPL print it: "0-3", "0,2,5-7".
local type, tostring, fmt, concat = type, tostring, string.format, table.concat

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

-- "0-3", "0,2,5-7": runs of three or more consecutive ranks as a range
function M.ranks(list)
  local t, i = {}, 1
  while i <= #list do
    local j = i
    while list[j + 1] == list[j] + 1 do j = j + 1 end
    t[#t + 1] = j > i + 1 and (list[i] .. "-" .. list[j]) or
                (j == i + 1 and (list[i] .. "," .. list[j]) or tostring(list[i]))
    i = j + 1
  end
  return concat(t, ",")
end

return M
