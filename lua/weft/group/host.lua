-- weft.group.host — the host data path of weft.group (lua/weft/group.lua):
-- grow-only scratch buffers (weft_host_alloc), the local reduction in rank
-- order (weft_host_reduce, src/host/hostops.c), the registry of backends
-- with the store, shm and shm_gather backends (weft.shm over
-- src/host/shm.c; the cpu group over src/host/cpugroup.c), the per-group
-- memo of the policy's choice, and the re-raising of a lower layer's error
-- as "weft: <op>: group <name>: <cause>".
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local policy = require("weft.policy")
local K = require("weft.group.checks")
local calls = require("weft.group.calls")

local C = wffi.C
local ffi_cast = ffi.cast
local hostmem = require("weft.internal.hostmem")
local copy_bytes = hostmem.copy -- any size (ffi.copy stops at 2^31)
local type, tostring, error, pcall, tonumber, setmetatable, require =
  type, tostring, error, pcall, tonumber, setmetatable, require
local concat = table.concat
local gname, REDUCE_OPS = K.gname, K.REDUCE_OPS

local M = {}

local u8p = ffi.typeof("uint8_t *")
local cu8p = ffi.typeof("const uint8_t *")

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
function M.scratch(self, slot, n)
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

function M.reduce_blocks(self, dst, blocks, count, dtype, rop)
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
  local shm = require("weft.shm")
  -- chunk per rank: WEFT_SHM_BYTES, else weft.group.SHM_BYTES, else weft.shm's default
  -- (the setting lives on weft.group, loaded wherever a group exists: read
  -- there, not required, since weft.group requires this module)
  local wg = package.loaded["weft.group"]
  local per_rank = tonumber(os.getenv("WEFT_SHM_BYTES")) or (wg and wg.SHM_BYTES)
  c = shm.new(g.cpu_group, per_rank)
  g._shm = c
  return c
end

local function lens_error(g, op, lens, mine)
  local parts = {}
  for i = 1, #lens do parts[i] = ("rank %d: %d"):format(g.ranks[i], lens[i]) end
  error(("weft: %s: ranks passed different sizes on group %s (bytes %s; this rank %d)")
        :format(op, gname(g), concat(parts, ", "), mine), 0)
end

-- store: every rank's bytes through the cpu group's all-gather, each part
-- framed with the rank's call (weft.group.objects: the object collectives'
-- call agreement), so ranks whose calls differ in dtype, shape, reduction,
-- root or kind all fail at once with the same message, and the group stays
-- usable. t, extra: what the call is (K.call_desc); nil for a raw exchange.
-- weft.async's store path frames its parts the same way (store_part,
-- store_check), so blocking and async calls meet.
local function store_part(op, payload, t, extra)
  local call = t and K.call_desc(op, t, extra) or op
  return calls.frame(call, payload), call
end
local function store_check(g, op, call, list)
  return calls.check_calls(g, op, call, list)
end
M.store_part, M.store_check = store_part, store_check

local function framed(g, op, payload, t, extra)
  local part, call = store_part(op, payload, t, extra)
  local list = g.cpu_group:allgather(part)
  return list, store_check(g, op, call, list)
end

-- barrier(g): on the communicator the group's host collectives already use
-- (its descriptor or agreement word compared with the peers' calls, so a
-- barrier against another collective fails at once on every rank); before
-- the group made that communicator, the cpu group's barrier. Either choice
-- depends only on the group's calls so far, the same on every rank.
local function cpu_barrier(g) g.cpu_group:barrier() end
M.cpu_barrier = cpu_barrier

local store_backend = {
  barrier = cpu_barrier,
  gather_bytes = function(g, op, src, nbytes, dst, t, extra)
    local list, offs = framed(g, op, hostmem.string(src, nbytes, op, 2), t, extra)
    local lens, bad = {}, false
    for i = 1, #list do lens[i] = #list[i] - offs[i]; if lens[i] ~= nbytes then bad = true end end
    if bad then lens_error(g, op, lens, nbytes) end
    local d = ffi_cast(u8p, dst)
    for i = 1, #list do copy_bytes(d + (i - 1) * nbytes, ffi_cast(cu8p, list[i]) + offs[i], nbytes) end
  end,
  -- an exchange in which only the root's part carries the bytes: every rank
  -- (the root too) returns once all have called, and a rank that named
  -- another root fails with all the others
  broadcast = function(g, op, ptr, nbytes, src, t)
    local me = g.rank_in_group
    local list, offs = framed(g, op, me == src and hostmem.string(ptr, nbytes, op, 2) or "", t,
                              "src=" .. tostring(src))
    local n = #list[src + 1] - offs[src + 1]
    if n ~= nbytes then
      error(("weft: %s: rank %d broadcast %d bytes on group %s, this rank expected %d")
            :format(op, g.ranks[src + 1], n, gname(g), nbytes), 0)
    end
    if me ~= src then copy_bytes(ptr, ffi_cast(cu8p, list[src + 1]) + offs[src + 1], nbytes) end
  end,
}
M.register_backend("store", store_backend)

