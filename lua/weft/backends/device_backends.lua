-- weft.backends.device_backends — device tensors through the GroupCoordinator: the
-- device rules of weft.policy (the seed's all_reduce dispatch order and its
-- eager/graph table, as data), the backends that serve them, and the
-- per-group device state (NCCL communicator, custom all-reduce workspace,
-- fusion workspaces, scratch), created lazily and torn down by g:destroy().
-- docs/policy.md describes the decisions; installed by weft.group on load.
--
-- Backends (group.register_backend):
--   nccl         every device collective (weft.nccl), one communicator per group
--   custom_ar    all_reduce through weft's one-/two-shot kernels (weft.backends.custom_ar)
--   device_host  NCCL unusable (ranks sharing a GPU, no libnccl): the data
--                goes through host memory and the host path; eager only
--   fused        fused_allreduce_rmsnorm: the fused kernel (weft.fusion) where
--                it applies, else all_reduce + the norm kernel
--   invalid_override  raises the WEFT_ALLREDUCE error for the calls it steers
--
-- This module holds the custom_ar and fused backends, the device rules'
-- predicates (policy.predicate; the rules themselves are in weft.policy's
-- table), choice and install; the rest lives in its folder, lua/weft/backends/device_backends/ (and is
-- re-exported from here):
--   weft.backends.device_backends.setup         configuration, per-group device state
--                                               (lazy, collective set-up), prepare, info, destroy
--   weft.backends.device_backends.nccl_backend  the nccl and device_host (host staging)
--                                               backends (the communicators: weft.nccl)
--   weft.backends.device_backends.checks        the should_custom_ar and fused checks as
--                                               data, fused_decision, explain text, override checkers
local ffi = require("ffi")
local policy = require("weft.policy")
local S = require("weft.backends.device_backends.setup")
local check_fused_outputs = require("weft.group.checks").check_fused_outputs
local N = require("weft.backends.device_backends.nccl_backend")
local show = require("weft.internal.show").value -- names a refused value's type
local K = require("weft.backends.device_backends.checks")

local type, tostring, tonumber, error, pcall, ipairs = type, tostring, tonumber, error, pcall, ipairs
local fmt = string.format
local T, CUDA, gname, is_device, cuda_ok = S.T, S.CUDA, S.gname, S.is_device, S.cuda_ok
local dev_of, wrong_device, stream_capturing = S.dev_of, S.wrong_device, S.stream_capturing
local nccl_be, stage = N.nccl_backend, N.stage
local fused_tokens_cap, FUSED_DTYPES = K.fused_tokens_cap, K.AR_DTYPES
local ar_rule, ar_why, ar_why_not, ar_lines, fused_lines = K.ar_rule, K.ar_why, K.ar_why_not, K.ar_lines, K.fused_lines

local M = {}

local group_mod           -- weft.group, given to install()
local DETERMINISTIC = 512 -- WEFT_AR_DETERMINISTIC, or'ed into the algorithm

-- The public surface of the modules above, re-exported (the same tables and
-- functions: M.config, M.custom_ar_checks, ... are theirs, edited in place).
M.config, M.custom_ar_by_kind, M.is_device = S.config, S.custom_ar_by_kind, S.is_device
M._set_cuda_available = S._set_cuda_available
M.setup, M.ensure_ar, M.prepare, M.info, M.fusion_ctx = S.setup, S.ensure_ar, S.prepare, S.info, S.fusion_ctx
M.stage, M.nccl_backend = stage, nccl_be
M.custom_ar_checks, M.fused_checks, M.fused_decision = K.custom_ar_checks, K.fused_checks, K.fused_decision

---------------------------------------------------------------- custom all-reduce backend
local car = {}
local backend_for   -- weft.group.host's, for a first call (below)
-- choice: the "custom_ar" rule's (checks.lua ar_rule), handed over by the
-- policy with the rule: the kernel to run (C's choice, made by the rule
-- through weft_ar_resolve), or the error the call raises. This backend picks
-- nothing: whether the call takes the kernels (size, alignment of input and
-- output, the workspace) is the rule's. On a group's first call the rule ran
-- before the workspace existed: it is made here (collective) and the call
-- asks the policy again, now with it. nil (a caller that named this backend
-- itself, e.g. a rule of policy.add_rule): "auto", which weft_ar_run resolves.
function car.all_reduce(g, op, t, out_ptr, rop, code, choice)
  local det, algo = false, 0
  if choice ~= nil then
    if choice.err then error("weft: all_reduce: " .. choice.err, 0) end
    det, algo = choice.det, choice.kernel or choice.pick
  end
  local d = dev_of(g, op, t)
  if d.ar_state == nil then
    M.ensure_ar(g)
    backend_for = backend_for or require("weft.group.host").backend_for
    local be, _, again = backend_for(g, op, t, rop, out_ptr ~= t.ptr and out_ptr or nil)
    return be.all_reduce(g, op, t, out_ptr, rop, code, again)
  end
  if d.ar_state == "broken" then
    error(fmt("weft: all_reduce: the custom all-reduce of group %s failed earlier (%s); its ranks may "
              .. "now disagree on the backend, so the calls it would serve raise rather than go to NCCL "
              .. "on this rank alone: destroy and re-create the group", gname(g), tostring(d.ar_why)), 0)
  end
  local ar = d.ar
  if ar == nil then   -- only a caller that named this backend itself: the rule checks the workspace
    error(fmt("weft: all_reduce: group %s has no custom all-reduce workspace: %s", gname(g), tostring(d.ar_why)), 0)
  end
  if det then algo = algo + DETERMINISTIC end
  local ok, err = pcall(ar.run, ar, t.ptr, out_ptr, t.numel, t.dtype, algo)
  if not ok and ar.refused then error(err, 0) end   -- refused before launch: state unchanged
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

