-- One rank of tests/faults/fault_agreement_spec.lua: ranks that disagree (on which
-- object collective they call, on initialize_model_parallel's arguments, on a
-- custom group's rank list) all fail at once naming each rank's part, the
-- group keeps working, and shutdown() completes. AGREE_CASE=objects (2 ranks)
-- or setup (4 ranks). Prints "ELAPSED <what> <ms>" per error and "OK <name>".
local U = require("helpers.group_util")
local weft = U.weft
local T = weft.tensor
local async = require("weft.async")
local now_ms = require("weft.internal.clock").now_ms
local E, ok, check = U.expect_error, U.ok, U.check

local world = weft.init()
local W, me = world.world_size, world.rank

-- fn raises on this rank with every string of wants, within a few seconds
local function fails_fast(what, fn, wants)
  local t0 = now_ms()
  local err = E(fn, wants, what)
  local ms = now_ms() - t0
  U.say("ELAPSED %s %d", what, ms)
  check(ms < 5000, "%s: the error took %d ms (the timeout is %s ms): %s", what, ms,
        tostring(os.getenv("WEFT_TIMEOUT_MS")), err)
  return err
end

local function healthy(label)
  local all = world:all_gather_object(me * 10)
  for r = 0, W - 1 do check(all[r + 1] == r * 10, "%s: all_gather_object after the error", label) end
  check(world:broadcast_object(me == 1 and "b" or nil, 1) == "b", "%s: broadcast_object after the error", label)
end

local function objects()
  assert(W == 2, "the objects case runs on 2 ranks")
  -- the issue's case: one rank broadcasts, the other all-gathers
  local call_0, call_1 = "rank 0: broadcast_object src=0", "rank 1: all_gather_object"
  fails_fast("broadcast_object vs all_gather_object", function()
    if me == 0 then return world:broadcast_object({ 1, 2 }, 0) end
    return world:all_gather_object("x")
  end, { me == 0 and "broadcast_object" or "all_gather_object", "ranks called different collectives on group world",
         call_0, call_1 })
  healthy("bcast/gather")
  ok("broadcast_object vs all_gather_object")

  -- each rank names itself the source: both would return their own object
  fails_fast("two sources", function() return world:broadcast_object(me, me) end,
             { "broadcast_object src=0", "broadcast_object src=1" })
  healthy("two sources")
  ok("different sources")

  -- a tensor dict against a plain object broadcast
  fails_fast("broadcast_tensor_dict vs broadcast_object", function()
    if me == 0 then return world:broadcast_tensor_dict({ a = 1, t = T.zeros({ 2 }, "f32") }, 0) end
    return world:broadcast_object(nil, 0)
  end, { "rank 0: broadcast_tensor_dict src=0", "rank 1: broadcast_object src=0" })
  healthy("tensor dict")
  ok("broadcast_tensor_dict vs broadcast_object")

  -- async against blocking: the same parts, so they meet and both fail
  fails_fast("async all_gather_object vs broadcast_object", function()
    if me == 0 then return async.all_gather_object(world, "a"):wait() end
    return world:broadcast_object(nil, 0)
  end, { "rank 0: all_gather_object", "rank 1: broadcast_object src=0" })
  check(async.broadcast_object(world, me == 0 and "fine" or nil, 0):wait() == "fine", "async after the error")
  healthy("async")
  ok("async vs blocking")

  -- point to point: the receiver names what was sent
  if me == 0 then
    world:send_object({ 1 }, 1)
    world:send_tensor_dict({ k = 1 }, 1)
    world:send(T.zeros({ 2 }, "f32"), 1)
  else
    fails_fast("send_object vs recv", function() return world:recv({ 2 }, 0) end,
               { "recv", "rank 0 sent with send_object", "expects send" })
    fails_fast("send_tensor_dict vs recv_object", function() return world:recv_object(0) end,
               { "recv_object", "rank 0 sent with send_tensor_dict" })
    fails_fast("send vs recv_tensor_dict", function() return world:recv_tensor_dict(0) end,
               { "recv_tensor_dict", "rank 0 sent with send," })
  end
  healthy("p2p")
  ok("send/recv mismatches")
end

local function setup()
  assert(W == 4, "the setup case runs on 4 ranks")
  -- one rank asks for another (valid) layout: the others' groups would never
  -- meet its own
  fails_fast("initialize_model_parallel tp", function()
    if me == 1 then weft.initialize_model_parallel { tp = 4 } else weft.initialize_model_parallel { tp = 2, pp = 2 } end
  end, { "initialize_model_parallel", "ranks passed different arguments",
         "ranks 0,2,3: pp=2 tp=2; rank 1: pp=1 tp=4" })
  check(not weft.model_parallel_is_initialized(), "nothing built after the disagreement")
  -- only the differing argument is named; a default counts as given
  fails_fast("initialize_model_parallel pp", function()
    if me == 3 then weft.initialize_model_parallel { tp = 2 } else weft.initialize_model_parallel { tp = 2, pp = 2 } end
  end, { "ranks 0-2: pp=2; rank 3: pp=1" })
  -- long names and explicit defaults are the same arguments
  if me == 0 then
    weft.initialize_model_parallel { tensor_model_parallel_size = 2, pp = 2, dcp = 1 }
  else
    weft.initialize_model_parallel { tp = 2, pp = 2 }
  end
  check(weft.tp().world_size == 2 and weft.pp().world_size == 2, "agreed layout built")
  local x = T.full({ 3 }, 1, "f32")
  weft.tp():all_reduce(x)
  U.same(x:to_table(), { 2, 2, 2 }, "tp all_reduce")
  weft.destroy_model_parallel()
  ok("initialize_model_parallel arguments")

  -- custom group rank lists: rank 1 lists rank 2 as well, rank 0 does not
  if me < 2 then
    fails_fast("custom group lists", function()
      weft.create_custom_group(me == 1 and { 0, 1, 2 } or { 0, 1 }, "pairs")
    end, { "create_custom_group", "ranks passed different rank lists for group pairs",
           "rank 0: ranks 0,1; rank 1: ranks 0,1,2" })
  end
  -- order matters too (rank_in_group follows the list)
  fails_fast("custom group order", function()
    weft.create_custom_group(me == 3 and { 3, 2, 1, 0 } or { 0, 1, 2, 3 }, "ordered")
  end, { "ranks passed different rank lists for group ordered", "ranks 0,1,2,3", "ranks 3,2,1,0" })
  -- agreeing lists still work, also one name on disjoint rank sets
  local g = weft.create_custom_group(me < 2 and { 0, 1 } or { 2, 3 }, "halves")
  local y = T.full({ 1 }, me, "i32")
  g:all_reduce(y)
  U.same(y:to_table(), { me < 2 and 1 or 5 }, "halves all_reduce")
  g:destroy()
  local all = weft.create_custom_group({ 0, 1, 2, 3 }, "all")
  check(all:all_gather_object(me)[4] == 3, "all-ranks custom group")
  all:destroy()
  ok("custom group rank lists")
end

local case = os.getenv("AGREE_CASE")
if case == "objects" then objects() elseif case == "setup" then setup() else error("AGREE_CASE?") end

local t0 = now_ms()
weft.shutdown()
U.say("ELAPSED shutdown %d", now_ms() - t0)
ok("shutdown")
