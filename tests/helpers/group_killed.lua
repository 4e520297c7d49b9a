-- A rank dies in the middle of a job (exits without a word, like a crash):
-- the others' next shared-memory collective fails with an error naming it
-- instead of hanging. Needs at least 2 ranks.
local U = require("helpers.group_util")
local weft = U.weft
local T = weft.tensor

local world = weft.init()
local W, me = world.world_size, world.rank
require("ffi").cdef("int getpid(void);")
U.say("pid %d", require("ffi").C.getpid())
local victim = W - 1
local x = T.full({ 1024 }, 1, "f32")
world:all_reduce(x)
U.same({ x:to_table()[1] }, { W }, "all_reduce before the death")
U.ok("all_reduce before")
if me == victim then
  io.stdout:flush()
  os.exit(0, false)          -- no shutdown, no goodbye: gone
end
local err = U.expect_error(function()
  for _ = 1, 1000 do world:all_reduce(x) end
end, { "all_reduce", "group world" }, "collective with a dead peer")
U.check(err:find("rank " .. victim, 1, true) or err:find("global " .. victim, 1, true),
        "the error names the dead rank: %s", err)
U.say("error: %s", err)
U.ok("dead peer reported")
os.exit(0, false)
