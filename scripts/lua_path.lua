-- The path preamble of the repository's Lua scripts (scripts/bench-*.lua):
-- puts the tree's lua/ first on package.path, wherever the script was
-- started from, and returns the tree's root.
--   local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local root = debug.getinfo(1, "S").source:match("^@(.*)/scripts/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
return root
