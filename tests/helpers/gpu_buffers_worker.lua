-- One rank of tests/gpu/gpu_buffers_spec.lua (`scripts/weft-run -n 2
-- tests/helpers/gpu_buffers_worker.lua`, one GPU per rank): the device side
-- of freed and in-use buffers (issue 13 items 1-3). A view of freed device
-- storage never reaches a collective; free() of a device tensor that a
-- pending async NCCL all-reduce uses raises; and a custom all-reduce kernel
-- that gives up on a peer (rank 1 never calls) is reported at the next host
-- wait of rank 0 (to_table, compare, synchronize, stream and event waits),
-- naming the group, the operation and the cause, instead of its wrong output
-- being read quietly. Prints "PASS <name> (<s> s)" or "FAIL <name>: <why>".
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local R = require("helpers.gpu_worker")
local G, weft, T, cuda, car, async = R.G, R.weft, R.T, R.cuda, R.car, R.async
local group = require("weft.group")
async.install(group.GroupCoordinator, group)

local world = weft.init { timeout_ms = 30000 }
local me, W = world.rank, world.world_size
assert(W == 2, "run with 2 ranks")
weft.initialize_model_parallel { tp = 2 }
local tp = weft.tp()
local DEV = "cuda:" .. cuda.current_device()
local N = 1048576

local S = G.soft_checks()
local want, expect_error = S.want, S.expect_error
local check, done = G.checks(world, S)

local function first(t) return t:to_table()[1] end

check("device_freed_views", function()
  local y = T.full({ N }, 1, "f32", DEV)
  local v, n = y:view({ 1024, 1024 }), y:narrow(0, 4096, 4096)
  y:free()
  local z = T.full({ N }, me + 1, "f32", DEV)   -- may take y's memory from the pool
  want(v.ptr == nil and n.ptr == nil, "views of a freed device tensor keep their pointers")
  expect_error("storage was freed", tp.all_reduce, tp, v)
  expect_error("storage was freed", tp.all_reduce, tp, n)
  expect_error("storage was freed", tp.broadcast, tp, v, 0)
  expect_error("storage was freed", tp.all_reduce_async, tp, v)
  expect_error("storage was freed", v.to_table, v)
  tp:barrier()
  want(first(z) == me + 1, "new device tensor holds %s, expected %d", tostring(first(z)), me + 1)
  -- freeing a view keeps its base
  local b = T.full({ N }, 2, "f32", DEV)
  local bv = b:view({ N })
  bv:free()
  tp:all_reduce(b)
  want(first(b) == 4, "base after its view was freed holds %s, expected 4", tostring(first(b)))
  b:free(); z:free()
end)

check("device_pinned_async", function()
  local warm = T.ones({ 16 }, "f32", DEV)
  tp:all_reduce(warm)                          -- makes the NCCL communicator
  if not require("weft.backends.device_backends").info(tp).nccl then
    -- ranks sharing a GPU (no NCCL): the async form runs weft's kernel at
    -- once, ordered on the stream, and returns a finished handle; a free()
    -- after it is stream-ordered like any other (the pool reuses on the stream)
    local x = T.full({ N }, me + 1, "f32", DEV)
    local h = tp:all_reduce_async(x)
    want(h:test(), "the handle without NCCL is not finished")
    want(first(x) == 3, "async all-reduce result %s, expected 3", tostring(first(x)))
    x:free()
    local z = T.zeros({ N }, "f32", DEV)
    want(first(z) == 0, "tensor made after the free holds %s", tostring(first(z)))
    h:wait()
    z:free(); warm:free()
    return
  end
  local x = T.full({ N }, me + 1, "f32", DEV)
  async.sleep(tp, 300)                         -- keeps the all-reduce pending
  local h = tp:all_reduce_async(x)
  expect_error("in use by a pending all_reduce", x.free, x)
  expect_error("in use by a pending all_reduce", function() x:view({ N }):free() end)
  local z = T.zeros({ N }, "f32", DEV)         -- would take x's memory if it had gone
  h:wait()
  want(first(x) == 3, "async all-reduce result %s, expected 3", tostring(first(x)))
  want(first(z) == 0, "tensor made while pending holds %s", tostring(first(z)))
  x:free(); z:free(); warm:free()
end)

check("custom_ar_failure_raises_at_host_waits", function()
  local ar = car.new(world.cpu_group, 1048576)
  ar:set_timeout(500)
  local x = T.ones({ 4096 }, "bf16", DEV)
  ar:run(x.ptr, x.ptr, 4096, "bf16", "oneshot")
  want(first(x) == 2, "good call: %s, expected 2", tostring(first(x)))
  world:barrier()
  if me == 0 then                              -- rank 1 never calls: the one-shot times out
    local t0 = weft.now_us()
    ar:run(x.ptr, x.ptr, 4096, "bf16", "oneshot")
    local pat = "allreduce %(group '[^']*', rank 0 of 2%): peer 1 .*did not arrive"
    expect_error("cuda copy: .*" .. pat, x.to_table, x)
    local dt = (weft.now_us() - t0) / 1e6
    want(dt < 5, "reported after %.1f s (timeout 0.5 s)", dt)
    expect_error(pat, x.compare, x, T.full({ 4096 }, 2, "f32"))
    expect_error("cuda synchronize: .*" .. pat, cuda.synchronize)
    expect_error(pat, function() cuda.current_stream():synchronize() end)
    expect_error(pat, function() local ev = cuda.event(); ev:record(); ev:synchronize() end)
    expect_error(pat, function() return T.zeros({ 8 }, "f32", DEV):to_table() end)
    want(ar:check_error() ~= nil, "check_error reports nothing")
    ar:destroy()                               -- the report goes with the handle
    local ok, err = pcall(function() return T.full({ 8 }, 5, "f32", DEV):to_table() end)
    want(ok, "host wait after destroy: %s", tostring(err))
  else
    ar:destroy()
  end
  x:free()
end)

weft.destroy_model_parallel()
weft.shutdown()
done()
