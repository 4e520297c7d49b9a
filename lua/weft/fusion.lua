-- weft.fusion — the fused all-reduce + residual add + RMSNorm workspaces
-- (SGLang's FlashInferWorkspaceManager and flashinfer_allreduce_residual_rmsnorm,
-- python/sglang/srt/layers/flashinfer_comm_fusion.py), over src/coll/fusion.c.
--
-- The decisions are pure Lua over an injectable backend, so they are tested
-- on a CPU with a fake one (tests/unit/fusion_manager_spec.lua):
--
--   * one manager per kind: "attn_tp" (attention TP group) and "moe" (MoE EP
--     or TP group), each with its own workspace;
--   * grow-only: the manager remembers the largest tokens, hidden and element
--     size ever asked for and allocates that high-water mark, so a workspace
--     is recreated at most once per new maximum; a request it covers reuses it
--     (is_buffer_size_sufficient);
--   * before allocating, a preflight vote (AND over the group) on whether
--     every rank has room; the C create votes again inside (src/cuda/vmm.c);
--   * if creation fails on any rank, fusion is disabled on every rank of that
--     group together (MAX vote after every (re)creation), so ranks never
--     diverge (one fusing, one not) and never hang in a later graph capture;
--   * pre_initialize_workspaces() before graph capture (no collectives inside
--     a capture), cleanup() at the end.
--
-- Where this departs from the seed, on purpose:
--   * "disabled" is per workspace kind and voted on that kind's own group
--     (the seed sets one global flag and votes on the TP group even for the
--     MoE workspace, which can be another group);
--   * after the vote says another rank failed, this rank also drops its
--     workspace and answers false for that very call (the seed still answers
--     true once on the ranks that succeeded);
--   * misuse (shape or dtype mismatch, hidden not a multiple of 8, more tokens
--     than declared) raises a clear error instead of an assert; a call fusion
--     cannot serve (one rank, host or non-contiguous tensors, disabled) returns
--     nil plus the reason, and the caller takes the unfused path.
--
-- A coordinator (`coord`) is anything with world_size, rank_in_group and
-- cpu_group (a weft.cpugroup: :allreduce_i64, .handle) — a weft.group
-- GroupCoordinator is one.
local M = {}

local max, floor, type, tostring, error, pcall = math.max, math.floor, type, tostring, error, pcall

M.PATTERN = { ar = 0, ar_rmsnorm = 1, ar_rmsnorm_fp8 = 2 }
M.ALGO = { auto = 0, oneshot = 1, twoshot = 2 }
M.FLAG = { gemma = 1, fp32_acc = 2, pdl = 4, trigger_at_end = 8, deterministic = 16 }
M.DTYPE = { f32 = 0, f16 = 1, bf16 = 2 }
local DTYPE, ESIZE = M.DTYPE, { f32 = 4, f16 = 2, bf16 = 2 }
M.QUICK = { int8 = 1, int4 = 2, fp8 = 3 }   -- weft_fusion_params.quick (WEFT_QR_*)
local QUICK = M.QUICK
local ALGO, PATTERN, FLAG = M.ALGO, M.PATTERN, M.FLAG

-- weft.internal.errors: fail(2, op, ...) names the line that called the checking function
local E = require("weft.internal.errors")
local fail, shape_str, same_shape = E.fail, E.shape_str, E.same_shape

---------------------------------------------------------------- policy (pure)

-- Default one-shot limit in bytes by world size (the C side's default too;
-- WEFT_FUSION_ONESHOT_MAX overrides it there). Two ranks: no limit (math.huge):
-- both kernels move the same bytes per link direction there and the one-shot
-- needs no barrier; on 2 x H200 the two-shot led only at 8 and 16 MiB (by 4 and
-- 1.4 %) and trailed by 7-12 % at 32-128 MiB (bench/results/fused-nvidia-h200-
-- x2-2026-11-30.md), so no switch point beats none. More ranks: the one-shot
-- moves (world - 1) times the bytes; not yet measured.
function M.oneshot_max_bytes(world)
  if world == 2 then return math.huge end
  if world <= 4 then return 2 * 1048576 end
  return 512 * 1024
end

local function bytes_str(n)
  return n == math.huge and "none" or ("%d"):format(n)
end

