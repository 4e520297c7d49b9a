-- weft.group — GroupCoordinator: one group of ranks, its properties and its
-- collectives (SGLang's GroupCoordinator, DESIGN.md §9).
--
-- Ranks inside a group are 0-based (rank_in_group, src, dst); `ranks` is a Lua
-- array of global ranks. Every collective validates its arguments before
-- anything is sent, then asks weft.policy which backend serves the call and
-- runs that backend's implementation (registered here with register_backend).
--
-- Host backends:
--   shm         ranks on one node: shared-memory engine (weft.shm)
--   shm_gather  one node, dtype/op the engine does not reduce: shm all-gather
--               and a local reduction in rank order
--   gloo        ranks on several nodes: Gloo over TCP (weft.host_nodes)
--   gloo_hier   ranks on several nodes, all_reduce: shm inside each node, Gloo
--               among the node leaders, shm broadcast back (weft.host_nodes)
--   store       forced, or across nodes in a build without Gloo: bytes
--               through the TCP store
-- A backend is a table of functions; only gather_bytes and broadcast are
-- required, reductions fall back to gather + local reduce.
local ffi = require "ffi"
local wffi = require "weft.ffi"
local policy = require "weft.policy"
local serialize = require "weft.serialize"

local C = wffi.C
local floor = math.floor
local ffi_copy, ffi_cast, ffi_string = ffi.copy, ffi.cast, ffi.string
local type, tostring, error = type, tostring, error
local concat = table.concat

local M = {}
local G = {}
G.__index = G
M.GroupCoordinator = G

local u8p = ffi.typeof("uint8_t *")
local cu8p = ffi.typeof("const uint8_t *")

M.REDUCE_OPS = { sum = 0, max = 1, min = 2, prod = 4 }
local REDUCE_OPS = M.REDUCE_OPS
-- dtypes that can be reduced; f8e4m3 is storage only
local REDUCIBLE = { f32 = true, f16 = true, bf16 = true, i32 = true, i64 = true, u8 = true, f64 = true }

local tensor_mod
local function T()
  if not tensor_mod then tensor_mod = require "weft.tensor" end
  return tensor_mod
end

---------------------------------------------------------------- errors
local function fail(level, op, fmt, ...)
  error("weft: " .. op .. ": " .. fmt:format(...), level + 1)
end

local function shape_str(shape)
  return "{" .. concat(shape, ",") .. "}"
end

local function gname(g) return g.unique_name end

-- Checks shared by every collective; raised at the user's call site (level 3:
-- check -> method -> caller).
local function check_group(g, op)
  if g.destroyed then
    fail(3, op, "group %s is destroyed", gname(g))
  end
  if not g.is_member then
    fail(3, op, "rank %d is not in group %s (ranks %s)", g.rank, gname(g), concat(g.ranks, ","))
  end
end

local function check_tensor(g, op, t, what)
  what = what or "tensor"
  local tm = T()
  if not tm.is_tensor(t) then
    fail(3, op, "%s must be a weft tensor, got %s (group %s)", what, type(t), gname(g))
  end
  if t.ptr == nil and t.numel > 0 then
    fail(3, op, "%s storage was freed (group %s)", what, gname(g))
  end
  if not t:is_contiguous() then
    fail(3, op, "%s is not contiguous (shape %s, strides %s) on group %s: pass t:clone() or a contiguous tensor",
         what, shape_str(t.shape), shape_str(t.strides or {}), gname(g))
  end
end

-- host and device tensors (or two devices) never mix in one call
local function check_place(g, op, a, b, an, bn)
  if a.device ~= b.device then
    fail(3, op, "%s is on %s and %s on %s: host and device tensors (or two devices) cannot mix in one call (group %s)",
         an, tostring(a.device), bn, tostring(b.device), gname(g))
  end
end

local function check_peer(g, op, idx, what)
  if type(idx) ~= "number" or idx ~= floor(idx) or idx < 0 or idx >= g.world_size then
    fail(3, op, "%s %s is out of range for group %s of %d ranks (valid: 0..%d)",
         what, tostring(idx), gname(g), g.world_size, g.world_size - 1)
  end
end

local function check_reduce(g, op, t, rop)
  local code = REDUCE_OPS[rop]
  if not code then
    fail(3, op, "unknown reduction %q on group %s (sum, max, min, prod)", tostring(rop), gname(g))
  end
  if not REDUCIBLE[t.dtype] then
    fail(3, op, "dtype %s cannot be reduced on group %s (f32, f16, bf16, f64, i32, i64, u8)", t.dtype, gname(g))
  end
  return code
end

local function norm_dim(g, op, t, dim)
  local nd = #t.shape
  if type(dim) ~= "number" or dim ~= floor(dim) or dim < -nd or dim >= nd then
    fail(3, op, "dim %s is invalid for a tensor of shape %s (group %s)", tostring(dim), shape_str(t.shape), gname(g))
  end
  if dim < 0 then dim = dim + nd end
  return dim
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- products of the dims before / from `dim` (0-based)
local function outer_inner(shape, dim)
  local outer, inner = 1, 1
  for i = 1, #shape do
    if i <= dim then outer = outer * shape[i] else inner = inner * shape[i] end
  end
  return outer, inner
end

---------------------------------------------------------------- scratch memory
local have_host_alloc = pcall(function() return C.weft_host_alloc end)

local function alloc_bytes(n)
  if n < 64 then n = 64 end
  if have_host_alloc then
    local p = C.weft_host_alloc(n)
    if p == nil then error(("weft: alloc: out of host memory (%d bytes)"):format(n), 0) end
    return ffi.gc(ffi_cast(u8p, p), C.weft_host_free)
  end
  return ffi.new("uint8_t[?]", n)
end

-- grow-only per-group scratch buffers, by slot
function G:_scratch(slot, n)
  local s = self._scratch_bufs
  local cur = s[slot]
  if cur and cur.n >= n then return cur.p end
  local nn = cur and math.max(n, cur.n * 2) or n
  local p = alloc_bytes(nn)
  s[slot] = { p = p, n = nn }
  return p
end

---------------------------------------------------------------- local reduction
-- Reduce `nblocks` blocks (array of pointers, 1-based) of `count` elements into
-- dst, in block order, with weft_host_reduce: the shm engine's kernels, so
-- every rank and every backend computes bit-identical results (integers wrap,
-- f16/bf16 accumulate in f32 and round once, max/min propagate NaN). Never in
-- Lua numbers: their conversions back to integers depend on the JIT state.
local DT_CODE = { f32 = 0, f16 = 1, bf16 = 2, i32 = 3, i64 = 4, u8 = 5, f64 = 6, f8e4m3 = 7 }
local DT_SIZE = { f32 = 4, f16 = 2, bf16 = 2, i32 = 4, i64 = 8, u8 = 1, f64 = 8, f8e4m3 = 1 }
M.DT_CODE, M.DT_SIZE = DT_CODE, DT_SIZE
local srcs_ct = ffi.typeof("const void *[?]")

