-- Life cycle of the model-parallel state: getters before initialization,
-- bad layouts, initialize -> destroy -> re-initialize with another layout,
-- custom groups (same name twice, same name on different rank sets, bad
-- arguments), shutdown and init again.
local U = require("helpers.group_util")
local weft = U.weft
local T = weft.tensor
local E, ok, check = U.expect_error, U.ok, U.check

local W = tonumber(os.getenv("WORLD_SIZE"))
local me = tonumber(os.getenv("RANK"))

E(function() weft.tp() end, { "tp", "not initialized", "initialize_model_parallel" }, "tp before init")
E(function() weft.world() end, { "weft is not initialized", "weft.init()" }, "world before init")
E(function() weft.create_custom_group({ 0 }) end, { "create_custom_group", "weft.init()" }, "custom before init")
check(not weft.model_parallel_is_initialized(), "nothing initialized")
ok("getters before init")

-- initialize_model_parallel initializes the world when needed
weft.initialize_model_parallel { tp = W }
local world = weft.world()
check(weft.init() == world, "init is idempotent")
check(weft.tp().world_size == W and weft.pp().world_size == 1, "tp=W layout")
E(function() weft.initialize_model_parallel { tp = W } end, { "already initialized", "destroy_model_parallel" }, "twice")
local dcp_err = E(function() weft.dcp() end, { "dcp", "not created: dcp is 1", "pass dcp > 1" }, "dcp absent")
check(not dcp_err:find("first", 1, true), "dcp absent after initialize_model_parallel: %s", dcp_err)
check(weft.dcp_or_nil() == nil, "dcp_or_nil")
local old_tp = weft.tp()
weft.destroy_model_parallel()
check(old_tp.destroyed, "old tp destroyed")
E(function() old_tp:all_reduce(T.zeros({ 1 }, "f32")) end, { "is destroyed" }, "old tp refuses")
E(function() weft.pp() end, { "not initialized" }, "pp after destroy")
ok("initialize, destroy")

-- bad layouts: refused on every rank before any group exists
E(function() weft.initialize_model_parallel { tp = W + 1 } end, { "initialize_model_parallel" }, "tp too big")
E(function() weft.initialize_model_parallel { tp = 0 } end, { "tp must be a positive integer" }, "tp 0")
E(function() weft.initialize_model_parallel { tpp = 2 } end, { "unknown option \"tpp\"" }, "typo")
E(function() weft.initialize_model_parallel { tp = W, ep = W + 1 } end, { "initialize_model_parallel" }, "ep too big")
check(not weft.model_parallel_is_initialized(), "still not initialized")
ok("bad layouts")

-- re-initialize with another layout (long SGLang names accepted), twice
for round = 1, 2 do
  weft.initialize_model_parallel { tensor_model_parallel_size = 1, pipeline_model_parallel_size = W }
  local tp, pp = weft.tp(), weft.pp()
  check(tp.world_size == 1 and pp.world_size == W and pp.rank_in_group == me, "tp=1 pp=W layout")
  local x = T.full({ 3 }, 2, "f32")
  pp:all_reduce(x)
  U.same(x:to_table(), { 2 * W, 2 * W, 2 * W }, "pp all_reduce after re-init")
  tp:all_reduce(x)     -- a group of one: bypass
  U.same(x:to_table(), { 2 * W, 2 * W, 2 * W }, "tp bypass")
  weft.destroy_model_parallel()
  weft.initialize_model_parallel { tp = W }
  x = T.full({ 3 }, me, "i64")
  weft.tp():all_reduce(x, "max")
  U.same(x:to_table(), { W - 1, W - 1, W - 1 }, "tp all_reduce after re-init " .. round)
  weft.destroy_model_parallel()
end
ok("re-initialize with other layouts")

-- custom groups
local a = weft.create_custom_group(world.ranks, "again")
local b = weft.create_custom_group(world.ranks, "again")
check(a ~= b and a.unique_name == "again", "two groups of one name")
local xa, xb = T.full({ 2 }, 1, "f32"), T.full({ 2 }, 10, "f32")
b:all_reduce(xb); a:all_reduce(xa)
U.same(xa:to_table(), { W, W }, "first of the same name")
U.same(xb:to_table(), { 10 * W, 10 * W }, "second of the same name")
a:destroy(); b:destroy()
if W >= 4 then
  -- one name, disjoint rank sets, created at once
  local mine = me < 2 and { 0, 1 } or { 2, 3 }
  if me < 4 then
    local p = weft.create_custom_group(mine, "pair")
    local x = T.full({ 1 }, me, "i32")
    p:all_reduce(x)
    U.same(x:to_table(), { mine[1] + mine[2] }, "pair " .. mine[1])
    p:destroy()
  end
end
-- reversed order: rank_in_group follows the list, not the rank number
local rev = {}
for r = W - 1, 0, -1 do rev[#rev + 1] = r end
local rg = weft.create_custom_group(rev, "reversed")
check(rg.rank_in_group == W - 1 - me and rg.first_rank == W - 1 and rg.last_rank == 0, "reversed group properties")
local got = rg:all_gather(T.full({ 1 }, me, "i32"), 0):to_table()
U.same(got, rev, "reversed all_gather follows group order")
rg:destroy()
E(function() weft.create_custom_group({ 0, W }) end, { "rank " .. W .. " is out of range" }, "custom out of range")
E(function() weft.create_custom_group({ 0, 0 }) end, { "rank 0 appears twice" }, "custom duplicate")
E(function() weft.create_custom_group({}) end, { "non-empty" }, "custom empty")
E(function() weft.create_custom_group({ 0 }, "a b") end, { "without spaces" }, "custom bad name")
ok("custom groups")

-- shutdown, then a fresh start in the same processes
weft.shutdown()
check(not weft.is_initialized(), "shut down")
E(function() world:barrier() end, { "is destroyed" }, "world after shutdown")
local w2 = weft.init()
check(w2 ~= world and w2.world_size == W, "init again")
local x = T.full({ 2 }, 1, "f32")
w2:all_reduce(x)
U.same(x:to_table(), { W, W }, "all_reduce after re-init of the world")
weft.shutdown()
ok("shutdown and init again")
