-- The rank side of tests/unit/nodes_spec.lua and tests/faults/fault_nodes_spec.lua: runs
-- under scripts/weft-sim-nodes (each node a network + mount namespace with
-- its own /dev/shm and hostname). Prints "OK <what>" per passed check and
-- raises on the first failure (the rank exits non-zero).
--   luajit nodes_ranks.lua layout      hostnames, same-node flags, TP inside /
--                                      PP across nodes, mq broadcaster, explain
--   luajit nodes_ranks.lua collectives every op x dtype at odd sizes (integer
--                                      wrap, NaN) on world, tp and pp groups
--   luajit nodes_ranks.lua kill <rank> all-reduces on the world until <rank>
--                                      SIGKILLs itself: "DEATH <ms>" from it,
--                                      "FAIL <ms> <message>" from the others
--   luajit nodes_ranks.lua stall <rank> the same, but <rank> sleeps past the
--                                      timeout instead ("STALL <ms>")
--   luajit nodes_ranks.lua partition <node>  the same, but rank 0 cuts
--                                      <node>'s link from the hub (weft-sim-nodes'
--                                      WEFT_SIM_HUB) instead: "CUT <ms>" from it
--   luajit nodes_ranks.lua heal         rank 0 cuts node 1 off for ~3 s,
--                                      shorter than the timeout: "MARK cut|healed
--                                      <value>" (the store's unreachable mark of
--                                      rank per_node), then every rank "OK heal"
--   luajit nodes_ranks.lua determ_one <rank>  deterministic mode set on <rank>
--                                      only, then one all-reduce: "FAIL <ms> <msg>"
--                                      from every rank (issue 24 item 7)
local U = require("helpers.group_util")
local W = require("helpers.rank_util")
local ffi = require("ffi")
local weft, ok, check = U.weft, U.ok, U.check
local T = weft.tensor
local now_ms = function() return require("weft.internal.clock").now_ns() / 1e6 end

local scenario = arg[1] or "layout"
local nnodes = assert(tonumber(os.getenv("WEFT_NNODES")), "WEFT_NNODES")
local node = assert(tonumber(os.getenv("WEFT_NODE_RANK")), "WEFT_NODE_RANK")
local per_node = assert(tonumber(os.getenv("LOCAL_WORLD_SIZE")), "LOCAL_WORLD_SIZE")

local function hostname()
  local f = assert(io.open("/proc/sys/kernel/hostname"))
  local h = f:read("*l"); f:close()
  return h
end

local function node_of(rank) return math.floor(rank / per_node) end

