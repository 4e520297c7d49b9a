-- weft.group — GroupCoordinator: one group of ranks, its properties and its
-- collectives (SGLang's GroupCoordinator).
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
--   gloo        ranks on several nodes: Gloo over TCP (weft.backends.host_nodes)
--   gloo_hier   ranks on several nodes, all_reduce: shm inside each node, Gloo
--               among the node leaders, shm broadcast back (weft.backends.host_nodes)
--   store       forced, or across nodes in a build without Gloo: bytes
--               through the TCP store
-- A backend is a table of functions; only gather_bytes and broadcast are
-- required, reductions fall back to gather + local reduce.
--
-- This file is the GroupCoordinator class and the public surface; its parts
-- are in lua/weft/group/: checks.lua (argument checks), host.lua (scratch,
-- local reduction, the backend registry and the host backends, dispatch),
-- objects.lua (call agreement, object collectives, tensor dicts).
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local serialize = require("weft.serialize")
local K = require("weft.group.checks")
local H = require("weft.group.host")
local O = require("weft.group.objects")

local C = wffi.C
local floor = math.floor
local ffi_cast = ffi.cast
local hostmem = require("weft.internal.hostmem")
local show = require("weft.internal.show").value -- names a refused value's type
local copy_bytes = hostmem.copy -- any size (ffi.copy stops at 2^31)
local type, tostring, error = type, tostring, error
local concat = table.concat

local M = {}
local G = {}
G.__index = G
M.GroupCoordinator = G

local u8p = ffi.typeof("uint8_t *")
local cu8p = ffi.typeof("const uint8_t *")

M.REDUCE_OPS = K.REDUCE_OPS
local REDUCE_OPS = M.REDUCE_OPS
local T = K.T
local fail, shape_str, gname = K.fail, K.shape_str, K.gname
local check_group, check_tensor, check_place, check_peer = K.check_group, K.check_tensor, K.check_place, K.check_peer
local check_reduce, norm_dim, same_shape, outer_inner = K.check_reduce, K.norm_dim, K.same_shape, K.outer_inner
local check_overlap = K.check_overlap

-- a group of one: the collective's output is its input
local function alone(out, t)
  if out.ptr ~= t.ptr then out:copy_(t) end
  return out
end

-- where this rank's block of a gathered (or scattered) tensor starts in the
-- whole, when the collective runs along the outermost dim (the in-place
-- layout of NCCL's, Gloo's and shm's all-gather and reduce-scatter); nil
-- otherwise
local function own_block(self, t, dim, nbytes)
  return outer_inner(t.shape, dim) == 1 and self.rank_in_group * nbytes or nil
end

-- host data path (weft.group.host)
G._scratch, G._reduce_blocks = H.scratch, H.reduce_blocks
M.DT_CODE, M.DT_SIZE = H.DT_CODE, H.DT_SIZE
local DT_CODE, DT_SIZE = H.DT_CODE, H.DT_SIZE
M.backends, M.register_backend = H.backends, H.register_backend
M.SHM_BYTES = nil   -- chunk per rank of the shm engine (WEFT_SHM_BYTES wins); nil: weft.shm's default
local backend_for, call_be, cpu, gather_bytes = H.backend_for, H.call_be, H.cpu, H.gather_bytes
local reduce_by_backend = H.reduce_by_backend

-- call agreement and object collectives (weft.group.objects)
M.CALL_MARK, M.split_call, M.describe_calls, M.frame = O.CALL_MARK, O.split_call, O.describe_calls, O.frame
M.check_calls, M.exchange, M.check_message, M.encode_part = O.check_calls, O.exchange, O.check_message, O.encode_part
local exchange, exchange_strings, p2p_send, p2p_recv = O.exchange, O.exchange_strings, O.p2p_send, O.p2p_recv
for _, name in ipairs({ "broadcast_object", "all_gather_object", "send_object", "recv_object",
                        "broadcast_tensor_dict", "send_tensor_dict", "recv_tensor_dict" }) do
  G[name] = O[name]
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
      local cpugroup = require("weft.cpugroup")
      self.cpu_group = cpugroup.new(o.store, o.cpugroup_name or o.name, self.ranks, idx, o.timeout_ms)
      if o.same_node ~= nil then
        self.same_node = o.same_node
      else
        self.same_node = M.probe_same_node(self.cpu_group)
      end
      -- across nodes: which rank is on which node (collective, one probe per node)
      if not self.same_node then require("weft.backends.host_nodes").on_new(self) end
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

-- Local only: never a collective (a destroy never runs a collective teardown by itself). Idempotent.
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
-- The generic all-reduce (gather, then reduce in rank order) stages at most
-- this many bytes of all ranks' pieces together per round: a larger tensor
-- goes in rounds, so the call's host memory is the tensor plus this, not
-- the tensor times (world + 1) kept for the group's life (issue 37: a 2 GiB
-- u8 all-reduce on 2 ranks peaked at ~8.2 GB per rank). docs/host-waits.md.
local GENERIC_AR_STAGE = 64 * 2 ^ 20
M.GENERIC_AR_STAGE = GENERIC_AR_STAGE
local sizes_ct = ffi.typeof("int64_t[8]") -- one 64-byte block per rank

-- Reduce t across the group into out_ptr (t.ptr for in place); t validated.
-- extra, op: the call's other arguments the ranks must agree on besides
-- the tensor and the reduction, and its name (reduce_scatterv: its sizes)
local function reduce_into(g, t, out_ptr, rop, code, extra, op)
  op = op or "all_reduce"
  local be = reduce_by_backend(g, t, out_ptr, rop, code, extra, op)
  if be == nil then return end
  -- generic (the backend has no all_reduce): gather everything, reduce
  -- locally in rank order
  local nbytes, W = t.nbytes, g.world_size
  local step = floor(GENERIC_AR_STAGE / W / 64) * 64 -- per rank and round, whole elements
  if step < 4096 then step = 4096 end
  if nbytes <= step then
    local buf = g:_scratch("gather", nbytes * W)
    gather_bytes(g, be, op, t.ptr, nbytes, buf, t, extra or rop)
    local blocks = {}
    for r = 1, W do blocks[r] = buf + (r - 1) * nbytes end
    g:_reduce_blocks(out_ptr, blocks, t.numel, t.dtype, rop)
    return
  end
  -- in rounds: the sizes first, so a rank whose tensor differs fails with
  -- the others at once instead of waiting for rounds they never run
  local mine = g._ar_size or sizes_ct()
  g._ar_size = mine
  mine[0] = nbytes
  local all = g:_scratch("ar_sizes", 64 * W)
  gather_bytes(g, be, op, mine, 64, all, t, extra or rop)
  local sz = ffi_cast("int64_t *", all)
  for r = 0, W - 1 do
    if tonumber(sz[r * 8]) ~= nbytes then
      local parts = {}
      for i = 0, W - 1 do parts[#parts + 1] = ("rank %d: %d bytes"):format(g.ranks[i + 1], tonumber(sz[i * 8])) end
      fail(3, "all_reduce", "ranks passed tensors of different sizes on group %s (%s)", gname(g), concat(parts, ", "))
    end
  end
  local es = DT_SIZE[t.dtype]
  local src, dst = ffi_cast(u8p, t.ptr), ffi_cast(u8p, out_ptr)
  local buf = g:_scratch("gather", step * W)
  local blocks = {}
  local off = 0
  while off < nbytes do
    local n = nbytes - off < step and nbytes - off or step
    gather_bytes(g, be, op, src + off, n, buf, t, extra or rop)
    for r = 1, W do blocks[r] = buf + (r - 1) * n end
    g:_reduce_blocks(dst + off, blocks, n / es, t.dtype, rop)
    off = off + n
  end
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
    check_overlap(self, "all_reduce", t, "input", out, "output", 0, 3) -- in place, or apart
    if self.world_size == 1 then out:copy_(t); return out end
    reduce_into(self, t, out.ptr, rop, code)
    return out
  end
  if self.world_size == 1 then return t end
  reduce_into(self, t, t.ptr, rop, code)
  return t
end

-- Every rank's t along dim into out ([.., W * d, ..]) through backend be's
-- byte all-gather, the call agreed as op with its other arguments `extra`
-- (all_gather: the dim; gather: the root, so ranks that name
-- different roots fail instead of both gathering)
local function gather_along(self, be, op, t, dim, out, extra)
  local W, nbytes = self.world_size, t.nbytes
  local outer, inner = outer_inner(t.shape, dim)
  if outer == 1 then
    gather_bytes(self, be, op, t.ptr, nbytes, out.ptr, t, extra)
    return out
  end
  local buf = self:_scratch("gather", nbytes * W)
  gather_bytes(self, be, op, t.ptr, nbytes, buf, t, extra)
  -- buf is [W][outer][inner]; out is [outer][W][inner]
  local ib = inner * DT_SIZE[t.dtype]
  local o = ffi_cast(u8p, out.ptr)
  for r = 0, W - 1 do
    for k = 0, outer - 1 do
      copy_bytes(o + (k * W + r) * ib, buf + (r * outer + k) * ib, ib)
    end
  end
  return out
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
    -- the input may be this rank's block of the output (gathering along the
    -- outermost dim), as NCCL's, Gloo's and shm's in-place all-gather
    check_overlap(self, "all_gather", out, "output", t, "input", own_block(self, t, dim, t.nbytes), 3)
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if W == 1 then return alone(out, t) end
  local be = backend_for(self, "all_gather", t)
  if be.all_gather then call_be(self, "all_gather", be.all_gather, t, dim, out); return out end
  return gather_along(self, be, "all_gather", t, dim, out, dim)
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
    -- the output may be this rank's chunk of the input (scattering along the
    -- outermost dim), as NCCL's and shm's in-place reduce-scatter
    check_overlap(self, "reduce_scatter", t, "input", out, "output", own_block(self, t, dim, out.nbytes), 3)
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if W == 1 then return alone(out, t) end
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
        copy_bytes(buf + (r * outer + k) * chunk, src + (k * W + r) * chunk, chunk)
      end
    end
    src = buf
  end
  local count_out = out.numel
  if be.reduce_scatter_flat then
    call_be(self, "reduce_scatter", be.reduce_scatter_flat, src, out.ptr, count_out, t.dtype, rop, code, t)
    return out
  end
  local buf = self:_scratch("gather", nbytes * W)
  gather_bytes(self, be, "reduce_scatter", src, nbytes, buf, t, rop)
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