---------------------------------------------------------------- fused backend
local E = require("weft.internal.errors")
local shape_str, same_shape = E.shape_str, E.same_shape
-- fail(op, g, msg, args..., gname(g)): "weft: <op>: <msg> (group <name>)"
local function fail(op, _, msg, ...)
  E.fail(0, op, msg .. " (group %s)", ...)
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
      fail(op, g, "max_tokens must be a positive number, got %s", show(opts.max_tokens), gname(g))
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
      if not (s > 0) then fail(op, g, "FP8 scale must be positive, got %s", show(s), gname(g)) end
    elseif tm.is_tensor(s) then
      want(tm, g, op, x, s, "scale")
      if s.dtype ~= "f32" or s.numel ~= 1 then fail(op, g, "FP8 scale must be an f32 tensor of one element", gname(g)) end
    else
      fail(op, g, "FP8 output needs scale (an f32 device tensor of one element, or a number)", gname(g))
    end
  end
  check_fused_outputs(g, op, x, residual, weight, { opts.norm_out, "norm_out", opts.residual_out,
                      "residual_out", opts.quant_out, "quant_out" }, 0)

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
  local det, derr = S.determ_state(g)
  if derr then error("weft: " .. op .. ": " .. derr, 0) end
  if det then
    if opts.fp32_acc == false then
      fail(op, g, "deterministic mode needs f32 accumulation (fp32_acc = false is refused)", gname(g))
    end
    if fp8 then
      fail(op, g, "deterministic mode does not cover FP8 output (the fused kernel quantises the f32 norm, "
                  .. "the unfused path the rounded one)", gname(g))
    end
  end
  on_device(g, op, d, x); on_device(g, op, d, residual); on_device(g, op, d, weight)
  on_device(g, op, d, opts.norm_out); on_device(g, op, d, opts.residual_out); on_device(g, op, d, opts.quant_out)

  local path, why, algo, _, quick = M.fused_decision(g, x, residual, weight, opts)
  if path == "error" then error("weft: " .. op .. ": " .. why, 0) end
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
    fo.deterministic = det
    fo.quick = quick
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
    -- the quick all-reduce exactly when the fused kernel would have taken its
    -- quick two-shot (same setting, same size rule): with rows of a multiple
    -- of 32 elements both paths give the same bits
    local qc = K.quick_fused_pick(g, x, opts)
    g._no_quick = qc == nil or nil
    local ok, err = pcall(g.all_reduce, g, xc, "sum", norm_out)
    g._no_quick = nil
    if not ok then error(err, 0) end
    src = norm_out
  end
  CUDA().rmsnorm(src, rc, wc, eps, { out = norm_out, residual_out = res_out, gemma = opts.gemma,
                                     stream = opts.stream, deterministic = det })
  if xc ~= x then xc:free() end
  if rc ~= residual then rc:free() end
  if wc ~= weight then wc:free() end
  if fp8 then
    quantize_host(g, op, norm_out, opts.scale, quant_out)
    return norm_out, res_out, quant_out
  end
  return norm_out, res_out
end

---------------------------------------------------------------- rules
local NAN_CALLS = { all_reduce = true, reduce_scatter = true, reduce_scatterv = true }

-- the NaN pass of float max/min (weft.backends.device_backends.nccl_backend), for explain
local function nan_lines(op, t, rop)
  if not NAN_CALLS[op] then return nil end
  if N.nan_pass(t.dtype, rop) then
    return { fmt("NaN pass: %s %s adds a NaN-mask kernel, an NCCL max of a u8 mask (%s) and a fix-up "
                 .. "kernel around the NCCL %s, so a NaN on any rank gives NaN (torch's rule; NCCL's "
                 .. "fmax/__hmax alone drops it)", t.dtype, rop,
                 policy.human_bytes(tonumber(t.numel) or 0), rop) }
  end
  if rop == "max" or rop == "min" then
    return { fmt("NaN pass: none (%s is not a float dtype)", tostring(t.dtype)) }
  end
  return nil
end

local function stage_why(g)
  local d = g._dev
  return "NCCL cannot serve this group (" .. tostring(d and d.nccl_why) .. "): device data goes "
         .. "through host memory and the host path (eager only)"
end

