-- One rank of tests/faults/fault_async_cross_spec.lua (4 ranks, tp=2 x pp=2): an
-- async collective on one group while the caller runs a blocking one on
-- another (issue 24 item 4), for every async op x blocking op x ordered
-- group pair: submit, run the blocking op, wait, check both results exactly.
-- Before the fix the worker's wait and the caller's wait queued on the one
-- store connection, and ranks that took it in different orders waited for
-- each other until the timeout. ASYNC_CROSS_ITERS (default 2) per triple.
local weft = require("weft")
local async = require("weft.async")
local W = require("helpers.rank_util")
local T = weft.tensor

local rank = W.env()
local K = W.checker(rank)
local ITERS = tonumber(os.getenv("ASYNC_CROSS_ITERS")) or 2

weft.init()
weft.initialize_model_parallel { tp = 2, pp = 2 }
local G = { world = weft.world(), tp = weft.tp(), pp = weft.pp() }

-- sum over g's members of f(global rank)
local function over(g, f)
  local s = 0
  for _, r in ipairs(g.ranks) do s = s + f(r) end
  return s
end

local function same(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- p2p inside a group: index 2k sends to 2k + 1
local function p2p_role(g)
  local i = g.rank_in_group
  if i % 2 == 0 then return "send", i + 1 end
  return "recv", i - 1
end

-- async ops: submit(g, it) -> handle, check(result) -> ok, what
local ASYNC = {
  all_reduce = function(g, it)
    local t = T.full({ 64 }, rank + it, "f32")
    return async.all_reduce(g, t), function()
      local want = over(g, function(r) return r + it end)
      local v = t:to_table()
      return v[1] == want and v[64] == want, ("%s ~= %s"):format(v[1], want)
    end
  end,
  all_gather = function(g, it)
    local t = T.full({ 3 }, rank * 10 + it, "i32")
    return async.all_gather(g, t, 0), function(out)
      local v, want = out:to_table(), {}
      for _, r in ipairs(g.ranks) do for _ = 1, 3 do want[#want + 1] = r * 10 + it end end
      return same(v, want), table.concat(v, ",")
    end
  end,
  reduce_scatter = function(g, it)
    local n = g.world_size * 2
    local t = T.full({ n }, rank + it, "f64")
    return async.reduce_scatter(g, t, 0), function(out)
      local want = over(g, function(r) return r + it end)
      local v = out:to_table()
      return #v == 2 and v[1] == want and v[2] == want, table.concat(v, ",")
    end
  end,
  broadcast = function(g, it)
    local t = T.full({ 16 }, g.rank_in_group == 0 and 100 + it or -1, "f32")
    return async.broadcast(g, t, 0), function()
      local v = t:to_table()
      return v[1] == 100 + it and v[16] == 100 + it, tostring(v[1])
    end
  end,
  barrier = function(g)
    return async.barrier(g), function() return true end
  end,
  broadcast_object = function(g, it)
    return async.broadcast_object(g, g.rank_in_group == 0 and { it, "root" } or nil, 0), function(o)
      return type(o) == "table" and o[1] == it and o[2] == "root", tostring(o)
    end
  end,
  all_gather_object = function(g, it)
    return async.all_gather_object(g, { rank, it }), function(list)
      for i, r in ipairs(g.ranks) do
        if list[i][1] ~= r or list[i][2] ~= it then return false, "entry " .. i end
      end
      return #list == g.world_size, "count " .. #list
    end
  end,
  allreduce_i64 = function(g, it)
    return async.allreduce_i64(g, { rank, it }), function(v)
      return v[1] == over(g, function(r) return r end) and v[2] == it * g.world_size,
             tostring(v[1]) .. "," .. tostring(v[2])
    end
  end,
  send_recv_object = function(g, it)
    local role, peer = p2p_role(g)
    if role == "send" then
      return async.send_object(g, { rank, it }, peer), function() return true end
    end
    return async.recv_object(g, peer), function(o)
      return o[1] == g.ranks[peer + 1] and o[2] == it, tostring(o[1])
    end
  end,
}

-- blocking ops: run(g, it) -> ok, what
local BLOCKING = {
  barrier = function(g) g:barrier(); return true end,
  all_reduce = function(g, it)
    local t = T.full({ 32 }, rank * it, "f64")
    g:all_reduce(t)
    local want = over(g, function(r) return r * it end)
    return t:to_table()[32] == want, "all_reduce"
  end,
  all_gather_object = function(g, it)
    local list = g:all_gather_object(it * 100 + rank)
    for i, r in ipairs(g.ranks) do if list[i] ~= it * 100 + r then return false, "entry " .. i end end
    return true
  end,
  broadcast_object = function(g, it)
    local o = g:broadcast_object(g.rank_in_group == 0 and ("b" .. it) or nil, 0)
    return o == "b" .. it, tostring(o)
  end,
  broadcast = function(g, it)
    local t = T.full({ 8 }, g.rank_in_group == 0 and it or 0, "i64")
    g:broadcast(t, 0)
    return t:to_table()[8] == it, "broadcast"
  end,
  all_gather = function(g, it)
    local out = g:all_gather(T.full({ 2 }, rank + it, "i32"), 0)
    local v = out:to_table()
    for i, r in ipairs(g.ranks) do
      if v[2 * i - 1] ~= r + it or v[2 * i] ~= r + it then return false, "entry " .. i end
    end
    return #v == 2 * g.world_size, "count " .. #v
  end,
  reduce_scatter = function(g, it)
    local out = g:reduce_scatter(T.full({ g.world_size * 3 }, rank - it, "f32"), 0)
    local v, want = out:to_table(), over(g, function(r) return r - it end)
    return #v == 3 and v[1] == want and v[3] == want, tostring(v[1])
  end,
  send_recv_object = function(g, it)
    local role, peer = p2p_role(g)
    if role == "send" then g:send_object({ it }, peer); return true end
    local o = g:recv_object(peer)
    return o[1] == it, tostring(o[1])
  end,
}

local function sorted_keys(t)
  local k = {}
  for n in pairs(t) do k[#k + 1] = n end
  table.sort(k)
  return k
end

local PAIRS = { { "world", "tp" }, { "tp", "world" }, { "tp", "pp" }, { "pp", "tp" },
                { "world", "pp" }, { "pp", "world" } }

-- the issue's loop first: it failed at iteration 2-4
for i = 1, 50 do
  local h = async.all_gather_object(G.world, { i })
  G.tp:barrier()
  local list = h:wait()
  if not K.check(#list == 4 and list[1][1] == i and list[4][1] == i, "issue loop, iteration %d", i) then
    K.exit()
  end
end

local t0 = os.clock()
local triples = 0
for _, an in ipairs(sorted_keys(ASYNC)) do
  for _, bn in ipairs(sorted_keys(BLOCKING)) do
    for _, pair in ipairs(PAIRS) do
      local ga, gb = G[pair[1]], G[pair[2]]
      for it = 1, ITERS do
        local where = ("async %s on %s x blocking %s on %s, iteration %d"):format(an, pair[1], bn, pair[2], it)
        local ok, err = pcall(function()
          local h, check = ASYNC[an](ga, it)
          local bok, bwhat = BLOCKING[bn](gb, it)
          K.check(bok, "%s: blocking result wrong: %s", where, tostring(bwhat))
          local aok, awhat = check(h:wait())
          K.check(aok, "%s: async result wrong: %s", where, tostring(awhat))
        end)
        if not K.check(ok, "%s: %s", where, tostring(err)) then K.exit() end
      end
      triples = triples + 1
    end
  end
end
W.say(("ASYNC_CROSS rank %d triples=%d iters=%d cpu_s=%.1f"):format(rank, triples, ITERS, os.clock() - t0))
weft.destroy_model_parallel()  -- closes tp's and pp's queues, and their workers' connections
-- a worker's own connection never speaks for the rank: its closing is no death
local ffi = require("ffi")
local C = require("weft.internal.ffi").C
local buf, n = ffi.new("char[512]"), ffi.new("int[1]")
C.weft_store_gone_ranks(weft.dist.state.store.handle, 300, buf, 512, n)
K.check(n[0] == 0, "after the workers' connections closed, ranks are marked gone: %s", ffi.string(buf))
G.world:barrier()
K.ok_line()
weft.shutdown()
K.exit()