-- resolve_algo(world, tokens, hidden, dtype [, requested [, limit]]) -> "oneshot"|"twoshot", why
-- Like the seed's use_oneshot choice: one-shot (Lamport, one NVLink trip, no
-- barrier) while the tensor is small; two-shot (each rank reduces and
-- normalises its token range) once bandwidth dominates.
function M.resolve_algo(world, tokens, hidden, dtype, requested, limit)
  if requested == "oneshot" or requested == "twoshot" then return requested, requested .. " requested" end
  local bytes = tokens * hidden * (ESIZE[dtype] or 2)
  limit = limit or M.oneshot_max_bytes(world)
  if bytes <= limit then
    return "oneshot", ("%d bytes <= one-shot limit %s (world %d): latency path"):format(bytes, bytes_str(limit), world)
  end
  return "twoshot", ("%d bytes > one-shot limit %s (world %d): bandwidth path"):format(bytes, bytes_str(limit), world)
end

-- resolve_backend(requested, {multi_node=, allow_multicast=}) -> name|nil, why
-- Like the seed's _resolve_backend: weft's own kernels serve one node; across
-- nodes fusion is off (NCCL then the norm). A multicast design stays off
-- unless WEFT_ALLOW_MULTICAST=1, and even then weft has no multicast kernel.
function M.resolve_backend(requested, o)
  o = o or {}
  requested = requested or "auto"
  if o.multi_node then return nil, "ranks on several nodes: fusion off (NCCL all-reduce, then the norm)" end
  if requested == "multicast" then
    if not o.allow_multicast then
      return "weft", "multicast requested but not allowed (WEFT_ALLOW_MULTICAST unset): weft one/two-shot"
    end
    return "weft", "multicast allowed, but weft has no multicast kernel: weft one/two-shot"
  end
  if requested == "auto" or requested == "weft" then return "weft", "one node: weft one/two-shot kernels" end
  return nil, "unknown fusion backend " .. tostring(requested)
end

---------------------------------------------------------------- C backend

-- A workspace backend over a family of src/coll/fused_ws.h through the FFI:
-- spec.prefix names its C functions (weft_fusion: _preflight, _create,
-- _destroy, _sufficient, _run, _check_error), spec.params its call struct,
-- spec.dtypes its dtype codes by name; spec.what prefixes its errors.
-- (FFI loaded lazily, so the pure parts of this module work without libweft.)
local function ffi_backend(spec)
  local ffi = require("ffi")
  local wffi = require("weft.internal.ffi")
  local C = wffi.C
  local pre, what, DT = spec.prefix, spec.what, spec.dtypes
  local B = { name = spec.name }
  local okp = ffi.new("int[1]")
  local function opts(s)
    local o = ffi.new("weft_fusion_opts")
    o.max_tokens, o.hidden, o.dtype = s.max_tokens, s.hidden, DT[s.dtype] or DT[spec.default_dtype]
    o.timeout_ms = s.timeout_ms or 0
    o.oneshot_max_tokens = s.oneshot_max_tokens or 0
    return o
  end
  function B.preflight(coord, s)
    wffi.check(C[pre .. "_preflight"](opts(s), coord.world_size, okp), what .. " preflight", 2)
    return okp[0] == 1
  end
  function B.vote(coord, value, op)
    return coord.cpu_group:allreduce_i64({ value }, op)[1]
  end
  function B.create(coord, s)
    local out = ffi.new(pre .. " *[1]")
    local rc = C[pre .. "_create"](coord.cpu_group.handle, opts(s), out)
    if rc ~= 0 then return nil, wffi.last_error() end
    return ffi.gc(out[0], C[pre .. "_destroy"])
  end
  function B.destroy(ws)
    ffi.gc(ws, nil)
    C[pre .. "_destroy"](ws)
  end
  function B.sufficient(ws, tokens, hidden, dtype, algo)
    wffi.check(C[pre .. "_sufficient"](ws, tokens, hidden, DT[dtype] or -1, ALGO[algo or "auto"], okp),
               what .. " sufficient", 2)
    return okp[0] == 1
  end
  function B.new_params() return ffi.new(spec.params) end
  function B.run(ws, p)
    if C[pre .. "_run"](ws, p) ~= 0 then return nil, wffi.last_error() end
    return true
  end
  function B.check_error(ws)
    if C[pre .. "_check_error"](ws) ~= 0 then return wffi.last_error() end
  end
  function B.empty_like(t) return require("weft.tensor").empty(t.shape, t.dtype, t.device) end
  return B
end
M.ffi_backend = ffi_backend