-- The predicates of the device rules written in weft.policy's table (their
-- `when` keys), with the texts computed from the device state; registered
-- when this module loads. The rules' order, names, backends and fixed texts
-- are policy.lua's.
policy.predicate("no_cuda", function(_, _, t) return is_device(t) and not cuda_ok() end,
  { why_not = function(_, _, t) return is_device(t) and "CUDA is available" or "host tensor" end })
policy.predicate("invalid_override", function(_, _, t) return is_device(t) and policy.override_error ~= nil end)
policy.predicate("custom_ar", function(g, _, t, rop, out)
  if not is_device(t) then return false end
  return ar_rule(g, t, rop, out)
end, { why = ar_why, why_not = ar_why_not,
       detail = function(g, _, t, rop) if is_device(t) then return ar_lines(g, t, rop) end end })
policy.predicate("fused", function(_, _, t) return is_device(t) end,
  { detail = function(g, op, t) if is_device(t) then return fused_lines(g, op, t) end end })
policy.predicate("deterministic", K.det_refused, {
  why = K.det_refused_why,
  why_not = function(g, _, t)
    if not is_device(t) then return "host tensor (every host backend reduces in rank order)" end
    return policy.deterministic(g) and "not a float sum: exact in any order" or "off"
  end })
policy.predicate("host_staging", function(g, _, t) local d = g._dev; return is_device(t) and d ~= nil and d.nccl == nil end, {
  why = stage_why,
  why_not = function(g, _, t)
    if not is_device(t) then return "host tensor" end
    if g._dev == nil then return "NCCL set up on first device use" end
    return "NCCL communicator ready"
  end })
policy.predicate("nccl", function(_, _, t) return is_device(t) end,
  { detail = function(_, op, t, rop) if is_device(t) then return nan_lines(op, t, rop) end end })

-- the device rules of weft.policy's table (the same tables), for reading
M.rules = {}
for _, r in ipairs(policy.rules) do
  if r.device then M.rules[#M.rules + 1] = r end
end

---------------------------------------------------------------- choice
local AR_NAME = { [0] = "auto", "oneshot", "twoshot", "oneshot_flag",
                  "quick_fp", "quick_int8", "quick_int4", "quick_fp8" }

-- choice(g, op, t [, opts]) -> the concrete backend a call would get, in the
-- policy file's terms: all_reduce "nccl" | "oneshot" | "twoshot" |
-- "oneshot_flag" | "auto" (or a host/other backend name); fused_allreduce_rmsnorm
-- "fused_oneshot" | "fused_twoshot" | "fused_auto" | "unfused". Second value:
-- why. Runs nothing (scripts/weft-tune compares policies with it).
function M.choice(g, op, t, opts)
  local be, why, _, choice = policy.select(g, op, t)
  if op == "all_reduce" and be == "custom_ar" then
    if choice and choice.err then return nil, choice.err end
    return AR_NAME[choice and choice.pick or 0], why
  end
  if op == "fused_allreduce_rmsnorm" and be == "fused" then
    local path, fwhy, algo, _, quick = M.fused_decision(g, t, nil, nil, opts or {})
    if path == "error" then return nil, fwhy end
    if path ~= "fused" then return "unfused", fwhy end
    if quick then return "fused_quick_" .. quick, fwhy end
    return "fused_" .. algo, fwhy
  end
  return be, why
end

local installed = false

-- install(group_module): registers the backends, the override checkers, and
-- the destroy / graph hooks (the rules' predicates are registered when this
-- module loads, above). Idempotent.
function M.install(gm)
  if installed then return M end
  installed = true
  group_mod = gm
  gm.register_backend("nccl", nccl_be)
  gm.register_backend("custom_ar", car)
  gm.register_backend("device_host", stage)
  -- the eager all_reduce's size-dependent choice, memoised (see that module)
  require("weft.group.host").sized_memo = require("weft.backends.device_backends.sized_memo")
  gm.register_backend("fused", {
    fused_allreduce_rmsnorm = function(g, _, x, r, w, eps, opts) return M.fused(g, x, r, w, eps, opts) end,
  })
  local function refuse(g, op, t, rop) error("weft: " .. op .. ": " .. K.det_refused_why(g, op, t, rop), 0) end
  gm.register_backend("determ_refused", {
    all_reduce = function(g, op, t, _, rop) refuse(g, op, t, rop) end,
    reduce_scatter = function(g, op, t, _, _, rop) refuse(g, op, t, rop) end,
    reduce_scatterv = function(g, op, t, _, _, rop) refuse(g, op, t, rop) end,
  })
  gm.register_backend("invalid_override", setmetatable({}, { __index = function()
    return function(_, op) error(fmt("weft: %s: %s", op, tostring(policy.override_error)), 0) end
  end }))
  policy.checkers.all_reduce = K.check_all_reduce
  policy.checkers.fused = K.check_fused
  gm.destroy_hooks[#gm.destroy_hooks + 1] = S.destroy_hook
  gm.graph_hooks.enter[#gm.graph_hooks.enter + 1] = S.graph_enter
  gm.device_fused = M.fused
  policy.choice = M.choice
  return M
end

return M