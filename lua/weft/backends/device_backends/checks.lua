-- weft.backends.device_backends.checks — which device path a call takes, and why: the seed's
-- should_custom_ar and the fused path's conditions as data (custom_ar_checks,
-- fused_checks: tried in order, each with its explain text), the custom
-- all-reduce rule's predicate and explain helpers, fused_decision, and the
-- checkers policy.set uses to refuse overrides a group cannot serve.
-- weft.backends.device_backends puts them into weft.policy's rules and re-exports
-- custom_ar_checks, fused_checks and fused_decision; the group facts come
-- from weft.backends.device_backends.setup. Runs no collective.
local ffi = require("ffi")
local policy = require("weft.policy")
local S = require("weft.backends.device_backends.setup")
local Q = require("weft.quick")

local tostring, tonumber, ipairs = tostring, tonumber, ipairs
local fmt = string.format
local mod, gname, is_device = S.mod, S.gname, S.is_device
local group_kind, ar_enabled, AR_WORLDS = S.group_kind, S.ar_enabled, S.AR_WORLDS

local M = {}

local AR_DTYPES = { f32 = true, f16 = true, bf16 = true }

---------------------------------------------------------------- custom all-reduce
-- The seed's should_custom_ar, as data: checks tried in order; each returns
-- ok, text (text formatted only when `v`, for explain). The `mode` argument
-- is the column of the seed's eager/graph table: in graph mode the workspace
-- must exist already (a capture cannot make it).
-- the one alignment test of the device all-reduce's Lua side (the rule's
-- check, the backend's output check, the sized memo): 16 bytes
local uptr = ffi.typeof("uintptr_t")
local function ptr_aligned(p)
  return p ~= nil and ffi.cast(uptr, p) % 16 == 0
end

local function ar_limit(d)
  if d ~= nil and d.ar ~= nil then return d.ar.max_bytes end
  return S.config.custom_ar_max_bytes
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
      local why = S.kernel_block(d)
      if why then return false, why end
      return true, d.shared_mode or "yes"
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