-- The default backend: src/coll/fusion.c
local function c_backend()
  return ffi_backend{ name = "weft", prefix = "weft_fusion", params = "weft_fusion_params",
                      what = "fusion", dtypes = DTYPE }
end
M.c_backend = c_backend

---------------------------------------------------------------- one manager

local Manager = {}
Manager.__index = Manager
M.Manager = Manager

function M.new_manager(kind, backend)
  return setmetatable({
    kind = kind, backend = backend,
    ws = nil, initialized = false,
    world_size = nil, rank = nil, group = nil,
    max_tokens = nil, hidden = nil, dtype = nil,
    hwm_tokens = 0, hwm_hidden = 0, hwm_esize = 0, -- grow-only: largest ever asked
    disabled = false, disabled_reason = nil,
    creates = 0,
  }, Manager)
end

-- Does the current workspace cover (tokens, hidden, dtype[, algo])?
function Manager:is_buffer_size_sufficient(tokens, hidden, dtype, algo)
  if not self.initialized or self.ws == nil then return false end
  local ok, res = pcall(self.backend.sufficient, self.ws, tokens, hidden, dtype, algo)
  if ok then return res and true or false end
  -- the seed's fallback: within the allocated dimensions
  return tokens <= self.max_tokens and hidden <= self.hidden
     and (ESIZE[dtype] or 99) <= (ESIZE[self.dtype] or 0)
end

-- Drop the workspace (local; never a collective). Keeps the high-water marks.
function Manager:cleanup()
  if self.ws ~= nil then
    local ws = self.ws
    self.ws = nil
    pcall(self.backend.destroy, ws)
  end
  self.initialized = false
  self.world_size, self.rank, self.group = nil, nil, nil
  self.max_tokens, self.hidden, self.dtype = nil, nil, nil
end

function Manager:disable(reason)
  self:cleanup()
  self.disabled = true
  self.disabled_reason = reason
end

-- initialize(coord, {max_tokens=, hidden=, dtype=, oneshot_max_tokens=, timeout_ms=})
-- Collective over coord. Returns true when a covering workspace exists.
function Manager:initialize(coord, spec)
  local esz = ESIZE[spec.dtype]
  self.hwm_tokens = max(self.hwm_tokens, spec.max_tokens)
  self.hwm_hidden = max(self.hwm_hidden, spec.hidden)
  self.hwm_esize = max(self.hwm_esize, esz)
  if self.initialized and self.world_size == coord.world_size
     and self:is_buffer_size_sufficient(spec.max_tokens, spec.hidden, spec.dtype) then
    return true
  end
  self:cleanup()
  local alloc = {
    max_tokens = self.hwm_tokens, hidden = self.hwm_hidden,
    dtype = self.hwm_esize == 4 and "f32" or spec.dtype,
    oneshot_max_tokens = spec.oneshot_max_tokens, timeout_ms = spec.timeout_ms,
  }
  -- preflight: every rank must have room, or nobody allocates
  local ok_local, pre = pcall(self.backend.preflight, coord, alloc)
  local mine = ok_local and pre and true or false
  local voted, agreed = pcall(self.backend.vote, coord, mine and 1 or 0, "and")
  if not voted or agreed ~= 1 then
    self:disable(not voted and ("preflight vote failed: " .. tostring(agreed))
                 or mine and "preflight vote: another rank has no room for the workspace"
                 or "preflight: no room for the workspace on this rank")
    return false
  end
  local ok, ws, err = pcall(self.backend.create, coord, alloc)
  if not ok or ws == nil then
    self:disable("workspace creation failed: " .. tostring(ok and err or ws))
    return false
  end
  self.ws = ws
  self.initialized = true
  self.world_size, self.rank, self.group = coord.world_size, coord.rank_in_group, coord
  self.max_tokens, self.hidden, self.dtype = alloc.max_tokens, alloc.hidden, alloc.dtype
  self.creates = self.creates + 1
  return true
end

---------------------------------------------------------------- the context

local Ctx = {}
Ctx.__index = Ctx
M.Context = Ctx

-- new{backend=} -> a context: the two managers and the fused entry point.
function M.new(o)
  o = o or {}
  local backend = o.backend or c_backend()
  local self = setmetatable({
    backend = backend,
    attn = M.new_manager("attn_tp", backend),
    moe = M.new_manager("moe", backend),
    last_reason = nil,
  }, Ctx)
  self.params = backend.new_params and backend.new_params() or {}
  return self
