-- Loads one weft module in this fresh process (tests/unit/require_cycle_spec.lua:
-- luajit -e "MOD='weft.x'" tests/helpers/require_probe.lua), watching every
-- require of a weft module made while it loads. Prints:
--   LOOP a > b > a   a require that came back to a module still loading (Lua
--                    raises "loop or previous error loading module" there,
--                    whether or not a pcall catches it)
--   OK               the module loaded
--   ERR <message>    it did not (the message on one line)
package.path = "lua/?.lua;lua/?/init.lua;" .. package.path
local real_require, concat = require, table.concat
local loading = {}   -- the weft modules being loaded, outermost first

local function watched(name)
  if type(name) ~= "string" or not name:match("^weft") then return real_require(name) end
  for i = 1, #loading do
    if loading[i] == name then print("LOOP " .. concat(loading, " > ", i) .. " > " .. name) end
  end
  loading[#loading + 1] = name
  local ok, a, b = pcall(real_require, name)
  loading[#loading] = nil
  if not ok then error(a, 0) end
  return a, b
end
_G.require = watched

local ok, err = pcall(require, MOD)
print(ok and "OK" or ("ERR " .. tostring(err):gsub("\n", " ")))
