-- weft.backends.host_nodes — host tensors of groups that span several nodes: the
-- node layout of such a group, and the two backends that serve them on
-- Gloo's TCP transport (weft.gloo). Installed by weft.group on load; the
-- choice between them is weft.policy's ("gloo across nodes",
-- "hierarchical across nodes").
--
-- Backends (group.register_backend):
--   gloo       every host collective of the group over one Gloo context
--              (full mesh; Gloo's ring all-reduce, weft's ring reduce-scatter)
--   gloo_hier  all_reduce in three steps: shm all-reduce inside each node,
--              Gloo all-reduce among the node leaders (the first rank of
--              each node), shm broadcast back from the leader; the other
--              ops as gloo. Inside a node the bytes never touch TCP.
-- Both create their communicators on first use (collective: every rank of
-- the group makes the same call) and tear them down with g:destroy().
-- Host send/recv of tensors go over Gloo too: a 256-byte header (dtype,
-- shape, bytes) the receiver checks, then the bytes.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")

local ffi_string, ffi_copy, ffi_fill = ffi.string, ffi.copy, ffi.fill
local concat, fmt = table.concat, string.format
local error, tostring = error, tostring

local M = {}

local G          -- weft.group, given to install()

local gloo_mod
local function gloo()
  if not gloo_mod then gloo_mod = require("weft.gloo") end
  return gloo_mod
end

-- true when weft was built with Gloo (the library answers; a library older
-- than this Lua, without the symbol, counts as no)
M.built = (function()
  local ok, avail = pcall(function() return require("weft.gloo").available() end)
  return ok and avail or false
end)()