end

function Ctx:manager(use_attn_tp_group)
  if use_attn_tp_group == false then return self.moe end
  return self.attn
end

-- Everyone on the group agrees: if any rank's manager is disabled, all are.
function Ctx:_sync_disabled(mgr, coord)
  local ok, any = pcall(self.backend.vote, coord, mgr.disabled and 1 or 0, "max")
  if not ok then
    mgr:disable("agreement vote failed: " .. tostring(any))
  elseif any ~= 0 and not mgr.disabled then
    mgr:disable("workspace creation failed on another rank of the group")
  end
end

-- ensure_workspace_initialized{coord=, max_tokens=2048, hidden=4096, dtype="bf16",
--   tokens=nil, algo=nil, use_attn_tp_group=true, oneshot_max_tokens=, timeout_ms=}
-- Collective over coord whenever it (re)creates. -> true when usable.
function Ctx:ensure_workspace_initialized(a)
  local coord = a.coord
  if coord == nil or coord.world_size <= 1 then return false end
  local mgr = self:manager(a.use_attn_tp_group)
  if mgr.disabled then return false end
  local max_tokens, hidden, dtype = a.max_tokens or 2048, a.hidden or 4096, a.dtype or "bf16"
  local tokens = a.tokens or max_tokens
  if not mgr.initialized or mgr.world_size ~= coord.world_size or mgr.rank ~= coord.rank_in_group
     or mgr.group ~= coord
     or not mgr:is_buffer_size_sufficient(tokens, hidden, dtype, a.algo) then
    mgr:initialize(coord, { max_tokens = max(max_tokens, tokens), hidden = hidden, dtype = dtype,
                            oneshot_max_tokens = a.oneshot_max_tokens, timeout_ms = a.timeout_ms })
    self:_sync_disabled(mgr, coord)
  end
  return mgr.initialized and not mgr.disabled
end

