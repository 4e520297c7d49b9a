-- Multi-rank checks of weft.async (run by tests/unit/async_spec.lua under
-- scripts/weft-run). Prints "OK <name>" per passed check; any failure raises,
-- so the rank exits non-zero and weft-run fails.
local ffi = require("ffi")
local weft = require("weft")
local async = require("weft.async")
local group = require("weft.group")
local T = weft.tensor

local function say(fmt, ...) io.stdout:write(fmt:format(...), "\n"); io.stdout:flush() end
local function ok(name) say("OK %s", name) end
local function check(cond, fmt, ...) if not cond then error("check failed: " .. fmt:format(...), 2) end end

async.install(group.GroupCoordinator, group)

local world = weft.init()
local W, me = world.world_size, world.rank_in_group
local backend_env = os.getenv("WEFT_HOST_BACKEND") or "auto"

-- integer-valued data of (rank, tag): exact in every dtype
local function data(n, dtype, rank, tag)
  local v = {}
  for i = 1, n do v[i] = ((rank + 1) * 3 + i * 7 + tag) % 5 - 2 end
  return T.from_table(v, dtype, { n }), v
end

local function expect_sum(n, tag)
  local s = {}
  for i = 1, n do
    local acc = 0
    for r = 0, W - 1 do acc = acc + (((r + 1) * 3 + i * 7 + tag) % 5 - 2) end
    s[i] = acc
  end
  return s
end

