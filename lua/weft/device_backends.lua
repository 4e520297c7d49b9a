-- weft.device_backends — device tensors through the GroupCoordinator: the
-- device rules of weft.policy (the seed's all_reduce dispatch order and its
-- eager/graph table, as data), the backends that serve them, and the
-- per-group device state (NCCL communicator, custom all-reduce workspace,
-- fusion workspaces, scratch), created lazily and torn down by g:destroy().
-- docs/policy.md describes the decisions; installed by weft.group on load.
--
-- Backends (group.register_backend):
--   nccl         every device collective (weft.nccl), one communicator per group
--   custom_ar    all_reduce through weft's one-/two-shot kernels (weft.custom_ar)
--   device_host  NCCL unusable (ranks sharing a GPU, no libnccl): the data
--                goes through host memory and the host path; eager only
--   fused        fused_allreduce_rmsnorm: the fused kernel (weft.fusion) where
--                it applies, else all_reduce + the norm kernel
--   invalid_override  raises the WEFT_ALLREDUCE error for the calls it steers
--
-- Lazy, collective set-up. A group's device state is made on its first
-- device collective: every rank of the group reaches it in that same call
-- (every rank calls the same collective), so it is agreed without an extra
-- round. It all-gathers (host, device, NCCL loadable) over the cpu group,
-- creates the NCCL communicator when every rank has its own GPU and NCCL,
-- and votes (AND) on the outcome, so all ranks use NCCL or all stage through
-- the host. The custom all-reduce workspace is made on the first all_reduce
-- the custom rule accepts (weft_ar_create agrees inside; one more AND vote
-- here): if it fails on any rank, every rank uses NCCL. A graph capture
-- cannot run these collectives: weft.graph.capture enters its groups (and
-- calls M.prepare) before it begins.
local ffi = require "ffi"
local policy = require "weft.policy"

local type, tostring, tonumber, error, pcall, ipairs, pairs = type, tostring, tonumber, error, pcall, ipairs, pairs
local fmt, concat, floor, max = string.format, table.concat, math.floor, math.max

local M = {}

---------------------------------------------------------------- lazy modules
local mods = {}
local function mod(name)
  local m = mods[name]
  if m == nil then m = require(name); mods[name] = m end
  return m
end
local function CUDA() return mod("weft.cuda") end
local function T() return mod("weft.tensor") end

local group_mod           -- weft.group, given to install()

---------------------------------------------------------------- configuration
local function env_num(name, default, lo)
  local v = tonumber(os.getenv(name) or "")
  if v == nil or v ~= floor(v) or v < (lo or 1) then return default end
  return v
end

local MIB = 1048576
-- custom_ar_max_bytes: the custom all-reduce workspace holds calls up to this
-- size, and the size rule lets every call that fits use it: on 2 x H200 weft's
-- auto beats NCCL at every size measured, 1 KiB to 256 MiB, eager and in
-- graphs (bench/results/ar-nvidia-h200-x2-2026-11-30.md). 64 MiB covers
-- 8192 tokens x 4096 hidden in bf16 at ~176 MiB of workspace per GPU (two
-- data parities of max_bytes plus 48 MiB of Lamport buffers, for 2 ranks).
-- fused_max_tokens: the fusion workspace's token capacity when the caller
-- declares no max_tokens; longer calls take the unfused path.
M.config = {
  custom_ar_max_bytes = env_num("WEFT_CUSTOM_AR_MAX_BYTES", 64 * MIB, 16),
  fused_max_tokens = env_num("WEFT_FUSION_MAX_TOKENS", 2048, 1),
}

-- Which groups use the custom all-reduce: the seed's use_custom_allreduce per
-- init_model_parallel_group (off for PP, attention TP, MoE EP and MoE TP).
-- weft also enables the world and custom groups (the seed does not): the
-- workspace is only made when such a group all-reduces device tensors.
-- g.use_custom_allreduce = true/false overrides this per group; a
-- policy.set{all_reduce = "oneshot"|...} override does too.
M.custom_ar_by_kind = {
  tp = true, pdmux_prefill_tp = true, dcp = true, attn_cp = true, moe_dp = true,
  pp = false, attn_tp = false, moe_ep = false, moe_tp = false,
}

local AR_DTYPES = { f32 = true, f16 = true, bf16 = true }
local AR_WORLDS = { [2] = true, [4] = true, [6] = true, [8] = true }
local FUSED_DTYPES = AR_DTYPES
local U8 = 5                 -- byte-moving collectives go as u8 (any dtype, f8 too)

local function is_device(t)
  return type(t) == "table" and t.device ~= nil and t.device ~= "cpu"
end
M.is_device = is_device

local cuda_ok_cache
local function cuda_ok()
  if cuda_ok_cache == nil then
    local ok, c = pcall(require, "weft.cuda")
    local ok2, avail = false, false
    if ok then ok2, avail = pcall(c.available) end
    cuda_ok_cache = ok2 and avail == true
  end
  return cuda_ok_cache
end
-- tests: pretend CUDA is (not) there; nil: ask again
function M._set_cuda_available(v) cuda_ok_cache = v end

local function gname(g) return tostring(g.unique_name) end

local function group_kind(g)
  local k = g._kind
  if k == nil then
    local n = tostring(g.unique_name)
    k = n:match("^([%w_]+)%.%d+$") or (n == "world" and "world" or "custom")
    g._kind = k
  end
  return k
end

-- custom AR enabled on g? -> bool, source
local function ar_enabled(g)
  local u = g.use_custom_allreduce
  if u ~= nil then return u and true or false, "g.use_custom_allreduce" end
  local v = M.custom_ar_by_kind[group_kind(g)]
  if v == nil then return true, "weft default" end
  return v, "the seed's table"
end

---------------------------------------------------------------- host name
pcall(ffi.cdef, "int gethostname(char *name, size_t len);")
local function hostname()
  local buf = ffi.new("char[256]")
  if ffi.C.gethostname(buf, 255) == 0 then return ffi.string(buf) end
  return os.getenv("HOSTNAME") or "?"
end

---------------------------------------------------------------- device state
-- g._dev = { device, nccl (weft.nccl comm or nil), nccl_why, shared (text or
--   nil), own_nccl, ar (weft.custom_ar or nil), ar_state (nil: not tried,
--   "ready", "failed" (creation, on every rank), "off", "broken" (a kernel failed on this rank)), ar_why, scratch = {}, retired = {} }

local function graph_refusal(g, op)
  error(fmt("weft: %s: group %s has not set up its device communicators, and a graph capture "
            .. "cannot (it needs collectives over the cpu group): pass the group to "
            .. "weft.graph.capture(fn, {groups = {...}}) (groups are set up before capture begins), "
            .. "call weft.device_backends.prepare(g) on every rank first, or run the call once eagerly",
            op, gname(g)), 0)
end