-- pre_initialize_workspaces{max_tokens=, hidden=, dtype=, attn_coord=, moe_coord=}
-- Before graph capture: creation runs collectives, which a capture forbids.
-- MoE first, then attention (the seed's order: every rank takes the same).
function Ctx:pre_initialize_workspaces(a)
  local r = {}
  if a.moe_coord then
    r.moe = self:ensure_workspace_initialized{ coord = a.moe_coord, max_tokens = a.max_tokens,
      hidden = a.hidden, dtype = a.dtype, algo = a.algo, use_attn_tp_group = false,
      oneshot_max_tokens = a.oneshot_max_tokens, timeout_ms = a.timeout_ms }
  end
  if a.attn_coord then
    r.attn_tp = self:ensure_workspace_initialized{ coord = a.attn_coord, max_tokens = a.max_tokens,
      hidden = a.hidden, dtype = a.dtype, algo = a.algo, use_attn_tp_group = true,
      oneshot_max_tokens = a.oneshot_max_tokens, timeout_ms = a.timeout_ms }
  end
  return r
end

function Ctx:cleanup()
  self.attn:cleanup()
  if self.moe ~= self.attn then self.moe:cleanup() end
end

-- fused_allreduce_rmsnorm(coord, x, residual, weight, eps, opts)
--   -> norm_out, residual_out          (fused kernel ran)
--   -> nil, reason                     (fusion does not apply: take the unfused path)
-- opts: max_tokens (declared maximum, default 2048), algo ("auto"|"oneshot"|
-- "twoshot"), fp32_acc (default true), gemma, pdl (default true, as the
-- seed launches), trigger_completion_at_end, use_attn_tp_group (default
-- true), deterministic (the bit-identical variant, WEFT_FUSION_DETERMINISTIC),
-- norm_out=, residual_out= (preallocated outputs), stream (raw
-- cudaStream_t), quant_out= with scale= (FP8 pattern: an e4m3 tensor like x
-- and a device f32 tensor of one element; weft.backends.device_backends checks them),
-- quick= "int8"|"int4"|"fp8" (the quick two-shot: the sum on a compressed
-- wire, docs/quick-allreduce.md; weft.backends.device_backends sets it from the policy).
-- Errors (raised): dtype mix, shape mismatch, hidden not a multiple of 8,
-- tokens above max_tokens, an unsupported dtype.
function Ctx:fused_allreduce_rmsnorm(coord, x, residual, weight, eps, opts)
  local op = "fused_allreduce_rmsnorm"
  opts = opts or {}
  if x.dtype ~= residual.dtype or x.dtype ~= weight.dtype then
    fail(2, op, "dtypes differ: input %s, residual %s, weight %s", tostring(x.dtype),
         tostring(residual.dtype), tostring(weight.dtype))
  end
  if not DTYPE[x.dtype] then fail(2, op, "dtype %s not supported (f32, f16, bf16)", tostring(x.dtype)) end
  if not same_shape(x.shape, residual.shape) then
    fail(2, op, "residual shape %s differs from input shape %s", shape_str(residual.shape), shape_str(x.shape))
  end
  local hidden = x.shape[#x.shape]
  if #weight.shape ~= 1 or weight.shape[1] ~= hidden then
    fail(2, op, "weight shape %s must be {%s} (last dim of input %s)", shape_str(weight.shape),
         tostring(hidden), shape_str(x.shape))
  end
  if hidden % 8 ~= 0 or hidden < 8 or hidden > 16384 then
    fail(2, op, "hidden %d must be a multiple of 8 in [8, 16384]", hidden)
  end
  local tokens = floor(x.numel / hidden)
  local max_tokens = opts.max_tokens or 2048
  if tokens > max_tokens then
    fail(2, op, "%d tokens exceed the declared maximum %d (max_tokens)", tokens, max_tokens)
  end
  eps = eps or 1e-6
  if coord.world_size <= 1 then return self:_skip("group of one rank: nothing to reduce") end
  if x.device == "cpu" or residual.device == "cpu" or weight.device == "cpu" then
    return self:_skip("host tensors: the fused kernel runs on the device")
  end
  if not (x:is_contiguous() and residual:is_contiguous() and weight:is_contiguous()) then
    return self:_skip("non-contiguous tensors")
  end
  local use_attn = opts.use_attn_tp_group ~= false
  if not self:ensure_workspace_initialized{ coord = coord, max_tokens = max_tokens, hidden = hidden,
                                            dtype = x.dtype, tokens = tokens, algo = opts.algo,
                                            use_attn_tp_group = use_attn } then
    local mgr = self:manager(use_attn)
    return self:_skip("fusion workspace unavailable: " .. tostring(mgr.disabled_reason or "not initialized"))
  end
  local mgr = self:manager(use_attn)
  local B = self.backend
  local norm_out = opts.norm_out or B.empty_like(x)
  local res_out = opts.residual_out or B.empty_like(residual)
  local p = self.params
  p.pattern, p.algo, p.dtype = PATTERN.ar_rmsnorm, ALGO[opts.algo or "auto"] or 0, DTYPE[x.dtype]
  p.flags = (opts.fp32_acc == false and 0 or FLAG.fp32_acc) + (opts.gemma and FLAG.gemma or 0)
            + (opts.pdl == false and 0 or FLAG.pdl)
            + (opts.trigger_completion_at_end and FLAG.trigger_at_end or 0)
            + (opts.deterministic and FLAG.deterministic or 0)
  p.tokens, p.hidden = tokens, hidden
  p.input, p.residual, p.weight = x.ptr, residual.ptr, weight.ptr
  p.out, p.residual_out, p.norm_out = nil, res_out.ptr, norm_out.ptr
  p.quant_out, p.scale = nil, nil
  if opts.quant_out ~= nil then   -- FP8: e4m3 of norm / *scale too (opts.scale: device f32 tensor)
    p.pattern, p.quant_out, p.scale = PATTERN.ar_rmsnorm_fp8, opts.quant_out.ptr, opts.scale.ptr
  end
  p.eps, p.stream = eps, opts.stream
  p.quick = 0
  if opts.quick ~= nil then   -- the quick two-shot (kernels/quick_fused.cu): int8 / int4 / fp8 on the wire
    p.quick = QUICK[opts.quick] or fail(2, op, "quick codec %s is not int8, int4 or fp8", tostring(opts.quick))
  end
  local ok, err = B.run(mgr.ws, p)
  if not ok then error("weft: " .. op .. ": " .. tostring(err), 2) end
  self.last_reason = "fused kernel (" .. mgr.kind .. " workspace)"
  return norm_out, res_out
end

function Ctx:_skip(reason)
  self.last_reason = reason
  return nil, reason
end

-- The module-level default context (created on first use).
local default
function M.default()
  if not default then default = M.new() end
  return default
end

return M