-- gather: the input may be this rank's rows of the output (slot: their
-- byte offset); scatter: the output this rank's rows of the input
local function check_out(g, op, t, out, shape, slot, gather)
  check_tensor(g, op, out, "output")
  check_place(g, op, t, out, "input", "output")
  if out.dtype ~= t.dtype or not same_shape(out.shape, shape) then
    fail(3, op, "output is %s %s, expected %s %s (group %s)", out.dtype, shape_str(out.shape), t.dtype,
         shape_str(shape), gname(g))
  end
  if gather then check_overlap(g, op, out, "output", t, "input", slot, 4)
  else check_overlap(g, op, t, "input", out, "output", slot, 4) end
end

-- byte offset of rank me's rows when rank r holds sizes[r+1] rows of row_bytes
local function rows_before(sizes, me, t)
  local rows = 0
  for r = 1, me do rows = rows + sizes[r] end
  local row = DT_SIZE[t.dtype]
  for i = 2, #t.shape do row = row * t.shape[i] end
  return rows * row
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
  if out ~= nil then
    check_out(self, op, t, out, oshape, rows_before(sizes, self.rank_in_group, t), true)
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if self.world_size == 1 then return alone(out, t) end
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
  if t.nbytes > 0 then copy_bytes(src, t.ptr, t.nbytes) end
  local buf = self:_scratch("gather", nb * self.world_size)
  -- the call as every rank makes it alike (each rank's own rows differ by
  -- design): the padded share and the sizes table
  gather_bytes(self, be, op, src, nb, buf, { dtype = t.dtype, shape = rows_shape(t, maxr) }, sizes)
  local o, pos = ffi_cast(u8p, out.ptr), 0
  for r = 1, #sizes do
    local n = sizes[r] * row
    if n > 0 then copy_bytes(o + pos, buf + (r - 1) * nb, n) end
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
  if out ~= nil then
    check_out(self, op, t, out, oshape, rows_before(sizes, me, t), false)
  else
    out = T().empty(oshape, t.dtype, t.device)
  end
  if self.world_size == 1 then return alone(out, t) end
  local be = backend_for(self, op, t, rop)
  if be.reduce_scatterv then call_be(self, op, be.reduce_scatterv, t, sizes, out, rop, code); return out end
  -- host: reduce everything, keep this rank's rows
  if t.nbytes == 0 then return out end
  local buf = self:_scratch("rsv", t.nbytes)
  reduce_into(self, t, buf, rop, code, sizes, op)
  local row = t.nbytes / t.shape[1]
  local off = 0
  for r = 1, me do off = off + sizes[r] end
  if out.nbytes > 0 then copy_bytes(out.ptr, buf + off * row, out.nbytes) end
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
  call_be(self, "broadcast", be.broadcast, t.ptr, t.nbytes, src, t)
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
  local oshape = {}
  for i = 1, #t.shape do oshape[i] = t.shape[i] end
  oshape[dim + 1] = oshape[dim + 1] * self.world_size
  local out = T().empty(oshape, t.dtype, t.device)
  local ok, err = pcall(gather_along, self, be, "gather", t, dim, out, "dst=" .. dst)
  if not ok or self.rank_in_group ~= dst then out:free() end
  if not ok then error(err, 0) end
  if self.rank_in_group == dst then return out end
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

