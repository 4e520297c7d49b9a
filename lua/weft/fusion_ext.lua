-- weft.fusion_ext — the fusion patterns beyond all-reduce + residual +
-- RMSNorm (FlashInfer's AllReduceFusionOp kinds; docs/fusion.md "More
-- patterns"), as GroupCoordinator methods:
--
--   g:fused_moe_allreduce_rmsnorm{...}           MoE reduction, all-reduce, residual, RMSNorm
--   g:fused_moe_finalize_allreduce_rmsnorm{...}  the same from permuted (grouped-GEMM) rows
--   g:fused_allreduce_prepost_rmsnorm(x, residual, weight_pre, weight, eps, opts)
--   g:fused_reduce_scatter_rmsnorm(x, residual, weight, eps, opts)  (+ all_gather = true)
--   g:prepare_fusion_ext{max_tokens=, hidden=}   the workspace, made before a capture
--
-- Every call is checked completely (shapes, dtypes, devices, token counts)
-- before anything is enqueued. Host tensors take the host path: the local
-- MoE reduction (weft_host_moe_reduce), the group's all_reduce /
-- reduce_scatter / all_gather and weft_host_rmsnorm — the reference the
-- kernels are tested against. Device tensors take the fused kernel
-- (src/coll/fusion_ext.c, kernels/fused_ext.cu) where the checks below pass
-- (policy.explain shows them), else the unfused path: the same separate
-- device calls (weft_cuda_moe_reduce, all_reduce, weft_cuda_rmsnorm),
-- graph-capturable as well. Deterministic mode sends every pattern to the
-- unfused path, whose pieces are deterministic (rank-order all-reduce, the
-- deterministic norm kernel; the reduce-scatter through a deterministic
-- all-reduce and this rank's slice of it).
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local policy = require("weft.policy")
local fusion = require("weft.fusion")
local show = require("weft.internal.show").value -- names a refused value's type

local C = wffi.C
local fmt = string.format
local max = math.max

local M = {}

local function T() return require("weft.tensor") end
local function S() return require("weft.backends.device_backends.setup") end
local function CUDA() return require("weft.cuda") end

local E = require("weft.internal.errors")
local gname, shape_str, same_shape = E.gname, E.shape_str, E.same_shape
local unpack = unpack or table.unpack
-- refuse(op, g, msg, args...): raises "weft: <op>: <msg> (group <name>)"
local function refuse(op, g, msg, ...)
  local n = select("#", ...)
  local args = { ... }
  args[n + 1] = gname(g)
  E.fail(0, op, msg .. " (group %s)", unpack(args, 1, n + 1))
end

local DT = { f32 = 0, f16 = 1, bf16 = 2 }      -- WEFT_F32 / F16 / BF16
M.DT = DT
local FLOATS = { f32 = true, f16 = true, bf16 = true }
local KERNEL_DTYPES = { f16 = true, bf16 = true }
local PATTERN = { moe = 1, finalize = 2, prepost = 3, rs = 4 }   -- WEFT_FX_*
local ALGO = { auto = 0, oneshot = 1, twoshot = 2 }
local FX_GEMMA, FX_PDL, FX_SCALES_DTYPE = 1, 4, 32
M.OPS = {
  fused_moe_allreduce_rmsnorm = "moe", fused_moe_finalize_allreduce_rmsnorm = "finalize",
  fused_allreduce_prepost_rmsnorm = "prepost", fused_reduce_scatter_rmsnorm = "rs",
}

---------------------------------------------------------------- argument checks
-- want(c, t, what [, optional]): a live weft tensor on the call's device
local function want(c, t, what, optional)
  if t == nil then
    if optional then return nil end
    refuse(c.op, c.g, "%s is missing", what)
  end
  if not T().is_tensor(t) then refuse(c.op, c.g, "%s must be a weft tensor, got %s", what, type(t)) end
  if t.ptr == nil and t.numel > 0 then refuse(c.op, c.g, "%s storage was freed", what) end
  if c.device == nil then c.device = t.device end
  if t.device ~= c.device then
    refuse(c.op, c.g, "%s is on %s and %s on %s: host and device tensors (or two devices) cannot mix in one call",
           what, tostring(t.device), c.first, tostring(c.device))
  end
  c.first = c.first or what
  return t
end

local function want_shape(c, t, shape, what)
  if not same_shape(t.shape, shape) then
    refuse(c.op, c.g, "%s has shape %s, expected %s", what, shape_str(t.shape), shape_str(shape))
  end
end

local function want_dtype(c, t, what)
  if t.dtype ~= c.dtype then refuse(c.op, c.g, "%s is %s, the input is %s", what, t.dtype, c.dtype) end
end

local function want_out(c, t, shape, what)
  if t == nil then return nil end
  want(c, t, what)
  want_dtype(c, t, what)
  want_shape(c, t, shape, what)
  if not t:is_contiguous() then refuse(c.op, c.g, "%s is not contiguous", what) end
  return t
end

local function num(c, v, what, default)
  if v == nil then return default end
  if type(v) ~= "number" or v ~= v or v < 0 then refuse(c.op, c.g, "%s must be a non-negative number", what) end
  return v
end

local function common_opts(c, o)
  if o.algo ~= nil and ALGO[o.algo] == nil then
    refuse(c.op, c.g, "algo %s is not auto, oneshot or twoshot", tostring(o.algo))
  end
  if c.pattern == "rs" and o.algo == "oneshot" then
    refuse(c.op, c.g, "reduce-scatter has one kernel (the two-shot's first half): algo oneshot refused")
  end
  if o.max_tokens ~= nil and (type(o.max_tokens) ~= "number" or o.max_tokens < 1) then
    refuse(c.op, c.g, "max_tokens must be a positive number, got %s", show(o.max_tokens))
  end
  if c.tokens and o.max_tokens and c.tokens > o.max_tokens then
    refuse(c.op, c.g, "%d tokens exceed the declared maximum %d (max_tokens)", c.tokens, o.max_tokens)
  end
  c.algo, c.gemma, c.pdl, c.stream, c.max_tokens = o.algo, o.gemma and true or false, o.pdl, o.stream, o.max_tokens
end

-- residual [tokens, hidden] (rs: [tokens / world, hidden]) and weight [hidden]
local function norm_args(c, residual, weight, rows)
  want(c, residual, "residual"); want_dtype(c, residual, "residual")
  want_shape(c, residual, { rows, c.hidden }, "residual")
  want(c, weight, "weight"); want_dtype(c, weight, "weight")
  want_shape(c, weight, { c.hidden }, "weight")
  c.residual, c.weight = residual, weight
end

local function base(g, op, pattern)
  if g.destroyed then error(fmt("weft: %s: group %s is destroyed", op, gname(g)), 0) end
  if not g.is_member then error(fmt("weft: %s: this rank is not a member of group %s", op, gname(g)), 0) end
  return { g = g, op = op, pattern = pattern, world = g.world_size }
end

local function set_dtype(c, t, what)
  c.dtype = t.dtype
  if not FLOATS[c.dtype] then refuse(c.op, c.g, "%s dtype %s is not supported (f32, f16, bf16)", what, c.dtype) end
end

local function check_scales(c, s, shape, what)
  want(c, s, what)
  if s.dtype ~= "f32" and s.dtype ~= c.dtype then
    refuse(c.op, c.g, "%s is %s: f32 or the input's dtype (%s)", what, s.dtype, c.dtype)
  end
  want_shape(c, s, shape, what)
  c.scales = s
end

-- outputs in place over the input or the residual, or apart from every
-- input and from each other (weft.group.checks.check_fused_outputs)
local function check_outputs(c)
  require("weft.group.checks").check_fused_outputs(c.g, c.op, c.x, c.residual, c.weight,
    { c.norm_out, "norm_out", c.residual_out, "residual_out", c.gathered_out, "gathered_out" }, 0)
end

-- the options every pattern takes, then the norm's two outputs of `rows` rows
-- (given, checked; or nil, made at the call)
local function norm_outs(c, opts, rows)
  common_opts(c, opts)
  c.norm_out = want_out(c, opts.norm_out, { rows, c.hidden }, "norm_out")
  c.residual_out = want_out(c, opts.residual_out, { rows, c.hidden }, "residual_out")
end

-- the MoE patterns' argument table and its expert outputs (of `dims` dims)
local function moe_input(c, a, dims, layout)
  if type(a) ~= "table" then refuse(c.op, c.g, "expects a table of named arguments, got %s", type(a)) end
  local x = want(c, a.expert_outputs, "expert_outputs")
  set_dtype(c, x, "expert_outputs")
  if #x.shape ~= dims then refuse(c.op, c.g, "expert_outputs must be %s, got %s", layout, shape_str(x.shape)) end
  c.x = x
  return x
end

-- the rest of a MoE pattern's arguments: the shared expert's output
-- [tokens, hidden] (optional, named `shared`), the norm's, the options and
-- the outputs
local function moe_rest(c, a, shared)
  c.shared = want(c, a[shared], shared, true)
  if c.shared then
    want_dtype(c, c.shared, shared)
    want_shape(c, c.shared, { c.tokens, c.hidden }, shared)
  end
  norm_args(c, a.residual, a.weight, c.tokens)
  c.eps = num(c, a.eps, "eps", 1e-6)
  norm_outs(c, a, c.tokens)
  check_outputs(c)
  return c
end

local function check_topk(c)
  if c.top_k < 1 or c.top_k > 16 then refuse(c.op, c.g, "top_k %d out of range [1, 16]", c.top_k) end
end

-- a: {expert_outputs=[top_k][tokens][hidden], expert_scales=[top_k][tokens],
--     shared_output=[tokens][hidden]?, residual=, weight=, eps=, ...}
function M.check_moe(g, a)
  local c = base(g, "fused_moe_allreduce_rmsnorm", "moe")
  local x = moe_input(c, a, 3, "[top_k, tokens, hidden]")
  c.top_k, c.tokens, c.hidden = x.shape[1], x.shape[2], x.shape[3]
  check_topk(c)
  check_scales(c, a.expert_scales, { c.top_k, c.tokens }, "expert_scales")
  return moe_rest(c, a, "shared_output")
end

-- a: {expert_outputs=[rows][hidden] (permuted), expanded_idx_to_permuted_idx=i32 [tokens][top_k],
--     expert_scale_factor=[tokens][top_k], shared_expert_output=[tokens][hidden]?, residual=, weight=, eps=}
function M.check_finalize(g, a)
  local c = base(g, "fused_moe_finalize_allreduce_rmsnorm", "finalize")
  local x = moe_input(c, a, 2, "[permuted rows, hidden]")
  c.expert_rows, c.hidden = x.shape[1], x.shape[2]
  local p = want(c, a.expanded_idx_to_permuted_idx, "expanded_idx_to_permuted_idx")
  if p.dtype ~= "i32" then refuse(c.op, g, "expanded_idx_to_permuted_idx must be i32, got %s", p.dtype) end
  if #p.shape ~= 2 then
    refuse(c.op, g, "expanded_idx_to_permuted_idx must be [tokens, top_k], got %s", shape_str(p.shape))
  end
  c.tokens, c.top_k = p.shape[1], p.shape[2]
  check_topk(c)
  c.perm = p
  check_scales(c, a.expert_scale_factor, { c.tokens, c.top_k }, "expert_scale_factor")
  return moe_rest(c, a, "shared_expert_output")
end

-- the input [tokens, hidden] of the patterns called with positional
-- arguments, and their options table (opts or {})
local function xin(c, x, opts)
  opts = opts or {}
  if type(opts) ~= "table" then refuse(c.op, c.g, "options must be a table, got %s", type(opts)) end
  want(c, x, "input")
  set_dtype(c, x, "input")
  if #x.shape ~= 2 then refuse(c.op, c.g, "input must be [tokens, hidden], got %s", shape_str(x.shape)) end
  c.tokens, c.hidden, c.x = x.shape[1], x.shape[2], x
  return opts
end

function M.check_prepost(g, x, residual, weight_pre, weight, eps, opts)
  local c = base(g, "fused_allreduce_prepost_rmsnorm", "prepost")
  opts = xin(c, x, opts)
  norm_args(c, residual, weight, c.tokens)
  want(c, weight_pre, "weight_pre"); want_dtype(c, weight_pre, "weight_pre")
  want_shape(c, weight_pre, { c.hidden }, "weight_pre")
  c.weight_pre = weight_pre
  c.eps = num(c, eps, "eps", 1e-6)
  c.eps_pre = num(c, opts.eps_pre, "eps_pre", c.eps)
  norm_outs(c, opts, c.tokens)
  check_outputs(c)
  return c
end

function M.check_rs(g, x, residual, weight, eps, opts)
  local c = base(g, "fused_reduce_scatter_rmsnorm", "rs")
  opts = xin(c, x, opts)
  if c.tokens % c.world ~= 0 then
    refuse(c.op, g, "%d tokens do not divide among the %d ranks (reduce-scatter by tokens: pad the batch "
           .. "to a multiple of %d)", c.tokens, c.world, c.world)
  end
  c.rows = c.tokens / c.world
  norm_args(c, residual, weight, c.rows)
  c.eps = num(c, eps, "eps", 1e-6)
  norm_outs(c, opts, c.rows)
  c.gathered_out = want_out(c, opts.gathered_out, { c.tokens, c.hidden }, "gathered_out")
  c.all_gather = opts.all_gather and true or c.gathered_out ~= nil
  check_outputs(c)
  return c
end

---------------------------------------------------------------- outputs
local function outputs(c)
  local tm = T()
  local rows = c.pattern == "rs" and c.rows or c.tokens
  c.norm_out = c.norm_out or tm.empty({ rows, c.hidden }, c.dtype, c.device)
  c.residual_out = c.residual_out or tm.empty({ rows, c.hidden }, c.dtype, c.device)
  if c.pattern == "rs" and c.all_gather then
    c.gathered_out = c.gathered_out or tm.empty({ c.tokens, c.hidden }, c.dtype, c.device)
  end
end

local function results(c)
  if c.pattern == "rs" and c.all_gather then return c.norm_out, c.residual_out, c.gathered_out end
  return c.norm_out, c.residual_out
end

local function scales_dtype(c) return DT[c.scales.dtype] end

-- t is no longer needed by this call: freed, or while a graph is being
-- captured kept on the group until it is destroyed (the graph uses it at
-- every replay)
local function release(g, t)
  if policy.mode() == "graph" then
    g._fx_keep = g._fx_keep or {}
    g._fx_keep[#g._fx_keep + 1] = t
  else
    t:free()
  end
end

---------------------------------------------------------------- host path
-- The local MoE partial [tokens][hidden] (host or device), into out.
-- With res and w (device, one rank): residual_out and norm_out of the call too.
local function moe_partial(c, out, device, res, w)
  local x, s = c.x:contiguous(), c.scales:contiguous()
  local sh = c.shared and c.shared:contiguous() or nil
  local perm = c.perm and c.perm:contiguous() or nil
  local pptr = perm and ffi.cast("const int32_t *", perm.ptr) or nil
  local rows = c.pattern == "finalize" and c.expert_rows or c.top_k * c.tokens
  local rc
  if device then
    rc = C.weft_cuda_moe_reduce(x.ptr, s.ptr, scales_dtype(c), pptr, rows, sh and sh.ptr, out and out.ptr,
                                res and res.ptr, w and w.ptr, w and c.residual_out.ptr, w and c.norm_out.ptr,
                                c.tokens, c.hidden, c.top_k, DT[c.dtype], c.eps, (w and c.gemma) and 1 or 0,
                                CUDA().stream_handle(c.stream))
  else
    rc = C.weft_host_moe_reduce(x.ptr, s.ptr, scales_dtype(c), pptr, rows, sh and sh.ptr, out.ptr,
                                c.tokens, c.hidden, c.top_k, DT[c.dtype])
  end
  if x ~= c.x then release(c.g, x) end
  if s ~= c.scales then release(c.g, s) end
  if sh and sh ~= c.shared then release(c.g, sh) end
  if perm and perm ~= c.perm then release(c.g, perm) end
  wffi.check(rc, c.op .. " (local MoE reduction)", 2)
end

local function host_norm(c, x, residual, weight, out, res_out, rows, eps)
  wffi.check(C.weft_host_rmsnorm(x.ptr, residual and residual.ptr, weight.ptr, out.ptr,
                                 res_out and res_out.ptr, rows, c.hidden, DT[c.dtype], eps,
                                 c.gemma and 1 or 0), c.op, 2)
end

-- The host path: the same separate steps the unfused device path takes.
function M.host_run(c)
  local g, tm = c.g, T()
  outputs(c)
  local res, w = c.residual:contiguous(), c.weight:contiguous()
  local tmp = {}
  local function scratch(shape) local t = tm.empty(shape, c.dtype, "cpu"); tmp[#tmp + 1] = t; return t end
  local ok, err = pcall(function()
    if c.pattern == "moe" or c.pattern == "finalize" then
      local part = scratch({ c.tokens, c.hidden })
      moe_partial(c, part, false)
      g:all_reduce(part, "sum")
      host_norm(c, part, res, w, c.norm_out, c.residual_out, c.tokens, c.eps)
    elseif c.pattern == "prepost" then
      local sum = scratch({ c.tokens, c.hidden })
      g:all_reduce(c.x, "sum", sum)
      local pre = scratch({ c.tokens, c.hidden })
      host_norm(c, sum, nil, c.weight_pre:contiguous(), pre, nil, c.tokens, c.eps_pre)
      host_norm(c, pre, res, w, c.norm_out, c.residual_out, c.tokens, c.eps)
    else
      local slice = scratch({ c.rows, c.hidden })
      g:reduce_scatter(c.x:contiguous(), 0, slice)
      host_norm(c, slice, res, w, c.norm_out, c.residual_out, c.rows, c.eps)
      if c.all_gather then g:all_gather(c.norm_out, 0, c.gathered_out) end
    end
  end)
  for _, t in ipairs(tmp) do t:free() end
  if res ~= c.residual then res:free() end
  if w ~= c.weight then w:free() end
  if not ok then error(err, 0) end
  g._fx_path, g._fx_why = "host", "host tensors: local steps and the group's host collectives"
  return results(c)
end

---------------------------------------------------------------- workspace (C backend)
local function c_backend()
  return fusion.ffi_backend{ name = "weft_ext", prefix = "weft_fusion_ext", params = "weft_fusion_ext_params",
                             what = "fusion_ext", dtypes = DT, default_dtype = "bf16" }
end
M.c_backend = c_backend

-- the group's manager (weft.fusion's grow-only manager over this backend)
function M.manager(g)
  local m = g._fusion_ext
  if m == nil then
    m = fusion.new_manager("ext", M.backend or c_backend())
    m.params = m.backend.new_params()
    g._fusion_ext = m
  end
  return m
end

local function ensure(g, max_tokens, hidden, dtype, tokens, algo)
  local m = M.manager(g)
  if m.disabled then return false end
  if not m.initialized or m.world_size ~= g.world_size or m.group ~= g
     or not m:is_buffer_size_sufficient(tokens or max_tokens, hidden, dtype, algo) then
    m:initialize(g, { max_tokens = max(max_tokens, tokens or 0), hidden = hidden, dtype = dtype })
    local ok, any = pcall(m.backend.vote, g, m.disabled and 1 or 0, "max")
    if not ok then m:disable("agreement vote failed: " .. tostring(any))
    elseif any ~= 0 and not m.disabled then m:disable("workspace creation failed on another rank of the group") end
  end
  return m.initialized and not m.disabled
end

-- g:prepare_fusion_ext{max_tokens=, hidden=, dtype=}: make the workspace now
-- (collective), e.g. before a graph capture, which cannot make it.
function M.prepare(g, o)
  o = o or {}
  if g.world_size <= 1 or not g.same_node or g.world_size > 8 then return false end
  local d = S().setup(g, "prepare_fusion_ext")
  if S().kernel_block(d) then return false end
  return ensure(g, o.max_tokens or S().config.fused_max_tokens, o.hidden or 4096, o.dtype or "bf16")
end

---------------------------------------------------------------- the decision
local function cap_of(c) return c.max_tokens or S().config.fused_max_tokens end

-- Checks as data: check(g, c, d, mode, verbose) -> ok, text. The first that
-- fails sends the call to the unfused path with its text.
M.checks = {
  { name = "override", check = function(g)
      local ov, src = policy.override(g, "fused")
      if ov == "unfused" then return false, "override fused=unfused (" .. tostring(src) .. ")" end
      return true, ov and ("override fused=" .. ov) or "none"
    end },
  { name = "more than one rank", check = function(g)
      if g.world_size > 1 then return true, "yes" end
      return false, "group of one rank: the local steps alone"
    end },
  { name = "one node", check = function(g)
      if g.same_node then return true, "yes" end
      return false, "ranks on several nodes: NCCL collectives, then the norm"
    end },
  { name = "world size <= 8", check = function(g)
      if g.world_size <= 8 then return true, "yes" end
      return false, fmt("%d ranks (kernels for 2..8)", g.world_size)
    end },
  { name = "one GPU per rank", check = function(_, _, d)
      if d == nil then return true, "checked when the group first uses the device" end
      local why = S().kernel_block(d)
      if why then return false, why end
      return true, d.shared_mode or "yes"
    end },
  { name = "dtype bf16 or f16", check = function(_, c)
      if KERNEL_DTYPES[c.dtype] then return true, c.dtype end
      return false, fmt("%s: the fused kernels serve bf16 and f16", tostring(c.dtype))
    end },
  { name = "hidden a multiple of 8, <= 16384", check = function(_, c)
      if c.hidden % 8 == 0 and c.hidden <= 16384 and c.hidden >= 8 then return true, tostring(c.hidden) end
      return false, fmt("hidden %d", c.hidden)
    end },
  { name = "contiguous", check = function(_, c)
      for _, t in ipairs { c.x, c.residual, c.weight, c.weight_pre or c.weight, c.shared or c.x,
                           c.scales or c.x, c.perm or c.x } do
        if not t:is_contiguous() then return false, "non-contiguous tensors" end
      end
      return true, "yes"
    end },
  { name = "not deterministic mode", check = function(g)
      local on, src = policy.deterministic(g)
      if on then
        return false, fmt("deterministic mode (%s): the unfused path, whose pieces are deterministic", tostring(src))
      end
      return true, "off"
    end },
  { name = "tokens within the workspace", check = function(_, c)
      local cap = cap_of(c)
      if c.tokens <= cap then return true, fmt("%d <= %d", c.tokens, cap) end
      return false, fmt("%d tokens > the workspace's %d (declare max_tokens, or WEFT_FUSION_MAX_TOKENS)", c.tokens, cap)
    end },
  { name = "workspace", check = function(g, c, _, mode)
      local m = g._fusion_ext
      if m and m.disabled then return false, "fusion_ext disabled on this group: " .. tostring(m.disabled_reason) end
      if mode == "graph" then
        local algo = c.pattern == "rs" and "twoshot" or (c.algo or "auto")
        if not (m and m.initialized and m:is_buffer_size_sufficient(c.tokens, c.hidden, c.dtype, algo)) then
          return false, "no workspace holding this call was made before capture (g:prepare_fusion_ext{max_tokens=, "
                        .. "hidden=}, or weft.graph.capture{fusion = {..., ext = true}})"
        end
        return true, "ready"
      end
      if m and m.initialized then return true, "ready" end
      return true, "made on first use: collective, preflight vote, disabled on every rank together if any fails"
    end },
}

-- decision(g, c [, verbose]) -> "fused"|"unfused", why, algo, lines
function M.decision(g, c, verbose)
  local d, mode = g._dev, policy.mode()
  local lines = verbose and {} or nil
  local path, why = "fused", nil
  for _, k in ipairs(M.checks) do
    local ok, text = k.check(g, c, d, mode)
    if lines then lines[#lines + 1] = fmt("%s %s: %s", ok and "+" or "x", k.name, tostring(text)) end
    if not ok and path == "fused" then
      path, why = "unfused", k.name .. ": " .. tostring(text)
      if not verbose then return path, why end
    end
  end
  if path ~= "fused" then return path, why, nil, lines end
  local ov = policy.override(g, "fused")
  local algo, how
  if c.pattern == "rs" then
    algo, how = "twoshot", "reduce-scatter: its one kernel"
  else
    algo = c.algo or (ov ~= "unfused" and ov) or "auto"
    how = c.algo and "opts.algo" or ov and "override" or "built-in (one-shot up to the kernel's limit, then two-shot)"
  end
  why = fmt("fused kernel, %s (%s)", algo, how)
  if lines then lines[#lines + 1] = "= " .. why end
  return "fused", why, algo, lines
end

---------------------------------------------------------------- device path
local function run_fused(g, c, algo)
  if not ensure(g, cap_of(c), c.hidden, c.dtype, c.tokens, algo) then
    return nil, "fusion_ext workspace unavailable: " .. tostring(M.manager(g).disabled_reason or "not initialized")
  end
  local m = M.manager(g)
  outputs(c)
  local p = m.params
  p.pattern, p.algo, p.dtype = PATTERN[c.pattern], ALGO[algo] or 0, DT[c.dtype]
  p.flags = (c.gemma and FX_GEMMA or 0) + (c.pdl == false and 0 or FX_PDL)
            + ((c.scales and c.scales.dtype ~= "f32") and FX_SCALES_DTYPE or 0)
  p.tokens, p.hidden, p.top_k = c.tokens, c.hidden, c.top_k or 0
  p.expert_rows = c.expert_rows or 0
  p.input = c.x.ptr
  p.scales = c.scales and c.scales.ptr or nil
  p.permutation = c.perm and ffi.cast("const int32_t *", c.perm.ptr) or nil
  p.shared_output = c.shared and c.shared.ptr or nil
  p.residual, p.weight = c.residual.ptr, c.weight.ptr
  p.weight_pre = c.weight_pre and c.weight_pre.ptr or nil
  p.residual_out, p.norm_out = c.residual_out.ptr, c.norm_out.ptr
  p.gathered_out = c.gathered_out and c.gathered_out.ptr or nil
  p.eps, p.eps_pre = c.eps, c.eps_pre or c.eps
  p.stream = c.stream ~= nil and CUDA().stream_handle(c.stream) or nil
  local ok, err = m.backend.run(m.ws, p)
  if not ok then error("weft: " .. c.op .. ": " .. tostring(err), 0) end
  return true
end

-- the unfused device path: separate device calls, graph-capturable. Its
-- intermediates live in the group's device scratch (weft.backends.device_backends.setup
-- scratch: kept until the group is destroyed), never in tensors freed after
-- the call: a captured graph reads and writes them at every replay.
-- Contiguous copies of strided inputs made while capturing are kept on the
-- group for the same reason.
local function run_unfused(g, c, det)
  local tm, cuda = T(), CUDA()
  outputs(c)
  local tmp = {}
  local capturing = policy.mode() == "graph"
  local d = g._dev
  local function scratch(shape, slot)
    local n = 1
    for i = 1, #shape do n = n * shape[i] end
    local p = S().scratch(d, "fusion_ext_" .. slot, max(n * c.x:elem_size(), 16))
    return tm.wrap(p, shape, c.dtype, c.device)
  end
  local function temp(t, orig)
    if t ~= orig then
      if capturing then
        g._fx_keep = g._fx_keep or {}
        g._fx_keep[#g._fx_keep + 1] = t
      else
        tmp[#tmp + 1] = t
      end
    end
    return t
  end
  local ok, err = pcall(function()
    local res, w = temp(c.residual:contiguous(), c.residual), temp(c.weight:contiguous(), c.weight)
    local nopts = { out = c.norm_out, residual_out = c.residual_out, gemma = c.gemma, stream = c.stream,
                    deterministic = det }
    if (c.pattern == "moe" or c.pattern == "finalize") and g.world_size == 1 and not det then
      -- one rank: the reduction, residual and norm in one kernel (kernels/moe_reduce.cu)
      moe_partial(c, nil, true, res, w)
    elseif c.pattern == "moe" or c.pattern == "finalize" then
      local part = scratch({ c.tokens, c.hidden }, "a")
      moe_partial(c, part, true)
      if g.world_size > 1 then g:all_reduce(part, "sum") end
      cuda.rmsnorm(part, res, w, c.eps, nopts)
    elseif c.pattern == "prepost" then
      local x = temp(c.x:contiguous(), c.x)
      local sum = scratch({ c.tokens, c.hidden }, "a")
      if g.world_size > 1 then g:all_reduce(x, "sum", sum) else sum:copy_(x) end
      local pre = scratch({ c.tokens, c.hidden }, "b")
      local wp = temp(c.weight_pre:contiguous(), c.weight_pre)
      cuda.rmsnorm(sum, nil, wp, c.eps_pre, { out = pre, gemma = c.gemma, stream = c.stream, deterministic = det })
      cuda.rmsnorm(pre, res, w, c.eps, nopts)
    else
      local x = temp(c.x:contiguous(), c.x)
      local slice
      if g.world_size == 1 then
        slice = x
      elseif det or (capturing and policy.select(g, "reduce_scatter", x) == "device_host") then
        -- deterministic mode (a rank-order sum), or a capture where the
        -- reduce-scatter could only go through host memory (no NCCL: ranks
        -- sharing a GPU): weft's all-reduce, then this rank's rows (whole rows: contiguous)
        local sum = scratch({ c.tokens, c.hidden }, "a")
        g:all_reduce(x, "sum", sum)
        slice = sum:narrow(0, g.rank_in_group * c.rows, c.rows)
      else
        slice = scratch({ c.rows, c.hidden }, "a")
        g:reduce_scatter(x, 0, slice)
      end
      cuda.rmsnorm(slice, res, w, c.eps, nopts)
      if c.all_gather then
        if g.world_size > 1 then g:all_gather(c.norm_out, 0, c.gathered_out) else c.gathered_out:copy_(c.norm_out) end
      end
    end
  end)
  for _, t in ipairs(tmp) do pcall(t.free, t) end
  if not ok then error(err, 0) end
end

function M.device_run(c)
  local g = c.g
  local d = g._dev
  if d == nil then
    if g.world_size > 1 then
      local sel = policy.select(g, c.op, c.pattern == "moe" and c.residual or c.x)
      if sel == "no_device_backend" then
        refuse(c.op, g, "device tensors need CUDA, which this process does not have")
      end
    end
    d = S().setup(g, c.op)
  end
  for _, t in ipairs { c.x, c.residual, c.weight, c.weight_pre, c.shared, c.scales, c.perm,
                       c.norm_out, c.residual_out, c.gathered_out } do
    if t ~= nil and t.device_index ~= d.device then S().wrong_device(g, c.op, t, "a tensor", d) end
  end
  local det, derr = S().determ_state(g)
  if derr then error("weft: " .. c.op .. ": " .. derr, 0) end
  local path, why, algo = M.decision(g, c)
  if path == "fused" then
    local ok, r = run_fused(g, c, algo)
    if ok then
      g._fx_path, g._fx_why = "fused", why
      return results(c)
    end
    why = "fusion declined: " .. tostring(r)
  end
  g._fx_path, g._fx_why = "unfused", why
  run_unfused(g, c, det)
  return results(c)
end

local function run(c)
  if c.device == "cpu" then return M.host_run(c) end
  return M.device_run(c)
end

---------------------------------------------------------------- methods and policy
local methods = {}
function methods.fused_moe_allreduce_rmsnorm(g, a) return run(M.check_moe(g, a)) end
function methods.fused_moe_finalize_allreduce_rmsnorm(g, a) return run(M.check_finalize(g, a)) end
function methods.fused_allreduce_prepost_rmsnorm(g, x, residual, weight_pre, weight, eps, opts)
  return run(M.check_prepost(g, x, residual, weight_pre, weight, eps, opts))
end
function methods.fused_reduce_scatter_rmsnorm(g, x, residual, weight, eps, opts)
  return run(M.check_rs(g, x, residual, weight, eps, opts))
end
function methods.prepare_fusion_ext(g, o) return M.prepare(g, o) end
-- the last call's path: "fused" | "unfused" | "host", and why
function methods.fusion_ext_last(g) return g._fx_path, g._fx_why end
M.methods = methods

local function is_device(t) return type(t) == "table" and t.device ~= nil and t.device ~= "cpu" end

-- explain lines for op on t (the [tokens, hidden] tensor: residual for the MoE patterns)
local function lines_for(g, op, t)
  if not is_device(t) or t.shape == nil or #t.shape ~= 2 or t.is_contiguous == nil then
    return { "(explain with the device [tokens, hidden] tensor: the residual for the MoE patterns, else the input)" }
  end
  local pat = M.OPS[op]
  local c = { g = g, op = op, pattern = pat, dtype = t.dtype, tokens = t.shape[1], hidden = t.shape[2],
              x = t, residual = t, weight = t, world = g.world_size }
  local _, _, _, lines = M.decision(g, c, true)
  if pat == "rs" and c.tokens % g.world_size ~= 0 then
    lines[#lines + 1] = fmt("x %d tokens do not divide among %d ranks: the call is refused", c.tokens, g.world_size)
  end
  if g._fx_path then lines[#lines + 1] = fmt("last call: %s (%s)", g._fx_path, tostring(g._fx_why)) end
  return lines
end

-- the predicate of weft.policy's "fused kernel (MoE, pre/post norm,
-- reduce-scatter)" rule (when = "fused_ext") and its checks for explain;
-- the rule itself is written in policy.lua's table
policy.predicate("fused_ext", function(_, _, t) return is_device(t) end,
  { detail = function(g, op, t) if is_device(t) then return lines_for(g, op, t) end end })

local installed = false
-- install(group_module): the destroy and graph hooks (the methods are
-- declared in weft.group, which calls these; the rule's predicate is
-- registered when this module loads). Idempotent.
function M.install(gm)
  if installed then return M end
  installed = true
  gm.destroy_hooks[#gm.destroy_hooks + 1] = function(g)
    local m = g._fusion_ext
    if m then pcall(m.cleanup, m); g._fusion_ext = nil end
    for _, t in ipairs(g._fx_keep or {}) do pcall(t.free, t) end
    g._fx_keep = nil
  end
  -- weft.graph.capture{fusion = {max_tokens=, hidden=, dtype=, ext = true}}
  gm.graph_hooks.enter[#gm.graph_hooks.enter + 1] = function(g, ctx)
    local fz = ctx and ctx.fusion
    if fz and fz.ext and g.is_member and g.world_size > 1 then
      M.prepare(g, { max_tokens = fz.max_tokens, hidden = fz.hidden, dtype = fz.dtype })
    end
  end
  return M
end

return M
