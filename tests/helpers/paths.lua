-- The path preamble of a helper that runs as its own process (a rank under
-- scripts/weft-run or store_util.spawn, not a busted spec): puts the tree's
-- lua/ and tests/ first on package.path, wherever the process was started
-- from, and returns the tree's root.
--   local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/paths.lua")
local root = debug.getinfo(1, "S").source:match("^@(.*)/tests/helpers/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. root .. "/tests/?.lua;" .. package.path
return root