-- The split tables of an uneven all_to_all_single, agreed: every rank's
-- input splits, output rows and output splits (-1: none given) go through
-- the group's own transport as one all-gather whose call ("i64 {2W+1}
-- splits") differs from the even form's, so ranks that split and ranks that
-- do not fail together; then every rank checks the whole matrix, the same
-- way on every rank, so a rank whose output cannot take what the others send
-- fails with all the others, naming it, before any row moves. Returns
-- all[r][j]: rows rank r-1 sends to rank j-1.
local function agree_splits(g, op, inp, in_splits, out_splits, out_rows)
  local W = g.world_size
  local n = 2 * W + 1
  local mine = ffi.new("int64_t[?]", n)
  if out_splits ~= nil and (type(out_splits) ~= "table" or #out_splits ~= W) then
    fail(3, op, "output splits must be a table of %d row counts (group %s)", W, gname(g))
  end
  for i = 1, W do
    for _, side in ipairs { "input", "output" } do
      local list = side == "input" and in_splits or out_splits
      local v = list and list[i]
      if list and (type(v) ~= "number" or v < 0 or v % 1 ~= 0) then
        fail(3, op, "%s split %d is %s, expected a row count (group %s)", side, i - 1, show(v), gname(g))
      end
    end
    mine[i - 1] = in_splits[i]
    mine[W + 1 + i - 1] = out_splits and out_splits[i] or -1
  end
  mine[W] = out_rows
  local all_buf = g:_scratch("a2a_splits", n * 8 * W)
  local be = backend_for(g, op, inp)
  gather_bytes(g, be, op, mine, n * 8, all_buf, { dtype = "i64", shape = { n } }, "splits")
  local t = ffi_cast("int64_t *", all_buf)
  local tables, all = {}, {}
  for r = 1, W do
    local base = (r - 1) * n
    local input, output = {}, nil
    for j = 1, W do input[j] = tonumber(t[base + j - 1]) end
    if tonumber(t[base + W + 1]) >= 0 then
      output = {}
      for j = 1, W do output[j] = tonumber(t[base + W + j]) end
    end
    tables[r] = { input = input, rows = tonumber(t[base + W]), output = output }
    all[r] = input
  end
  K.check_split_tables(g, op, tables, 4)
  return all
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
  check_overlap(self, op, inp, "input", out, "output", nil, 3) -- every rank's rows move
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
    for i = 1, W do
      local v = in_splits[i]
      if type(v) ~= "number" or v < 0 or v % 1 ~= 0 then   -- (before the sum: NaN would sum to garbage)
        fail(2, op, "input split %d is %s, expected a row count (group %s)", i - 1, show(v), gname(self))
      end
      s = s + v
    end
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
    gather_bytes(self, be, op, inp.ptr, nbytes, buf, inp)
    local cb = nbytes / W
    local o = ffi_cast(u8p, out.ptr)
    for r = 0, W - 1 do copy_bytes(o + r * cb, buf + r * nbytes + me * cb, cb) end
    return out
  end
  -- uneven: the split tables first, then the rows through the cpu group
  local all = agree_splits(self, op, inp, in_splits, out_splits, out.shape[1])
  local data = exchange_strings(self, op, op .. " rows", hostmem.string(inp.ptr, inp.nbytes, op, 2))
  local o = ffi_cast(u8p, out.ptr)
  local pos = 0
  for r = 1, W do
    local off = 0
    for k = 1, me do off = off + all[r][k] end
    local n = all[r][me + 1] * row_bytes
    copy_bytes(o + pos, ffi_cast(cu8p, data[r]) + off * row_bytes, n)
    pos = pos + n
  end
  return out
end

-- On the transport the group's host collectives take (the policy's choice
-- for op "barrier": shm on one node, Gloo across nodes, else the store), so
-- a rank at a barrier and a rank in another collective fail together.
function G:barrier()
  check_group(self, "barrier")
  if self.world_size == 1 then return end
  local be = backend_for(self, "barrier")
  if be.barrier then call_be(self, "barrier", be.barrier) else cpu(self, "barrier", "barrier") end
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
    return M.device_fused(self, x, residual, weight, eps, opts)   -- weft.backends.device_backends
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
  K.check_fused_outputs(self, op, x, residual, weight,
                        { norm_out, "norm_out", res_out, "residual_out", opts.quant_out, "quant_out" }, 4)
  if x.device ~= "cpu" then
    error(("weft: %s: device tensors need a device backend on group %s"):format(op, gname(self)), 2)
  end
  if (opts.fp8 or opts.quant_out ~= nil) then   -- refused before the all-reduce, not after
    local s = opts.scale
    if not ((type(s) == "number" and s > 0) or (T().is_tensor(s) and s.dtype == "f32" and s.numel == 1)) then
      fail(2, op, "FP8 output needs scale: a positive number or an f32 tensor of one element (group %s)", gname(self))
    end
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
  if opts.fp8 or opts.quant_out ~= nil then
    -- the norm output and its FP8 (e4m3, satfinite) quantisation from the same call
    return norm_out, res_out, M.host_quantize_fp8(self, op, norm_out, opts.scale, opts.quant_out)
  end
  return norm_out, res_out