---------------------------------------------------------------- layout
local function layout()
  local world = weft.init()
  local me = world.rank
  check(hostname() == "node" .. node, "rank %d runs on host %s, expected node%d", me, hostname(), node)
  check(node_of(me) == node, "rank %d on node %d", me, node)
  check(world.same_node == (nnodes == 1), "world.same_node is %s with %d nodes", tostring(world.same_node), nnodes)
  -- the probe itself: who shares /dev/shm with index 0, and with this rank's node leader
  local shm = require("weft.shm")
  local flags = shm.same_node(world.cpu_group, 0)
  for r = 0, world.world_size - 1 do
    check(flags[r + 1] == (node_of(r) == 0), "same_node flag of rank %d (root 0) is %s", r, tostring(flags[r + 1]))
  end
  for k = 1, nnodes - 1 do   -- collective: every rank asks about each node leader
    local leader = k * per_node
    flags = shm.same_node(world.cpu_group, leader)
    for r = 0, world.world_size - 1 do
      check(flags[r + 1] == (node_of(r) == k), "same_node flag of rank %d (root %d) is %s", r, leader, tostring(flags[r + 1]))
    end
  end
  local root = node * per_node
  ok("same_node flags")

  -- TP inside a node, PP across nodes
  weft.initialize_model_parallel { tp = per_node, pp = nnodes }
  local tp, pp = weft.tp(), weft.pp()
  for i, r in ipairs(tp.ranks) do check(r == root + i - 1, "tp ranks %s", table.concat(tp.ranks, ",")) end
  check(tp.same_node == true, "tp.same_node is %s", tostring(tp.same_node))
  check(#pp.ranks == nnodes, "pp has %d ranks", #pp.ranks)
  for i, r in ipairs(pp.ranks) do
    check(r == (i - 1) * per_node + (me % per_node), "pp ranks %s", table.concat(pp.ranks, ","))
  end
  check(pp.same_node == (nnodes == 1), "pp.same_node is %s", tostring(pp.same_node))
  ok("tp inside a node, pp across nodes")

  -- the message-queue broadcaster only on the node-local TP group
  if per_node > 1 then
    check(tp.mq_broadcaster ~= nil, "tp has no mq broadcaster (WEFT_USE_MQ_BROADCASTER=%s)",
          tostring(os.getenv("WEFT_USE_MQ_BROADCASTER")))
  end
  check(pp.mq_broadcaster == nil, "pp (across nodes) got an mq broadcaster")
  local big = string.rep("n" .. node, 300000)   -- larger than one ring slot
  local got = tp:broadcast_object(tp.rank_in_group == 0 and { node = node, big = big } or nil, 0)
  check(got.node == node and got.big == big, "tp broadcast_object through the ring")
  got = pp:broadcast_object(pp.rank_in_group == 0 and { from = me, big = big } or nil, 0)
  check(got.from == me % per_node and #got.big == #big, "pp broadcast_object across nodes")
  local all = world:all_gather_object({ rank = me, host = hostname() })
  for r = 0, world.world_size - 1 do
    check(all[r + 1].rank == r and all[r + 1].host == "node" .. node_of(r), "all_gather_object entry %d", r)
  end
  if pp.world_size > 1 then
    local nxt, prv = (pp.rank_in_group + 1) % pp.world_size, (pp.rank_in_group - 1) % pp.world_size
    if pp.rank_in_group % 2 == 0 then
      pp:send_object({ host = hostname() }, nxt); got = pp:recv_object(prv)
    else
      got = pp:recv_object(prv); pp:send_object({ host = hostname() }, nxt)
    end
    check(got.host == "node" .. node_of(pp.ranks[prv + 1]), "pp recv_object from %s", tostring(got.host))
  end
  ok("object collectives and the mq broadcaster")

  -- explain names the node boundary for a host tensor across nodes
  local x = T.ones({ 5 }, "f32")
  local e = weft.policy.explain(pp, x)
  if nnodes > 1 then
    check(e:find("node", 1, true) ~= nil, "explain on pp does not mention nodes:\n%s", e)
    io.stdout:write("EXPLAIN pp ", (e:gsub("\n", " | ")), "\n")
  end
  ok("explain")
  weft.destroy_model_parallel()
  world:barrier()
  weft.shutdown()
  ok("shutdown")
end

---------------------------------------------------------------- collectives
-- Exact references with each dtype's own arithmetic: integers wrap in two's
-- complement (int64 cdata arithmetic, cast down), floats are small integers
-- (exact in every float dtype) with one NaN that every op must propagate.
local CT = { i32 = "int32_t", i64 = "int64_t", u8 = "uint8_t", f32 = "float", f64 = "double" }
local INT = { i32 = true, i64 = true, u8 = true }

local function value(rank, i, dt, rop)
  local s = (rank * 7919 + i * 104729 + 17) % 2147483647
  s = (s * 48271) % 2147483647
  if INT[dt] then
    if dt == "u8" then return s % 256 end
    if rop == "prod" then return (s % 65536) - 32768 end
    if dt == "i32" then return 0x40000000 + s % 1000 end     -- two of them overflow int32
    return ffi.new("int64_t", 0x4000000000000000LL + s % 1000) -- and int64
  end
  if rop == "prod" then return s % 5 - 2 end
  return s % 7 - 3
end

local function make(g, dt, rop, count, rank)
  local t = T.empty({ count }, dt)
  local nan_at = count > 2 and (count - 2) or nil
  if dt == "f16" or dt == "bf16" then
    local f = T.empty({ count }, "f64")
    local p = ffi.cast("double *", f.ptr)
    for i = 0, count - 1 do p[i] = value(rank, i, dt, rop) end
    if nan_at and rank == g.ranks[g.world_size] then p[nan_at] = 0 / 0 end
    t:copy_(f:to(dt)); f:free()
  else
    local p = ffi.cast(CT[dt] .. " *", t.ptr)
    for i = 0, count - 1 do p[i] = value(rank, i, dt, rop) end
    if nan_at and not INT[dt] and rank == g.ranks[g.world_size] then p[nan_at] = 0 / 0 end
  end
  return t
end

local function reference(g, dt, rop, count)
  local acc = {}
  for k, rank in ipairs(g.ranks) do
    for i = 0, count - 1 do
      local v = value(rank, i, dt, rop)
      if INT[dt] then v = ffi.new("int64_t", v) end
      if k == 1 then acc[i] = v
      elseif rop == "sum" then acc[i] = acc[i] + v
      elseif rop == "prod" then acc[i] = acc[i] * v
      elseif rop == "max" then if v > acc[i] then acc[i] = v end
      else if v < acc[i] then acc[i] = v end end
    end
  end
  if INT[dt] then
    for i = 0, count - 1 do acc[i] = ffi.cast(CT[dt], acc[i]) end   -- two's-complement wrap
  elseif count > 2 then
    acc[count - 2] = 0 / 0
  end
  return acc
end

local function read(t, dt, i)
  if dt == "f16" or dt == "bf16" then
    if not t._f64 then t._f64 = t:to("f64") end
    return ffi.cast("double *", t._f64.ptr)[i]
  end
  local v = ffi.cast(CT[dt] .. " *", t.ptr)[i]
  if dt == "i64" then return v end
  return tonumber(v)
end

local function equal(a, b, dt)
  if dt == "i64" then return ffi.cast("int64_t", a) == ffi.cast("int64_t", b) end
  if not INT[dt] and a ~= a then return b ~= b end
  return tonumber(a) == tonumber(b)
end

local DTYPES = { "f32", "f64", "f16", "bf16", "i32", "i64", "u8" }
local OPS = { "sum", "prod", "max", "min" }
local SIZES = { 1, 7, 1001, 40003 }
if os.getenv("NODES_SMALL") == "1" then SIZES = { 1, 7, 1001 } end   -- the slow store path

local function suite(g, label)
  if not g.is_member or g.world_size == 1 then return end
  local r = g.rank_in_group
  for _, dt in ipairs(DTYPES) do
    for _, rop in ipairs(OPS) do
      for _, count in ipairs(SIZES) do
        local x = make(g, dt, rop, count, g.rank)
        g:all_reduce(x, rop)
        local want = reference(g, dt, rop, count)
        for i = 0, count - 1 do
          local got = read(x, dt, i)
          if not equal(got, want[i], dt) then
            error(("%s all_reduce %s %s count %d: element %d is %s, expected %s"):format(
              label, dt, rop, count, i, tostring(got), tostring(want[i])), 0)
          end
        end
        x:free()
        if x._f64 then x._f64:free() end
      end
    end
  end
  ok(label .. " all_reduce every dtype x op x odd size")

  -- reduce_scatter (sum, max) and all_gather / broadcast at odd sizes
  local n = g.world_size
  for _, dt in ipairs(DTYPES) do
    for _, rop in ipairs({ "sum", "max" }) do
      local per = 1001
      local x = make(g, dt, rop, per * n, g.rank)
      local out = g:reduce_scatter(x, 0, nil, rop)
      local want = reference(g, dt, rop, per * n)
      for i = 0, per - 1 do
        local got = read(out, dt, i)
        check(equal(got, want[r * per + i], dt), "%s reduce_scatter %s %s element %d: %s vs %s",
              label, dt, rop, i, tostring(got), tostring(want[r * per + i]))
      end
    end
    for _, count in ipairs({ 1, 4099 }) do
      local x = make(g, dt, "sum", count, g.rank)
      local out = g:all_gather(x, 0)
      for k = 0, n - 1 do
        local ref = make(g, dt, "sum", count, g.ranks[k + 1])
        check(ffi.string(ffi.cast("uint8_t *", out.ptr) + k * x.nbytes, x.nbytes) == ffi.string(ref.ptr, ref.nbytes),
              "%s all_gather %s count %d: block %d differs", label, dt, count, k)
      end
      for src = 0, n - 1 do
        local b = make(g, dt, "sum", count, g.rank)
        g:broadcast(b, src)
        local ref = make(g, dt, "sum", count, g.ranks[src + 1])
        check(ffi.string(b.ptr, b.nbytes) == ffi.string(ref.ptr, ref.nbytes),
              "%s broadcast %s count %d from %d differs", label, dt, count, src)
      end
    end
  end
  ok(label .. " reduce_scatter, all_gather, broadcast at odd sizes")

  -- send/recv around the ring
  local nxt, prv = (r + 1) % n, (r - 1) % n
  for _, dt in ipairs(DTYPES) do
    local x = make(g, dt, "sum", 3001, g.rank)
    local ref = make(g, dt, "sum", 3001, g.ranks[prv + 1])
    local got = T.empty({ 3001 }, dt)
    if r % 2 == 0 then g:send(x, nxt); g:recv(got, prv) else g:recv(got, prv); g:send(x, nxt) end
    check(ffi.string(got.ptr, got.nbytes) == ffi.string(ref.ptr, ref.nbytes), "%s send/recv %s", label, dt)
  end
  g:barrier()
  -- a barrier holds every rank until the last one arrived: a late leader, a
  -- late non-leader (the hierarchy's three steps), the group's last rank
  for _, late in ipairs { 0, g.world_size - 1, 1 } do
    if late < g.world_size then
      local t0 = now_ms()
      if g.rank_in_group == late then os.execute("sleep 0.3") end
      g:barrier()
      local waited = now_ms() - t0
      check(waited >= 250, "%s barrier: left after %.0f ms, before rank %d arrived (at ~300 ms)",
            label, waited, late)
    end
  end
  ok(label .. " send/recv and barrier")
end

local function collectives()
  local world = weft.init()
  weft.initialize_model_parallel { tp = per_node, pp = nnodes }
  suite(world, "world")
  suite(weft.tp(), "tp")
  suite(weft.pp(), "pp")
  weft.destroy_model_parallel()
  world:barrier()
  weft.shutdown()
  ok("shutdown")
end

---------------------------------------------------------------- kill
-- weft-run stops a node's other ranks (SIGTERM) once one of them failed;
-- these ranks ignore SIGTERM so each one reports its own failure (the
-- launcher's SIGKILL after its grace still ends a rank that would hang)
local function own_failure_only()
  if not pcall(ffi.typeof, "nodes_sig_marker") then
    ffi.cdef [[ typedef struct { int unused; } nodes_sig_marker;
                void *nodes_signal(int sig, void *h) __asm__("signal"); ]]
  end
  ffi.C.nodes_signal(15, ffi.cast("void *", 1))
end

-- all_reduce x until a call fails (step(i, world) runs before call i: the
-- victim's fault), then report that failure with its time and exit 1
local function reduce_until_failure(world, x, step)
  world:all_reduce(x)     -- everybody connected and through one collective
  local okc, err = pcall(function()
    for i = 1, 1000000 do
      step(i, world)
      world:all_reduce(x)
    end
  end)
  W.say(("FAIL %d %s"):format(now_ms(), tostring(err):gsub("\n", " ")))
  assert(not okc)
  os.exit(1)
end

-- The fault scenarios' rank: reports only its own failure, joins the world,
-- and all-reduces <numel_env> (default `numel`) f32 ones until a call fails;
-- fault() runs on rank `who` before call `at`.
local function fault_run(numel_env, numel, who, at, fault)
  own_failure_only()
  local world = weft.init()
  local x = T.ones({ tonumber(os.getenv(numel_env)) or numel }, "f32")
  reduce_until_failure(world, x, function(i)
    if world.rank == who and i == at then fault() end
  end)
end

-- NODES_KILL_NUMEL: 4096 (flat Gloo) or 262144+ (hierarchical from 1 MiB: shm + leaders)
local function kill(victim)
  fault_run("NODES_KILL_NUMEL", 4096, victim, 20, function()
    W.say(("DEATH %d"):format(now_ms()))
    W.kill_self()
  end)
end

---------------------------------------------------------------- stall
-- NODES_STALL_NUMEL: f32 elements per call (tests/faults/fault_nodes_spec.lua picks the route with it)
local function stall(victim)
  fault_run("NODES_STALL_NUMEL", 65536, victim, 5, function()
    W.say(("STALL %d"):format(now_ms()))
    os.execute("sleep " .. (tonumber(os.getenv("WEFT_TIMEOUT_MS")) / 1000 + 2))
  end)
end

---------------------------------------------------------------- partition
-- NODES_PART_NUMEL: f32 elements per call (the route); NODES_PART_BACKEND:
-- WEFT_HOST_BACKEND's value, when the spec pins one
local function partition(cut)
  fault_run("NODES_PART_NUMEL", 4096, 0, 10, function()
    local hub = assert(os.getenv("WEFT_SIM_HUB"), "WEFT_SIM_HUB (run under scripts/weft-sim-nodes)")
    check(os.execute(("ip -n %s link set n%d nomaster"):format(hub, cut)) == 0, "cutting node %d", cut)
    W.say(("CUT %d"):format(now_ms()))
  end)
end

---------------------------------------------------------------- heal
-- a partition shorter than the timeout: the store's host marks node 1's
-- ranks unreachable while it lasts, clears the mark after, and the job goes on
local function heal()
  local world = weft.init()
  local st = world.cpu_group.store
  world:barrier()
  if world.rank == 0 then
    local hub = assert(os.getenv("WEFT_SIM_HUB"), "WEFT_SIM_HUB (run under scripts/weft-sim-nodes)")
    local key = ("weft/rank/%d/unreachable"):format(per_node)
    check(os.execute(("ip -n %s link set n1 nomaster"):format(hub)) == 0, "cutting node 1")
    os.execute("sleep 2.5")
    W.say("MARK cut " .. tostring(st:try_get(key)))
    check(os.execute(("ip -n %s link set n1 master br0"):format(hub)) == 0, "healing node 1")
    os.execute("sleep 1.5")
    W.say("MARK healed " .. tostring(st:try_get(key)))
  end
  world:barrier()
  local x = T.ones({ 4096 }, "f32")
  world:all_reduce(x)
  check(ffi.cast("float *", x.ptr)[0] == world.world_size, "all_reduce after the heal")
  weft.shutdown()
  ok("heal")
end

---------------------------------------------------------------- determ_one
-- one rank's policy differs: it takes another route than the others, and
-- every rank must fail with a message that names its cause
local function determ_one(odd)
  own_failure_only()
  local world = weft.init()
  if world.rank == odd then weft.policy.set { deterministic = true } end
  local x = T.ones({ tonumber(os.getenv("NODES_DET_NUMEL")) or 4096 }, "f32")
  local okc, err = pcall(function() world:all_reduce(x) end)
  W.say(("FAIL %d %s"):format(now_ms(), tostring(err):gsub("\n", " ")))
  assert(not okc)
  os.exit(1)
end

if scenario == "layout" then layout()
elseif scenario == "heal" then heal()
elseif scenario == "determ_one" then determ_one(assert(tonumber(arg[2]), "determ_one <rank>"))
elseif scenario == "partition" then partition(assert(tonumber(arg[2]), "partition <node>"))
elseif scenario == "stall" then stall(assert(tonumber(arg[2]), "stall <rank>"))
elseif scenario == "collectives" then collectives()
elseif scenario == "kill" then kill(assert(tonumber(arg[2]), "kill <rank>"))
else error("unknown scenario " .. tostring(scenario)) end