function G:_reduce_blocks(dst, blocks, count, dtype, rop)
  local n = #blocks
  local srcs = self._reduce_srcs
  if srcs == nil or self._reduce_srcs_n < n then
    srcs = srcs_ct(n)
    self._reduce_srcs, self._reduce_srcs_n = srcs, n
  end
  for r = 1, n do srcs[r - 1] = blocks[r] end
  wffi.check(C.weft_host_reduce(dst, srcs, n, count, DT_CODE[dtype], REDUCE_OPS[rop]), "reduce")
end

---------------------------------------------------------------- backends
M.backends = {}

function M.register_backend(name, impl)
  assert(type(name) == "string" and type(impl) == "table", "weft: register_backend(name, impl)")
  M.backends[name] = impl
end

local function shm_comm(g)
  local c = g._shm
  if c then return c end
  local shm = require "weft.shm"
  -- chunk per rank: WEFT_SHM_BYTES, else M.SHM_BYTES, else weft.shm's default
  local per_rank = tonumber(os.getenv("WEFT_SHM_BYTES")) or M.SHM_BYTES
  c = shm.new(g.cpu_group, per_rank)
  g._shm = c
  return c
end
M.SHM_BYTES = nil

local function lens_error(g, op, lens, mine)
  local parts = {}
  for i = 1, #lens do parts[i] = ("rank %d: %d"):format(g.ranks[i], lens[i]) end
  error(("weft: %s: ranks passed different sizes on group %s (bytes %s; this rank %d)")
        :format(op, gname(g), concat(parts, ", "), mine), 0)
end

