-- One rank of tests/faults/fault_buffers_spec.lua (2+ ranks through weft-run): freed
-- and in-use host buffers never reach a collective. A view (or narrow) of a
-- freed tensor raises "storage was freed" on every entry point, blocking and
-- async, and nothing is written into memory that was reused; freeing a view
-- leaves its base working; free() of a tensor a pending async operation
-- uses raises "in use by a pending <op>" and the operation completes right.
-- Prints "OK <name>" per passed check; any failure raises (rank exits 1).
local U = require("helpers.group_util")
local weft = U.weft
local T = weft.tensor
local async = require("weft.async")
local group = require("weft.group")
async.install(group.GroupCoordinator, group)   -- g:<op>_async, drain-first blocking calls
local E, ok, check = U.expect_error, U.ok, U.check

local world = weft.init {}
local W, me = world.world_size, world.rank
assert(W >= 2, "fault_buffers needs 2 or more ranks")
local N = 1048576

local function all_equal(t, v, what)
  local vals = t:to_table()
  for i = 1, #vals, 4099 do
    check(vals[i] == v, "%s: element %d is %s, expected %s", what, i, tostring(vals[i]), tostring(v))
  end
  check(vals[#vals] == v, "%s: last element is %s, expected %s", what, tostring(vals[#vals]), tostring(v))
end

local function healthy(label)
  local x = T.full({ 5 }, 1, "f32")
  world:all_reduce(x)
  all_equal(x, W, label .. ": group still works")
end

-- the issue's reproduction: a view outlives its freed base, and a new
-- tensor takes the memory; the collective must raise, not write into it
do
  local y = T.full({ N }, 1, "f32")
  local v = y:view({ N })
  local n2 = y:narrow(0, 0, N / 2)
  local v2 = y:view({ 1024, 1024 }):narrow(0, 1, 2)
  y:free()
  local z = T.full({ N }, me + 1, "f32")
  for _, c in ipairs { { "view", v }, { "narrow", n2 }, { "narrow of a view", v2 } } do
    local what, t = c[1], c[2]
    check(t.ptr == nil, "%s of a freed tensor keeps a pointer", what)
    E(function() world:all_reduce(t) end, { "all_reduce", "storage was freed" }, what .. " all_reduce")
    E(function() world:broadcast(t, 0) end, { "broadcast", "storage was freed" }, what .. " broadcast")
    E(function() world:all_gather(t, 0) end, { "all_gather", "storage was freed" }, what .. " all_gather")
    E(function() world:all_reduce_async(t) end, { "all_reduce", "storage was freed" }, what .. " all_reduce_async")
    E(function() world:broadcast_async(t, 0) end, { "broadcast", "storage was freed" }, what .. " broadcast_async")
    E(function() return t:to_table() end, { "to_table", "storage was freed" }, what .. " to_table")
    E(function() return t:view({ -1 }) end, { "view", "storage was freed" }, what .. " view")
    E(function() t:fill_(3) end, { "fill_", "storage was freed" }, what .. " fill_")
  end
  all_equal(z, me + 1, "new tensor after the refused collectives")
  world:barrier()
  all_equal(z, me + 1, "new tensor after a barrier")
  z:free()
  healthy("after freed views")
  ok("views of freed storage raise")
end

-- freeing a view drops the view only; its base keeps its storage
do
  local y = T.full({ N }, 2, "f32")
  local v = y:view({ 1024, 1024 })
  local n = y:narrow(0, 8, 16)
  v:free()
  v:free()
  n:free()
  check(y.ptr ~= nil, "base lost its pointer when a view was freed")
  E(function() return v:to_table() end, { "to_table", "storage was freed" }, "freed view to_table")
  E(function() world:all_reduce(n) end, { "all_reduce", "storage was freed" }, "freed narrow all_reduce")
  local other = T.full({ N }, 9, "f32") -- would take y's memory if it had gone
  world:all_reduce(y)
  all_equal(y, 2 * W, "base after its views were freed")
  all_equal(other, 9, "tensor made after the views were freed")
  local v3 = y:view({ N })
  world:all_reduce(v3)
  all_equal(y, 2 * W * W, "a new view of the base")
  y:free()
  check(v3.ptr == nil, "a view kept its pointer after its base was freed")
  other:free()
  ok("freeing a view keeps the base")
end

-- free() while an async collective uses the tensor: refused, the result right
do
  local x = T.full({ N }, me + 1, "f32")
  local xv = x:view({ 1024, 1024 })
  async.sleep(world, 300)              -- keeps the all-reduce pending for 300 ms
  local h = world:all_reduce_async(x)
  E(function() x:free() end, { "tensor.free", "in use by a pending all_reduce", world.unique_name }, "free while pending")
  E(function() xv:free() end, { "tensor.free", "in use by a pending all_reduce" }, "free of a view while pending")
  check(T.is_pinned(x), "tensor not pinned while its all-reduce is pending")
  local z = T.zeros({ N }, "f32")      -- would take x's memory if it had gone
  local got = h:wait()
  check(got == x, "all_reduce_async result is not its tensor")
  local sum = W * (W + 1) / 2
  all_equal(x, sum, "async all-reduce result after a refused free")
  all_equal(z, 0, "tensor made while the all-reduce was pending")
  check(not T.is_pinned(x), "tensor still pinned after its handle settled")
  x:free()
  check(x.ptr == nil and xv.ptr == nil, "free after the wait did not release")
  -- a handle nobody holds: drained by the next blocking call, then released
  local y = T.full({ N }, 1, "f32")
  async.sleep(world, 100)
  world:broadcast_async(y, 0)
  E(function() y:free() end, { "in use by a pending broadcast" }, "free while a dropped handle is pending")
  world:barrier()                      -- drains the queue first
  y:free()
  z:free()
  healthy("after pinned frees")
  ok("free of a pinned tensor raises")
end

world:barrier()
ok("done")
weft.shutdown()
