-- weft.backends.device_backends.sized_memo — the eager device all_reduce's hot path:
-- the policy's choice between weft's kernels and NCCL depends on the size
-- (should_custom_ar, the tuned table, the quick codec's minimum), so the
-- group's memo of cacheable decisions (weft.group.host) cannot hold it.
-- This one does, per (dtype, reduction, bytes), inside that memo: it is
-- dropped with it whenever the policy changes (policy.version) or the group's
-- device state does (g._dispatch = nil: workspace made or broken, settings
-- agreed). An entry also records what the decision read that can change
-- without either (g.use_custom_allreduce, the seed's per-kind table, the
-- fused path's exact-only flag, a policy file assigned directly, the row
-- length deterministic mode looks at) and is used only when all of them are
-- still the same, in eager mode, for a 16-byte-aligned input and output (the
-- rule's alignment checks, which the entry does not record); anything else
-- walks the rules as before. The choice filed holds the kernel the rule
-- resolved (weft_ar_resolve), so a hit makes no FFI call before the run.
-- Every argument check still runs per call (weft.group.checks before the
-- lookup; weft_ar_run's contract checks after).
local policy = require("weft.policy")
local S = require("weft.backends.device_backends.setup")

local type, tonumber = type, tonumber
local by_kind = S.custom_ar_by_kind
local is_device = S.is_device

local M = {}

local aligned = require("weft.backends.device_backends.checks").ptr_aligned

local function row_length(t)
  local sh = t.shape
  if type(sh) == "table" then
    local n = #sh
    if n > 0 then return sh[n] end
  end
  return t.numel
end

local function gm_current()
  local gm = package.loaded["weft.graph"]
  return gm ~= nil and gm.current() ~= nil
end

-- lookup(memo, g, op, t, rop [, out]) -> backend, name, choice | nil, nil,
-- nil, fileable. The memo's one test of the call (eager, input and output
-- 16-byte aligned: may a choice filed for this size apply to it?) is made
-- here once; a miss hands its answer to store (fileable), which files the
-- rules' choice only for such a call.
function M.lookup(memo, g, op, t, rop, out)
  if op ~= "all_reduce" then return nil end
  if not aligned(t.ptr) or (out ~= nil and not aligned(out)) or gm_current() then return nil end
  local s = memo._sized
  if s == nil then return nil, nil, nil, true end
  local a = s[t.dtype]
  local b = a and a[rop or "sum"]
  local e = b and b[t.nbytes]
  if e == nil then return nil, nil, nil, true end
  if e.use ~= g.use_custom_allreduce or e.by_kind ~= by_kind[g._kind or ""] or e.no_quick ~= g._no_quick
     or e.tuned ~= policy.tuned or e.row ~= row_length(t) or e.dev ~= t.device then
    return nil, nil, nil, true
  end
  return e.be, e.name, e.choice
end

-- store(memo, g, op, t, rop, be, name, choice, fileable): after the rules
-- chose `name` (and, inside it, `choice`) for this call; fileable: lookup's
-- answer for it
function M.store(memo, g, op, t, rop, be, name, choice, fileable)
  if not fileable or op ~= "all_reduce" or g._dispatch ~= memo or not is_device(t) then return end
  if name ~= "custom_ar" and name ~= "nccl" then return end
  local d = g._dev
  -- only once the workspace is settled (its size bounds the choice) and the
  -- call raised nothing through the rule
  if d == nil or d.ar_state ~= "ready" or (choice ~= nil and choice.err ~= nil) then return end
  local s = memo._sized
  if s == nil then s = {}; memo._sized = s end
  local a = s[t.dtype]
  if a == nil then a = {}; s[t.dtype] = a end
  local key = rop or "sum"
  local b = a[key]
  if b == nil then b = {}; a[key] = b end
  b[t.nbytes] = {
    be = be, name = name, choice = choice,
    use = g.use_custom_allreduce, by_kind = by_kind[g._kind or ""], no_quick = g._no_quick,
    tuned = policy.tuned, row = row_length(t), dev = t.device,
  }
end

return M