-- The rule's predicate: true and the call's choice, which the policy hands
-- to the backend with the rule (weft.policy.select's fourth value): { pick =
-- the algorithm asked (custom_ar.ALGO: an override, the quick codec, the
-- policy file, or 0 = auto), kernel = the kernel that runs it (1-7, C's own
-- answer through weft_ar_resolve once the workspace exists: "auto" by size
-- and what fits, a named one checked to fit), det = deterministic }, or,
-- under an override the group cannot serve, { err = the error the call
-- raises }. The choice is made here once; the backend runs `kernel`, and
-- weft_ar_run only checks that it fits. kernel is nil before the workspace
-- exists (the backend makes it and asks this rule again) and where C would
-- refuse the call (the run then raises C's message).
-- Deterministic mode (weft.backends.device_backends.setup determ_state): every f32/f16/bf16
-- sum takes the kernels, with their bit-identical variant; whatever stops
-- them (the size, the workspace, alignment, a shared GPU, an nccl override)
-- is an error naming the check, never NCCL (whose order changes with size).
local function det_sum(t, rop)
  return AR_DTYPES[t.dtype] and (rop == nil or rop == "sum")
end

-- The quick all-reduce (weft.quick; opt-in, agreed by the group): the
-- algorithm name when it serves this call, or nil; second value: the error
-- the call raises (disagreement, or deterministic mode with rows that do not
-- hold whole codec blocks). Deterministic mode keeps its promise through it:
-- every bf16/f16 sum takes the quick kernel at every size (a size threshold
-- would hand small batches to the exact kernels and large ones to the codec,
-- so a row's bits would change with the batch), and a row must be a
-- multiple of the 32-element block (no block straddles two rows).
local function row_length(t)
  local sh = t.shape
  if type(sh) == "table" and #sh > 0 then return tonumber(sh[#sh]) end
  return tonumber(t.numel) or 0
end

local function quick_pick(g, t, det)
  local qv, qerr = S.quick_state(g)
  if qerr then return nil, qerr end
  if qv == "off" or not Q.DTYPES[t.dtype] or not Q.WORLDS[g.world_size] then return nil end
  if g._no_quick then return nil end   -- fused_allreduce_rmsnorm's unfused path: exact
  if det then
    local row = row_length(t)
    if row % Q.BLOCK ~= 0 then
      return nil, fmt("deterministic mode with the quick all-reduce (%s) on group %s: rows of %d elements are not "
                      .. "a multiple of the codec's %d-element block, so a block would straddle two rows and a row's "
                      .. "bits would depend on the batch (use rows of a multiple of %d elements, or quick = \"off\")",
                      qv, gname(g), row, Q.BLOCK, Q.BLOCK)
    end
    return Q.algo(qv)
  end
  local min = Q.min_bytes(t.dtype, g.world_size, qv)
  if (tonumber(t.nbytes) or 0) >= min then return Q.algo(qv) end
  return nil
end
M.quick_pick = quick_pick

-- one table per (algorithm, kernel, mode): the hot path allocates nothing
local PICKS = { [false] = {}, [true] = {} }
local function picked(pick, det, kernel)
  local p = PICKS[det][pick]
  if p == nil then p = {}; PICKS[det][pick] = p end
  local k = kernel or false
  local c = p[k]
  if c == nil then c = { pick = pick, det = det, kernel = kernel }; p[k] = c end
  return c
end
local function refused(msg) return { err = msg } end

-- the kernel for the call: C's choice (weft_ar_resolve), once the workspace
-- exists; nil before, or where C refuses the call
local function kernel_of(d, t, pick)
  local ar = d and d.ar_state == "ready" and d.ar
  if not ar then return nil end
  return ar:kernel(t.numel, t.dtype, pick)
end

-- out: the output pointer where it is not the input's (nil: in place)
local function ar_rule(g, t, rop, out)
  local d = g._dev
  local mode = policy.mode()
  local det, derr = S.determ_state(g)
  if derr then return true, refused(derr) end
  det = det and det_sum(t, rop) or false
  local ov, src = policy.override(g, "all_reduce")
  if ov == "nccl" then
    if det then
      return true, refused(fmt("deterministic mode: all_reduce=nccl (%s) on group %s: NCCL's summation order "
                               .. "changes with the size (NCCL never sums in this mode: drop the override or "
                               .. "the mode)", tostring(src), gname(g)))
    end
    return false
  end
  local checks = M.custom_ar_checks
  for i = 1, #checks do
    local c = checks[i]
    if not ((ov ~= nil or det) and c.override_skips) then
      if not c.check(g, t, rop, d, mode, false) then
        if (ov ~= nil or det) and c.kind ~= "type" then
          local _, why = c.check(g, t, rop, d, mode, true)
          if det then
            return true, refused(fmt("deterministic mode: all_reduce of %s %s on group %s cannot take weft's "
                                     .. "kernels: %s: %s (NCCL never sums in this mode)", tostring(t.dtype),
                                     policy.human_bytes(tonumber(t.nbytes) or 0), gname(g), c.name, tostring(why)))
          end
          return true, refused(fmt("all_reduce=%s (%s) cannot be served on group %s: %s: %s",
                                   ov, tostring(src), gname(g), c.name, tostring(why)))
        end
        return false
      end
    end
  end
  -- the output's alignment (per call: an all_reduce into `out`), the texts
  -- the backend raised when it checked it
  if out ~= nil and not ptr_aligned(out) then
    if det then
      return true, refused(fmt("deterministic mode: group %s cannot take weft's kernels for this call: output "
                               .. "not 16-byte aligned (NCCL never sums in this mode; WEFT_CUSTOM_AR_MAX_BYTES "
                               .. "sizes the workspace)", gname(g)))
    end
    if ov ~= nil then
      return true, refused(fmt("all_reduce=%s cannot be served on group %s: output not 16-byte aligned", ov, gname(g)))
    end
    return false
  end
  local ALGO = mod("weft.backends.custom_ar").ALGO
  local algo = ov
  if algo == nil then
    local qa, qerr = quick_pick(g, t, det)
    if qerr then return true, refused(qerr) end
    if qa then
      local p = ALGO[qa]
      return true, picked(p, det, kernel_of(d, t, p))
    end
    local be = policy.tuned_backend("all_reduce", g.world_size, t.dtype, tonumber(t.nbytes))
    if be == "nccl" and not det then return false end
    algo = (be ~= "nccl" and be) or "auto"
  end
  local p = ALGO[algo] or 0
  return true, picked(p, det, kernel_of(d, t, p))
end

-- explain: every check, and the table / override step
local function ar_lines(g, t, rop)
  local lines, d, mode = {}, g._dev, policy.mode()
  local ov, src = policy.override(g, "all_reduce")
  local det, derr = S.determ_state(g)
  det = det and det_sum(t, rop)
  if derr then lines[#lines + 1] = "x deterministic mode: " .. derr end
  for _, c in ipairs(M.custom_ar_checks) do
    if (ov ~= nil or det) and c.override_skips then
      lines[#lines + 1] = fmt("- %s: skipped (%s)", c.name, ov and ("override all_reduce=" .. ov) or "deterministic mode")
    else
      local ok, why = c.check(g, t, rop, d, mode, true)
      lines[#lines + 1] = fmt("%s %s: %s", ok and "+" or "x", c.name, tostring(why))
    end
  end
  if det then
    lines[#lines + 1] = "= deterministic mode: weft's kernels at every size up to the workspace (one-shot, "
                        .. "flag one-shot and two-shot sum the sanitised inputs in rank order, f32, one rounding: "
                        .. "the same bits); a call they cannot take raises, NCCL never sums"
  end
  lines[#lines + 1] = M.quick_line(g, t, det, ov)
  if ov ~= nil then
    lines[#lines + 1] = fmt("= override all_reduce=%s (%s)", ov, tostring(src))
  else
    local be, s, wk, dk, i = policy.tuned_backend("all_reduce", g.world_size, t.dtype, tonumber(t.nbytes) or 0)
    if be then
      lines[#lines + 1] = fmt("= policy file %s: %s -> %s", tostring(policy.tuned_path),
                              mod("weft.internal.policy_file").where(s, wk, dk, i), be)
    else
      lines[#lines + 1] = "= built-in: auto (the kernel's measured crossovers: Lamport one-shot, then two-shot)"
    end
  end
  return lines
end

-- explain's line about the quick all-reduce for this call
function M.quick_line(g, t, det, ov)
  local qv, qerr = S.quick_state(g)
  if qerr then return "x quick all-reduce: " .. qerr end
  local _, src = policy.quick(g)
  if qv == "off" then
    return "- quick all-reduce: off (" .. tostring(src) .. "; opt in with policy.set{quick = \"int8\"|\"int4\"|\"fp8\"} "
           .. "or WEFT_QUICK_ALLREDUCE: it changes the numerics)"
  end
  if not Q.DTYPES[t.dtype] then return fmt("- quick all-reduce %s: not for %s (bf16 and f16 only)", qv, tostring(t.dtype)) end
  if not Q.WORLDS[g.world_size] then return fmt("- quick all-reduce %s: no kernel for %d ranks", qv, g.world_size) end
  if ov ~= nil then return fmt("- quick all-reduce %s: not used (override all_reduce=%s)", qv, ov) end
  local min, msrc = Q.min_bytes(t.dtype, g.world_size, qv)
  local n = tonumber(t.nbytes) or 0
  local bound = "error bound: " .. Q.bound_text(qv)
  if det then
    return fmt("+ quick all-reduce %s (%s): deterministic mode: every size (rows must hold whole 32-element "
               .. "blocks); %s", qv, tostring(src), bound)
  end
  return fmt("%s quick all-reduce %s (%s): %s on %d ranks from %s (%s); this call %s%s", n >= min and "+" or "-", qv,
             tostring(src), tostring(t.dtype), g.world_size, min == math.huge and "never" or policy.human_bytes(min), msrc,
             policy.human_bytes(n), n >= min and (" -> quick_" .. qv .. "; " .. bound) or " is below: the exact kernels")
end

local function ar_why(g, _, t, rop)
  local _, choice = ar_rule(g, t, rop)
  choice = choice or picked(0, false)
  local e = choice.err
  if e then return (e:find("^deterministic") and "error: " or "override error: ") .. e end
  local pick, det = choice.pick, choice.det
  if pick >= 4 then
    local qv, src = policy.quick(g)
    local min, msrc = Q.min_bytes(t.dtype, g.world_size, qv)
    return fmt("weft quick all-reduce, codec %s (%s)%s: two-shot, wire = %s; every rank gets the same bits; "
               .. "error bound: %s", qv, tostring(src),
               det and ", deterministic mode: every size" or fmt(", from %s (%s)", policy.human_bytes(min), msrc),
               qv == "fp8" and "fp8 e4m3 + one f32 scale per 32 elements"
                 or (qv .. " + one f32 scale per 32 elements"), Q.bound_text(qv))
  end
  local ov, src = policy.override(g, "all_reduce")
  local algo = ov
  local how = ov and ("override, " .. tostring(src)) or nil
  if not algo then
    local be = policy.tuned_backend("all_reduce", g.world_size, t.dtype, tonumber(t.nbytes) or 0)
    algo = be or "auto"
    how = be and ("policy file " .. tostring(policy.tuned_path)) or "built-in"
  end
  -- the kernel the rule chose (C's, through weft_ar_resolve); the reason
  -- asked of C for the same algorithm
  local kernel = ""
  local k = choice.kernel
  if k ~= nil then
    local name = mod("weft.backends.custom_ar").KIND_NAME[k] or "?"
    local _, w = g._dev.ar:resolve(t.numel, t.dtype, algo)
    kernel = fmt(" -> %s kernel (%s)", name, tostring(w))
  end
  return fmt("weft custom all-reduce, %s (%s)%s%s; in place, reads the input inside the kernel "
             .. "(graph-safe without registration)", algo, how, kernel,
             det and ", deterministic (bit-identical kernels)" or "")
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

---------------------------------------------------------------- deterministic refusal
-- Device reductions with float arithmetic that weft's kernels do not serve
-- (reduce_scatter, f64, prod, ...): refused in deterministic mode rather
-- than sent to NCCL or host staging. Integer reductions and float max/min
-- (exact whatever the order) go on as usual.
local FLOAT = { f32 = true, f16 = true, bf16 = true, f64 = true }
local ARITH = { sum = true, prod = true, avg = true, mean = true }
local function det_refused(g, _, t, rop)
  if not is_device(t) or g.world_size <= 1 then return false end
  local on, err = S.determ_state(g)
  if err then return true end
  return on and FLOAT[t.dtype] and ARITH[rop or "sum"] or false
end
local function det_refused_why(g, op, t, rop)
  local _, err = S.determ_state(g)
  if err then return err end
  return fmt("deterministic mode: device %s of %s %s on group %s has no deterministic path (weft's kernels serve "
             .. "all_reduce sums of f32/f16/bf16 and fused_allreduce_rmsnorm; NCCL's order changes with the size): "
             .. "all_reduce and take your part, or turn the mode off", op, tostring(t.dtype), tostring(rop or "sum"),
             gname(g))
end

---------------------------------------------------------------- fused
local function fused_tokens_cap(opts)
  return opts.max_tokens or S.config.fused_max_tokens
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
      local why = S.kernel_block(d)
      if why then return false, why end
      return true, d.shared_mode or "yes"
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

-- The quick all-reduce's setting applies to fused_allreduce_rmsnorm too
-- (kernels/quick_fused.cu: the two-shot with the codec on its wire): the
-- codec when it serves this call, else nil and why not; an error (raised by
-- the call) for a disagreement or deterministic mode with rows that do not
-- hold whole blocks. Decided before the fused checks, so that the unfused
-- path takes the same decision for its all-reduce.
function M.quick_fused_pick(g, x, opts)
  local qv, qerr = S.quick_state(g)
  if qerr then return nil, "quick all-reduce: " .. qerr, true end
  if qv == "off" then return nil, "quick all-reduce off" end
  if not Q.DTYPES[x.dtype] then return nil, fmt("quick %s: not for %s (bf16 and f16 only)", qv, tostring(x.dtype)) end
  if not Q.WORLDS[g.world_size] then return nil, fmt("quick %s: no kernel for %d ranks", qv, g.world_size) end
  if opts.fp8 or opts.quant_out ~= nil then return nil, fmt("quick %s: not for the FP8 output pattern (exact kernels)", qv) end
  local det = S.determ_state(g)
  local h = x.shape[#x.shape]
  if det then
    if h % Q.BLOCK ~= 0 then
      return nil, fmt("deterministic mode with the quick all-reduce (%s) on group %s: rows of %d elements are not "
                      .. "a multiple of the codec's %d-element block, so fused and unfused results would differ "
                      .. "(use rows of a multiple of %d elements, or quick = \"off\")", qv, gname(g), h, Q.BLOCK, Q.BLOCK), true
    end
    return qv, "deterministic mode: every size"
  end
  local min, msrc = Q.min_bytes(x.dtype, g.world_size, qv)
  local n = (tonumber(x.numel) or 0) * x:elem_size()
  if n >= min then return qv, fmt("%s >= %s (%s)", policy.human_bytes(n), policy.human_bytes(min), msrc) end
  return nil, fmt("quick %s: %s is below its minimum %s (%s)", qv, policy.human_bytes(n),
                  min == math.huge and "never" or policy.human_bytes(min), msrc)
end

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
  local qc, qwhy, qerr = M.quick_fused_pick(g, x, opts)
  if qerr then
    if lines then lines[#lines + 1] = "x " .. qwhy end
    return "error", qwhy, nil, lines
  end
  if qc and opts.algo ~= "oneshot" then
    if mode == "graph" and not graph_fits(g, x, opts, "twoshot") then
      why = "workspace: too small for this call with the quick two-shot, and a capture cannot grow it "
            .. "(pre-initialize it for the largest call)"
      if lines then lines[#lines + 1] = "x " .. why end
      return "unfused", why, nil, lines
    end
    why = fmt("fused quick two-shot, codec %s (%s); error bound: %s, then the residual add and the norm "
              .. "(docs/quick-allreduce.md)", qc, qwhy, Q.bound_text(qc))
    if lines then lines[#lines + 1] = "= " .. why end
    return "fused", why, "twoshot", lines, qc
  end
  if lines then
    lines[#lines + 1] = qc and fmt("- quick %s: not used (algo = oneshot requested)", qc) or ("- " .. tostring(qwhy))
  end
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


-- explain: the fused checks for a device input, and the last call's path
local function fused_lines(g, _, t)
  if not is_device(t) or t.shape == nil or #t.shape < 1 or t.is_contiguous == nil then
    return { "(explain with the device input tensor)" }
  end
  local _, _, _, lines = M.fused_decision(g, t, nil, nil, {}, true)
  if g._fused_path then lines[#lines + 1] = fmt("last call: %s (%s)", g._fused_path, tostring(g._fused_why)) end
  return lines
end

---------------------------------------------------------------- override checkers
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
  if S.kernel_block(d) then return false, S.kernel_block(d) end
  if d and d.ar_state == "failed" then return false, tostring(d.ar_why) end
  return true
end

local function check_fused(g, v)
  if v == "unfused" or g.world_size <= 1 then return true end
  if not g.same_node then return false, "ranks on several nodes" end
  if g.world_size > 8 then return false, "more than 8 ranks" end
  local d = g._dev
  if S.kernel_block(d) then return false, S.kernel_block(d) end
  local f = g._fusion
  if f and f.attn.disabled then return false, "fusion disabled: " .. tostring(f.attn.disabled_reason) end
  return true
end

------------------------------------------------------- for weft.backends.device_backends
M.AR_DTYPES, M.ptr_aligned, M.fused_tokens_cap = AR_DTYPES, ptr_aligned, fused_tokens_cap
M.ar_rule, M.ar_lines, M.ar_why, M.ar_why_not, M.fused_lines = ar_rule, ar_lines, ar_why, ar_why_not, fused_lines
M.check_all_reduce, M.check_fused = check_all_reduce, check_fused
M.det_refused, M.det_refused_why = det_refused, det_refused_why

return M