-- t, extra: the caller's tensor (nil for raw bytes) and the call's other
-- arguments (K.call_desc), whose words the shm engine's call descriptor
-- carries
local function shm_barrier(g)
  if g._shm then g._shm:barrier() else cpu_barrier(g) end
end
local shm_gather_backend = {
  barrier = shm_barrier,
  gather_bytes = function(g, _, src, nbytes, dst, t, extra)
    shm_comm(g):all_gather(src, dst, nbytes, t and t.shape, extra)
  end,
  broadcast = function(g, _, ptr, nbytes, src, t)
    shm_comm(g):broadcast(ptr, nbytes, src, t and t.shape)
  end,
}
M.register_backend("shm_gather", shm_gather_backend)

M.register_backend("shm", {
  barrier = shm_barrier,
  gather_bytes = shm_gather_backend.gather_bytes,
  broadcast = shm_gather_backend.broadcast,
  all_reduce = function(g, _, t, out_ptr, _, opcode, _, extra)
    shm_comm(g):all_reduce(t.ptr, out_ptr, t.numel, DT_CODE[t.dtype], opcode, t.shape, extra)
  end,
  -- input laid out as world contiguous chunks; out receives this rank's chunk
  reduce_scatter_flat = function(g, _, inp, out, count_out, dtype, rop, opcode, t)
    shm_comm(g):reduce_scatter(inp, out, count_out, DT_CODE[dtype], opcode, t and t.shape)
  end,
})

M.register_backend("no_device_backend", setmetatable({}, { __index = function(_, k)
  return function(g, op)
    error(("weft: %s: device tensors on group %s need a device backend (none registered; "
          .. "is weft.cuda loaded and the group's device communicator created?)"):format(op, gname(g)), 0)
  end
end }))

local function select_backend(g, op, t, rop, out)
  local name, why, cacheable, choice = policy.select(g, op, t, rop, out)
  local be = name and M.backends[name]
  -- weft.backends.host_nodes is installed by weft.group (it requires this module)
  local hn = package.loaded["weft.backends.host_nodes"]
  if name == "store" and not g.same_node and hn and not hn.built then hn.warn_store(g) end
  if not be then
    error(("weft: %s: policy chose backend %q for group %s but it is not registered (%s)")
          :format(op, tostring(name), gname(g), tostring(why)), 0)
  end
  return be, name, cacheable, choice
end