end

-- quant = e4m3_satfinite(norm * (1 / scale)) of a host tensor (the f32
-- reciprocal once, as the fused kernel); scale: a number or a one-element f32 tensor
function M.host_quantize_fp8(g, op, norm, scale, quant)
  local s = scale
  if T().is_tensor(s) then
    if s.dtype ~= "f32" or s.numel ~= 1 then fail(3, op, "FP8 scale must be an f32 tensor of one element (group %s)", gname(g)) end
    s = s:to_table()[1]
    if type(s) == "table" then s = s[1] end
  end
  if type(s) ~= "number" or not (s > 0) then fail(3, op, "FP8 output needs a positive scale (group %s)", gname(g)) end
  if quant ~= nil then
    check_tensor(g, op, quant, "quant_out")
    if quant.dtype ~= "f8e4m3" or not same_shape(quant.shape, norm.shape) then
      fail(3, op, "quant_out must be an f8e4m3 tensor of shape %s (group %s)", shape_str(norm.shape), gname(g))
    end
  else
    quant = T().empty(norm.shape, "f8e4m3", "cpu")
  end
  local h = norm:to("f32")
  local inv = ffi.new("float[1]", 1 / s)
  local p = ffi_cast("float *", h.ptr)
  local k = inv[0]
  for i = 0, h.numel - 1 do p[i] = p[i] * k end
  local q = h:to("f8e4m3")
  quant:copy_(q)
  q:free(); h:free()
  return quant