-- setup(g [, op]) -> d. Collective on the first call for a group of more than one rank.
function M.setup(g, op)
  local d = g._dev
  if d ~= nil then return d end
  op = op or "device setup"
  if g.destroyed then error(fmt("weft: %s: group %s is destroyed", op, gname(g)), 0) end
  local cuda = CUDA()
  if g.world_size <= 1 or not g.is_member then
    d = { device = cuda.current_device(), scratch = {}, retired = {}, nccl_why = "group of one rank" }
    g._dev = d
    return d
  end
  if policy.mode() == "graph" then graph_refusal(g, op) end
  local dev = cuda.current_device()
  local nccl = mod("weft.nccl")
  local have_nccl, nccl_msg = nccl.version()
  local host = hostname()
  local list = g.cpu_group:allgather(fmt("%s\t%d\t%d", host, dev, have_nccl and 1 or 0))
  local seen, shared, missing = {}, nil, nil
  for i, s in ipairs(list) do
    local h, dv, nk = s:match("^(.*)\t(%-?%d+)\t(%d)$")
    local key = tostring(h) .. "\t" .. tostring(dv)
    if seen[key] and not shared then
      shared = fmt("ranks %d and %d share cuda:%s on %s", g.ranks[seen[key]], g.ranks[i], tostring(dv), tostring(h))
    end
    seen[key] = seen[key] or i
    if nk ~= "1" and not missing then missing = g.ranks[i] end
  end
  d = { device = dev, scratch = {}, retired = {}, shared = shared }
  local existing = g.device_group
  if existing ~= nil and type(existing) == "table" and existing.handle ~= nil then
    d.nccl, d.device = existing, existing.device or dev        -- made by the caller (scripts/serve)
  elseif g.use_nccl == false then   -- the seed's use_pynccl, per group (agreed: every rank sets it)
    d.nccl_why = "g.use_nccl = false"
  elseif shared then
    d.nccl_why = shared .. " (NCCL needs one GPU per rank)"
  elseif missing then
    d.nccl_why = fmt("NCCL cannot be loaded on rank %d%s", missing,
                     missing == g.rank and (": " .. tostring(nccl_msg)) or "")
  else
    local ok, c = pcall(nccl.new, g.cpu_group)
    local agreed = g.cpu_group:allreduce_i64({ ok and 1 or 0 }, "and")[1]
    if ok and agreed == 1 then
      d.nccl, d.own_nccl = c, true
      g.device_group = c
    else
      if ok then pcall(c.abort, c); pcall(c.destroy, c) end
      d.nccl_why = ok and "NCCL communicator creation failed on another rank of the group"
                   or ("NCCL communicator creation failed: " .. tostring(c))
    end
  end
  g._dev = d
  g._dispatch = nil
  return d
end

local function ar_static_block(g, d)
  if not AR_WORLDS[g.world_size] then return fmt("world size %d (kernels for 2, 4, 6, 8)", g.world_size) end
  if not g.same_node then return "ranks on several nodes (NCCL is the path across nodes)" end
  if d.shared then return d.shared end
  return nil
end

-- ensure_ar(g) -> d. Collective the first time the custom all-reduce is tried.
function M.ensure_ar(g)
  local d = M.setup(g, "all_reduce")
  if d.ar_state ~= nil then return d end
  local why = ar_static_block(g, d)
  if why then d.ar_state, d.ar_why = "off", why; g._dispatch = nil; return d end
  if policy.mode() == "graph" then graph_refusal(g, "all_reduce") end
  local ok, h = pcall(mod("weft.custom_ar").new, g.cpu_group, M.config.custom_ar_max_bytes)
  local agreed = g.cpu_group:allreduce_i64({ ok and 1 or 0 }, "and")[1]
  if ok and agreed == 1 then
    d.ar, d.ar_state = h, "ready"
    d.ar_why = fmt("workspace for calls up to %s (auto: one-shot up to %s)",
                   policy.human_bytes(h.max_bytes), policy.human_bytes(h.oneshot_max))
  else
    if ok then h:destroy() end
    d.ar_state = "failed"
    d.ar_why = ok and "workspace creation failed on another rank of the group"
               or ("workspace creation failed: " .. tostring(h))
  end
  g._dispatch = nil
  return d
end

-- prepare(g [, {fusion = {max_tokens=, hidden=, dtype=}}]): everything a
-- capture needs, made now (collective over g): NCCL, the custom all-reduce
-- (when enabled), the fusion workspace. Called by weft.graph.capture for the
-- groups it enters; call it yourself on every rank to keep set-up out of the
-- first request.
function M.prepare(g, o)
  if not g.is_member or g.world_size <= 1 or g.destroyed or not cuda_ok() then return end
  local d = M.setup(g, "prepare")
  local ov = policy.override(g, "all_reduce")
  local on = ar_enabled(g)
  if d.ar_state == nil and ov ~= "nccl" and (on or ov ~= nil) then M.ensure_ar(g) end
  local fz = o and o.fusion
  if fz and not d.shared and g.same_node and g.world_size <= 8 then
    local ctx = M.fusion_ctx(g)
    ctx:pre_initialize_workspaces { attn_coord = g, max_tokens = fz.max_tokens or M.config.fused_max_tokens,
                                    hidden = fz.hidden or 4096, dtype = fz.dtype or "bf16" }
  end
  g._dispatch = nil
  return d
end

-- info(g) -> a table describing the group's device state (for people and tests)
function M.info(g)
  local d = g._dev
  if d == nil then return { setup = false } end
  local f = g._fusion
  return {
    setup = true, device = d.device, nccl = d.nccl ~= nil, nccl_why = d.nccl_why, shared = d.shared,
    custom_ar = d.ar_state, custom_ar_why = d.ar_why, custom_ar_max_bytes = d.ar and d.ar.max_bytes,
    fusion = f and { initialized = f.attn.initialized, disabled = f.attn.disabled,
                     reason = f.attn.disabled_reason, creates = f.attn.creates } or nil,
    last_fused = g._fused_path and { path = g._fused_path, why = g._fused_why } or nil,
  }
end

---------------------------------------------------------------- per-call checks
local function wrong_device(g, op, t, what, d)
  error(fmt("weft: %s: %s is on %s but group %s runs on cuda:%d (the device that was current when "
            .. "it first used the GPU); move it with t:to(\"cuda:%d\")", op, what, tostring(t.device),
            gname(g), d.device, d.device), 0)
end

-- d for g after checking that the tensors are on its device
local function dev_of(g, op, a, b)
  local d = g._dev or M.setup(g, op)
  if a ~= nil and a.device_index ~= d.device then wrong_device(g, op, a, "input", d) end
  if b ~= nil and b.device_index ~= d.device then wrong_device(g, op, b, "output", d) end
  return d
end

local function stream_capturing()
  return policy.mode() == "graph"
end

