-- Bad inputs to group collectives: each raises a clear "weft: <op>: ..." error
-- on the rank(s) that made the mistake and never hangs the others; the group
-- keeps working afterwards. Needs at least 2 ranks.
-- WEFT_TEST_BACKEND=store forces the store path for host tensors.
local U = require("helpers.group_util")
local weft = U.weft
local T = weft.tensor
local E, ok, check = U.expect_error, U.ok, U.check

local backend = os.getenv("WEFT_TEST_BACKEND")
local world = weft.init { backend = backend ~= "" and backend or nil }
local W, me = world.world_size, world.rank
assert(W >= 2, "group_errors needs 2 or more ranks")

local function healthy(g, label)
  local x = T.full({ 5 }, 1, "f32")
  g:all_reduce(x)
  U.same(x:to_table(), { g.world_size, g.world_size, g.world_size, g.world_size, g.world_size },
         label .. ": group still works")
end

-- wrong dtype (the same mistake on every rank: refused before any exchange)
local f8 = T.zeros({ 4 }, "f8e4m3")
E(function() world:all_reduce(f8) end, { "all_reduce", "dtype f8e4m3 cannot be reduced", "world" }, "f8 all_reduce")
E(function() world:all_reduce(T.zeros({ 4 }, "f32"), "avg") end, { "unknown reduction \"avg\"" }, "bad op")
E(function() world:all_gather(T.zeros({ 2 }, "f32"), 0, T.zeros({ 2 * W }, "bf16")) end,
  { "all_gather", "output dtype bf16 differs from input dtype f32" }, "all_gather out dtype")
E(function() world:fused_allreduce_rmsnorm(T.zeros({ 2, 8 }, "i32"), T.zeros({ 2, 8 }, "i32"), T.zeros({ 8 }, "i32"), 1e-6) end,
  { "fused_allreduce_rmsnorm", "dtype i32 is not supported" }, "fused dtype")
E(function() world:fused_allreduce_rmsnorm(T.zeros({ 2, 8 }, "f32"), T.zeros({ 2, 8 }, "bf16"), T.zeros({ 8 }, "f32"), 1e-6) end,
  { "dtypes differ" }, "fused mixed dtypes")
E(function() world:all_reduce({ 1, 2, 3 }) end, { "all_reduce", "must be a weft tensor, got a table" }, "not a tensor")
healthy(world, "after dtype errors")
ok("wrong dtype")

-- shape mismatch
E(function() world:all_gather(T.zeros({ 2, 3 }, "f32"), 1, T.zeros({ 2, 3 }, "f32")) end,
  { "all_gather", "output shape {2,3}, expected {2," .. 3 * W .. "}" }, "all_gather out shape")
E(function() world:reduce_scatter(T.zeros({ 2, W + 1 }, "f32"), 1) end,
  { "reduce_scatter", "not divisible by the " .. W .. " ranks" }, "reduce_scatter indivisible")
E(function() world:all_gather(T.zeros({ 2, 3 }, "f32"), 2) end, { "dim 2 is invalid for a tensor of shape {2,3}" }, "bad dim")
E(function() world:fused_allreduce_rmsnorm(T.zeros({ 2, 8 }, "f32"), T.zeros({ 2, 4 }, "f32"), T.zeros({ 8 }, "f32"), 1e-6) end,
  { "residual shape {2,4} differs from input shape {2,8}" }, "fused residual shape")
E(function() world:fused_allreduce_rmsnorm(T.zeros({ 2, 8 }, "f32"), T.zeros({ 2, 8 }, "f32"), T.zeros({ 4 }, "f32"), 1e-6) end,
  { "weight shape {4} must be {8}" }, "fused weight shape")
E(function() world:all_to_all_single(T.zeros({ W + 1, 2 }, "f32"), T.zeros({ W + 1, 2 }, "f32")) end,
  { "all_to_all_single", "divisible by " .. W .. " ranks" }, "all_to_all indivisible")
E(function() world:all_to_all_single(T.zeros({ W, 3 }, "f32"), T.zeros({ W, 2 }, "f32")) end,
  { "differ beyond dim 0" }, "all_to_all shapes")
-- a receiver expecting another shape than was sent: only it fails
if me == 0 then
  world:send(T.zeros({ 2, 3 }, "f32"), 1)
elseif me == 1 then
  E(function() world:recv({ 3, 2 }, 0, "f32") end, { "recv", "rank 0 sent f32 {2,3}, this rank expected f32 {3,2}" }, "recv shape")
end
healthy(world, "after shape errors")
ok("shape mismatch")

-- non-contiguous views
local base = T.zeros({ 4, 6 }, "f32")
E(function() world:all_reduce(base:transpose(0, 1)) end, { "all_reduce", "not contiguous", "shape {6,4}" }, "transposed")
E(function() world:broadcast(base:narrow(1, 1, 2), 0) end, { "broadcast", "not contiguous" }, "narrowed")
E(function() world:send(base:transpose(0, 1), (me + 1) % W) end, { "send", "not contiguous" }, "send view")
check(world:all_reduce(base:narrow(0, 1, 2)) ~= nil, "a contiguous narrow view is fine")
ok("non-contiguous tensors")