---------------------------------------------------------------- layout
-- Collective over g's cpu group: which node each group index is on, from the
-- shared-memory probe (the truth about node boundaries: who shares
-- /dev/shm), one probe per node. Sets g.node_of[index] (0-based node
-- numbers in order of first appearance), g.node_count, g.node_leaders
-- (group indices of each node's first rank) and g.local_indices (the group
-- indices on this rank's node).
function M.layout(g)
  local shm = require("weft.shm")
  local W = g.world_size
  local node_of, leaders = {}, {}
  local k, root = 0, 0
  while root do
    local flags = shm.same_node(g.cpu_group, root)
    node_of[root] = k   -- a root that could not make its segment says false for itself
    for i = 1, W do
      if flags[i] and node_of[i - 1] == nil then node_of[i - 1] = k end
    end
    leaders[k + 1] = root
    k = k + 1
    root = nil
    for i = 0, W - 1 do if node_of[i] == nil then root = i; break end end
  end
  local mine, locals = node_of[g.rank_in_group], {}
  for i = 0, W - 1 do if node_of[i] == mine then locals[#locals + 1] = i end end
  g.node_of, g.node_count, g.node_leaders, g.local_indices = node_of, k, leaders, locals
  g.node_index = mine
end

---------------------------------------------------------------- communicators
local function flat(g)
  local c = g._gloo
  if c then return c end
  c = gloo().new(g.cpu_group)
  g._gloo = c
  return c
end

-- { local_shm = weft.shm or nil, local_index, leaders_gloo = weft.gloo or nil }
local function hier(g)
  local h = g._hier
  if h then return h end
  local cpugroup = require("weft.cpugroup")
  local store = g.cpu_group.store
  local name = g.cpu_group.name
  h = {}
  local locals = {}
  for i, idx in ipairs(g.local_indices) do
    locals[i] = g.ranks[idx + 1]
    if idx == g.rank_in_group then h.local_index = i - 1 end
  end
  g._hier = h      -- partial state is torn down by destroy if a step below fails
  if #locals > 1 then
    h.local_cpu = cpugroup.new(store, name .. "/node" .. g.node_index, locals, h.local_index, g.timeout_ms)
    local per_rank = tonumber(os.getenv("WEFT_SHM_BYTES")) or G.SHM_BYTES
    h.local_shm = require("weft.shm").new(h.local_cpu, per_rank)
  end
  if h.local_index == 0 and g.node_count > 1 then
    local lranks = {}
    for i, idx in ipairs(g.node_leaders) do lranks[i] = g.ranks[idx + 1] end
    h.leaders_cpu = cpugroup.new(store, name .. "/leaders", lranks, g.node_index, g.timeout_ms)
    h.leaders_gloo = gloo().new(h.leaders_cpu)
  end
  return h
end

local function destroy(g)
  if g._gloo then g._gloo:destroy(); g._gloo = nil end
  local h = g._hier
  if h then
    g._hier = nil
    for _, k in ipairs { "leaders_gloo", "leaders_cpu", "local_shm", "local_cpu" } do
      if h[k] then h[k]:destroy() end
    end
  end
end

---------------------------------------------------------------- send / recv
local HDR = 256
local function header(t)
  local s = fmt("weft-gloo-p2p %s %s %d", t.dtype, concat(t.shape, ","), t.nbytes)
  return s
end

local function send_host(g, op, t, dst)
  local c = flat(g)
  local s = header(t)
  if #s >= HDR then
    error(fmt("weft: %s: tensor of %d dims is too many to describe in the header (group %s)",
              op, #t.shape, g.unique_name), 0)
  end
  local hb = g:_scratch("p2p_hdr", HDR)
  ffi_fill(hb, HDR)
  ffi_copy(hb, s)
  c:send(hb, HDR, dst)
  if t.nbytes > 0 then c:send(t.ptr, t.nbytes, dst) end
end

local function recv_host(g, op, into, src)
  local c = flat(g)
  local hb = g:_scratch("p2p_hdr", HDR)
  c:recv(hb, HDR, src)
  local s = ffi_string(hb)
  local dt, shape, nb = s:match("^weft%-gloo%-p2p (%S+) (%S*) (%d+)$")
  if not dt then
    error(fmt("weft: %s: rank %d sent something that is not a weft tensor header (group %s)",
              op, g.ranks[src + 1], g.unique_name), 0)
  end
  nb = tonumber(nb)
  local mine = header(into):match("^weft%-gloo%-p2p (.*)$")
  if dt .. " " .. shape .. " " .. nb ~= mine then
    -- take the bytes anyway, so the next message on this pair is read right
    if nb > 0 then c:recv(g:_scratch("p2p_drain", nb), nb, src) end
    error(fmt("weft: %s: rank %d sent %s {%s}, this rank expected %s {%s} (group %s)",
              op, g.ranks[src + 1], dt, shape, into.dtype, concat(into.shape, ","), g.unique_name), 0)
  end
  if nb > 0 then c:recv(into.ptr, nb, src) end
end

---------------------------------------------------------------- backends
-- a barrier goes where an all_reduce of nothing goes (weft.policy decides)
local NOTHING = { dtype = "f32", nbytes = 0, numel = 0, shape = { 0 }, device = "cpu" }
local hier_barrier   -- below

local gloo_backend = {
  -- where the policy sends an all_reduce of nothing: the hierarchy's three
  -- steps once the group made them, else the flat communicator once made,
  -- else the cpu group (weft.group.host's barrier rule)
  barrier = function(g)
    if g._hier and require("weft.policy").select(g, "all_reduce", NOTHING, "sum") == "gloo_hier" then
      return hier_barrier(g)
    end
    if g._gloo then g._gloo:barrier() else g.cpu_group:barrier() end
  end,
  -- t, extra: the caller's tensor and call, whose words the agreement word carries
  gather_bytes = function(g, _, src, nbytes, dst, t, extra)
    flat(g):all_gather(src, dst, nbytes, t and t.shape, extra)
  end,
  broadcast = function(g, _, ptr, nbytes, src, t) flat(g):broadcast(ptr, nbytes, src, t and t.shape) end,
  all_reduce = function(g, _, t, out_ptr, _, code, _, extra)
    flat(g):all_reduce(t.ptr, out_ptr, t.numel, G.DT_CODE[t.dtype], code, t.shape, extra)
  end,
  reduce_scatter_flat = function(g, _, inp, out, count_out, dtype, _, code, t)
    flat(g):reduce_scatter(inp, out, count_out, G.DT_CODE[dtype], code, t and t.shape)
  end,
  send_host = send_host,
  recv_host = recv_host,
}
M.gloo_backend = gloo_backend

-- Small tensors among the node leaders: the shim's small path (a power-of-two
-- number of leaders, up to weft_gloo_small_max bytes: recursive doubling on
-- synchronous pairs, ~20 us at 1 KiB between 2 leaders) where it applies;
-- else (3, 5, ... nodes) one all-gather through the store and a local
-- reduction in rank order beats Gloo's ring, whose every step is a hand-off
-- between Gloo's loop thread and the caller (on 2 busy CPUs: store ~50-100
-- us, ring ~200-400 us up to 16 KiB; bench/results/host-allreduce-nodes-*).
-- The bound is on what each leader gathers (bytes x leaders): every byte
-- goes through rank 0's store server.
M.LEADERS_STORE_MAX = tonumber(os.getenv("WEFT_HIER_STORE_MAX")) or 131072

-- Each leader's part is framed with its node's call (weft.group.host's
-- store_part: dtype, shape, reduction), so nodes whose calls differ fail on
-- every leader naming both, as the flat routes do.
local function leaders_store_reduce(g, h, src, out_ptr, t, dc, code, rop)
  local nb = t.nbytes
  local H = require("weft.group.host")
  local part, call = H.store_part("all_reduce", ffi_string(src, nb), t, rop)
  local list = h.leaders_cpu:allgather(part)
  local lg = h.leaders_view
  if not lg then
    lg = { ranks = h.leaders_cpu.ranks, unique_name = g.unique_name .. " (node leaders)" }
    h.leaders_view = lg
  end
  local offs = H.store_check(lg, "all_reduce", call, list)
  for i = 1, #list do list[i] = list[i]:sub(offs[i] + 1) end
  local n = #list
  local srcs = h._srcs
  if not srcs or h._nsrcs < n then srcs = ffi.new("const void *[?]", n); h._srcs, h._nsrcs = srcs, n end
  for i = 1, n do
    if #list[i] ~= nb then
      error(fmt("weft: all_reduce: node leader %d passed %d bytes, this one %d (group %s)",
                i - 1, #list[i], nb, g.unique_name), 0)
    end
    srcs[i - 1] = list[i]
  end
  local rc = wffi.C.weft_host_reduce(out_ptr, srcs, n, t.numel, dc, code)
  if rc ~= 0 then error("weft: " .. wffi.last_error(), 0) end
end

-- a failure of one step, with the world's dead ranks appended when the
-- message does not name them (the first death may be outside this group:
-- a node leader that exited after its own node failed), or the ranks the
-- store's host cannot reach, or the store itself being unreachable. A
-- message that went through the store's diagnosis already (the Gloo shim's)
-- is kept; a timeout waits for no tombstone (a death closes a connection
-- long before the timeout), so the whole costs ~0 past the step's deadline.
local gone_buf, gone_n = ffi.new("char[2048]"), ffi.new("int[1]")
local cut_buf, cut_n = ffi.new("char[2048]"), ffi.new("int[1]")
local CUT = "; unreachable from the store's host (no TCP acknowledgement, a partition?): "
local function with_gone(g, err)
  local msg = tostring(err)
  local st = g.cpu_group and g.cpu_group.store
  if not (st and st.handle) then return msg end
  if msg:find(" died ", 1, true) or msg:find("unreachable", 1, true) or msg:find("gone from the job", 1, true) then
    return msg
  end
  local timed_out = msg:find("timed out", 1, true) or msg:find("no progress within", 1, true)
  if wffi.C.weft_store_diagnose(st.handle, timed_out and 0 or 500, gone_buf, 2048, gone_n,
                                cut_buf, 2048, cut_n) ~= 0 then
    return msg .. "; " .. wffi.last_error():gsub("^store diagnose: ", "")
  end
  local gone, cut = ffi_string(gone_buf), ffi_string(cut_buf)
  if cut_n[0] > 0 then msg = msg .. CUT .. cut end
  if gone_n[0] == 0 or msg:find(gone, 1, true) then return msg end
  -- after a timeout, a rank gone now may have failed on the same cause and exited
  if timed_out then return msg .. "; gone from the job meanwhile: " .. gone end
  return msg .. " (gone from the job: " .. gone .. ")"
end

-- why the node leaders' exchange failed, in the ~100 bytes a shm abort
-- keeps: the dead, else whom the leader waited for and which hosts the
-- store cannot reach (a partition), else a pointer to the leader's error
local function leaders_failure(msg)
  if msg:find("different collectives", 1, true) then
    return "the ranks called different collectives (the node leaders' errors name every call)"
  end
  local hosts, seen = {}, {}
  local cut = msg:match("unreachable from the store's host[^:]*: ([^;]*)") or ""
  for h in cut:gmatch("host ([^,)%s]+)") do
    if not seen[h] then seen[h] = true; hosts[#hosts + 1] = h end
  end
  -- hosts cut off come first: ranks that died meanwhile may have failed on them
  local who = #hosts == 0 and (msg:match("gone from the job: (.-)%)$") or msg:match("(rank %d+ %b().-) died"))
  if who then return who .. " died" end
  local at = msg:match("waiting for (rank%(s%) [%d, ]+ at [^;%s(]+)")
  local why = at and ("the node leaders timed out waiting for " .. at) or "the node leaders' exchange failed"
  if #hosts > 0 then why = why .. "; unreachable: host " .. concat(hosts, ", ")
  elseif msg:find("is unreachable", 1, true) then why = why .. "; the store is unreachable" end
  if not at and #hosts == 0 and not msg:find("is unreachable", 1, true) then why = why .. " (see that rank's error)" end
  return why
end

-- A non-leader waits for its leader's broadcast this much past the group's
-- timeout: the leader's own cross-node step ends at the timeout, and its
-- abort (naming the cause) must arrive before this rank gives up on it.
M.HIER_GRACE_MS = 700

-- which exchange the node leaders use for t: Gloo, or the store (above)
local function leaders_use_gloo(g, nbytes)
  return not (nbytes * g.node_count <= M.LEADERS_STORE_MAX and not gloo().small_path(g.node_count, nbytes))
end
-- how long a leader whose node refused a call waits for the other leaders'
-- words in that call's Gloo round (they are there unless their own call
-- took the store's route)
M.REFUSE_WAIT_MS = 1000

-- This rank's node failed the call's first step (err): a leader tells the
-- other leaders why (they wait for it) through the leaders' cpu group, and
-- when its node's ranks disagreed, in the Gloo round they are in (its word
-- marked refused: they fail at once, naming it). Raises.
local function node_failed(g, h, err, round_on_gloo)
  if h.leaders_gloo and round_on_gloo and tostring(err):find("different collectives", 1, true) then
    pcall(h.leaders_gloo.refuse, h.leaders_gloo, M.REFUSE_WAIT_MS)
  end
  if h.leaders_cpu then
    local who = tostring(err):match("(rank %d+ %b()) died") or tostring(err):match("(rank %d+ %(global %d+, pid %d+, host [^)]*%)) died")
    h.leaders_cpu:abort(who and (who .. " died on node " .. g.node_index) or tostring(err):sub(1, 300))
  end
  error(with_gone(g, err), 0)
end

-- The leaders' step failed (err): the node's other ranks wait in the last
-- step; tell them why, now (the shm abort keeps ~100 bytes: the dead ranks,
-- else a hint). Raises.
local function leaders_failed(g, h, err)
  local msg = with_gone(g, err)
  if h.local_shm then h.local_shm:abort(leaders_failure(msg)) end
  error(msg, 0)
end

-- The last step, on the node's shm engine: f(comm, ...). A non-leader waits
-- there while its leader is in the leaders' step, which ends at the timeout:
-- it waits HIER_GRACE_MS longer, for the leader's abort that names the cause.
local function after_leaders(g, h, f, comm, ...)
  local T = g.timeout_ms
  if h.local_index ~= 0 and T and g.node_count > 1 then
    comm:set_timeout(T + M.HIER_GRACE_MS)
    local ok, err = pcall(f, comm, ...)
    comm:set_timeout(T)
    if not ok then error(err, 0) end
  else
    f(comm, ...)
  end
end

local hier_backend = setmetatable({
  all_reduce = function(g, _, t, out_ptr, rop, code, _, extra)
    local h = hier(g)
    local dc = G.DT_CODE[t.dtype]
    local src = t.ptr
    if h.local_shm then
      local ok, err = pcall(h.local_shm.all_reduce, h.local_shm, src, out_ptr, t.numel, dc, code, t.shape, extra)
      if not ok then node_failed(g, h, err, leaders_use_gloo(g, t.nbytes)) end
      src = out_ptr
    end
    if h.leaders_gloo then
      local ok, err
      if not leaders_use_gloo(g, t.nbytes) then
        ok, err = pcall(leaders_store_reduce, g, h, src, out_ptr, t, dc, code, rop)
      else
        ok, err = pcall(h.leaders_gloo.all_reduce, h.leaders_gloo, src, out_ptr, t.numel, dc, code, t.shape, extra)
      end
      if not ok then leaders_failed(g, h, err) end
    end
    if h.local_shm then
      after_leaders(g, h, h.local_shm.broadcast, h.local_shm, out_ptr, t.nbytes, 0, t.shape)
    end
  end,
}, { __index = gloo_backend })
M.hier_backend = hier_backend

-- The barrier in the hierarchy's all_reduce's three steps, so that it meets
-- that all_reduce where it goes: each node's shm engine (whose descriptors
-- tell a barrier from an all_reduce), the leaders' round on the route an
-- all_reduce of nothing takes there (Gloo's agreed barrier, or the store's),
-- then the node's shm again, which lets the node's ranks go once their
-- leader knows every node arrived. Called with g._hier made.
function hier_barrier(g)
  local h = g._hier
  if h.local_shm then
    local ok, err = pcall(h.local_shm.barrier, h.local_shm)
    if not ok then node_failed(g, h, err, leaders_use_gloo(g, 0)) end
  end
  if h.leaders_gloo then
    local c = leaders_use_gloo(g, 0) and h.leaders_gloo or h.leaders_cpu
    local ok, err = pcall(c.barrier, c)
    if not ok then leaders_failed(g, h, err) end
  end
  if h.local_shm then after_leaders(g, h, h.local_shm.barrier, h.local_shm) end
end

-- group.lua calls this once a group is known to span nodes
function M.on_new(g)
  M.layout(g)
end

-- the store path across nodes: said once per process, where it is used
local warned = false
function M.warn_store(g)
  if warned or g.host_backend == "store" then return end
  warned = true
  io.stderr:write(("weft: warning: host collectives of group %s span nodes and go through the "
    .. "TCP store (weft was built without Gloo: install libgloo-dev and run make lib)\n")
    :format(tostring(g.unique_name)))
end

function M.install(gm)
  G = gm
  gm.register_backend("gloo", gloo_backend)
  gm.register_backend("gloo_hier", hier_backend)
  gm.destroy_hooks[#gm.destroy_hooks + 1] = destroy
  return M
end

return M