local function scratch(d, slot, n)
  local s = d.scratch[slot]
  if s ~= nil and s.n >= n then return s.ptr end
  local nn = s and max(n, s.n * 2) or max(n, 256)
  local p = ffi.cast("uint8_t *", CUDA().alloc(nn, d.device))
  -- a graph captured earlier may still read the old buffer: keep it until destroy
  if s ~= nil then d.retired[#d.retired + 1] = s.ptr end
  d.scratch[slot] = { ptr = p, n = nn }
  return p
end

local C_
local function C()
  if C_ == nil then C_ = require("weft.ffi").C end
  return C_
end

local function copy2d(dst, dpitch, src, spitch, width, height)
  if C().weft_cuda_memcpy2d_async(dst, dpitch, src, spitch, width, height, nil) ~= 0 then
    error("weft: copy2d: " .. require("weft.ffi").last_error(), 0)
  end
end

local function outer_of(shape, dim)
  local o = 1
  for i = 1, dim do o = o * shape[i] end
  return o
end

local u8p = ffi.typeof("uint8_t *")

---------------------------------------------------------------- host staging
-- The host path with device data: copy in, run the group's host collective,
-- copy out. Correct anywhere, fast nowhere; refused while capturing.
local function stage_check(g, op, a, b)
  local d = dev_of(g, op, a, b)
  if stream_capturing() then
    error(fmt("weft: %s: group %s cannot run device collectives inside a graph capture: %s; "
              .. "its host staging path is eager only", op, gname(g), tostring(d.nccl_why)), 0)
  end
  return d
end

local function host_clone(t) return t:clone("cpu") end

local stage = {}
function stage.all_reduce(g, op, t, out_ptr, rop)
  stage_check(g, op, t)
  local h = host_clone(t)
  g:all_reduce(h, rop)
  local dst = t
  if out_ptr ~= t.ptr then dst = T().wrap(out_ptr, t.shape, t.dtype, t.device) end
  dst:copy_(h)
  h:free()
end
function stage.all_gather(g, op, t, dim, out)
  stage_check(g, op, t, out)
  local h = host_clone(t)
  local ho = g:all_gather(h, dim)
  out:copy_(ho)
  h:free(); ho:free()
end
function stage.reduce_scatter(g, op, t, dim, out, rop)
  stage_check(g, op, t, out)
  local h = host_clone(t)
  local ho = g:reduce_scatter(h, dim, nil, rop)
  out:copy_(ho)
  h:free(); ho:free()
end
function stage.broadcast_tensor(g, op, t, src)
  stage_check(g, op, t)
  local h = host_clone(t)
  g:broadcast(h, src)
  t:copy_(h)
  h:free()
end
function stage.gather(g, op, t, dst, dim)
  stage_check(g, op, t)
  local h = host_clone(t)
  local ho = g:gather(h, dst, dim)
  h:free()
  if ho == nil then return nil end
  local o = ho:clone(t.device)
  ho:free()
  return o
end
function stage.send(g, op, t, dst)
  stage_check(g, op, t)
  local h = host_clone(t)
  g:send(h, dst)
  h:free()
end
function stage.recv(g, op, t, src)
  stage_check(g, op, t)
  local h = T().empty(t.shape, t.dtype, "cpu")
  g:recv(h, src)
  t:copy_(h)
  h:free()
end
function stage.all_to_all_single(g, op, out, inp, in_splits, out_splits)
  stage_check(g, op, inp, out)
  local hi, ho = host_clone(inp), T().empty(out.shape, out.dtype, "cpu")
  local splits = nil
  if in_splits then splits = { input = in_splits, output = out_splits } end
  g:all_to_all_single(ho, hi, splits)
  out:copy_(ho)
  hi:free(); ho:free()
end
function stage.all_gatherv(g, op, t, sizes, out)
  stage_check(g, op, t, out)
  local h = host_clone(t)
  local ho = g:all_gatherv(h, sizes)
  out:copy_(ho)
  h:free(); ho:free()
end
function stage.reduce_scatterv(g, op, t, sizes, out, rop)
  stage_check(g, op, t, out)
  local h = host_clone(t)
  local ho = g:reduce_scatterv(h, nil, sizes, rop)
  out:copy_(ho)
  h:free(); ho:free()
end
M.stage = stage

---------------------------------------------------------------- NCCL backend
-- comm(g, op, a, b) -> nccl comm, or nil when the group stages through the host
local function comm(g, op, a, b)
  local d = dev_of(g, op, a, b)
  return d.nccl, d
end

-- point-to-point before set-up: only a group of two can set up in a send/recv
local function p2p_comm(g, op, t)
  if g._dev == nil and g.world_size > 2 then
    error(fmt("weft: %s: group %s (%d ranks) has no device communicator yet, and a point-to-point "
              .. "call cannot make one (only 2 of its ranks take part): run a device collective on the "
              .. "group first, or call weft.device_backends.prepare(g) on every rank", op, gname(g),
              g.world_size), 0)
  end
  return comm(g, op, t)
end

local nccl_be = {}
function nccl_be.all_reduce(g, op, t, out_ptr, rop, code)
  local c = comm(g, op, t)
  if c == nil then return stage.all_reduce(g, op, t, out_ptr, rop, code) end
  if t.numel == 0 then return end
  c:all_reduce(t.ptr, out_ptr, t.numel, t._code, code)
end

-- along `dim`: NCCL gathers [W][outer][inner]; the layout wanted is
-- [outer][W][inner]: one 2-D copy per rank
function nccl_be.all_gather(g, op, t, dim, out)
  local c, d = comm(g, op, t, out)
  if c == nil then return stage.all_gather(g, op, t, dim, out) end
  local nb, W = t.nbytes, g.world_size
  if nb == 0 then return end
  local outer = outer_of(t.shape, dim)
  if outer == 1 then return c:all_gather(t.ptr, out.ptr, nb, U8) end
  local buf = scratch(d, "gather", nb * W)
  c:all_gather(t.ptr, buf, nb, U8)
  local ib = nb / outer
  local o = ffi.cast(u8p, out.ptr)
  for r = 0, W - 1 do copy2d(o + r * ib, W * ib, buf + r * nb, ib, ib, outer) end
end

-- along `dim`: the input [outer][W][chunk] is laid out [W][outer][chunk] first
function nccl_be.reduce_scatter(g, op, t, dim, out, rop, code)
  local c, d = comm(g, op, t, out)
  if c == nil then return stage.reduce_scatter(g, op, t, dim, out, rop, code) end
  local nb, W = t.nbytes, g.world_size
  if nb == 0 then return end
  local outer = outer_of(t.shape, dim)
  local src = t.ptr
  if outer > 1 then
    local cb = nb / W / outer
    local buf = scratch(d, "rs_in", nb)
    local i = ffi.cast(u8p, t.ptr)
    for r = 0, W - 1 do copy2d(buf + r * outer * cb, cb, i + r * cb, W * cb, cb, outer) end
    src = buf
  end
  c:reduce_scatter(src, out.ptr, out.numel, t._code, code)
end

function nccl_be.broadcast_tensor(g, op, t, src)
  local c = comm(g, op, t)
  if c == nil then return stage.broadcast_tensor(g, op, t, src) end
  if t.nbytes == 0 then return end
  c:broadcast(t.ptr, t.nbytes, U8, src)
end

-- gather(t, dst, dim) -> on dst the concatenation along dim, elsewhere nil
function nccl_be.gather(g, op, t, dst, dim)
  local c, d = comm(g, op, t)
  if c == nil then return stage.gather(g, op, t, dst, dim) end
  local W, me, nb = g.world_size, g.rank_in_group, t.nbytes
  local out
  if me == dst then
    local shape = {}
    for i = 1, #t.shape do shape[i] = t.shape[i] end
    shape[dim + 1] = shape[dim + 1] * W
    out = T().empty(shape, t.dtype, t.device)
  end
  if nb == 0 then return out end
  local outer = outer_of(t.shape, dim)
  if outer == 1 then
    c:gather(t.ptr, out and out.ptr or nil, nb, U8, dst)
    return out
  end
  local buf = me == dst and scratch(d, "gather", nb * W) or nil
  c:gather(t.ptr, buf, nb, U8, dst)
  if out then
    local ib = nb / outer
    local o = ffi.cast(u8p, out.ptr)
    for r = 0, W - 1 do copy2d(o + r * ib, W * ib, buf + r * nb, ib, ib, outer) end
  end
  return out
end

function nccl_be.send(g, op, t, dst)
  local c = p2p_comm(g, op, t)
  if c == nil then return stage.send(g, op, t, dst) end
  if t.nbytes == 0 then return end
  c:send(t.ptr, t.nbytes, U8, dst)
end

function nccl_be.recv(g, op, t, src)
  local c = p2p_comm(g, op, t)
  if c == nil then return stage.recv(g, op, t, src) end
  if t.nbytes == 0 then return end
  c:recv(t.ptr, t.nbytes, U8, src)
end

local function row_bytes(t)
  local rb = t:elem_size()
  for i = 2, #t.shape do rb = rb * t.shape[i] end
  return rb
end

-- all_to_all_single: rows of inp split per peer (equal, or in_splits); the
-- receive sizes are out_splits when given on every rank, else exchanged over
-- the cpu group (eager only)
function nccl_be.all_to_all_single(g, op, out, inp, in_splits, out_splits)
  local c = comm(g, op, inp, out)
  if c == nil then return stage.all_to_all_single(g, op, out, inp, in_splits, out_splits) end
  local W, me = g.world_size, g.rank_in_group
  if in_splits == nil then
    if inp.nbytes == 0 then return end
    return c:all_to_all(inp.ptr, out.ptr, inp.nbytes, U8)
  end
  local rb = row_bytes(inp)
  local recv = out_splits
  if recv == nil then
    if stream_capturing() then
      error(fmt("weft: %s: uneven splits inside a graph capture need the output splits too "
                .. "({input = ..., output = ...}) on group %s", op, gname(g)), 0)
    end
    local ser = mod("weft.serialize")
    local list = g.cpu_group:allgather(ser.encode(in_splits))
    recv = {}
    for r = 1, W do recv[r] = ser.decode(list[r])[me + 1] end
  end
  local total = 0
  for r = 1, W do total = total + recv[r] end
  if total ~= out.shape[1] then
    error(fmt("weft: %s: this rank receives %d rows, output has %d (group %s)", op, total, out.shape[1], gname(g)), 0)
  end
  local sc, rc = {}, {}
  for r = 1, W do sc[r] = in_splits[r] * rb; rc[r] = recv[r] * rb end
  c:all_to_all(inp.ptr, out.ptr, 0, U8, sc, rc)
end

function nccl_be.all_gatherv(g, op, t, sizes, out)
  local c = comm(g, op, t, out)
  if c == nil then return stage.all_gatherv(g, op, t, sizes, out) end
  local rb = row_bytes(t)
  local counts = {}
  for r = 1, g.world_size do counts[r] = sizes[r] * rb end
  c:all_gatherv(t.ptr, out.ptr, counts, U8)
end

function nccl_be.reduce_scatterv(g, op, t, sizes, out, rop, code)
  local c = comm(g, op, t, out)
  if c == nil then return stage.reduce_scatterv(g, op, t, sizes, out, rop, code) end
  local re = row_bytes(t) / t:elem_size()
  local counts = {}
  for r = 1, g.world_size do counts[r] = sizes[r] * re end
  c:reduce_scatterv(t.ptr, out.ptr, counts, t._code, code)
end
M.nccl_backend = nccl_be

---------------------------------------------------------------- custom all-reduce
-- The seed's should_custom_ar, as data: checks tried in order; each returns
-- ok, text (text formatted only when `v`, for explain). The `mode` argument
-- is the column of the seed's eager/graph table: in graph mode the workspace
-- must exist already (a capture cannot make it).
local function ptr_aligned(p)
  if p == nil then return false end
  return tonumber(ffi.cast("uintptr_t", p) % 16) == 0
end

local function ar_limit(d)
  if d ~= nil and d.ar ~= nil then return d.ar.max_bytes end
  return M.config.custom_ar_max_bytes
end

M.custom_ar_checks = {
  { name = "dtype and reduction", kind = "type",
    check = function(_, t, rop, _, _, v)
      if not AR_DTYPES[t.dtype] then
        return false, v and fmt("dtype %s: the kernels reduce f32, f16 and bf16", tostring(t.dtype)) or "dtype"
      end
      if rop ~= nil and rop ~= "sum" then
        return false, v and fmt("reduction %s: the kernels only sum", tostring(rop)) or "reduction"
      end
      return true, "f32/f16/bf16 sum"
    end },
  { name = "enabled on the group", override_skips = true,
    check = function(g, _, _, _, _, v)
      local on, src = ar_enabled(g)
      if on then return true, v and ("enabled (" .. src .. ")") or "enabled" end
      return false, v and fmt("off for %s groups (%s; set g.use_custom_allreduce = true)", group_kind(g), src) or "off"
    end },
  { name = "world size",
    check = function(g, _, _, _, _, v)
      if AR_WORLDS[g.world_size] then return true, v and fmt("%d ranks (kernels for 2, 4, 6, 8)", g.world_size) or "ok" end
      return false, v and fmt("%d ranks: kernels exist for 2, 4, 6, 8", g.world_size) or "world size"
    end },
  { name = "one node",
    check = function(g)
      if g.same_node then return true, "every rank on one node" end
      return false, "ranks on several nodes: NCCL"
    end },
  { name = "one GPU per rank",
    check = function(_, _, _, d)
      if d == nil then return true, "checked when the group first uses the device" end
      if d.shared then return false, d.shared end
      return true, "yes"
    end },
  { name = "peer access (workspace)",
    check = function(_, _, _, d, mode, v)
      local st = d and d.ar_state
      if st == "ready" then return true, v and d.ar_why or "ready" end
      -- a kernel failed earlier: the calls this backend would serve raise
      -- (see car.all_reduce), they never move to NCCL on one rank alone
      if st == "broken" then return true, v and ("kernel failed earlier: " .. tostring(d.ar_why)) or st end
      if st == "failed" or st == "off" then return false, v and tostring(d.ar_why) or st end
      if mode == "graph" then
        return false, "no workspace yet, and a capture cannot make one (groups passed to weft.graph.capture are prepared before it begins)"
      end
      return true, "made on first use: collective, preflight vote, every rank or none"
    end },
  { name = "contiguous",
    check = function(_, t)
      if t.is_contiguous == nil or t:is_contiguous() then return true, "yes" end
      return false, "non-contiguous tensor"
    end },
  { name = "16-byte aligned",
    check = function(_, t, _, _, _, v)
      if ptr_aligned(t.ptr) then return true, "yes (any element count: the kernels handle tails)" end
      return false, v and fmt("address %s is not 16-byte aligned", tostring(t.ptr)) or "alignment"
    end },
  { name = "size",
    check = function(_, t, _, d, _, v)
      local n, lim = tonumber(t.nbytes) or 0, ar_limit(d)
      if n > 0 and n <= lim then
        return true, v and fmt("%s <= %s", policy.human_bytes(n), policy.human_bytes(lim)) or "ok"
      end
      if n == 0 then return false, "empty tensor" end
      return false, v and fmt("%s > %s (WEFT_CUSTOM_AR_MAX_BYTES / the workspace)", policy.human_bytes(n),
                              policy.human_bytes(lim)) or "size"
    end },
}

-- The rule's predicate: records the algorithm (g._ar_pick) or, under an
-- override the group cannot serve, the error the call raises (g._ar_pick_error).
local function ar_rule(g, t, rop)
  g._ar_pick_error = nil
  local d = g._dev
  local mode = policy.mode()
  local ov, src = policy.override(g, "all_reduce")
  if ov == "nccl" then return false end
  local checks = M.custom_ar_checks
  for i = 1, #checks do
    local c = checks[i]
    if not (ov ~= nil and c.override_skips) then
      if not c.check(g, t, rop, d, mode, false) then
        if ov ~= nil and c.kind ~= "type" then
          local _, why = c.check(g, t, rop, d, mode, true)
          g._ar_pick_error = fmt("all_reduce=%s (%s) cannot be served on group %s: %s: %s",
                                 ov, tostring(src), gname(g), c.name, tostring(why))
          return true
        end
        return false
      end
    end
  end
  local algo = ov
  if algo == nil then
    local be = policy.tuned_backend("all_reduce", g.world_size, t.dtype, tonumber(t.nbytes))
    if be == "nccl" then return false end
    algo = be or "auto"
  end
  g._ar_pick = mod("weft.custom_ar").ALGO[algo] or 0
  return true
end

-- explain: every check, and the table / override step
local function ar_lines(g, t, rop)
  local lines, d, mode = {}, g._dev, policy.mode()
  local ov, src = policy.override(g, "all_reduce")
  for _, c in ipairs(M.custom_ar_checks) do
    if ov ~= nil and c.override_skips then
      lines[#lines + 1] = fmt("- %s: skipped (override all_reduce=%s)", c.name, ov)
    else
      local ok, why = c.check(g, t, rop, d, mode, true)
      lines[#lines + 1] = fmt("%s %s: %s", ok and "+" or "x", c.name, tostring(why))
    end
  end
  if ov ~= nil then
    lines[#lines + 1] = fmt("= override all_reduce=%s (%s)", ov, tostring(src))
  else
    local be, s, wk, dk, i = policy.tuned_backend("all_reduce", g.world_size, t.dtype, tonumber(t.nbytes) or 0)
    if be then
      lines[#lines + 1] = fmt("= policy file %s: %s -> %s", tostring(policy.tuned_path),
                              mod("weft.policy_file").where(s, wk, dk, i), be)
    else
      lines[#lines + 1] = "= built-in: auto (the kernel's measured crossovers: Lamport one-shot, then two-shot)"
    end
  end
  return lines
end

local function ar_why(g, _, t, rop)
  if g._ar_pick_error then return "override error: " .. g._ar_pick_error end
  local ov, src = policy.override(g, "all_reduce")
  local algo = ov
  local how = ov and ("override, " .. tostring(src)) or nil
  if not algo then
    local be = policy.tuned_backend("all_reduce", g.world_size, t.dtype, tonumber(t.nbytes) or 0)
    algo = be or "auto"
    how = be and ("policy file " .. tostring(policy.tuned_path)) or "built-in"
  end
  local kernel = ""
  local d = g._dev
  if d and d.ar then
    local k, w = d.ar:resolve(t.numel, t.dtype, algo)
    if k then kernel = fmt(" -> %s kernel (%s)", k, w) end
  end
  return fmt("weft custom all-reduce, %s (%s)%s; in place, reads the input inside the kernel "
             .. "(graph-safe without registration)", algo, how, kernel)
end

local function ar_why_not(g, _, t, rop)
  if not is_device(t) then return "host tensor" end
  local ov, src = policy.override(g, "all_reduce")
  if ov == "nccl" then return "override all_reduce=nccl (" .. tostring(src) .. ")" end
  local d, mode = g._dev, policy.mode()
  for _, c in ipairs(M.custom_ar_checks) do
    if not (ov ~= nil and c.override_skips) then
      local ok, why = c.check(g, t, rop, d, mode, true)
      if not ok then return c.name .. ": " .. tostring(why) end
    end
  end
  return "the policy file says nccl at this size"
end

local car = {}
function car.all_reduce(g, op, t, out_ptr, rop, code)
  local perr = g._ar_pick_error
  if perr then
    g._ar_pick_error = nil
    error("weft: all_reduce: " .. perr, 0)
  end
  local algo = g._ar_pick or 0
  local d = dev_of(g, op, t)
  if d.ar_state == nil then d = M.ensure_ar(g) end
  if d.ar_state == "broken" then
    error(fmt("weft: all_reduce: the custom all-reduce of group %s failed earlier (%s); its ranks may "
              .. "now disagree on the backend, so the calls it would serve raise rather than go to NCCL "
              .. "on this rank alone: destroy and re-create the group", gname(g), tostring(d.ar_why)), 0)
  end
  local ar = d.ar
  local forced = policy.override(g, "all_reduce")
  local why
  if ar == nil then why = d.ar_why
  elseif t.nbytes > ar.max_bytes then why = fmt("%d bytes exceed the workspace's %d", t.nbytes, ar.max_bytes)
  elseif not ptr_aligned(out_ptr) then why = "output not 16-byte aligned" end
  if why then
    if forced then
      error(fmt("weft: all_reduce: all_reduce=%s cannot be served on group %s: %s", forced, gname(g), why), 0)
    end
    return nccl_be.all_reduce(g, op, t, out_ptr, rop, code)
  end
  local ok, err = pcall(ar.run, ar, t.ptr, out_ptr, t.numel, t.dtype, algo)
  if not ok then
    -- a kernel failed (a peer late past the timeout, an abort) on this rank,
    -- maybe not on the others (a late peer's own call may succeed). Moving
    -- this rank's later calls to NCCL would pair them with the peers' custom
    -- calls (or their NCCL calls of another size): this call raises, and so
    -- does every later call this backend would serve; sizes the policy sends
    -- to NCCL anyway still go there (the same choice on every rank).
    d.ar_state, d.ar_why = "broken", tostring(err)
    g._dispatch = nil
    error(err, 0)
  end
end
M.custom_ar_backend = car

---------------------------------------------------------------- fused
function M.fusion_ctx(g)
  local f = g._fusion
  if f == nil then
    f = mod("weft.fusion").new()
    g._fusion = f
  end
  return f
end

local function fused_tokens_cap(opts)
  return opts.max_tokens or M.config.fused_max_tokens
end

-- The fused path's checks, as data (like custom_ar_checks); each
-- check(g, x, res, w, opts, d, mode, v) -> ok, text. A failed check sends the
-- call to the unfused path (all_reduce + the norm kernel) with that reason.
M.fused_checks = {
  { name = "override",
    check = function(g)
      local ov, src = policy.override(g, "fused")
      if ov == "unfused" then return false, "override fused=unfused (" .. tostring(src) .. ")" end
      return true, ov and ("override fused=" .. ov) or "none"
    end },
  { name = "more than one rank",
    check = function(g)
      if g.world_size > 1 then return true, "yes" end
      return false, "group of one rank: the norm kernel alone"
    end },
  { name = "one node",
    check = function(g)
      if g.same_node then return true, "yes" end
      return false, "ranks on several nodes: NCCL all-reduce, then the norm (the seed's _resolve_backend)"
    end },
  { name = "world size <= 8",
    check = function(g, _, _, _, _, _, _, v)
      if g.world_size <= 8 then return true, "yes" end
      return false, v and fmt("%d ranks (kernels for 2..8)", g.world_size) or "world size"
    end },
  { name = "one GPU per rank",
    check = function(_, _, _, _, _, d)
      if d == nil then return true, "checked when the group first uses the device" end
      if d.shared then return false, d.shared end
      return true, "yes"
    end },
  { name = "hidden <= 16384",
    check = function(_, x, _, _, _, _, _, v)
      local h = x.shape[#x.shape]
      if h <= 16384 then return true, "yes" end
      return false, v and fmt("hidden %d > 16384", h) or "hidden"
    end },
  { name = "contiguous",
    check = function(_, x, r, w)
      if x:is_contiguous() and (r == nil or r:is_contiguous()) and (w == nil or w:is_contiguous()) then
        return true, "yes"
      end
      return false, "non-contiguous tensors"
    end },
  { name = "tokens within the workspace",
    check = function(_, x, _, _, opts, _, _, v)
      local h = x.shape[#x.shape]
      local tokens, cap = x.numel / h, fused_tokens_cap(opts)
      if tokens <= cap then return true, v and fmt("%d <= %d", tokens, cap) or "ok" end
      return false, v and fmt("%d tokens > the workspace's %d (declare max_tokens, or WEFT_FUSION_MAX_TOKENS)",
                              tokens, cap) or "tokens"
    end },
  { name = "workspace",
    check = function(g, _, _, _, opts, _, mode)
      local f = g._fusion
      local mgr = f and f:manager(opts.use_attn_tp_group)
      if mgr and mgr.disabled then return false, "fusion disabled on this group: " .. tostring(mgr.disabled_reason) end
      if mgr and mgr.initialized then return true, "ready" end
      if mode == "graph" then
        return false, "no workspace was made before capture "
                      .. "(weft.graph.capture{fusion = {max_tokens=, hidden=, dtype=}} pre-initializes it)"
      end
      return true, "made on first use: collective, preflight vote, disabled on every rank together if any fails"
    end },
}

-- graph mode: the workspace must already hold the call with that kernel (a
-- capture cannot grow it: growing is collective)
local function graph_fits(g, x, opts, algo)
  local mgr = g._fusion:manager(opts.use_attn_tp_group)
  local h = x.shape[#x.shape]
  return mgr:is_buffer_size_sufficient(x.numel / h, h, x.dtype, algo)
end

local FUSED_ALGO = { fused_oneshot = "oneshot", fused_twoshot = "twoshot", fused_auto = "auto" }

-- fused_decision(g, x, res, w, opts [, verbose]) -> path ("fused"|"unfused"), why, algo, lines
function M.fused_decision(g, x, res, w, opts, verbose)
  opts = opts or {}
  local d, mode = g._dev, policy.mode()
  local lines = verbose and {} or nil
  local path, why = "fused", nil
  for _, c in ipairs(M.fused_checks) do
    local ok, text = c.check(g, x, res, w, opts, d, mode, verbose)
    if lines then lines[#lines + 1] = fmt("%s %s: %s", ok and "+" or "x", c.name, tostring(text)) end
    if not ok and path == "fused" then
      if not verbose then ok, text = c.check(g, x, res, w, opts, d, mode, true) end
      path, why = "unfused", c.name .. ": " .. tostring(text)
      if not verbose then return path, why end
    end
  end
  if path ~= "fused" then return path, why, nil, lines end
  local ov = policy.override(g, "fused")
  local algo = opts.algo or ov
  local how = opts.algo and "opts.algo" or ov and "override" or nil
  if algo == nil then
    local be = policy.tuned_backend("fused", g.world_size, x.dtype, x.numel * x:elem_size())
    if be == "unfused" then
      why = "policy file " .. tostring(policy.tuned_path) .. ": unfused at this size"
      if lines then lines[#lines + 1] = "= " .. why end
      return "unfused", why, nil, lines
    end
    algo = be and FUSED_ALGO[be] or "auto"
    how = be and ("policy file " .. tostring(policy.tuned_path)) or "built-in (one-shot up to the kernel's limit, then two-shot)"
  end
  if mode == "graph" and not graph_fits(g, x, opts, algo) then
    why = fmt("workspace: too small for this call with the %s kernel, and a capture cannot grow it "
              .. "(pre-initialize it for the largest call)", algo)
    if lines then lines[#lines + 1] = "x " .. why end
    return "unfused", why, nil, lines
  end
  why = fmt("fused kernel, %s (%s)", algo, how)
  if lines then lines[#lines + 1] = "= " .. why end
  return "fused", why, algo, lines
end

-- fail(op, g, msg, args..., gname(g)): "weft: <op>: <msg> (group <name>)"
local function fail(op, _, msg, ...)
  error(fmt("weft: %s: " .. msg .. " (group %s)", op, ...), 0)
end

local function shape_str(s) return "{" .. concat(s, ",") .. "}" end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- quantize norm_out into quant_out on the host (the unfused FP8 path; eager)
local function quantize_host(g, op, norm_out, scale, quant_out)
  if stream_capturing() then
    error(fmt("weft: %s: FP8 output without the fused kernel needs host work and cannot be captured "
              .. "(group %s)", op, gname(g)), 0)
  end
  local s = type(scale) == "number" and scale or scale:to_table()[1]
  local h = norm_out:to("cpu"):to("f32")
  local inv = ffi.new("float[1]")
  inv[0] = 1 / s
  local p = ffi.cast("float *", h.ptr)
  local k = inv[0]
  for i = 0, h.numel - 1 do p[i] = p[i] * k end
  local q = h:to("f8e4m3")
  quant_out:copy_(q)
  q:free(); h:free()
end

-- device scale tensor for a numeric scale (per group, eager only)
local function scale_tensor(g, d, s)
  local st = d.scale_t
  if st == nil then
    st = T().empty({ 1 }, "f32", "cuda:" .. d.device)
    d.scale_t = st
  end
  if d.scale_v ~= s then
    if stream_capturing() then
      error(fmt("weft: fused_allreduce_rmsnorm: inside a graph capture pass the FP8 scale as a device "
                .. "f32 tensor (group %s)", gname(g)), 0)
    end
    st:fill_(s)
    d.scale_v = s
  end
  return st
end

-- t is a live tensor on x's device
local function want(tm, g, op, x, t, what)
  if not tm.is_tensor(t) then fail(op, g, "%s must be a weft tensor, got %s", what, type(t), gname(g)) end
  if t.ptr == nil and t.numel > 0 then fail(op, g, "%s storage was freed", what, gname(g)) end
  if t.device ~= x.device then
    fail(op, g, "%s is on %s and the input on %s: host and device tensors (or two devices) cannot mix in one call",
         what, tostring(t.device), tostring(x.device), gname(g))
  end
end

local function want_out(tm, g, op, x, t, what)
  if t == nil then return end
  want(tm, g, op, x, t, what)
  if t.dtype ~= x.dtype or not same_shape(t.shape, x.shape) then
    fail(op, g, "%s is %s %s, expected %s %s", what, t.dtype, shape_str(t.shape), x.dtype, shape_str(x.shape), gname(g))
  end
  if not t:is_contiguous() then fail(op, g, "%s is not contiguous", what, gname(g)) end
end

local function on_device(g, op, d, t)
  if t ~= nil and t.device_index ~= d.device then wrong_device(g, op, t, "a tensor", d) end
end

-- The device fused_allreduce_rmsnorm (weft.group calls it for device tensors).
-- opts: max_tokens (declared maximum: more tokens is an error), algo
-- ("auto"|"oneshot"|"twoshot"), gemma, pdl (default true), fp32_acc
-- (default true), trigger_completion_at_end, use_attn_tp_group, norm_out=,
-- residual_out=, fp8 = true with scale (device f32 tensor of 1 element, or a
-- number) and quant_out= (e4m3 tensor like x; made when absent), stream.
-- Returns norm_out, residual_out (and quant_out with fp8). x is unchanged.
function M.fused(g, x, residual, weight, eps, opts)
  local op = "fused_allreduce_rmsnorm"
  opts = opts or {}
  if type(opts) ~= "table" then fail(op, g, "options must be a table, got %s", type(opts), gname(g)) end
  local tm = T()
  want(tm, g, op, x, x, "input")
  want(tm, g, op, x, residual, "residual")
  want(tm, g, op, x, weight, "weight")
  if not FUSED_DTYPES[x.dtype] then fail(op, g, "dtype %s is not supported (f32, f16, bf16)", x.dtype, gname(g)) end
  if residual.dtype ~= x.dtype or weight.dtype ~= x.dtype then
    fail(op, g, "dtypes differ: input %s, residual %s, weight %s", x.dtype, residual.dtype, weight.dtype, gname(g))
  end
  if #x.shape < 1 then fail(op, g, "input must have at least one dim", gname(g)) end
  if not same_shape(x.shape, residual.shape) then
    fail(op, g, "residual shape %s differs from input shape %s", shape_str(residual.shape), shape_str(x.shape), gname(g))
  end
  local hidden = x.shape[#x.shape]
  if #weight.shape ~= 1 or weight.shape[1] ~= hidden then
    fail(op, g, "weight shape %s must be {%d} (last dim of input %s)", shape_str(weight.shape), hidden,
         shape_str(x.shape), gname(g))
  end
  if hidden < 8 or hidden % 8 ~= 0 then
    fail(op, g, "hidden %d must be a multiple of 8 (16-byte rows) for device tensors", hidden, gname(g))
  end
  local tokens = x.numel / hidden
  if opts.max_tokens ~= nil then
    if type(opts.max_tokens) ~= "number" or opts.max_tokens < 1 then
      fail(op, g, "max_tokens must be a positive number, got %s", tostring(opts.max_tokens), gname(g))
    end
    if tokens > opts.max_tokens then
      fail(op, g, "%d tokens exceed the declared maximum %d (max_tokens)", tokens, opts.max_tokens, gname(g))
    end
  end
  eps = eps or 1e-6
  if type(eps) ~= "number" or eps < 0 or eps ~= eps then fail(op, g, "eps must be a non-negative number", gname(g)) end
  if opts.algo ~= nil and opts.algo ~= "auto" and opts.algo ~= "oneshot" and opts.algo ~= "twoshot" then
    fail(op, g, "algo %s is not auto, oneshot or twoshot", tostring(opts.algo), gname(g))
  end
  want_out(tm, g, op, x, opts.norm_out, "norm_out")
  want_out(tm, g, op, x, opts.residual_out, "residual_out")
  local fp8 = opts.fp8 or opts.quant_out ~= nil
  if fp8 then
    local q = opts.quant_out
    if q ~= nil then
      want(tm, g, op, x, q, "quant_out")
      if q.dtype ~= "f8e4m3" or not same_shape(q.shape, x.shape) or not q:is_contiguous() then
        fail(op, g, "quant_out must be a contiguous f8e4m3 tensor of shape %s", shape_str(x.shape), gname(g))
      end
    end
    local s = opts.scale
    if type(s) == "number" then
      if not (s > 0) then fail(op, g, "FP8 scale must be positive, got %s", tostring(s), gname(g)) end
    elseif tm.is_tensor(s) then
      want(tm, g, op, x, s, "scale")
      if s.dtype ~= "f32" or s.numel ~= 1 then fail(op, g, "FP8 scale must be an f32 tensor of one element", gname(g)) end
    else
      fail(op, g, "FP8 output needs scale (an f32 device tensor of one element, or a number)", gname(g))
    end
  end

  -- the group's device (set-up is collective: every rank gets here with the same call)
  local d = g._dev
  if d == nil then
    if g.world_size > 1 then
      local sel = policy.select(g, op, x)
      if sel == "no_device_backend" then
        fail(op, g, "device tensors need CUDA, which this process does not have", gname(g))
      end
    end
    d = M.setup(g, op)
  end
  on_device(g, op, d, x); on_device(g, op, d, residual); on_device(g, op, d, weight)
  on_device(g, op, d, opts.norm_out); on_device(g, op, d, opts.residual_out); on_device(g, op, d, opts.quant_out)

  local path, why, algo = M.fused_decision(g, x, residual, weight, opts)
  local norm_out = opts.norm_out or tm.empty(x.shape, x.dtype, x.device)
  local res_out = opts.residual_out or tm.empty(x.shape, x.dtype, x.device)
  local quant_out = fp8 and (opts.quant_out or tm.empty(x.shape, "f8e4m3", x.device)) or nil
  local scale_t = nil
  if fp8 then scale_t = tm.is_tensor(opts.scale) and opts.scale or scale_tensor(g, d, opts.scale) end
  if path == "fused" then
    local ctx = M.fusion_ctx(g)
    local fo = g._fused_opts          -- reused: no table per call
    if fo == nil then fo = {}; g._fused_opts = fo end
    fo.max_tokens, fo.algo, fo.gemma, fo.pdl = fused_tokens_cap(opts), algo, opts.gemma, opts.pdl
    fo.fp32_acc, fo.trigger_completion_at_end = opts.fp32_acc, opts.trigger_completion_at_end
    fo.use_attn_tp_group, fo.norm_out, fo.residual_out = opts.use_attn_tp_group, norm_out, res_out
    fo.quant_out, fo.scale = quant_out, scale_t
    fo.stream = opts.stream ~= nil and CUDA().stream_handle(opts.stream) or nil
    local n, r = ctx:fused_allreduce_rmsnorm(g, x, residual, weight, eps, fo)
    fo.norm_out, fo.residual_out, fo.quant_out, fo.scale = nil, nil, nil, nil
    if n ~= nil then
      g._fused_path, g._fused_why = "fused", why
      if fp8 then return n, r, quant_out end
      return n, r
    end
    why = "fusion declined: " .. tostring(r)
  end
  -- unfused: all_reduce(x -> norm_out) [x unchanged], then the norm kernel in place
  g._fused_path, g._fused_why = "unfused", why
  local xc, rc, wc = x:contiguous(), residual:contiguous(), weight:contiguous()
  local src = xc
  if g.world_size > 1 then
    g:all_reduce(xc, "sum", norm_out)
    src = norm_out
  end
  CUDA().rmsnorm(src, rc, wc, eps, { out = norm_out, residual_out = res_out, gemma = opts.gemma,
                                     stream = opts.stream })
  if xc ~= x then xc:free() end
  if rc ~= residual then rc:free() end
  if wc ~= weight then wc:free() end
  if fp8 then
    quantize_host(g, op, norm_out, opts.scale, quant_out)
    return norm_out, res_out, quant_out
  end
  return norm_out, res_out
end

local function fused_lines(g, _, t)
  if not is_device(t) or t.shape == nil or #t.shape < 1 or t.is_contiguous == nil then
    return { "(explain with the device input tensor)" }
  end
  local _, _, _, lines = M.fused_decision(g, t, nil, nil, {}, true)
  if g._fused_path then lines[#lines + 1] = fmt("last call: %s (%s)", g._fused_path, tostring(g._fused_why)) end
  return lines
end

---------------------------------------------------------------- rules
local function stage_why(g)
  local d = g._dev
  return "NCCL cannot serve this group (" .. tostring(d and d.nccl_why) .. "): device data goes "
         .. "through host memory and the host path (eager only)"
end

-- Inserted into weft.policy's table where its "device tensor" placeholder was.
M.rules = {
  { name = "no CUDA", device = true, backend = "no_device_backend", cacheable = true,
    when = function(_, _, t) return is_device(t) and not cuda_ok() end,
    why = "device tensor, but this process has no CUDA device (or libweft was built without CUDA)",
    why_not = function(_, _, t) return is_device(t) and "CUDA is available" or "host tensor" end },
  { name = "invalid WEFT_ALLREDUCE", device = true, backend = "invalid_override", cacheable = true, ops = { all_reduce = true },
    when = function(_, _, t) return is_device(t) and policy.override_error ~= nil end,
    why = function() return tostring(policy.override_error) end,
    why_not = "no invalid override" },
  { name = "custom all-reduce (should_custom_ar)", device = true, backend = "custom_ar", ops = { all_reduce = true },
    when = function(g, _, t, rop) return is_device(t) and ar_rule(g, t, rop) end,
    why = ar_why, why_not = ar_why_not,
    detail = function(g, _, t, rop) if is_device(t) then return ar_lines(g, t, rop) end end },
  { name = "fused kernel", device = true, backend = "fused", cacheable = true, ops = { fused_allreduce_rmsnorm = true },
    when = function(_, _, t) return is_device(t) end,
    why = "device tensors: the fused all-reduce + residual + RMSNorm kernel where it applies, "
          .. "else all_reduce + the norm kernel (checks below)",
    why_not = "host tensors: all-reduce, then weft_host_rmsnorm",
    detail = function(g, op, t) if is_device(t) then return fused_lines(g, op, t) end end },
  { name = "host staging (no NCCL)", device = true, backend = "device_host", cacheable = true,
    when = function(g, _, t) local d = g._dev; return is_device(t) and d ~= nil and d.nccl == nil end,
    why = stage_why,
    why_not = function(g, _, t)
      if not is_device(t) then return "host tensor" end
      if g._dev == nil then return "NCCL set up on first device use" end
      return "NCCL communicator ready"
    end },
  { name = "NCCL", device = true, backend = "nccl", cacheable = true,
    when = function(_, _, t) return is_device(t) end,
    why = "device tensor: NCCL (one communicator per group, made on first device use; the seed's PyNccl "
          .. "in graphs and torch.distributed when eager are both this)",
    why_not = "host tensor" },
}

-- Overrides the group cannot use, refused by policy.set when given the group.
local function check_all_reduce(g, v)
  if g.world_size <= 1 then return true end
  local d = g._dev
  if v == "nccl" then
    if d and d.nccl == nil then return false, "NCCL cannot serve it: " .. tostring(d.nccl_why) end
    return true
  end
  if not AR_WORLDS[g.world_size] then return false, fmt("%d ranks: the custom kernels exist for 2, 4, 6, 8", g.world_size) end
  if not g.same_node then return false, "ranks on several nodes" end
  if d and d.shared then return false, d.shared end
  if d and d.ar_state == "failed" then return false, tostring(d.ar_why) end
  return true
end

local function check_fused(g, v)
  if v == "unfused" or g.world_size <= 1 then return true end
  if not g.same_node then return false, "ranks on several nodes" end
  if g.world_size > 8 then return false, "more than 8 ranks" end
  local d = g._dev
  if d and d.shared then return false, d.shared end
  local f = g._fusion
  if f and f.attn.disabled then return false, "fusion disabled: " .. tostring(f.attn.disabled_reason) end
  return true
end

---------------------------------------------------------------- choice
local AR_NAME = { [0] = "auto", "oneshot", "twoshot", "oneshot_flag" }

-- choice(g, op, t [, opts]) -> the concrete backend a call would get, in the
-- policy file's terms: all_reduce "nccl" | "oneshot" | "twoshot" |
-- "oneshot_flag" | "auto" (or a host/other backend name); fused_allreduce_rmsnorm
-- "fused_oneshot" | "fused_twoshot" | "fused_auto" | "unfused". Second value:
-- why. Runs nothing (scripts/weft-tune compares policies with it).
function M.choice(g, op, t, opts)
  local be, why = policy.select(g, op, t)
  if op == "all_reduce" and be == "custom_ar" then
    if g._ar_pick_error then return nil, g._ar_pick_error end
    return AR_NAME[g._ar_pick or 0], why
  end
  if op == "fused_allreduce_rmsnorm" and be == "fused" then
    local path, fwhy, algo = M.fused_decision(g, t, nil, nil, opts or {})
    if path ~= "fused" then return "unfused", fwhy end
    return "fused_" .. algo, fwhy
  end
  return be, why
end

---------------------------------------------------------------- lifecycle
local function destroy_hook(g)
  local am = package.loaded["weft.async"]
  if am and am.close then pcall(am.close, g) end   -- its queue may use the communicator
  if g._fusion then pcall(g._fusion.cleanup, g._fusion); g._fusion = nil end
  local d = g._dev
  if d == nil then return end
  g._dev = nil
  if d.ar then pcall(d.ar.destroy, d.ar) end
  if d.own_nccl and d.nccl then
    pcall(d.nccl.destroy, d.nccl)
    if g.device_group == d.nccl then g.device_group = nil end
  end
  local cuda = package.loaded["weft.cuda"]
  if cuda then
    for _, s in pairs(d.scratch) do pcall(cuda.free, s.ptr) end
    for _, p in ipairs(d.retired) do pcall(cuda.free, p) end
  end
  if d.scale_t then pcall(d.scale_t.free, d.scale_t) end
end

-- graph.capture enters each group once before it begins: set up what a
-- capture cannot (collectives), so the graph column of the table applies.
local function graph_enter(g, ctx)
  if not g.is_member or g.world_size <= 1 or not cuda_ok() then return end
  M.prepare(g, { fusion = ctx and ctx.fusion })
end

local installed = false

-- install(group_module): registers the backends, the rules (replacing
-- weft.policy's "device tensor" placeholder), the override checkers, and the
-- destroy / graph hooks. Idempotent.
function M.install(gm)
  if installed then return M end
  installed = true
  group_mod = gm
  gm.register_backend("nccl", nccl_be)
  gm.register_backend("custom_ar", car)
  gm.register_backend("device_host", stage)
  gm.register_backend("fused", {
    fused_allreduce_rmsnorm = function(g, _, x, r, w, eps, opts) return M.fused(g, x, r, w, eps, opts) end,
  })
  gm.register_backend("invalid_override", setmetatable({}, { __index = function()
    return function(_, op) error(fmt("weft: %s: %s", op, tostring(policy.override_error)), 0) end
  end }))
  local pos
  for i, r in ipairs(policy.rules) do
    if r.name == "device tensor" then pos = i; break end
  end
  if pos then
    table.remove(policy.rules, pos)
  else
    pos = 2
    for i, r in ipairs(policy.rules) do if r.name == "single rank" then pos = i + 1 end end
  end
  for i, r in ipairs(M.rules) do table.insert(policy.rules, pos + i - 1, r) end
  policy.version = policy.version + 1
  policy.checkers.all_reduce = check_all_reduce
  policy.checkers.fused = check_fused
  gm.destroy_hooks[#gm.destroy_hooks + 1] = destroy_hook
  gm.graph_hooks.enter[#gm.graph_hooks.enter + 1] = graph_enter
  gm.device_fused = M.fused
  policy.choice = M.choice
  return M
end

return M