end

---------------------------------------------------------------- device
-- Device backends, their policy rules' predicates and hooks (weft.backends.device_backends; loads
-- nothing of CUDA until a device tensor arrives).
require("weft.backends.device_backends").install(M)
-- Host tensors of groups across nodes (Gloo; weft.backends.host_nodes).
require("weft.backends.host_nodes").install(M)
-- The fusion patterns beyond all-reduce + RMSNorm, declared with the class and
-- served by weft.fusion_ext (its rule's predicate registered when it loads, hooks with install);
-- tail calls, so its errors still point at the caller's line.
local FX = require("weft.fusion_ext").install(M)
local fx = FX.methods
function G:fused_moe_allreduce_rmsnorm(a) return fx.fused_moe_allreduce_rmsnorm(self, a) end
function G:fused_moe_finalize_allreduce_rmsnorm(a) return fx.fused_moe_finalize_allreduce_rmsnorm(self, a) end
function G:fused_allreduce_prepost_rmsnorm(...) return fx.fused_allreduce_prepost_rmsnorm(self, ...) end
function G:fused_reduce_scatter_rmsnorm(...) return fx.fused_reduce_scatter_rmsnorm(self, ...) end
function G:prepare_fusion_ext(opts) return fx.prepare_fusion_ext(self, opts) end
-- the last fused call's path ("fused" | "unfused" | "host") and why
function G:fusion_ext_last() return fx.fusion_ext_last(self) end

return M

