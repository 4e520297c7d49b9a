-- Rank script for launcher_spec: prints its environment on one line.
io.stdout:setvbuf("line")
local names = { "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "WEFT_NNODES", "WEFT_NODE_RANK" }
local parts = { "ENV" }
for _, n in ipairs(names) do parts[#parts + 1] = n .. "=" .. tostring(os.getenv(n)) end
-- `require("weft...")` must resolve inside the repository's lua/ directory
local found = package.searchpath("weft.tools.launcher", package.path)
parts[#parts + 1] = "WEFT_MODULE=" .. tostring(found and found:match("lua/weft/tools/launcher%.lua$") ~= nil)
parts[#parts + 1] = "ARGS=" .. table.concat(arg, ",")
print(table.concat(parts, " "))