-- Deterministic mode routes a float host reduction across nodes (the store
-- path instead of Gloo's ring). The switch is local, so a group agrees on
-- it at its first such call (one all-gather over its cpu group, every rank
-- at the same call): ranks that disagree would wait on different routes and
-- meet nowhere. Mixed: every rank raises naming who is on and who is off.
-- Later, a rank whose value left the agreed one raises before anything is
-- sent (policy.set{deterministic = v, group = g} changes it collectively).
local function rank_list(g, idx)
  local t = {}
  for i, k in ipairs(idx) do t[i] = tostring(g.ranks[k] or (k - 1)) end
  return concat(t, ", ")
end

local function host_determ_check(g, op)
  local on, src = policy.deterministic(g)
  on = on and true or false
  if g._host_determ == nil then
    local votes = M.cpu(g, op, "allgather", on and "1" or "0")
    local ons, offs = {}, {}
    for i, v in ipairs(votes) do
      if v == "1" then ons[#ons + 1] = i else offs[#offs + 1] = i end
    end
    if #ons > 0 and #offs > 0 then
      error(("weft: %s: group %s: deterministic mode is on for %s %s and off for %s %s: their host "
             .. "reductions across nodes would take different routes (store path / Gloo) and never "
             .. "meet; set policy.set{deterministic = ...} or WEFT_DETERMINISTIC alike on every rank")
            :format(op, gname(g), #ons == 1 and "rank" or "ranks", rank_list(g, ons),
                    #offs == 1 and "rank" or "ranks", rank_list(g, offs)), 0)
    end
    g._host_determ = on
  elseif g._host_determ ~= on then
    error(("weft: %s: group %s: deterministic mode is %s on this rank (%s) but the group agreed on %s "
           .. "at its first host reduction across nodes: change it with policy.set{deterministic = %s, "
           .. "group = g} on every rank (collective over the group)")
          :format(op, gname(g), on and "on" or "off", tostring(src), g._host_determ and "on" or "off",
                  tostring(on)), 0)
  end
end

-- The hot path: a per-group memo of cacheable decisions, keyed by op, dtype,
-- device and reduction (nested tables: no key building per call); dropped
-- whenever the policy table changes (policy.version) or the group changes
-- state (g._dispatch = nil). Decisions that depend on the size (the device
-- all_reduce's kernels-or-NCCL) go to M.sized_memo where one is installed
-- (weft.backends.device_backends.sized_memo), kept inside the same memo.
-- out: the output pointer of an all_reduce into another buffer (nil: in
-- place); the device all_reduce's choice reads its alignment.
M.sized_memo = nil
local function backend_for(g, op, t, rop, out)
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
  if e then return e[1], e[2], e[3] end
  local sized, fileable = M.sized_memo, nil
  if sized ~= nil then
    local sbe, sname, schoice
    sbe, sname, schoice, fileable = sized.lookup(memo, g, op, t, rop, out)
    if sbe ~= nil then return sbe, sname, schoice end
  end
  if policy.det_host_routed(g, op, t, rop) and g.world_size > 1 then host_determ_check(g, op) end
  local be, name, cacheable, choice = select_backend(g, op, t, rop, out)
  if cacheable then
    if not a then a = {}; memo[op] = a end
    if not b then b = {}; a[dt] = b end
    if not c then c = {}; b[dev] = c end
    c[rop or ""] = { be, name, choice }
  elseif sized ~= nil then
    sized.store(memo, g, op, t, rop, be, name, choice, fileable)
  end
  return be, name, choice
end

-- Re-raise a failure of the layer below as "weft: <op>: group <name>: <cause>"
-- (the cause keeps its own naming of the C call, the ranks, the timeout).
-- Also the group's ledger (weft.recover compares it across ranks): the host
-- calls completed, and the last one that failed.
local function rethrow(g, op, ok, ...)
  local L = g._ledger
  if L == nil then L = { done = 0, fail_op = false }; g._ledger = L end
  if ok then L.done = L.done + 1; return ... end
  L.fail_op = op
  local msg = tostring((...))
  local i = msg:find("weft: ", 1, true)
  if i then msg = msg:sub(i) end
  if msg:find("^weft: " .. op .. ":") then error(msg, 0) end
  error(("weft: %s: group %s: %s"):format(op, gname(g), (msg:gsub("^weft: ", ""))), 0)
end

-- A blocking call waits for the group's async operations first (program
-- order is execution order), with or without weft.async.install: a queued
-- operation runs on the group's progress worker, and the worker and the
-- caller in one communicator at once refuse each other (or, on the cpu
-- group before it refused too, silently paired each other's keys).
local drain
local function settle(g)
  local q = g._async
  if q and q.npending > 0 then
    drain = drain or require("weft.async.queue").drain
    drain(g)
  end
end

M.settle = settle

local function call_be(g, op, f, ...)
  settle(g)
  return rethrow(g, op, pcall(f, g, op, ...))
end

-- all_reduce of t into out_ptr (t.ptr: in place) through the backend the
-- policy chooses for it: one step down from weft.group, so the output pointer
-- goes from here to the backend without coming back up. Returns nothing when
-- the backend ran it, or the backend when it has no all_reduce (weft.group
-- then reduces through its gather).
local function reduce_by_backend(g, t, out_ptr, rop, code, extra, op)
  local be, _, choice = backend_for(g, "all_reduce", t, rop, out_ptr ~= t.ptr and out_ptr or nil)
  local f = be.all_reduce
  if f == nil then return be end
  call_be(g, op or "all_reduce", f, t, out_ptr, rop, code, choice, extra)
end

local function cpu(g, op, method, ...)
  settle(g)
  local c = g.cpu_group
  return rethrow(g, op, pcall(c[method], c, ...))
end

-- all-gather `nbytes` from src into dst (world * nbytes), through backend `be`
-- (t, extra: the call, for backends that check it: K.call_desc)
local function gather_bytes(g, be, op, src, nbytes, dst, t, extra)
  if not be.gather_bytes then
    error(("weft: %s: backend cannot gather on group %s"):format(op, gname(g)), 0)
  end
  call_be(g, op, be.gather_bytes, src, nbytes, dst, t, extra)
end

M.shm_comm, M.backend_for, M.rethrow, M.call_be, M.cpu, M.gather_bytes, M.reduce_by_backend =
  shm_comm, backend_for, rethrow, call_be, cpu, gather_bytes, reduce_by_backend

return M