-- store: every rank's bytes through the cpu group's all-gather
local store_backend = {
  gather_bytes = function(g, op, src, nbytes, dst)
    local list = g.cpu_group:allgather(ffi_string(src, nbytes))
    local lens, bad = {}, false
    for i = 1, #list do lens[i] = #list[i]; if lens[i] ~= nbytes then bad = true end end
    if bad then lens_error(g, op, lens, nbytes) end
    local d = ffi_cast(u8p, dst)
    for i = 1, #list do ffi_copy(d + (i - 1) * nbytes, list[i], nbytes) end
  end,
  broadcast = function(g, op, ptr, nbytes, src)
    local me = g.rank_in_group
    local data = g.cpu_group:broadcast(me == src and ffi_string(ptr, nbytes) or nil, src)
    if #data ~= nbytes then
      error(("weft: %s: rank %d broadcast %d bytes on group %s, this rank expected %d")
            :format(op, g.ranks[src + 1], #data, gname(g), nbytes), 0)
    end
    if me ~= src then ffi_copy(ptr, data, nbytes) end
  end,
}
M.register_backend("store", store_backend)

local shm_gather_backend = {
  gather_bytes = function(g, _, src, nbytes, dst)
    shm_comm(g):all_gather(src, dst, nbytes)
  end,
  broadcast = function(g, _, ptr, nbytes, src)
    shm_comm(g):broadcast(ptr, nbytes, src)
  end,
}
M.register_backend("shm_gather", shm_gather_backend)

M.register_backend("shm", {
  gather_bytes = shm_gather_backend.gather_bytes,
  broadcast = shm_gather_backend.broadcast,
  all_reduce = function(g, _, t, out_ptr, _, opcode)
    shm_comm(g):all_reduce(t.ptr, out_ptr, t.numel, DT_CODE[t.dtype], opcode)
  end,
  -- input laid out as world contiguous chunks; out receives this rank's chunk
  reduce_scatter_flat = function(g, _, inp, out, count_out, dtype, rop, opcode)
    shm_comm(g):reduce_scatter(inp, out, count_out, DT_CODE[dtype], opcode)
  end,
})

M.register_backend("no_device_backend", setmetatable({}, { __index = function(_, k)
  return function(g, op)
    error(("weft: %s: device tensors on group %s need a device backend (none registered; "
          .. "is weft.cuda loaded and the group's device communicator created?)"):format(op, gname(g)), 0)
  end
end }))

local function select_backend(g, op, t, rop)
  local name, why, cacheable = policy.select(g, op, t, rop)
  local be = name and M.backends[name]
  if name == "store" and not g.same_node and not require("weft.host_nodes").built then
    require("weft.host_nodes").warn_store(g)
  end
  if not be then
    error(("weft: %s: policy chose backend %q for group %s but it is not registered (%s)")
          :format(op, tostring(name), gname(g), tostring(why)), 0)
  end
  return be, name, cacheable
end

-- The hot path: a per-group memo of cacheable decisions, keyed by op, dtype,
-- device and reduction (nested tables: no key building per call); dropped
-- whenever the policy table changes (policy.version) or the group changes
-- state (g._dispatch = nil).
local function backend_for(g, op, t, rop)
  local memo = g._dispatch
  if memo == nil or memo.version ~= policy.version then
    memo = { version = policy.version }
    g._dispatch = memo
  end
  local a = memo[op]
  local dt, dev = t and t.dtype or "", t and t.device or ""
  local b = a and a[dt]
  local c = b and b[dev]
  local e = c and c[rop or ""]
  if e then return e[1], e[2] end
  local be, name, cacheable = select_backend(g, op, t, rop)
  if cacheable then
    if not a then a = {}; memo[op] = a end
    if not b then b = {}; a[dt] = b end
    if not c then c = {}; b[dev] = c end
    c[rop or ""] = { be, name }
  end
  return be, name
end

-- Re-raise a failure of the layer below as "weft: <op>: group <name>: <cause>"
-- (the cause keeps its own naming of the C call, the ranks, the timeout).
local function rethrow(g, op, ok, ...)
  if ok then return ... end
  local msg = tostring((...))
  local i = msg:find("weft: ", 1, true)
  if i then msg = msg:sub(i) end
  if msg:find("^weft: " .. op .. ":") then error(msg, 0) end
  error(("weft: %s: group %s: %s"):format(op, gname(g), (msg:gsub("^weft: ", ""))), 0)
end

local function call_be(g, op, f, ...)
  return rethrow(g, op, pcall(f, g, op, ...))
end

local function cpu(g, op, method, ...)
  local c = g.cpu_group
  return rethrow(g, op, pcall(c[method], c, ...))
end

---------------------------------------------------------------- call agreement
-- Object collectives (and the uneven all_to_all_single) are one all-gather on
-- the cpu group whose parts start with each rank's call ("broadcast_object
-- src=0", "all_gather_object"): ranks that called different operations (or
-- named another source) all complete the same exchange and all fail at once,
-- each naming every rank's call, and the group stays usable -- what the shm
-- engine does for tensor collectives with its call descriptors. weft.async's
-- object collectives use the same parts, so blocking and async calls meet.
-- Point-to-point messages carry the sender's call the same way; the receiver
-- checks it (a send is not waited for, so only the receiver can tell).
local CALL_MARK = "\1weft-call\1"
local MARK_LEN = #CALL_MARK
M.CALL_MARK = CALL_MARK

local topology_mod
local function ranks_str(list)
  topology_mod = topology_mod or require "weft.topology"
  return topology_mod.ranks_str(list)
end

-- The call a part names (nil when it is not a coordinator call: a lower-level
-- exchange of another module) and where its payload starts (0-based).
local function split_call(s)
  if s:sub(1, MARK_LEN) ~= CALL_MARK then return nil, 0 end
  local z = s:find("\0", MARK_LEN + 1, true)
  if not z then return nil, 0 end
  return s:sub(MARK_LEN + 1, z - 1), z
end
M.split_call = split_call

-- "rank 1: all_gather_object; ranks 0,2,3: broadcast_object src=0": ranks
-- (global) grouped by what they called, groups in order of their first rank.
function M.describe_calls(ranks, calls)
  local order, by = {}, {}
  for i = 1, #calls do
    local c = calls[i] or "another call (not a weft collective)"
    if not by[c] then by[c] = {}; order[#order + 1] = c end
    local l = by[c]
    l[#l + 1] = ranks[i]
  end
  local parts = {}
  for k, c in ipairs(order) do
    local l = by[c]
    parts[k] = ("rank%s %s: %s"):format(#l > 1 and "s" or "", ranks_str(l), c)
  end
  return concat(parts, "; ")
end

-- A part: the call, then the payload.
function M.frame(call, payload) return CALL_MARK .. call .. "\0" .. payload end

-- check_calls(g, op, call, parts) -> offsets: where each part's payload
-- starts (0-based); raises, alike on every rank, when the calls differ.
function M.check_calls(g, op, call, parts)
  local offs, bad = {}, false
  for i = 1, #parts do
    local c, off = split_call(parts[i])
    offs[i] = off
    if c ~= call then bad = true end
  end
  if bad then
    local calls = {}
    for i = 1, #parts do calls[i] = split_call(parts[i]) or false end
    error(("weft: %s: ranks called different collectives on group %s: %s")
          :format(op, gname(g), M.describe_calls(g.ranks, calls)), 0)
  end
  return offs
end

-- exchange(g, op, call, payload) -> parts, offsets: every rank's part (raw
-- strings, in group order) and where each payload starts in it.
function M.exchange(g, op, call, payload)
  local list = cpu(g, op, "allgather", M.frame(call, payload))
  return list, M.check_calls(g, op, call, list)
end
local exchange = M.exchange

-- payloads only, as strings (object collectives)
local function exchange_strings(g, op, call, payload)
  local list, offs = exchange(g, op, call, payload)
  for i = 1, #list do list[i] = list[i]:sub(offs[i] + 1) end
  return list
end

-- point to point: the message names the sender's call; the receiver says
-- what it expected when the two differ
local function p2p_send(g, op, payload, dst)
  cpu(g, op, "send", M.frame(op, payload), dst)
end

local P2P_PAIR = { recv = "send", recv_object = "send_object", recv_tensor_dict = "send_tensor_dict" }
-- the payload of message s from src, checked against the call op expects
function M.check_message(g, op, s, src)
  local c, off = split_call(s)
  local want = P2P_PAIR[op]
  if c ~= want then
    error(("weft: %s: rank %d sent with %s, this rank called %s (expects %s) on group %s")
          :format(op, g.ranks[src + 1], c or "another call (not a weft send)", op, want, gname(g)), 0)
  end
  return s:sub(off + 1)
end
local function p2p_recv(g, op, src)
  return M.check_message(g, op, cpu(g, op, "recv", src), src)
end

-- all-gather `nbytes` from src into dst (world * nbytes), through backend `be`
local function gather_bytes(g, be, op, src, nbytes, dst)
  if not be.gather_bytes then
    error(("weft: %s: backend cannot gather on group %s"):format(op, gname(g)), 0)
  end
  call_be(g, op, be.gather_bytes, src, nbytes, dst)
end

---------------------------------------------------------------- construction
-- M.new{name=, ranks=, rank=, local_rank=, store=, timeout_ms=, cpugroup_name=,
--       same_node=true|false|nil (nil: probe), host_backend=nil|"store"}
function M.new(o)
  local ranks = o.ranks
  local self = setmetatable({}, G)
  self.unique_name = o.name
  self.rank = o.rank
  self.local_rank = o.local_rank or o.rank
  self.ranks = {}
  for i = 1, #ranks do self.ranks[i] = ranks[i] end
  self.world_size = #ranks
  self.first_rank = ranks[1]
  self.last_rank = ranks[#ranks]
  self.timeout_ms = o.timeout_ms
  self.host_backend = o.host_backend
  self.device_group = nil     -- filled by device backends (NCCL communicator)
  self.cpu_group = nil
  self.destroyed = false
  self._scratch_bufs = {}
  local idx
  for i = 1, #ranks do if ranks[i] == o.rank then idx = i - 1 end end
  self.is_member = idx ~= nil
  self.rank_in_group = idx
  if idx then
    self.is_first_rank = o.rank == self.first_rank
    self.is_last_rank = o.rank == self.last_rank
    self.next_rank = ranks[(idx + 1) % #ranks + 1]
    self.prev_rank = ranks[(idx - 1) % #ranks + 1]
    if #ranks > 1 then
      local cpugroup = require "weft.cpugroup"
      self.cpu_group = cpugroup.new(o.store, o.cpugroup_name or o.name, self.ranks, idx, o.timeout_ms)
      if o.same_node ~= nil then
        self.same_node = o.same_node
      else
        self.same_node = M.probe_same_node(self.cpu_group)
      end
      -- across nodes: which rank is on which node (collective, one probe per node)
      if not self.same_node then require("weft.host_nodes").on_new(self) end
      -- The seed's mq_broadcaster: a shared-memory ring for broadcast_object
      -- from index 0. Collective, so every rank must decide alike: the option
      -- (dist.lua sets it for the TP group under WEFT_USE_MQ_BROADCASTER=1)
      -- and same_node, which all ranks agreed on.
      if o.use_mq_broadcaster and self.same_node then
        self.mq_broadcaster = require("weft.mq").new(self.cpu_group,
          { writer = 0, chunk_bytes = o.mq_chunk_bytes, chunks = o.mq_chunks })
      end
    else
      self.same_node = true
    end
  else
    self.is_first_rank, self.is_last_rank = false, false
    self.same_node = false
  end
  return self
end

-- Collective: true when every rank of the cpu group shares memory with index 0
-- (the seed's in_the_same_node_as, reduced to one answer every rank agrees on).
function M.probe_same_node(cpu)
  local ok, shm = pcall(require, "weft.shm")
  if not ok then return false end
  local flags = shm.same_node(cpu, 0)
  for i = 1, #flags do if not flags[i] then return false end end
  return true
end

function G:__tostring()
  return ("GroupCoordinator(%s: ranks={%s} rank=%d local_rank=%d world_size=%d rank_in_group=%s%s)")
    :format(tostring(self.unique_name), concat(self.ranks, ","), self.rank, self.local_rank,
            self.world_size, tostring(self.rank_in_group), self.destroyed and " destroyed" or "")
end

-- Local only: never a collective (DESIGN.md §3). Idempotent.
function G:destroy()
  if self.destroyed then return end
  self.destroyed = true
  for _, hook in ipairs(M.destroy_hooks) do hook(self) end
  if self._shm then self._shm:destroy(); self._shm = nil end
  if self.mq_broadcaster then self.mq_broadcaster:destroy(); self.mq_broadcaster = nil end
  if self.cpu_group then self.cpu_group:destroy(); self.cpu_group = nil end
  self._scratch_bufs = {}
end
-- device backends register teardown of their per-group state here
M.destroy_hooks = {}

-- weft.graph calls these once per distinct group around a capture; device
-- backends add functions(g, ctx) to prepare (register buffers, switch modes).
M.graph_hooks = { enter = {}, exit = {} }
function G:graph_enter(ctx)
  if self.destroyed then error(("weft: graph_enter: group %s is destroyed"):format(gname(self)), 2) end
  for _, hook in ipairs(M.graph_hooks.enter) do hook(self, ctx) end
end
function G:graph_exit(ctx)
  for i = #M.graph_hooks.exit, 1, -1 do M.graph_hooks.exit[i](self, ctx) end
end

---------------------------------------------------------------- tensor collectives
-- Reduce t across the group into out_ptr (t.ptr for in place); t validated.
local function reduce_into(g, t, out_ptr, rop, code)
  local be = backend_for(g, "all_reduce", t, rop)
  local f = be.all_reduce
  if f then return call_be(g, "all_reduce", f, t, out_ptr, rop, code) end
  -- generic: gather everything, reduce locally in rank order
  local nbytes = t.nbytes
  local buf = g:_scratch("gather", nbytes * g.world_size)
  gather_bytes(g, be, "all_reduce", t.ptr, nbytes, buf)
  local blocks = {}
  for r = 1, g.world_size do blocks[r] = buf + (r - 1) * nbytes end
  g:_reduce_blocks(out_ptr, blocks, t.numel, t.dtype, rop)
end

-- all_reduce(t [, op="sum" [, out]]) -> t reduced in place, or out (t unchanged)
function G:all_reduce(t, rop, out)
  check_group(self, "all_reduce")
  check_tensor(self, "all_reduce", t)
  rop = rop or "sum"
  local code = check_reduce(self, "all_reduce", t, rop)
  if out ~= nil and out ~= t then
    check_tensor(self, "all_reduce", out, "output")
    check_place(self, "all_reduce", t, out, "input", "output")
    if out.dtype ~= t.dtype or not same_shape(out.shape, t.shape) then
      fail(2, "all_reduce", "output is %s %s, expected %s %s (group %s)", out.dtype, shape_str(out.shape),
           t.dtype, shape_str(t.shape), gname(self))
    end
    if self.world_size == 1 then out:copy_(t); return out end
    reduce_into(self, t, out.ptr, rop, code)
    return out
  end
  if self.world_size == 1 then return t end
  reduce_into(self, t, t.ptr, rop, code)
  return t
end

-- all_gather(t [, dim=-1 [, out]]) -> out, t gathered along dim in group order
function G:all_gather(t, dim, out)
  check_group(self, "all_gather")
  check_tensor(self, "all_gather", t)
  dim = norm_dim(self, "all_gather", t, dim or -1)
  local W = self.world_size
  local oshape = {}
  for i = 1, #t.shape do oshape[i] = t.shape[i] end
  oshape[dim + 1] = oshape[dim + 1] * W
  if out ~= nil then
    check_tensor(self, "all_gather", out, "output")
    check_place(self, "all_gather", t, out, "input", "output")
    if out.dtype ~= t.dtype then
      fail(2, "all_gather", "output dtype %s differs from input dtype %s (group %s)", out.dtype, t.dtype, gname(self))
    end
    if not same_shape(out.shape, oshape) then
      fail(2, "all_gather", "output shape %s, expected %s for input %s gathered along dim %d over %d ranks (group %s)",
           shape_str(out.shape), shape_str(oshape), shape_str(t.shape), dim, W, gname(self))
    end
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if W == 1 then
    if out.ptr ~= t.ptr then out:copy_(t) end
    return out
  end
  local be = backend_for(self, "all_gather", t)
  if be.all_gather then call_be(self, "all_gather", be.all_gather, t, dim, out); return out end
  local nbytes = t.nbytes
  local outer, inner = outer_inner(t.shape, dim)
  if outer == 1 then
    gather_bytes(self, be, "all_gather", t.ptr, nbytes, out.ptr)
    return out
  end
  local buf = self:_scratch("gather", nbytes * W)
  gather_bytes(self, be, "all_gather", t.ptr, nbytes, buf)
  -- buf is [W][outer][inner]; out is [outer][W][inner]
  local ib = inner * DT_SIZE[t.dtype]
  local o = ffi_cast(u8p, out.ptr)
  for r = 0, W - 1 do
    for k = 0, outer - 1 do
      ffi_copy(o + (k * W + r) * ib, buf + (r * outer + k) * ib, ib)
    end
  end
  return out
end

function G:all_gather_into_tensor(out, t)
  return self:all_gather(t, 0, out)
end

-- reduce_scatter(t [, dim=-1 [, out [, op]]]) -> out: this rank's chunk of the
-- reduction, t split into world equal chunks along dim.
function G:reduce_scatter(t, dim, out, rop)
  check_group(self, "reduce_scatter")
  check_tensor(self, "reduce_scatter", t)
  rop = rop or "sum"
  local code = check_reduce(self, "reduce_scatter", t, rop)
  dim = norm_dim(self, "reduce_scatter", t, dim or -1)
  local W = self.world_size
  local d = t.shape[dim + 1]
  if d % W ~= 0 then
    fail(2, "reduce_scatter", "dim %d of shape %s has size %d, not divisible by the %d ranks of group %s",
         dim, shape_str(t.shape), d, W, gname(self))
  end
  local oshape = {}
  for i = 1, #t.shape do oshape[i] = t.shape[i] end
  oshape[dim + 1] = d / W
  if out ~= nil then
    check_tensor(self, "reduce_scatter", out, "output")
    check_place(self, "reduce_scatter", t, out, "input", "output")
    if out.dtype ~= t.dtype or not same_shape(out.shape, oshape) then
      fail(2, "reduce_scatter", "output is %s %s, expected %s %s (group %s)",
           out.dtype, shape_str(out.shape), t.dtype, shape_str(oshape), gname(self))
    end
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if W == 1 then
    if out.ptr ~= t.ptr then out:copy_(t) end
    return out
  end
  local be = backend_for(self, "reduce_scatter", t, rop)
  if be.reduce_scatter then call_be(self, "reduce_scatter", be.reduce_scatter, t, dim, out, rop, code); return out end
  -- lay the input out as W contiguous chunks (chunk r goes to rank r)
  local nbytes = t.nbytes
  local outer = outer_inner(t.shape, dim)
  local chunk = nbytes / W / outer          -- bytes of one [chunk] row piece
  local src = ffi_cast(u8p, t.ptr)
  if outer > 1 then
    local buf = self:_scratch("rs_in", nbytes)
    for k = 0, outer - 1 do
      for r = 0, W - 1 do
        ffi_copy(buf + (r * outer + k) * chunk, src + (k * W + r) * chunk, chunk)
      end
    end
    src = buf
  end
  local count_out = out.numel
  if be.reduce_scatter_flat then
    call_be(self, "reduce_scatter", be.reduce_scatter_flat, src, out.ptr, count_out, t.dtype, rop, code)
    return out
  end
  local buf = self:_scratch("gather", nbytes * W)
  gather_bytes(self, be, "reduce_scatter", src, nbytes, buf)
  local me, ob = self.rank_in_group, out.nbytes
  local blocks = {}
  for r = 1, W do blocks[r] = buf + (r - 1) * nbytes + me * ob end
  self:_reduce_blocks(out.ptr, blocks, count_out, t.dtype, rop)
  return out
end

function G:reduce_scatter_tensor(out, t)
  return self:reduce_scatter(t, 0, out)
end

-- sizes: rows (dim 0) per rank, a Lua array of world_size counts
local function check_sizes(g, op, sizes, rows, what)
  if type(sizes) ~= "table" or #sizes ~= g.world_size then
    fail(3, op, "sizes must list %d row counts, one per rank (group %s)", g.world_size, gname(g))
  end
  local sum = 0
  for i = 1, #sizes do
    local n = sizes[i]
    if type(n) ~= "number" or n ~= floor(n) or n < 0 then
      fail(3, op, "size %d is %s, not a row count (group %s)", i - 1, tostring(n), gname(g))
    end
    sum = sum + n
  end
  if what == "mine" and sizes[g.rank_in_group + 1] ~= rows then
    fail(3, op, "sizes say this rank has %d rows, the input has %d (group %s)",
         sizes[g.rank_in_group + 1], rows, gname(g))
  elseif what == "sum" and sum ~= rows then
    fail(3, op, "sizes sum to %d rows, the input has %d (group %s)", sum, rows, gname(g))
  end
  return sum
end

local function rows_shape(t, rows)
  local s = { rows }
  for i = 2, #t.shape do s[i] = t.shape[i] end
  return s
end

local function check_out(g, op, t, out, shape)
  check_tensor(g, op, out, "output")
  check_place(g, op, t, out, "input", "output")
  if out.dtype ~= t.dtype or not same_shape(out.shape, shape) then
    fail(3, op, "output is %s %s, expected %s %s (group %s)", out.dtype, shape_str(out.shape), t.dtype,
         shape_str(shape), gname(g))
  end
end

-- all_gatherv(t, sizes [, out]) -> out: rank r contributes sizes[r+1] rows
-- (dim 0), concatenated in rank order (the seed's all_gatherv; sizes nil:
-- equal shares, all_gather along dim 0).
function G:all_gatherv(t, sizes, out)
  local op = "all_gatherv"
  check_group(self, op)
  check_tensor(self, op, t)
  if #t.shape < 1 then fail(2, op, "input needs at least one dim (group %s)", gname(self)) end
  if sizes == nil then return self:all_gather(t, 0, out) end
  local total = check_sizes(self, op, sizes, t.shape[1], "mine")
  local oshape = rows_shape(t, total)
  if out ~= nil then check_out(self, op, t, out, oshape) else out = T().empty(oshape, t.dtype, t.device) end
  if self.world_size == 1 then
    if out.ptr ~= t.ptr then out:copy_(t) end
    return out
  end
  local be = backend_for(self, op, t)
  if be.all_gatherv then call_be(self, op, be.all_gatherv, t, sizes, out); return out end
  -- host: pad every share to the largest, gather, compact
  local row = DT_SIZE[t.dtype]
  for i = 2, #t.shape do row = row * t.shape[i] end
  local maxr = 0
  for i = 1, #sizes do if sizes[i] > maxr then maxr = sizes[i] end end
  local nb = maxr * row
  if nb == 0 then return out end
  local src = self:_scratch("agv", nb)
  if t.nbytes > 0 then ffi_copy(src, t.ptr, t.nbytes) end
  local buf = self:_scratch("gather", nb * self.world_size)
  gather_bytes(self, be, op, src, nb, buf)
  local o, pos = ffi_cast(u8p, out.ptr), 0
  for r = 1, #sizes do
    local n = sizes[r] * row
    if n > 0 then ffi_copy(o + pos, buf + (r - 1) * nb, n) end
    pos = pos + n
  end
  return out
end

-- reduce_scatterv(t [, out [, sizes [, op="sum"]]]) -> out: the reduction of
-- t, of which rank r keeps sizes[r+1] rows (dim 0) (the seed's
-- reduce_scatterv; sizes nil: equal shares, reduce_scatter along dim 0).
function G:reduce_scatterv(t, out, sizes, rop)
  local op = "reduce_scatterv"
  check_group(self, op)
  check_tensor(self, op, t)
  rop = rop or "sum"
  local code = check_reduce(self, op, t, rop)
  if #t.shape < 1 then fail(2, op, "input needs at least one dim (group %s)", gname(self)) end
  if sizes == nil then return self:reduce_scatter(t, 0, out, rop) end
  check_sizes(self, op, sizes, t.shape[1], "sum")
  local me = self.rank_in_group
  local oshape = rows_shape(t, sizes[me + 1])
  if out ~= nil then check_out(self, op, t, out, oshape) else out = T().empty(oshape, t.dtype, t.device) end
  if self.world_size == 1 then
    if out.ptr ~= t.ptr then out:copy_(t) end
    return out
  end
  local be = backend_for(self, op, t, rop)
  if be.reduce_scatterv then call_be(self, op, be.reduce_scatterv, t, sizes, out, rop, code); return out end
  -- host: reduce everything, keep this rank's rows
  if t.nbytes == 0 then return out end
  local buf = self:_scratch("rsv", t.nbytes)
  reduce_into(self, t, buf, rop, code)
  local row = t.nbytes / t.shape[1]
  local off = 0
  for r = 1, me do off = off + sizes[r] end
  if out.nbytes > 0 then ffi_copy(out.ptr, buf + off * row, out.nbytes) end
  return out
end

-- broadcast(t [, src=0]) -> t, in place
function G:broadcast(t, src)
  check_group(self, "broadcast")
  src = src or 0
  check_peer(self, "broadcast", src, "src")
  check_tensor(self, "broadcast", t)
  if self.world_size == 1 then return t end
  local be = backend_for(self, "broadcast", t)
  if be.broadcast_tensor then call_be(self, "broadcast", be.broadcast_tensor, t, src); return t end
  call_be(self, "broadcast", be.broadcast, t.ptr, t.nbytes, src)
  return t
end

-- gather(t [, dst=0 [, dim=-1]]) -> on dst the concatenation along dim, elsewhere nil
function G:gather(t, dst, dim)
  check_group(self, "gather")
  dst = dst or 0
  check_peer(self, "gather", dst, "dst")
  check_tensor(self, "gather", t)
  dim = norm_dim(self, "gather", t, dim or -1)
  if self.world_size == 1 then return t end
  local be = backend_for(self, "gather", t)
  if be.gather then return call_be(self, "gather", be.gather, t, dst, dim) end
  local out = self:all_gather(t, dim)
  if self.rank_in_group == dst then return out end
  out:free()
  return nil
end

---------------------------------------------------------------- point to point
-- Tensors travel as serialized values (dtype, shape, bytes) over the cpu group,
-- so the receiver checks what arrives against what it expects.
function G:send(t, dst)
  check_group(self, "send")
  if dst == nil then dst = (self.rank_in_group + 1) % self.world_size end
  check_peer(self, "send", dst, "dst")
  check_tensor(self, "send", t)
  if dst == self.rank_in_group then
    fail(2, "send", "dst %d is this rank's own index in group %s", dst, gname(self))
  end
  if t.device ~= "cpu" then   -- device tensors: the device backend (sizes must match the recv)
    local be = backend_for(self, "send", t)
    call_be(self, "send", be.send, t, dst)
    return
  end
  local be = backend_for(self, "send", t)
  if be.send_host then call_be(self, "send", be.send_host, t, dst); return end   -- gloo across nodes
  p2p_send(self, "send", serialize.encode(t), dst)
end

-- recv(tensor_or_shape [, src [, dtype="f32"]]) -> tensor (filled in place when given)
function G:recv(spec, src, dtype)
  check_group(self, "recv")
  if src == nil then src = (self.rank_in_group - 1) % self.world_size end
  check_peer(self, "recv", src, "src")
  if src == self.rank_in_group then
    fail(2, "recv", "src %d is this rank's own index in group %s", src, gname(self))
  end
  local tm = T()
  local into
  if tm.is_tensor(spec) then
    check_tensor(self, "recv", spec)
    into = spec
  elseif type(spec) == "table" then
    into = tm.empty(spec, dtype or "f32")
  else
    fail(2, "recv", "expected a tensor or a shape table, got %s (group %s)", type(spec), gname(self))
  end
  if into.device ~= "cpu" then
    local be = backend_for(self, "recv", into)
    call_be(self, "recv", be.recv, into, src)
    return into
  end
  local hbe = backend_for(self, "recv", into)
  if hbe.recv_host then call_be(self, "recv", hbe.recv_host, into, src); return into end
  local got = serialize.decode(p2p_recv(self, "recv", src))
  if not tm.is_tensor(got) then
    error(("weft: recv: rank %d sent a %s, not a tensor (group %s)"):format(self.ranks[src + 1], type(got), gname(self)), 2)
  end
  if got.dtype ~= into.dtype or not same_shape(got.shape, into.shape) then
    local a, b = got.dtype, shape_str(got.shape)
    got:free()
    error(("weft: recv: rank %d sent %s %s, this rank expected %s %s (group %s)")
          :format(self.ranks[src + 1], a, b, into.dtype, shape_str(into.shape), gname(self)), 2)
  end
  if into.nbytes > 0 then into:copy_(got) end
  got:free()
  return into
end

-- all_to_all_single(out, inp [, splits]): rows (dim 0) of inp are split into
-- world chunks, chunk r goes to rank r; out receives chunk `me` of every rank
-- in rank order. splits: nil (equal), an array of input row counts per rank,
-- or {input = {...}, output = {...}}.
function G:all_to_all_single(out, inp, splits)
  local op = "all_to_all_single"
  check_group(self, op)
  check_tensor(self, op, out, "output")
  check_tensor(self, op, inp, "input")
  check_place(self, op, inp, out, "input", "output")
  if out.dtype ~= inp.dtype then
    fail(2, op, "output dtype %s differs from input dtype %s (group %s)", out.dtype, inp.dtype, gname(self))
  end
  if #inp.shape == 0 or #out.shape ~= #inp.shape then
    fail(2, op, "input %s and output %s must have the same number of dims, at least 1 (group %s)",
         shape_str(inp.shape), shape_str(out.shape), gname(self))
  end
  for i = 2, #inp.shape do
    if inp.shape[i] ~= out.shape[i] then
      fail(2, op, "input %s and output %s differ beyond dim 0 (group %s)",
           shape_str(inp.shape), shape_str(out.shape), gname(self))
    end
  end
  local W, me = self.world_size, self.rank_in_group
  local rows = inp.shape[1]
  local row_bytes = rows > 0 and inp.nbytes / rows or 0
  if row_bytes == 0 and #inp.shape > 0 then
    local rb = DT_SIZE[inp.dtype]
    for i = 2, #inp.shape do rb = rb * inp.shape[i] end
    row_bytes = rb
  end
  local in_splits, out_splits = nil, nil
  if splits ~= nil then
    if type(splits) ~= "table" then fail(2, op, "splits must be a table (group %s)", gname(self)) end
    in_splits = splits.input or splits
    out_splits = splits.output
    if #in_splits ~= W then
      fail(2, op, "input splits have %d entries, group %s has %d ranks", #in_splits, gname(self), W)
    end
    local s = 0
    for i = 1, W do s = s + in_splits[i] end
    if s ~= rows then
      fail(2, op, "input splits sum to %d rows, input has %d (group %s)", s, rows, gname(self))
    end
  else
    if rows % W ~= 0 or out.shape[1] ~= rows then
      fail(2, op, "input rows %d and output rows %d must be equal and divisible by %d ranks (group %s)",
           rows, out.shape[1], W, gname(self))
    end
  end
  if W == 1 then
    if out.nbytes ~= inp.nbytes then
      fail(2, op, "output %s cannot hold input %s (group %s)", shape_str(out.shape), shape_str(inp.shape), gname(self))
    end
    if out.ptr ~= inp.ptr then out:copy_(inp) end
    return out
  end
  if inp.device ~= "cpu" then
    local be = backend_for(self, op, inp)
    call_be(self, op, be.all_to_all_single, out, inp, in_splits, out_splits)
    return out
  end
  if in_splits == nil then
    local be = backend_for(self, op, inp)
    local nbytes = inp.nbytes
    local buf = self:_scratch("gather", nbytes * W)
    gather_bytes(self, be, op, inp.ptr, nbytes, buf)
    local cb = nbytes / W
    local o = ffi_cast(u8p, out.ptr)
    for r = 0, W - 1 do ffi_copy(o + r * cb, buf + r * nbytes + me * cb, cb) end
    return out
  end
  -- uneven: exchange the split tables, then the rows through the cpu group
  local list = exchange_strings(self, op, op .. " splits", serialize.encode(in_splits))
  local all = {}
  for r = 1, W do all[r] = serialize.decode(list[r]) end
  local total = 0
  for r = 1, W do total = total + all[r][me + 1] end
  if out_splits then
    for r = 1, W do
      if out_splits[r] ~= all[r][me + 1] then
        fail(2, op, "output split %d says %d rows, rank %d sends %d (group %s)",
             r - 1, out_splits[r], self.ranks[r], all[r][me + 1], gname(self))
      end
    end
  end
  if total ~= out.shape[1] then
    fail(2, op, "this rank receives %d rows, output has %d (group %s)", total, out.shape[1], gname(self))
  end
  local data = exchange_strings(self, op, op .. " rows", ffi_string(inp.ptr, inp.nbytes))
  local o = ffi_cast(u8p, out.ptr)
  local pos = 0
  for r = 1, W do
    local off = 0
    for k = 1, me do off = off + all[r][k] end
    local n = all[r][me + 1] * row_bytes
    ffi_copy(o + pos, ffi_cast(cu8p, data[r]) + off * row_bytes, n)
    pos = pos + n
  end
  return out
end

function G:barrier()
  check_group(self, "barrier")
  if self.world_size == 1 then return end
  cpu(self, "barrier", "barrier")
end

---------------------------------------------------------------- objects
-- Object collectives are exchanges (see "call agreement"): a broadcast is an
-- all-gather in which only the source's part carries the object, so every
-- rank, the source too, returns once all have called, and ranks that called
-- something else (or named another source) fail together.
local function broadcast_obj(g, op, obj, src)
  local q = g.mq_broadcaster
  if q and src == 0 then   -- the ring's writer (no call check there); other sources use the store
    return rethrow(g, op, pcall(q.broadcast_object, q, obj))
  end
  local me = g.rank_in_group
  local list, offs = exchange(g, op, op .. " src=" .. src, me == src and serialize.encode(obj) or "")
  if me == src then return obj end
  return serialize.decode(list[src + 1]:sub(offs[src + 1] + 1))
end

function G:broadcast_object(obj, src)
  check_group(self, "broadcast_object")
  src = src or 0
  check_peer(self, "broadcast_object", src, "src")
  if self.world_size == 1 then return obj end
  return broadcast_obj(self, "broadcast_object", obj, src)
end

-- all_gather_object(obj) -> list of every rank's object (group order), count
function G:all_gather_object(obj)
  check_group(self, "all_gather_object")
  if self.world_size == 1 then return { obj }, 1 end
  local list = exchange_strings(self, "all_gather_object", "all_gather_object", serialize.encode(obj))
  local res = {}
  for i = 1, #list do res[i] = serialize.decode(list[i]) end
  return res, #list
end

function G:send_object(obj, dst)
  check_group(self, "send_object")
  check_peer(self, "send_object", dst, "dst")
  if dst == self.rank_in_group then
    fail(2, "send_object", "dst %d is this rank's own index in group %s", dst, gname(self))
  end
  p2p_send(self, "send_object", serialize.encode(obj), dst)
end

function G:recv_object(src)
  check_group(self, "recv_object")
  check_peer(self, "recv_object", src, "src")
  if src == self.rank_in_group then
    fail(2, "recv_object", "src %d is this rank's own index in group %s", src, gname(self))
  end
  return serialize.decode(p2p_recv(self, "recv_object", src))
end

---------------------------------------------------------------- tensor dicts
-- Metadata: an array of {key, "t", dtype, shape, device} or {key, "v", value};
-- tensors then travel by the group's data path in that order.
local function split_dict(g, op, dict)
  if type(dict) ~= "table" then
    fail(3, op, "expected a table of tensors and values, got %s (group %s)", type(dict), gname(g))
  end
  local tm = T()
  local meta, tensors = {}, {}
  local keys = {}
  for k in pairs(dict) do keys[#keys + 1] = k end
  table.sort(keys, serialize.key_less)
  for _, k in ipairs(keys) do
    local v = dict[k]
    if tm.is_tensor(v) then
      if not v:is_contiguous() then
        fail(3, op, "tensor %s is not contiguous (group %s)", tostring(k), gname(g))
      end
      meta[#meta + 1] = { k, "t", v.dtype, v.shape, v.device }
      tensors[#tensors + 1] = v
    else
      meta[#meta + 1] = { k, "v", v }
    end
  end
  return meta, tensors
end

local function device_for(dev)
  if dev == nil or dev == "cpu" then return "cpu" end
  return "cuda"       -- the receiver's current device
end

function G:broadcast_tensor_dict(dict, src)
  local op = "broadcast_tensor_dict"
  check_group(self, op)
  src = src or 0
  check_peer(self, op, src, "src")
  if self.world_size == 1 then return dict end
  if self.rank_in_group == src then
    local meta, tensors = split_dict(self, op, dict)
    broadcast_obj(self, op, meta, src)
    for _, t in ipairs(tensors) do
      if t.numel > 0 then self:broadcast(t, src) end
    end
    return dict
  end
  local meta = broadcast_obj(self, op, nil, src)
  local res = {}
  local tm = T()
  for _, m in ipairs(meta) do
    if m[2] == "t" then
      local t = tm.empty(m[4], m[3], device_for(m[5]))
      if t.numel > 0 then self:broadcast(t, src) end
      res[m[1]] = t
    else
      res[m[1]] = m[3]
    end
  end
  return res
end

-- send_tensor_dict(dict [, dst [, all_gather_group]]): with all_gather_group,
-- each tensor whose numel divides by its size sends only this rank's slice
-- (the receiver all-gathers them back), as in the seed.
function G:send_tensor_dict(dict, dst, ag)
  local op = "send_tensor_dict"
  check_group(self, op)
  if self.world_size == 1 then return dict end
  if dst == nil then dst = (self.rank_in_group + 1) % self.world_size end
  check_peer(self, op, dst, "dst")
  local meta, tensors = split_dict(self, op, dict)
  if dst == self.rank_in_group then
    fail(2, op, "dst %d is this rank's own index in group %s", dst, gname(self))
  end
  p2p_send(self, op, serialize.encode(meta), dst)
  local agw = ag and ag.world_size or 1
  local agr = ag and ag.rank_in_group or 0
  local tm = T()
  for _, t in ipairs(tensors) do
    if t.numel > 0 then
      if ag and t.numel % agw == 0 then
        local n = t.numel / agw
        local part = tm.wrap(ffi_cast(u8p, t.ptr) + agr * n * t:elem_size(), { n }, t.dtype, t.device, t)
        self:send(part, dst)
      else
        self:send(t, dst)
      end
    end
  end
end

function G:recv_tensor_dict(src, ag)
  local op = "recv_tensor_dict"
  check_group(self, op)
  if self.world_size == 1 then return nil end
  if src == nil then src = (self.rank_in_group - 1) % self.world_size end
  check_peer(self, op, src, "src")
  if src == self.rank_in_group then
    fail(2, op, "src %d is this rank's own index in group %s", src, gname(self))
  end
  local meta = serialize.decode(p2p_recv(self, op, src))
  if type(meta) ~= "table" then
    error(("weft: %s: rank %d sent a %s, not tensor-dict metadata (group %s)")
          :format(op, self.ranks[src + 1], type(meta), gname(self)), 2)
  end
  local agw = ag and ag.world_size or 1
  local res = {}
  local tm = T()
  for _, m in ipairs(meta) do
    if m[2] == "t" then
      local t = tm.empty(m[4], m[3], device_for(m[5]))
      if t.numel > 0 then
        if ag and t.numel % agw == 0 then
          local part = self:recv(tm.empty({ t.numel / agw }, t.dtype, t.device), src)
          local full = ag:all_gather(part, 0)
          t:copy_(full)
          part:free(); full:free()
        else
          self:recv(t, src)
        end
      end
      res[m[1]] = t
    else
      res[m[1]] = m[3]
    end
  end
  return res
end

---------------------------------------------------------------- fused
-- fused_allreduce_rmsnorm(x, residual, weight, eps [, {norm_out=, residual_out=, gemma=}])
--   -> norm_out, residual_out
-- residual_out = all_reduce(x) + residual; norm_out = rmsnorm(residual_out) * weight.
-- x itself is left unchanged. Host path: all-reduce into scratch, then
-- weft_host_rmsnorm (f32 math). Device backends may register a fused kernel.
local FLOATS = { f32 = true, f16 = true, bf16 = true }
function G:fused_allreduce_rmsnorm(x, residual, weight, eps, opts)
  local op = "fused_allreduce_rmsnorm"
  check_group(self, op)
  if M.device_fused and T().is_tensor(x) and x.device ~= "cpu" then
    return M.device_fused(self, x, residual, weight, eps, opts)   -- weft.device_backends
  end
  check_tensor(self, op, x, "input")
  check_tensor(self, op, residual, "residual")
  check_tensor(self, op, weight, "weight")
  check_place(self, op, x, residual, "input", "residual")
  check_place(self, op, x, weight, "input", "weight")
  if not FLOATS[x.dtype] then
    fail(2, op, "dtype %s is not supported (f32, f16, bf16) on group %s", x.dtype, gname(self))
  end
  if residual.dtype ~= x.dtype or weight.dtype ~= x.dtype then
    fail(2, op, "dtypes differ: input %s, residual %s, weight %s (group %s)",
         x.dtype, residual.dtype, weight.dtype, gname(self))
  end
  if not same_shape(x.shape, residual.shape) then
    fail(2, op, "residual shape %s differs from input shape %s (group %s)",
         shape_str(residual.shape), shape_str(x.shape), gname(self))
  end
  local hidden = x.shape[#x.shape]
  if #x.shape < 1 or #weight.shape ~= 1 or weight.shape[1] ~= hidden then
    fail(2, op, "weight shape %s must be {%s} (last dim of input %s) on group %s",
         shape_str(weight.shape), tostring(hidden), shape_str(x.shape), gname(self))
  end
  eps = eps or 1e-6
  if type(eps) ~= "number" or eps < 0 then fail(2, op, "eps must be a non-negative number (group %s)", gname(self)) end
  opts = opts or {}
  local be = self.world_size > 1 and backend_for(self, op, x) or nil
  if be and be.fused_allreduce_rmsnorm then
    return call_be(self, op, be.fused_allreduce_rmsnorm, x, residual, weight, eps, opts)
  end
  local tm = T()
  local norm_out = opts.norm_out or tm.empty(x.shape, x.dtype, x.device)
  local res_out = opts.residual_out or tm.empty(x.shape, x.dtype, x.device)
  for _, p in ipairs({ { norm_out, "norm_out" }, { res_out, "residual_out" } }) do
    check_tensor(self, op, p[1], p[2])
    check_place(self, op, x, p[1], "input", p[2])
    if p[1].dtype ~= x.dtype or not same_shape(p[1].shape, x.shape) then
      fail(2, op, "%s is %s %s, expected %s %s (group %s)", p[2], p[1].dtype,
           shape_str(p[1].shape), x.dtype, shape_str(x.shape), gname(self))
    end
  end
  if x.device ~= "cpu" then
    error(("weft: %s: device tensors need a device backend on group %s"):format(op, gname(self)), 2)
  end
  local src = x.ptr
  if self.world_size > 1 then
    -- reduce into scratch: x stays as the caller gave it
    src = self:_scratch("fused", x.nbytes)
    reduce_into(self, x, src, "sum", 0)
  end
  local tokens = x.numel / hidden
  wffi.check(C.weft_host_rmsnorm(src, residual.ptr, weight.ptr, norm_out.ptr, res_out.ptr,
                                 tokens, hidden, DT_CODE[x.dtype], eps, opts.gemma and 1 or 0), op, 2)
  return norm_out, res_out
end

---------------------------------------------------------------- device
-- Device backends, their policy rules and hooks (weft.device_backends; loads
-- nothing of CUDA until a device tensor arrives).
require("weft.device_backends").install(M)
-- Host tensors of groups across nodes (Gloo; weft.host_nodes).
require("weft.host_nodes").install(M)

return M