local function same(a, b, what)
  check(#a == #b, "%s: %d values, expected %d", what, #a, #b)
  for i = 1, #a do check(a[i] == b[i], "%s: element %d is %s, expected %s", what, i, tostring(a[i]), tostring(b[i])) end
end

-- 1. all_reduce in several dtypes (shm native, shm gather-reduce for u8/prod, or store)
for _, dt in ipairs({ "f32", "f64", "i32", "bf16", "f16", "i64" }) do
  local t = data(37, dt, me, 1)
  local h = world:all_reduce_async(t)
  check(getmetatable(h) == async.Handle, "all_reduce_async returns a handle")
  local r = h:wait()
  check(r == t, "result is the tensor itself (in place)")
  same(t:to_table(), expect_sum(37, 1), "all_reduce " .. dt)
end
ok("all_reduce dtypes " .. backend_env)

do -- max and prod (prod goes through gather + local reduce on shm)
  local t = data(16, "i32", me, 2)
  world:all_reduce_async(t, "max"):wait()
  local want = {}
  for i = 1, 16 do
    local m = -math.huge
    for r = 0, W - 1 do m = math.max(m, ((r + 1) * 3 + i * 7 + 2) % 5 - 2) end
    want[i] = m
  end
  same(t:to_table(), want, "all_reduce max")
  local p = T.from_table({ me + 1, 2, -1 }, "i32", { 3 })
  world:all_reduce_async(p, "prod"):wait()
  local f = 1
  for r = 0, W - 1 do f = f * (r + 1) end
  same(p:to_table(), { f, 2 ^ W, (-1) ^ W }, "all_reduce prod")
end
ok("all_reduce ops")

do -- all_gather along dim 0 and along the last dim
  local t = T.from_table({ me * 10 + 1, me * 10 + 2, me * 10 + 3, me * 10 + 4 }, "f32", { 2, 2 })
  local o0 = world:all_gather_async(t, 0):wait()
  check(o0.shape[1] == 2 * W and o0.shape[2] == 2, "all_gather dim 0 shape")
  local want = {}
  for r = 0, W - 1 do for k = 1, 4 do want[#want + 1] = r * 10 + k end end
  same(o0:to_table(), want, "all_gather dim 0")
  local o1 = world:all_gather_async(t, -1):wait()
  want = {}
  for row = 0, 1 do
    for r = 0, W - 1 do for k = 1, 2 do want[#want + 1] = r * 10 + row * 2 + k end end
  end
  same(o1:to_table(), want, "all_gather dim -1")
end
ok("all_gather")

do -- broadcast from the last rank, barrier
  local src = W - 1
  local t = me == src and T.from_table({ 5, 6, 7 }, "f32", { 3 }) or T.zeros({ 3 }, "f32")
  world:broadcast_async(t, src):wait()
  same(t:to_table(), { 5, 6, 7 }, "broadcast")
  check(world:barrier_async():wait() == true, "barrier")
end
ok("broadcast barrier")

do -- reduce_scatter along dim 0
  local t = T.from_table((function() local v = {} for i = 1, 2 * W do v[i] = i + me end return v end)(), "f32", { 2 * W })
  local o = world:reduce_scatter_async(t, 0):wait()
  local want = {}
  for k = 1, 2 do
    local i = me * 2 + k
    local s = 0
    for r = 0, W - 1 do s = s + i + r end
    want[k] = s
  end
  same(o:to_table(), want, "reduce_scatter")
end
ok("reduce_scatter")

do -- objects
  local obj = world:broadcast_object_async(me == 0 and { step = 7, x = { 1, 2, 3 }, s = "hi" } or nil, 0):wait()
  check(obj.step == 7 and obj.x[3] == 3 and obj.s == "hi", "broadcast_object")
  local all = world:all_gather_object_async({ rank = me, pid = me * 100 }):wait()
  check(#all == W, "all_gather_object count")
  for r = 0, W - 1 do check(all[r + 1].rank == r, "all_gather_object order") end
  local nxt, prv = (me + 1) % W, (me - 1) % W
  local hs = world:send_object_async({ from = me }, nxt)
  local got = world:recv_object_async(prv):wait()
  hs:wait()
  check(got.from == prv, "send/recv object ring")
  local v = async.allreduce_i64(world, { me, 1, me == 0 and 5 or 2 }, "max"):wait()
  check(v[1] == W - 1 and v[2] == 1 and v[3] == (W > 1 and 5 or 5), "allreduce_i64")
end
ok("objects")

do -- many ops in flight, waited in reverse order: submission order is execution order
  local hs, ts = {}, {}
  for k = 1, 12 do
    ts[k] = data(8, "f32", me, 10 + k)
    hs[k] = world:all_reduce_async(ts[k])
  end
  local hb = world:broadcast_object_async(me == 0 and "last" or nil, 0)
  check(hb:wait() == "last", "object after tensors")
  for k = 12, 1, -1 do hs[k]:wait(); same(ts[k]:to_table(), expect_sum(8, 10 + k), "in flight " .. k) end
  check(async.pending(world) == 0, "nothing pending")
end
ok("in flight order")

do -- a blocking call drains the queue first
  local a = data(8, "f32", me, 30)
  local h = world:all_reduce_async(a)
  local b = data(8, "f32", me, 31)
  world:all_reduce(b)                 -- the installed wrapper drains first
  check(h.state ~= "pending" or h:done(), "pending op drained before the blocking call")
  h:wait()
  same(a:to_table(), expect_sum(8, 30), "drained op")
  same(b:to_table(), expect_sum(8, 31), "blocking op")
end
ok("blocking drains")

do -- dropped handles keep their inputs alive
  for k = 1, 4 do world:all_reduce_async((data(1024, "f32", me, 40 + k))) end
  collectgarbage(); collectgarbage()
  check(async.drain(world) >= 0, "drain")
  check(async.pending(world) == 0, "no pending after drain")
end
ok("dropped handles")

do -- the caller is never blocked: rank 0 polls from a coroutine while another
   -- coroutine lets rank 1 proceed (store key) only after running a few times
  -- a second connection: a cpu-group wait on the worker holds the group
  -- store handle's mutex (store backend), so signal through another handle
  local S = weft.dist.state
  local store = require("weft.store").open { host = S.master_addr, port = S.master_port, timeout_ms = 30000 }
  local key = "async-test/go"
  if me == 0 then
    local t = data(4, "f32", me, 50)
    local h = world:all_reduce_async(t)
    local other_ran = 0
    local poller = coroutine.create(function()
      return async.poll_wait(h, coroutine.yield, 30000)
    end)
    local helper = coroutine.create(function()
      for _ = 1, 5 do other_ran = other_ran + 1; coroutine.yield() end
      store:set(key, "1")
    end)
    while coroutine.status(poller) ~= "dead" do
      local okp, errp = coroutine.resume(poller)
      if not okp then error(errp) end
      if coroutine.status(helper) ~= "dead" then assert(coroutine.resume(helper)) end
    end
    check(other_ran == 5, "the other coroutine ran while the all_reduce was pending (%d)", other_ran)
    same(t:to_table(), expect_sum(4, 50), "polled all_reduce")
  else
    store:get(key, 30000)
    local t = data(4, "f32", me, 50)
    world:all_reduce(t)
  end
  store:close()
end
ok("poll_wait yields")

do -- errors: ranks disagree on the size; the message is raised on the caller
  local n = me == 0 and 4 or 8
  local h = world:all_reduce_async(T.zeros({ n }, "f32"))
  local okw, err = pcall(h.wait, h)
  check(not okw, "mismatched sizes must fail")
  check(err:find("weft: all_reduce: group world:", 1, true), "message names op and group: %s", err)
  local okt, err2 = pcall(h.test, h)
  check(not okt and err2 == err, "the error stays on the handle")
  -- the group is still usable afterwards
  local t = data(4, "f32", me, 60)
  world:all_reduce_async(t):wait()
  same(t:to_table(), expect_sum(4, 60), "usable after a mismatch")
end
ok("errors")

do -- a timeout on a custom group: rank 0 waits in a barrier the others skip
  local cg = weft.create_custom_group((function() local r = {} for i = 0, W - 1 do r[i + 1] = i end return r end)(),
                                      "async_tmo", { timeout_ms = 400 })
  if me == 0 then
    local h = cg:barrier_async()
    local okw, err = pcall(h.wait, h, 20)
    check(not okw and err:find("not done after 20 ms", 1, true), "short wait: %s", tostring(err))
    okw, err = pcall(h.wait, h)
    check(not okw and err:find("timed out", 1, true) and err:find("did not arrive", 1, true),
          "barrier timeout names who is missing: %s", tostring(err))
  end
  cg:destroy()
  check(cg._async == nil, "destroy closes the queue")
  world:barrier()
end
ok("timeouts")

local st = async.stats(world)
check(st.started and st.submitted >= 30 and st.pending == 0, "stats %d %d", st.submitted, st.pending)
ok("stats")
weft.shutdown()
ok("done")