-- an output that overlaps its input in part (issue 37): refused before
-- anything moves, nothing written; in place and this rank's block still work
local buf = T.from_table({ 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3 }, "f32", { 12 })
E(function() world:all_reduce(buf:narrow(0, 0, 8), "sum", buf:narrow(0, 4, 8)) end,
  { "all_reduce", "input and output overlap in part", "group world" }, "overlapping output")
U.same(buf:to_table(), { 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3 }, "nothing written")
local gbuf = T.zeros({ 2 * W + 2 }, "f32")
E(function() world:all_gather(gbuf:narrow(0, 2 * me + 1, 2), 0, gbuf:narrow(0, 0, 2 * W)) end,
  { "all_gather", "output and input overlap in part" }, "gather input off its block")
local ag = T.zeros({ 2 * W }, "f32")
ag:narrow(0, 2 * me, 2):fill_(me + 1)
world:all_gather(ag:narrow(0, 2 * me, 2), 0, ag)
for r = 0, W - 1 do check(ag:to_table()[2 * r + 1] == r + 1, "in-place all_gather block %d", r) end
local rs = T.full({ 2 * W }, 1, "f32")
world:reduce_scatter(rs, 0, rs:narrow(0, 2 * me, 2))
check(rs:to_table()[2 * me + 1] == W, "in-place reduce_scatter chunk")
healthy(world, "after overlap errors")
ok("overlapping outputs")

-- rank out of range
E(function() world:broadcast(T.zeros({ 2 }, "f32"), W) end,
  { "broadcast", "src " .. W .. " is out of range for group world of " .. W .. " ranks" }, "broadcast src")
E(function() world:broadcast_object("x", -1) end, { "broadcast_object", "src -1 is out of range" }, "bcast obj src")
E(function() world:send(T.zeros({ 2 }, "f32"), W + 3) end, { "send", "dst " .. (W + 3) .. " is out of range" }, "send dst")
E(function() world:recv({ 2 }, 0.5) end, { "recv", "src 0.5 is out of range" }, "recv src")
E(function() world:gather(T.zeros({ 2 }, "f32"), 99) end, { "gather", "dst 99 is out of range" }, "gather dst")
E(function() world:send_object(1, me) end, { "send_object", "this rank's own index" }, "send to self")
healthy(world, "after range errors")
ok("rank out of range")

-- different sizes on different ranks: every rank fails, none hangs
E(function() world:all_reduce(T.zeros({ me == 0 and 4 or 8 }, "f32")) end, { "all_reduce" }, "sizes differ")
E(function() world:all_gather(T.zeros({ me == 0 and 3 or 2 }, "bf16"), 0) end, { "all_gather" }, "gather sizes differ")
healthy(world, "after size mismatch")
ok("different sizes on different ranks")

-- a collective on a group this rank is not in
local firsts = weft.create_custom_group({ 0, 1 }, "firsts")
if me >= 2 then
  check(not firsts.is_member and firsts.rank_in_group == nil, "non-member coordinator")
  E(function() firsts:all_reduce(T.zeros({ 2 }, "f32")) end,
    { "all_reduce", "rank " .. me .. " is not in group firsts (ranks 0,1)" }, "non-member")
  E(function() firsts:barrier() end, { "barrier", "not in group firsts" }, "non-member barrier")
else
  check(firsts.is_member and firsts.world_size == 2, "member coordinator")
  healthy(firsts, "firsts")
end
ok("group this rank is not in")

-- destroyed group: every op refuses, destroy is idempotent
firsts:destroy()
firsts:destroy()
for _, f in ipairs({
  function() firsts:all_reduce(T.zeros({ 2 }, "f32")) end,
  function() firsts:barrier() end,
  function() firsts:broadcast_object(1) end,
  function() firsts:all_gather(T.zeros({ 2 }, "f32")) end,
}) do
  E(f, { "group firsts is destroyed" }, "destroyed")
end
ok("destroyed group")

-- objects that cannot travel: the source fails before sending; on a group
-- with a short timeout the others get an error naming it, not a hang
local g1 = weft.create_custom_group(world.ranks, "unsendable", { timeout_ms = 400 })
if me == 0 then
  E(function() g1:broadcast_object({ f = print }, 0) end, { "serialize", "function", "rank 0" }, "function object")
else
  E(function() g1:broadcast_object(nil, 0) end, { "broadcast_object", "rank 0" }, "bcast from a rank that failed")
end
g1:destroy()
world:barrier()
ok("unserializable objects")

-- a rank that never arrives: the others get a timeout naming it
local g2 = weft.create_custom_group(world.ranks, "late", { timeout_ms = 1500 })
local late = W - 1
if me ~= late then
  local err = E(function() g2:barrier() end, { "rank " .. late }, "missing rank")
  check(err:find("timed out", 1, true) ~= nil, "a timeout: %s", err)
end
g2:destroy()
ok("rank that never arrives")
healthy(world, "world after the timeouts")

weft.shutdown()
ok("done")
